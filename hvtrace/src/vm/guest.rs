//! The built-in guest: kernels and initramfs from the scripts in
//! `scripts/guest/`, found relative to the repository root.
//!
//! The Debian guest boots an initramfs that carries modules of its kernel
//! package (file systems, overlay, loop; more with `--modules`); the
//! fast-lane guest boots the plain busybox initramfs.
//!
//! Each script builds or downloads its output on first use (into a cache
//! outside the repository), logs progress on stderr and prints one path on
//! stdout. Next to each bzImage lies a file `release` with what `uname -r`
//! prints in the guest.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};

/// The built-in guest kernels (see `scripts/guest/`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Guest {
    /// Debian's stock kernel (6.1).
    #[default]
    Debian,
    /// The small fast-lane kernel built from Debian's 6.12 sources.
    Fast,
}

impl Guest {
    /// The script that prints the path of this guest's bzImage.
    pub fn script(self) -> &'static str {
        match self {
            Guest::Debian => "scripts/guest/debian-kernel.sh",
            Guest::Fast => "scripts/guest/fast-kernel.sh",
        }
    }
}

/// The repository root: `$HVTRACE_ROOT` when set, else the parent of this
/// crate's directory at build time.
pub fn repo_root() -> PathBuf {
    if let Some(root) = std::env::var_os("HVTRACE_ROOT") {
        if !root.is_empty() {
            return PathBuf::from(root);
        }
    }
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().unwrap_or(manifest).to_path_buf()
}

/// Runs one of the path-printing scripts (relative to the repository root)
/// and returns the path it printed. Its stderr goes to ours.
pub fn run_script(relative: &str) -> Result<PathBuf> {
    run_script_with(relative, &[])
}

/// [`run_script`] with arguments.
pub fn run_script_with(relative: &str, args: &[String]) -> Result<PathBuf> {
    let root = repo_root();
    let script = root.join(relative);
    if !script.is_file() {
        bail!(
            "{} not found (set HVTRACE_ROOT to the hvtrace repository)",
            script.display()
        );
    }
    let output = Command::new("bash")
        .arg(&script)
        .args(args)
        .current_dir(&root)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("cannot run bash {}", script.display()))?;
    if !output.status.success() {
        bail!(
            "{relative} failed ({}); see its messages above",
            output.status
        );
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let Some(line) = stdout.lines().rev().map(str::trim).find(|l| !l.is_empty()) else {
        bail!("{relative} printed no path");
    };
    let path = PathBuf::from(line);
    if !path.is_file() {
        bail!("{relative} printed {}, which is not a file", path.display());
    }
    Ok(path)
}

/// The bzImage of a built-in guest.
pub fn kernel(guest: Guest) -> Result<PathBuf> {
    run_script(guest.script())
}

/// The plain guest initramfs: busybox and the guest tools, no modules.
/// The fast-lane guest boots it, and so does a kernel of the user's own.
pub fn initrd() -> Result<PathBuf> {
    run_script("scripts/guest/initramfs.sh")
}

/// The script that builds the Debian guest's initramfs, and its module index.
const DEBIAN_MODULES: &str = "scripts/guest/debian-modules.sh";

/// The initramfs a built-in guest boots when none is given: Debian's
/// carries modules of its kernel package, `extra` among them
/// ([`debian_initrd`]); the fast lane's is the plain one ([`initrd`]),
/// which takes no modules.
pub fn default_initrd(guest: Guest, extra: &[String]) -> Result<PathBuf> {
    check_modules_guest(guest, extra)?;
    match guest {
        Guest::Debian => debian_initrd(extra),
        Guest::Fast => initrd(),
    }
}

/// Fails when modules are asked for (`extra`) and `guest` does not take
/// them: only the Debian guest's initramfs carries its kernel package's
/// modules.
pub fn check_modules_guest(guest: Guest, extra: &[String]) -> Result<()> {
    if guest != Guest::Debian && !extra.is_empty() {
        bail!(
            "--modules adds modules of Debian's kernel package to the Debian guest's initramfs; the fast-lane guest (--guest fast) takes none"
        );
    }
    Ok(())
}

/// The Debian guest's initramfs: the plain one with modules of the stock
/// kernel package under `/lib/modules/RELEASE` and a modules.dep made by
/// depmod (the file systems, overlay and loop; see
/// `scripts/guest/debian-modules.sh`), the modules named in `extra` and
/// what they need added. A name the package does not have is refused
/// before anything is built.
pub fn debian_initrd(extra: &[String]) -> Result<PathBuf> {
    if !extra.is_empty() {
        let dep = run_script_with(DEBIAN_MODULES, &["--index".to_string()])?;
        ModuleIndex::load(&dep)?.check(extra)?;
    }
    run_script_with(DEBIAN_MODULES, extra)
}

/// The longest module name the kernel takes (`MODULE_NAME_LEN` less its NUL).
pub const MAX_MODULE_NAME: usize = 55;

/// Checks the spelling of a module name (`--modules`): letters, digits,
/// `_` and `-`, as modprobe takes it (no path, no `.ko`).
pub fn check_module_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("an empty module name".to_string());
    }
    if name.len() > MAX_MODULE_NAME
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    {
        return Err(format!(
            "'{}' is not a module name (at most {MAX_MODULE_NAME} letters, digits, '_' and '-')",
            name.escape_default()
        ));
    }
    Ok(())
}

/// A module's name as the kernel and modprobe compare it: from a path in
/// modules.dep or modules.builtin (`kernel/fs/nls/nls_iso8859-1.ko`) or
/// as a user wrote it, without directory and `.ko` suffix, `-` as `_`.
pub fn module_name(path: &str) -> String {
    let base = path.rsplit('/').next().unwrap_or(path);
    let base = [".ko", ".ko.xz", ".ko.zst", ".ko.gz"]
        .iter()
        .find_map(|ext| base.strip_suffix(ext))
        .unwrap_or(base);
    base.replace('-', "_")
}

/// The modules of Debian's kernel package, as `debian-modules.sh --index`
/// lists them: what `--modules` may name.
#[derive(Clone, Debug, Default)]
pub struct ModuleIndex {
    /// `NAME VERSION` of the kernel package.
    pub package: String,
    /// The modules' names.
    pub modules: BTreeSet<String>,
    /// The names of the modules built into the kernel.
    pub builtin: BTreeSet<String>,
    /// Plain aliases (no wildcards) and the modules they name, for a hint
    /// when an alias is given for a module.
    pub aliases: BTreeMap<String, BTreeSet<String>>,
}

impl ModuleIndex {
    /// Reads the index whose `modules.dep` is `dep` (with `modules.builtin`,
    /// `modules.alias` and `package` beside it).
    pub fn load(dep: &Path) -> Result<ModuleIndex> {
        let read = |name: &str| {
            let path = dep.with_file_name(name);
            std::fs::read_to_string(&path)
                .with_context(|| format!("cannot read {}", path.display()))
        };
        let package = read("package")?;
        Ok(ModuleIndex::parse(
            package.lines().next().unwrap_or_default(),
            &read("modules.dep")?,
            &read("modules.builtin")?,
            &read("modules.alias")?,
        ))
    }

    /// The index from the text of its files.
    pub fn parse(package: &str, dep: &str, builtin: &str, alias: &str) -> ModuleIndex {
        let modules = dep
            .lines()
            .filter_map(|l| l.split_once(':'))
            .map(|(path, _)| module_name(path.trim()))
            .collect();
        let builtin = builtin
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(module_name)
            .collect();
        let mut aliases: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for line in alias.lines() {
            let mut words = line.split_whitespace();
            if let (Some("alias"), Some(pattern), Some(module), None) =
                (words.next(), words.next(), words.next(), words.next())
            {
                if !pattern.contains(['*', '?', '[']) {
                    aliases
                        .entry(module_name(pattern))
                        .or_default()
                        .insert(module_name(module));
                }
            }
        }
        ModuleIndex {
            package: package.trim().to_string(),
            modules,
            builtin,
            aliases,
        }
    }

    /// Fails, naming every one, unless each of `names` is a module of the
    /// package or built into its kernel.
    pub fn check(&self, names: &[String]) -> Result<()> {
        let mut unknown = Vec::new();
        let mut hints = Vec::new();
        for name in names {
            let key = module_name(name);
            if self.modules.contains(&key) || self.builtin.contains(&key) {
                continue;
            }
            if let Some(of) = self.aliases.get(&key) {
                let of: Vec<&str> = of.iter().map(String::as_str).collect();
                hints.push(format!("{name} is an alias of {}", of.join(", ")));
            }
            if !unknown.contains(name) {
                unknown.push(name.clone());
            }
        }
        if unknown.is_empty() {
            return Ok(());
        }
        let what = if unknown.len() == 1 {
            "no module named"
        } else {
            "no modules named"
        };
        let hint = if hints.is_empty() {
            String::new()
        } else {
            format!(" ({}: name the module)", hints.join("; "))
        };
        bail!(
            "--modules: {what} {} in {}{hint}",
            unknown.join(", "),
            self.package
        )
    }
}

/// The kernel release recorded next to a bzImage (`release`), trimmed.
pub fn release_of(kernel: &Path) -> Result<String> {
    let file = kernel.with_file_name("release");
    let text = std::fs::read_to_string(&file)
        .with_context(|| format!("cannot read {}", file.display()))?;
    let release = text.trim();
    if release.is_empty() {
        bail!("{} is empty", file.display());
    }
    Ok(release.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEP: &str =
        "kernel/fs/ext4/ext4.ko: kernel/lib/crc16.ko kernel/fs/mbcache.ko kernel/fs/jbd2/jbd2.ko
kernel/fs/jbd2/jbd2.ko:
kernel/fs/mbcache.ko:
kernel/lib/crc16.ko:
kernel/fs/nls/nls_iso8859-1.ko:
kernel/arch/x86/crypto/crc32c-intel.ko:
kernel/crypto/crc32c_generic.ko:
kernel/fs/xfs/xfs.ko: kernel/lib/libcrc32c.ko
kernel/lib/libcrc32c.ko:
";
    const BUILTIN: &str = "kernel/lib/crc32.ko\nkernel/fs/binfmt_misc.ko\n";
    const ALIAS: &str = "# Aliases extracted from modules themselves.
alias crypto-crc32c crc32c_intel
alias crc32c crc32c_intel
alias crc32c crc32c_generic
alias fs-ext4 ext4
alias pci:v00008086d*sv*sd*bc*sc*i* xfs
";

    fn index() -> ModuleIndex {
        ModuleIndex::parse(
            "linux-image-6.1.0-57-amd64 6.1.192-3\n",
            DEP,
            BUILTIN,
            ALIAS,
        )
    }

    #[test]
    fn module_names_as_modprobe_compares_them() {
        assert_eq!(
            module_name("kernel/fs/nls/nls_iso8859-1.ko"),
            "nls_iso8859_1"
        );
        assert_eq!(module_name("kernel/fs/ext4/ext4.ko.xz"), "ext4");
        assert_eq!(module_name("crc32c-intel"), "crc32c_intel");
        assert_eq!(module_name("loop"), "loop");
    }

    #[test]
    fn the_index_takes_modules_builtins_and_plain_aliases() {
        let ix = index();
        assert_eq!(ix.package, "linux-image-6.1.0-57-amd64 6.1.192-3");
        assert_eq!(ix.modules.len(), 9);
        assert!(ix.modules.contains("nls_iso8859_1") && ix.modules.contains("crc32c_intel"));
        assert!(ix.builtin.contains("crc32") && ix.builtin.contains("binfmt_misc"));
        // Wildcard aliases (device ids) are not names anyone types.
        assert_eq!(ix.aliases.len(), 3, "{:?}", ix.aliases);
        assert_eq!(
            ix.aliases["crc32c"].iter().collect::<Vec<_>>(),
            ["crc32c_generic", "crc32c_intel"]
        );
    }

    #[test]
    fn known_names_pass_in_either_spelling() {
        let ix = index();
        let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        ix.check(&names(&[
            "xfs",
            "nls_iso8859-1",
            "nls_iso8859_1",
            "crc32c-intel",
        ]))
        .unwrap();
        // A built-in module is there already: nothing to add, no error.
        ix.check(&names(&["crc32"])).unwrap();
    }

    #[test]
    fn unknown_names_are_refused_together_with_the_package() {
        let ix = index();
        let err = ix.check(&["nosuch".to_string()]).unwrap_err().to_string();
        assert_eq!(
            err,
            "--modules: no module named nosuch in linux-image-6.1.0-57-amd64 6.1.192-3"
        );
        let err = ix
            .check(&["xfs".into(), "btrfs".into(), "zfs".into(), "btrfs".into()])
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "--modules: no modules named btrfs, zfs in linux-image-6.1.0-57-amd64 6.1.192-3"
        );
        // An alias is not a module name: the error says whose it is.
        let err = ix.check(&["crc32c".into()]).unwrap_err().to_string();
        assert_eq!(
            err,
            "--modules: no module named crc32c in linux-image-6.1.0-57-amd64 6.1.192-3 (crc32c is an alias of crc32c_generic, crc32c_intel: name the module)"
        );
    }

    #[test]
    fn module_name_spelling() {
        for ok in [
            "ext4",
            "nls_iso8859-1",
            "crc32c-intel",
            &"m".repeat(MAX_MODULE_NAME),
        ] {
            assert_eq!(check_module_name(ok), Ok(()), "{ok}");
        }
        assert_eq!(
            check_module_name(""),
            Err("an empty module name".to_string())
        );
        for bad in [
            "ext4.ko",
            "fs/ext4",
            "ext 4",
            "ext4\n",
            &"m".repeat(MAX_MODULE_NAME + 1),
        ] {
            let err = check_module_name(bad).unwrap_err();
            assert!(
                err.contains("is not a module name") && !err.contains('\n'),
                "{err}"
            );
        }
    }

    #[test]
    fn only_the_debian_guest_takes_modules() {
        let xfs = ["xfs".to_string()];
        assert!(check_modules_guest(Guest::Debian, &xfs).is_ok());
        assert!(check_modules_guest(Guest::Fast, &[]).is_ok());
        let err = check_modules_guest(Guest::Fast, &xfs)
            .unwrap_err()
            .to_string();
        assert!(err.contains("--guest fast"), "{err}");
    }
}
