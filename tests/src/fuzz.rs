//! The fuzzing guest's host half: building its bzImage, running it bare and
//! under the hypervisor in Bochs, and comparing the digests it prints.
//!
//! `scripts/fuzz-guest.sh` (the `fuzz-driver` binary) and the VM test
//! `tests/fuzz.rs` both use it.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use fuzz_guest::known::CLASSES;
use fuzz_guest::ops::{self, Op, Shape};
use fuzz_guest::rng::Rng;
use fuzz_guest::LINK_BASE;
use guest_introspect::elf::{Elf, PT_LOAD};
use hvtrace::{RunConfig, Vm};
use loader::bzimage::{hdr, XLoadFlags, BOOT_FLAG, HEADER_MAGIC};

/// What one run asks the program for: the program's own parameters.
pub use fuzz_guest::cmdline::Params;

/// The program's command line for `p`. A debugging aid:
/// HVTRACE_FUZZ_SKIP=MASK draws the operation kinds of MASK (bits by
/// `fuzz_guest::ops::kind`) without carrying them out, to find which kind a
/// failure needs (when `p` skips none itself).
pub fn cmdline(p: &Params) -> String {
    let mut s = p.to_string();
    if p.skip == 0 {
        if let Some(mask) = std::env::var("HVTRACE_FUZZ_SKIP")
            .ok()
            .filter(|m| !m.is_empty())
        {
            s.push_str(&format!(" fuzz.skip={mask}"));
        }
    }
    s
}

/// Operation `index` of vCPU `cpu`'s stream of `p`, regenerated here.
pub fn op(p: &Params, cpu: u32, index: u64) -> Op {
    let mut r = Rng::new(p.seed, cpu);
    let shape = Shape {
        cpu,
        cpus: p.cpus,
        tracer: p.tracer,
    };
    let mut op = ops::draw(&mut r, shape);
    for _ in 0..index {
        op = ops::draw(&mut r, shape);
    }
    op
}

/// The seed corpus: each entry reproduces a bug the fuzzer found in root
/// (each fixed, with a host test of its own as well).
pub const CORPUS: &[(&str, Params)] = &[
    (
        "corpus seed 1, one vCPU (a fetch above 4 GiB stopped the VM; CR0.PG cleared from 64-bit code; CR0.CD lost with NE; split port reads)",
        Params {
            seed: 1,
            ops: 5000,
            cpus: 1,
            window: 1000,
            record: true,
            tracer: false,
            ..Params::BASE
        },
    ),
    (
        "corpus seed 1, two vCPUs (an AP's CR0 write judged with a stale CR4.PAE)",
        Params {
            seed: 1,
            ops: 5000,
            cpus: 2,
            window: 1000,
            record: true,
            tracer: false,
            ..Params::BASE
        },
    ),
    (
        "corpus seed 404, two vCPUs, hooks under fire (a step of a hooked page's read with IF clear and another vCPU's IPI pending never ended; root's TF then trapped in the guest. And the program's own: root's trampoline code, run from a wild offset, popped IF set and took an IPI on a stack near 0, which left it in service for good)",
        Params {
            seed: 404,
            ops: 15_000,
            cpus: 2,
            window: 1000,
            record: true,
            tracer: true,
            ..Params::BASE
        },
    ),
];

/// A test over one operation.
pub type OpTest = fn(&Op) -> bool;

/// For a corpus entry (by its index in [`CORPUS`]), the operations its
/// bugs need, each with a name: the test checks that the stream still
/// holds them (the stream changes when operations are added).
pub fn corpus_needs(index: usize) -> Vec<(&'static str, OpTest)> {
    match index {
        0 => vec![
            (
                "a fetch above 4 GiB",
                |op| matches!(op, Op::Fetch { addr } if *addr >= 1 << 32),
            ),
            (
                "a CR0 write clearing PG",
                |op| matches!(op, Op::Cr0 { flip } if flip & (1 << 31) != 0),
            ),
            (
                "a CR0 write of CD with NE",
                |op| matches!(op, Op::Cr0 { flip } if flip & (1 << 30) != 0 && flip & (1 << 5) != 0),
            ),
            (
                "a narrow read at 0xCF8..0xCFB",
                |op| matches!(op, Op::In { port, width } if (0xCF8..=0xCFB).contains(port) && (*port != 0xCF8 || *width < 4)),
            ),
        ],
        // The AP's own start-up reproduced it: every run on two vCPUs.
        1 => vec![],
        _ => vec![
            ("an IPI to the other vCPUs", |op| {
                matches!(
                    op,
                    Op::Ipi(
                        fuzz_guest::ops::IpiKind::FixedOthers(_)
                            | fuzz_guest::ops::IpiKind::FixedAll(_)
                    )
                )
            }),
            ("a read of the hooked page", |op| {
                matches!(op, Op::HookRead { .. } | Op::HookCall { f: 3, .. })
            }),
            ("a run of root's trampoline code", |op| {
                matches!(op, Op::Trampoline { run: true, .. })
            }),
        ],
    }
}

/// Every operation of a run's streams, in order per vCPU.
pub fn stream(p: &Params) -> Vec<Op> {
    let mut out = Vec::new();
    for cpu in 0..p.cpus {
        let mut r = Rng::new(p.seed, cpu);
        let shape = Shape {
            cpu,
            cpus: p.cpus,
            tracer: p.tracer,
        };
        out.extend((0..p.ops).map(|_| ops::draw(&mut r, shape)));
    }
    out
}

/// The fixed seeds CI runs besides the corpus.
pub const CI_SEEDS: &[(&str, Params)] = &[
    (
        "seed 303, one vCPU, hooks under fire",
        Params {
            seed: 303,
            ops: 60_000,
            cpus: 1,
            window: 2000,
            record: true,
            tracer: true,
            ..Params::BASE
        },
    ),
    (
        "seed 505, two vCPUs, hooks under fire",
        Params {
            seed: 505,
            ops: 10_000,
            cpus: 2,
            window: 1000,
            record: true,
            tracer: true,
            ..Params::BASE
        },
    ),
    (
        "seed 101, one vCPU",
        Params {
            seed: 101,
            ops: 40_000,
            cpus: 1,
            window: 2000,
            record: true,
            tracer: false,
            ..Params::BASE
        },
    ),
    (
        "seed 202, two vCPUs",
        Params {
            seed: 202,
            ops: 25_000,
            cpus: 2,
            window: 2000,
            record: true,
            tracer: false,
            ..Params::BASE
        },
    ),
];

// ---------------------------------------------------------------- the image

/// Where the setup header ends: protocol 2.15's last field,
/// `kernel_info_offset`, is 4 bytes.
const HEADER_END: usize = hdr::KERNEL_INFO_OFFSET + 4;

fn u32_at(b: &[u8], at: usize) -> Result<u32> {
    let s = b
        .get(at..at + 4)
        .ok_or_else(|| anyhow!("ELF truncated at {at:#x}"))?;
    Ok(u32::from_le_bytes(s.try_into()?))
}

fn u64_at(b: &[u8], at: usize) -> Result<u64> {
    let s = b
        .get(at..at + 8)
        .ok_or_else(|| anyhow!("ELF truncated at {at:#x}"))?;
    Ok(u64::from_le_bytes(s.try_into()?))
}

/// The program's memory image from `LINK_BASE`: the loadable segments'
/// file bytes (gaps zero), and the size it needs with its bss.
pub fn flatten(elf: &[u8]) -> Result<(Vec<u8>, u64)> {
    let elf = Elf::parse(elf).map_err(|e| anyhow!("{e}"))?;
    let mut image = Vec::new();
    let mut memsz_end = LINK_BASE;
    for (i, ph) in elf.program_headers().enumerate() {
        let ph = ph.map_err(|e| anyhow!("{e}"))?;
        if ph.kind != PT_LOAD {
            continue;
        }
        // Placed by physical (load) address: the hooked part runs at
        // kernel-text addresses but loads right after the rest.
        if ph.paddr < LINK_BASE {
            bail!(
                "segment at {:#x} below the link base {LINK_BASE:#x}",
                ph.paddr
            );
        }
        memsz_end = memsz_end.max(ph.paddr + ph.mem_size);
        if ph.file_size == 0 {
            continue;
        }
        let (at, offset, filesz) = (
            (ph.paddr - LINK_BASE) as usize,
            ph.offset as usize,
            ph.file_size as usize,
        );
        let bytes = elf
            .bytes()
            .get(offset..offset + filesz)
            .ok_or_else(|| anyhow!("segment {i} runs past the file"))?;
        if image.len() < at + filesz {
            image.resize(at + filesz, 0);
        }
        image[at..at + filesz].copy_from_slice(bytes);
    }
    if image.is_empty() {
        bail!("no loadable segment");
    }
    Ok((image, memsz_end - LINK_BASE))
}

/// The ELF's symbols (name → value) from its symbol table.
pub fn elf_symbols(elf: &[u8]) -> Result<BTreeMap<String, u64>> {
    const SHT_SYMTAB: u32 = 2;
    const SYM_SIZE: usize = 24;
    let elf = Elf::parse(elf).map_err(|e| anyhow!("{e}"))?;
    let sections: Vec<_> = elf
        .sections()
        .collect::<Result<_, _>>()
        .map_err(|e| anyhow!("{e}"))?;
    let mut out = BTreeMap::new();
    for sh in sections.iter().filter(|sh| sh.kind == SHT_SYMTAB) {
        let syms = elf.data(sh).map_err(|e| anyhow!("{e}"))?;
        let strtab = sections
            .get(sh.link as usize)
            .ok_or_else(|| anyhow!("the symbol table's string table is missing"))?;
        let strs = elf.data(strtab).map_err(|e| anyhow!("{e}"))?;
        for e in syms.chunks_exact((sh.entsize as usize).max(SYM_SIZE)) {
            let name_at = u32_at(e, 0)? as usize;
            let Some(name) = strs
                .get(name_at..)
                .and_then(|r| r.split(|&b| b == 0).next())
            else {
                continue;
            };
            if !name.is_empty() {
                out.insert(String::from_utf8_lossy(name).into_owned(), u64_at(e, 8)?);
            }
        }
    }
    Ok(out)
}

/// The kallsyms tables of the program's hooked part, in the layout of a
/// 6.12 kernel, for root's introspection to find as it finds a kernel's:
/// `_stext`, the hooked functions, `_etext`, `linux_banner`, and data
/// symbols after them (a kernel's tables are never tiny).
pub fn kallsyms(syms: &BTreeMap<String, u64>) -> Result<(u64, Vec<u8>)> {
    use test_support::synth::{generate, Order, Sym};
    let get = |n: &str| {
        syms.get(n)
            .copied()
            .ok_or_else(|| anyhow!("the fuzzing guest has no symbol {n}"))
    };
    let stext = get("fz_stext")?;
    let at = get("fz_kallsyms")?;
    let mut list = vec![Sym {
        kind: b'T',
        name: "_stext".into(),
        addr: stext,
    }];
    for f in fuzz_guest::HOOKED_FUNCTIONS {
        list.push(Sym {
            kind: b'T',
            name: f.into(),
            addr: get(f)?,
        });
    }
    for (kind, name, sym) in [
        (b'd', "fz_hook_word", "fz_hook_word"),
        (b'd', "fz_hook_spare", "fz_hook_spare"),
        (b'T', "_etext", "fz_etext"),
        (b'D', "linux_banner", "fz_linux_banner"),
    ] {
        list.push(Sym {
            kind,
            name: name.into(),
            addr: get(sym)?,
        });
    }
    for i in 0..300u64 {
        list.push(Sym {
            kind: b'd',
            name: format!("fz_table_{i:04}"),
            addr: at + i * 8,
        });
    }
    list.sort_by_key(|s| s.addr);
    let (blob, _) = generate(&list, Order::V612, false, stext);
    if blob.len() > fuzz_guest::KALLSYMS_ROOM {
        bail!(
            "the kallsyms tables take {} bytes, more than the {} reserved",
            blob.len(),
            fuzz_guest::KALLSYMS_ROOM
        );
    }
    Ok((at, blob))
}

/// Wraps the program in a bzImage: a boot sector and one setup sector that
/// hold the setup header (no real-mode code: neither loader runs it), then
/// the protected-mode image (32-bit entry at 0, 64-bit entry at 0x200).
pub fn bzimage(elf: &[u8]) -> Result<Vec<u8>> {
    let (mut image, mem) = flatten(elf)?;
    // The kallsyms tables, written where the program reserved room.
    let syms = elf_symbols(elf)?;
    if syms.contains_key("fz_kallsyms") {
        let (at, blob) = kallsyms(&syms)?;
        let off = (at - fuzz_guest::HOOKED_VMA + fuzz_guest::HOOKED_LMA - LINK_BASE) as usize;
        image
            .get_mut(off..off + blob.len())
            .ok_or_else(|| anyhow!("the kallsyms room at {at:#x} is outside the image"))?
            .copy_from_slice(&blob);
    }
    while image.len() % 16 != 0 {
        image.push(0);
    }
    let setup_sects = 1usize;
    let mut out = vec![0u8; (setup_sects + 1) * 512];
    let put = |out: &mut Vec<u8>, at: usize, bytes: &[u8]| {
        out[at..at + bytes.len()].copy_from_slice(bytes)
    };
    out[hdr::SETUP_SECTS] = setup_sects as u8;
    put(
        &mut out,
        hdr::SYSSIZE,
        &((image.len() / 16) as u32).to_le_bytes(),
    );
    put(&mut out, hdr::BOOT_FLAG, &BOOT_FLAG.to_le_bytes());
    // A short jump over the header, as the kernel's.
    put(
        &mut out,
        hdr::JUMP_OFFSET - 1,
        &[0xEB, (HEADER_END - hdr::JUMP_BASE) as u8],
    );
    put(&mut out, hdr::HEADER_MAGIC, &HEADER_MAGIC);
    put(&mut out, hdr::VERSION, &0x020Fu16.to_le_bytes());
    out[hdr::TYPE_OF_LOADER] = 0;
    // LOADED_HIGH: the protected-mode part goes at 1 MiB or above.
    out[hdr::LOADFLAGS] = 0x01;
    put(&mut out, hdr::CODE32_START, &0x10_0000u32.to_le_bytes());
    put(
        &mut out,
        hdr::INITRD_ADDR_MAX,
        &0x7FFF_FFFFu32.to_le_bytes(),
    );
    put(&mut out, hdr::KERNEL_ALIGNMENT, &0x20_0000u32.to_le_bytes());
    out[hdr::RELOCATABLE_KERNEL] = 1;
    out[hdr::MIN_ALIGNMENT] = 21;
    // XLF_KERNEL_64: the 64-bit entry at +0x200.
    put(
        &mut out,
        hdr::XLOADFLAGS,
        &XLoadFlags::KERNEL_64.bits().to_le_bytes(),
    );
    put(&mut out, hdr::CMDLINE_SIZE, &2047u32.to_le_bytes());
    put(&mut out, hdr::PREF_ADDRESS, &LINK_BASE.to_le_bytes());
    let init_size = u32::try_from(mem.max(image.len() as u64)).context("the program is too big")?;
    put(&mut out, hdr::INIT_SIZE, &init_size.to_le_bytes());
    out.extend_from_slice(&image);
    Ok(out)
}

/// An initramfs with nothing in it: a newc archive of its trailer alone
/// (the loaders want one; the program never looks at it).
pub fn empty_initrd() -> Vec<u8> {
    let name = b"TRAILER!!!\0";
    let mut h = format!(
        "070701{:08X}{:08X}{:08X}{:08X}{:08X}{:08X}{:08X}{:08X}{:08X}{:08X}{:08X}{:08X}{:08X}",
        0,
        0,
        0,
        0,
        1,
        0,
        0,
        0,
        0,
        0,
        0,
        name.len(),
        0
    )
    .into_bytes();
    h.extend_from_slice(name);
    while h.len() % 4 != 0 {
        h.push(0);
    }
    while h.len() % 512 != 0 {
        h.push(0);
    }
    h
}

/// The repository root.
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// Builds the program with cargo and writes `fuzz-guest.bzImage` and an
/// empty initramfs next to it; returns both paths (built once per process).
pub fn guest_files() -> Result<(PathBuf, PathBuf)> {
    static FILES: OnceLock<Result<(PathBuf, PathBuf), String>> = OnceLock::new();
    FILES
        .get_or_init(|| build_guest_files().map_err(|e| format!("{e:#}")))
        .clone()
        .map_err(|e| anyhow!("{e}"))
}

fn build_guest_files() -> Result<(PathBuf, PathBuf)> {
    let root = repo_root();
    let status = Command::new("cargo")
        .args([
            "build",
            "-q",
            "-p",
            "fuzz-guest",
            "--release",
            "--target",
            "x86_64-unknown-none",
            "--features",
            "bare-metal",
        ])
        .current_dir(&root)
        .stdin(Stdio::null())
        .status()
        .context("cannot run cargo to build the fuzzing guest")?;
    if !status.success() {
        bail!("building the fuzzing guest failed ({status})");
    }
    let target = match std::env::var_os("CARGO_TARGET_DIR") {
        Some(d) if !d.is_empty() => root.join(d),
        _ => root.join("target"),
    };
    let dir = target.join("x86_64-unknown-none").join("release");
    let elf = dir.join("fuzz-guest");
    let bytes = std::fs::read(&elf).with_context(|| format!("cannot read {}", elf.display()))?;
    let image = bzimage(&bytes).with_context(|| format!("wrapping {}", elf.display()))?;
    let kernel = dir.join("fuzz-guest.bzImage");
    write_whole(&kernel, &image)?;
    let initrd = dir.join("fuzz-guest.initrd");
    write_whole(&initrd, &empty_initrd())?;
    Ok((kernel, initrd))
}

/// Writes `path` under a name of its own, then renames it into place: a
/// second driver running at the same time (and the emulator it started)
/// never reads a file half written.
fn write_whole(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, bytes).with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("cannot rename into {}", path.display()))
}

// ---------------------------------------------------------------- one run

/// What one run of the program came to.
#[derive(Debug, Default, Clone)]
pub struct RunResult {
    /// Bare or under the hypervisor.
    pub under: bool,
    /// The program's lines (`fuzz: ` stripped).
    pub lines: Vec<String>,
    /// The program printed `end`.
    pub finished: bool,
    /// Why the run did not finish, if it did not.
    pub failure: Option<String>,
    /// The hypervisor's error lines.
    pub hv_errors: Vec<String>,
    /// Root's exit counts, by reason, after the program ended (from a
    /// status request: root answered).
    pub exits: Option<BTreeMap<String, u64>>,
    /// From the program's `start` line to its `end`.
    pub fuzz_time: Option<Duration>,
    /// The whole run.
    pub wall: Duration,
    /// What the tracer did (tracer mode under the hypervisor).
    pub tracer: Option<TracerReport>,
    /// A recording run that finished: its VM, the program waiting for
    /// questions ([`pinpoint`]).
    pub kept: Option<Kept>,
}

/// A finished recording run's VM, kept to ask the program about its
/// outcomes; closed when the last clone goes.
#[derive(Clone)]
pub struct Kept(std::sync::Arc<std::sync::Mutex<Closing>>);

/// Closes the VM (its run directory removed) when dropped, then lets the
/// thread that started it end ([`run_in_thread`]).
pub struct Closing(Option<Vm>, Option<std::sync::mpsc::Sender<()>>);

impl Drop for Closing {
    fn drop(&mut self) {
        if let Some(vm) = self.0.take() {
            vm.close();
        }
    }
}

/// Runs [`run_once`] in a thread of its own and returns its result. The
/// emulator gets SIGKILL when the thread that started it ends (its
/// parent-death signal, `hvtrace::sys`), so for a kept VM the thread
/// waits until the VM is closed.
pub fn run_in_thread(
    p: &Params,
    hypervisor: Option<&Path>,
    timeout: Duration,
) -> Result<RunResult> {
    let (tx, rx) = std::sync::mpsc::channel();
    let p = *p;
    let hypervisor = hypervisor.map(Path::to_path_buf);
    std::thread::spawn(move || {
        let (hold, wait) = std::sync::mpsc::channel::<()>();
        let r = run_once(&p, hypervisor.as_deref(), timeout);
        if let Some(k) = r.as_ref().ok().and_then(|r| r.kept.as_ref()) {
            if let Ok(mut c) = k.0.lock() {
                c.1 = Some(hold);
            }
        } else {
            drop(hold);
        }
        let _ = tx.send(r);
        // Returns once every sender is gone: the kept VM closed.
        let _ = wait.recv();
    });
    rx.recv()
        .unwrap_or_else(|_| Err(anyhow!("the run's thread ended without a result")))
}

impl std::fmt::Debug for Kept {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Kept(..)")
    }
}

/// How long the program gets to answer one question.
pub const ANSWER_TIME: Duration = Duration::from_secs(120);

impl Kept {
    /// Asks one question (`fuzz_guest::query`) and returns the answer's
    /// lines, up to its `qdone`.
    pub fn ask(&self, question: &str) -> Result<Vec<String>> {
        let mut guard = self
            .0
            .lock()
            .map_err(|_| anyhow!("the kept VM's lock is poisoned"))?;
        let vm = guard
            .0
            .as_mut()
            .ok_or_else(|| anyhow!("the kept VM is closed"))?;
        let before = fuzz_lines(&vm.console_text()).len();
        vm.send(format!("{question}\n").as_bytes())?;
        let deadline = Instant::now() + ANSWER_TIME;
        loop {
            let lines = fuzz_lines(&vm.console_text());
            if let Some(end) = lines.iter().skip(before).position(|l| l == "qdone") {
                let answer: Vec<String> = lines[before..before + end].to_vec();
                if let Some(e) = answer.iter().find(|l| l.starts_with("qerr ")) {
                    bail!("the program refused {question:?}: {e}");
                }
                return Ok(answer);
            }
            if let Some(why) = vm.watch().ended() {
                bail!("the VM ended while answering {question:?}: {why}");
            }
            if Instant::now() > deadline {
                bail!(
                    "no answer to {question:?} within {} s",
                    ANSWER_TIME.as_secs()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// How long root gets to answer the status request after the program
/// ended: past it, root counts as hung.
pub const ROOT_ANSWER: Duration = Duration::from_secs(30);

/// Boots the program once, bare or under `hypervisor`, and collects its
/// lines until `end`, a `FATAL` line, the emulator's end or `timeout`.
pub fn run_once(p: &Params, hypervisor: Option<&Path>, timeout: Duration) -> Result<RunResult> {
    let (kernel, initrd) = guest_files()?;
    let mut cfg = RunConfig::new(kernel, initrd);
    cfg.append = cmdline(p);
    cfg.cpus = p.cpus;
    cfg.memory_mib = 256;
    if p.record {
        // The record lies from 128 MiB up; 16 MiB to spare above it.
        let kept = p.recorded();
        let bytes = fuzz_guest::query::record_bytes(kept.end - kept.start, p.cpus)
            .ok_or_else(|| anyhow!("fuzz.record: too many operations to keep"))?;
        let top = fuzz_guest::query::RECORD_BASE + bytes;
        cfg.memory_mib = cfg
            .memory_mib
            .max(u32::try_from(top.div_ceil(1 << 20) + 16)?);
    }
    cfg.timeout = timeout + Duration::from_secs(60);
    cfg.progress = false;
    cfg.hypervisor = hypervisor.map(Path::to_path_buf);
    let under = cfg.under_hypervisor();
    let tracer = p.tracer;
    // HVTRACE_FUZZ_KEEP=DIR keeps each run's directory (the emulator's
    // log among it) under DIR/bare or DIR/hv.
    if let Some(dir) = std::env::var_os("HVTRACE_FUZZ_KEEP").filter(|d| !d.is_empty()) {
        // A second run of the same kind (the driver's narrowing runs, two
        // bare runs compared) gets a name of its own.
        static RUNS: [std::sync::atomic::AtomicU32; 2] =
            [const { std::sync::atomic::AtomicU32::new(0) }; 2];
        let n = RUNS[usize::from(under)].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = if under { "hv" } else { "bare" };
        cfg.run_dir = Some(PathBuf::from(dir).join(if n == 0 {
            name.to_string()
        } else {
            format!("{name}-{n}")
        }));
        cfg.keep_dir = true;
    }
    let started = Instant::now();
    let mut vm = Vm::start(cfg)?;
    let mut ctl = if under {
        Some(Ctl::new(vm.take_control()?)?)
    } else {
        None
    };
    let mut result = RunResult {
        under,
        ..RunResult::default()
    };
    let mut report = TracerReport::default();
    let mut went = false;
    let mut armed_at = Instant::now();
    let mut armed = false;
    let watch = vm.watch();
    let mut start_seen: Option<Instant> = None;
    let deadline = started + timeout;
    loop {
        let text = vm.console_text();
        let lines = fuzz_lines(&text);
        if !went && lines.iter().any(|l| l.starts_with("ready ")) {
            // Tracer mode: hooks on (under the hypervisor), then go.
            if let Some(ctl) = ctl.as_mut() {
                if let Err(e) = tracer_start(ctl, &mut report) {
                    result.lines = lines;
                    result.failure = Some(format!("the tracer did not start: {e:#}"));
                    break;
                }
                armed = true;
                armed_at = Instant::now();
            }
            vm.send(b"g")?;
            went = true;
            start_seen = Some(Instant::now());
        }
        if start_seen.is_none() && !tracer && lines.iter().any(|l| l.starts_with("start ")) {
            start_seen = Some(Instant::now());
        }
        if let (Some(ctl), true) = (ctl.as_mut(), went && tracer) {
            // Under fire: off and on again every 300 ms, the events read
            // in between.
            ctl.pump(Duration::from_millis(100))?;
            if armed_at.elapsed() > Duration::from_millis(300) {
                if armed {
                    disarm(ctl, &mut report);
                    report.cycles += 1;
                } else {
                    arm(ctl, &mut report);
                }
                armed = !armed;
                armed_at = Instant::now();
            }
        }
        if lines.iter().any(|l| l == "end")
            && (!p.record || lines.iter().any(|l| l == "serving") || Instant::now() > deadline)
        {
            result.finished = true;
            result.fuzz_time = start_seen.map(|s| s.elapsed());
            result.lines = lines;
            break;
        }
        if let Some(l) = lines.iter().find(|l| l.starts_with("FATAL")) {
            // Let the rest of the line (and the other vCPUs' lines) arrive.
            std::thread::sleep(Duration::from_millis(1500));
            result.lines = fuzz_lines(&vm.console_text());
            result.failure = Some(format!("the program stopped: {l}"));
            break;
        }
        if lines.iter().any(|l| l.starts_with("STALL")) {
            // A vCPU named another as stalled and asked it where it is:
            // give its answer time to arrive.
            std::thread::sleep(Duration::from_secs(5));
            result.lines = fuzz_lines(&vm.console_text());
            let stalls: Vec<&String> = result
                .lines
                .iter()
                .filter(|l| l.starts_with("STALL"))
                .collect();
            result.failure = Some(format!("a vCPU stalled: {stalls:?}"));
            break;
        }
        if !vm.hv_errors().is_empty() {
            result.lines = lines;
            result.failure = Some(format!("root reported errors: {:?}", vm.hv_errors()));
            break;
        }
        if let Some(why) = watch.ended() {
            result.lines = lines;
            result.failure = Some(format!("the VM ended before the program's end: {why}"));
            break;
        }
        if Instant::now() > deadline {
            result.lines = lines;
            result.failure = Some(format!(
                "no `end` within {} s (last line: {:?})",
                timeout.as_secs(),
                result.lines.last()
            ));
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    result.hv_errors = vm.hv_errors();
    if let Some(ctl) = ctl.as_mut() {
        if result.failure.is_none() {
            if tracer {
                if armed {
                    disarm(ctl, &mut report);
                }
                let _ = ctl.call(protocol::Request::TraceStop, Duration::from_secs(30));
                let _ = ctl.pump(Duration::from_millis(500));
                tally(ctl, &mut report);
                result.tracer = Some(report);
            }
            match ctl.exits() {
                Ok(exits) => result.exits = Some(exits),
                Err(e) => {
                    result.failure = Some(format!("root did not answer a status request: {e:#}"))
                }
            }
        } else if result
            .failure
            .as_deref()
            .is_some_and(|f| f.starts_with("no `end`"))
        {
            // The program stopped making progress: whether root still
            // answers, and what the vCPUs were exiting for, tell a guest
            // stuck from a root stuck.
            let answer = match ctl.exits() {
                Ok(exits) => format!("root still answers; exits so far: {exits:?}"),
                Err(e) => format!("root does not answer either: {e:#}"),
            };
            if let Some(f) = result.failure.as_mut() {
                f.push_str("; ");
                f.push_str(&answer);
            }
        }
    }
    result.wall = started.elapsed();
    if p.record && result.finished && result.failure.is_none() {
        result.kept = Some(Kept(std::sync::Arc::new(std::sync::Mutex::new(Closing(
            Some(vm),
            None,
        )))));
    } else {
        vm.close();
    }
    Ok(result)
}

/// Runs `p` bare and under `hypervisor` side by side (one emulator each)
/// and returns both outcomes: (bare, under the hypervisor).
pub fn run_pair(
    p: &Params,
    hypervisor: &Path,
    timeout: Duration,
) -> (Result<RunResult>, Result<RunResult>) {
    let pb = *p;
    let bare = std::thread::spawn(move || run_in_thread(&pb, None, timeout));
    let under = run_once(p, Some(hypervisor), timeout);
    let bare = bare
        .join()
        .unwrap_or_else(|_| Err(anyhow!("the bare run panicked")));
    (bare, under)
}

/// Blocks per question of [`pinpoint`].
pub const NARROW_BLOCKS: u64 = 64;

/// What [`pinpoint`] and [`first_differing_op`] found.
#[derive(Debug, Default)]
pub struct OpSearch {
    /// Each step's result, in order.
    pub steps: Vec<String>,
    /// The first operation whose outcome differs: (bare line, hypervisor
    /// line). `None`: the difference did not come back.
    pub first: Option<(String, String)>,
}

/// Finds the first operation of vCPU `cpu` in window `win` whose outcome
/// differs, bare and under `hypervisor`, for runs that kept no record:
/// both run again, whole and with the same output while the stream runs
/// (so the same timing, which a difference between vCPUs can need), the
/// record keeping that window only, and [`pinpoint`] asks them.
pub fn first_differing_op(
    p: &Params,
    cpu: u32,
    win: u64,
    hypervisor: &Path,
    timeout: Duration,
) -> Result<OpSearch> {
    let q = Params {
        log: None,
        record: true,
        from: win * p.window,
        until: ((win + 1) * p.window).min(p.ops),
        ..*p
    };
    let (bare, under) = run_pair(&q, hypervisor, timeout);
    let (bare, under) = (bare?, under?);
    match (&bare.kept, &under.kept) {
        (Some(b), Some(h)) => pinpoint(&q, cpu, win, b, h),
        _ => {
            let mut search = OpSearch::default();
            for (name, r) in [("bare", &bare), ("hypervisor", &under)] {
                if r.kept.is_none() {
                    search.steps.push(format!(
                        "the {name} run again did not finish: {}",
                        r.failure.as_deref().unwrap_or("no end line")
                    ));
                }
            }
            Ok(search)
        }
    }
}

/// Operations a question prints one by one, at most ([`pinpoint`]).
pub const PINPOINT_OPS: u64 = 256;

/// Finds the first operation of vCPU `cpu` in window `win` whose outcome
/// differs, by asking the two recording runs that showed it (both VMs
/// kept, the programs serving): block digests of the range, 64 at a time,
/// narrow it to [`PINPOINT_OPS`] operations, which both print. No second
/// run, so a difference that needs one run's timing is found too.
pub fn pinpoint(p: &Params, cpu: u32, win: u64, bare: &Kept, hv: &Kept) -> Result<OpSearch> {
    let mut lo = win * p.window;
    let mut hi = ((win + 1) * p.window).min(p.ops);
    let mut search = OpSearch::default();
    while hi - lo > PINPOINT_OPS {
        let len = (hi - lo).div_ceil(NARROW_BLOCKS);
        let n = (hi - lo).div_ceil(len);
        let q = format!("b {cpu} {lo} {len} {n}");
        let (b, h) = (
            block_digests(&bare.ask(&q)?, cpu),
            block_digests(&hv.ask(&q)?, cpu),
        );
        let Some(k) = (0..n).find(|k| b.get(k) != h.get(k)) else {
            search
                .steps
                .push(format!("blocks of {len} over operations {lo}..{hi} agree"));
            return Ok(search);
        };
        lo += k * len;
        hi = (lo + len).min(hi);
        search.steps.push(format!(
            "blocks of {len}: operations {lo}..{hi} differ first"
        ));
    }
    let q = format!("o {cpu} {lo} {}", hi - lo);
    search.first = first_op_diff(&bare.ask(&q)?, &hv.ask(&q)?);
    search.steps.push(format!(
        "operations {lo}..{hi}, one by one: {}",
        if search.first.is_some() {
            "the first differing one follows"
        } else {
            "they agree"
        }
    ));
    Ok(search)
}

/// Names the first differing operation of vCPU `cpu` in window `win`:
/// from the runs themselves when both kept their VMs ([`pinpoint`]), else
/// by running them again ([`first_differing_op`]).
pub fn explain(
    p: &Params,
    cpu: u32,
    win: u64,
    runs: (&RunResult, &RunResult),
    hypervisor: &Path,
    timeout: Duration,
) -> Result<OpSearch> {
    match (&runs.0.kept, &runs.1.kept) {
        (Some(b), Some(h)) => pinpoint(p, cpu, win, b, h),
        _ => first_differing_op(p, cpu, win, hypervisor, timeout),
    }
}

/// vCPU `cpu`'s block digests (`blk <cpu> <k> <digest>`), by block.
pub fn block_digests(lines: &[String], cpu: u32) -> BTreeMap<u64, String> {
    lines
        .iter()
        .filter_map(|l| {
            let mut w = l.strip_prefix("blk ")?.split(' ');
            if w.next()?.parse::<u32>().ok()? != cpu {
                return None;
            }
            let k = w.next()?.parse().ok()?;
            Some((k, w.next()?.to_string()))
        })
        .collect()
}

/// A client of root's control line (COM2) for one run: requests and
/// their answers, with the trace events that come in between kept.
struct Ctl {
    w: protocol::io::FrameWriter<hvtrace::vm::channel::Channel>,
    r: protocol::io::FrameReader<std::os::unix::net::UnixStream>,
    seq: u32,
    /// (source, line) of every trace line so far.
    lines: Vec<(u32, String)>,
    lost: u64,
}

impl Ctl {
    fn new(control: hvtrace::vm::ControlChannel) -> Result<Ctl> {
        control
            .reader
            .set_read_timeout(Some(Duration::from_millis(200)))?;
        Ok(Ctl {
            w: protocol::io::FrameWriter::new(control.writer),
            r: protocol::io::FrameReader::new(control.reader),
            seq: 100,
            lines: Vec::new(),
            lost: 0,
        })
    }

    /// Reads one frame (or times out after 200 ms); keeps trace lines.
    fn frame(&mut self) -> Result<Option<protocol::Frame>> {
        use protocol::{Body, Event};
        match self.r.read_frame() {
            Ok(f) => {
                if let Body::Event(Event::TraceText {
                    source, lost, text, ..
                }) = &f.body
                {
                    self.lost += lost;
                    self.lines
                        .extend(text.lines().map(|l| (*source, l.to_string())));
                }
                Ok(Some(f))
            }
            Err(protocol::io::ReadError::Io(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                Ok(None)
            }
            Err(protocol::io::ReadError::Decode(_)) => Ok(None),
            Err(e) => Err(anyhow!("reading COM2: {e}")),
        }
    }

    /// Sends `req` and waits up to `limit` for its answer.
    fn call(&mut self, req: protocol::Request, limit: Duration) -> Result<protocol::Response> {
        use protocol::{Body, Frame};
        self.seq += 1;
        let seq = self.seq;
        self.w.write_frame(&Frame::request(seq, req))?;
        let asked = Instant::now();
        while asked.elapsed() < limit {
            if let Some(Frame {
                seq: s,
                body: Body::Response(r),
                ..
            }) = self.frame()?
            {
                if s == seq {
                    return Ok(r);
                }
            }
        }
        bail!("no answer within {} s", limit.as_secs())
    }

    /// Keeps reading trace events for `d`.
    fn pump(&mut self, d: Duration) -> Result<()> {
        let until = Instant::now() + d;
        while Instant::now() < until {
            self.frame()?;
        }
        Ok(())
    }

    /// Root's exit counts.
    fn exits(&mut self) -> Result<BTreeMap<String, u64>> {
        match self.call(protocol::Request::Status, ROOT_ANSWER)? {
            protocol::Response::Status(report) => Ok(report
                .exits
                .into_iter()
                .map(|e| (e.name, e.count))
                .collect()),
            other => bail!("unexpected answer to status: {other:?}"),
        }
    }
}

/// What the tracer did during a run under the hypervisor.
#[derive(Debug, Default, Clone)]
pub struct TracerReport {
    /// Root found the program's symbols (its "kernel").
    pub recovered: bool,
    /// Times the probe, the function tracer and the graph session were
    /// all armed and disarmed again while the program ran.
    pub cycles: u64,
    /// Trace lines of the probe on fz_hook_0.
    pub probe_lines: u64,
    /// Trace lines of the function tracer on fz_hook_1.
    pub function_lines: u64,
    /// Trace lines of the graph sessions on fz_hook_2.
    pub graph_lines: u64,
    /// Events root said it lost.
    pub lost: u64,
    /// A few lines of each kind.
    pub sample: Vec<String>,
    /// Requests that failed.
    pub errors: Vec<String>,
}

/// The requests that arm the hooks: a probe on fz_hook_0, the function
/// tracer on fz_hook_1, a graph session on fz_hook_2.
fn arm(ctl: &mut Ctl, report: &mut TracerReport) {
    use protocol::{GraphFilter, Request, Response};
    let t = Duration::from_secs(30);
    let reqs = [
        Request::ProbeAdd {
            spec: "p:fz/h0 fz_hook_0 arg=%di".into(),
        },
        Request::FunctionAdd {
            glob: "fz_hook_1".into(),
        },
        Request::GraphStart(GraphFilter {
            functions: vec!["fz_hook_2".into()],
            ..GraphFilter::default()
        }),
    ];
    for req in reqs {
        let what = format!("{req:?}");
        match ctl.call(req, t) {
            Ok(
                Response::ProbeAdded { .. }
                | Response::FunctionAdded { traced: 1, .. }
                | Response::GraphStarted { .. },
            ) => {}
            Ok(other) => report.errors.push(format!("{what}: {other:?}")),
            Err(e) => report.errors.push(format!("{what}: {e:#}")),
        }
    }
}

/// The requests that take them off.
fn disarm(ctl: &mut Ctl, report: &mut TracerReport) {
    use protocol::{Request, Response};
    let t = Duration::from_secs(30);
    for req in [
        Request::ProbeDel {
            name: "fz/h0".into(),
        },
        Request::FunctionClear,
        Request::GraphStop { session: None },
    ] {
        let what = format!("{req:?}");
        match ctl.call(req, t) {
            Ok(Response::Ok) => {}
            Ok(other) => report.errors.push(format!("{what}: {other:?}")),
            Err(e) => report.errors.push(format!("{what}: {e:#}")),
        }
    }
}

/// Waits for root to find the program's symbols, then arms the hooks and
/// starts the trace.
fn tracer_start(ctl: &mut Ctl, report: &mut TracerReport) -> Result<()> {
    use protocol::{Request, Response, TraceFormat};
    let until = Instant::now() + Duration::from_secs(120);
    while Instant::now() < until {
        if let Response::Status(s) = ctl.call(Request::Status, ROOT_ANSWER)? {
            if s.kernel.is_some() {
                report.recovered = true;
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    if !report.recovered {
        bail!("root did not find the program's symbols within 120 s");
    }
    match ctl.call(
        Request::TraceStart {
            format: TraceFormat::Text,
        },
        Duration::from_secs(30),
    )? {
        Response::Ok => {}
        other => bail!("TraceStart: {other:?}"),
    }
    arm(ctl, report);
    Ok(())
}

/// Counts the trace lines by kind.
fn tally(ctl: &Ctl, report: &mut TracerReport) {
    report.lost = ctl.lost;
    for (source, line) in &ctl.lines {
        let kind = if *source > 0 && line.contains("fz_hook_2") {
            &mut report.graph_lines
        } else if *source == 0 && line.contains("h0:") {
            &mut report.probe_lines
        } else if *source == 0 && line.contains("fz_hook_1") {
            &mut report.function_lines
        } else {
            continue;
        };
        if *kind < 2 {
            report.sample.push(format!("[{source}] {line}"));
        }
        *kind += 1;
    }
}

/// The program's lines in a console text, without the prefix.
pub fn fuzz_lines(console: &str) -> Vec<String> {
    console
        .lines()
        .filter_map(|l| {
            l.trim_end_matches('\r')
                .split_once(fuzz_guest::LINE_PREFIX)
                .map(|(_, r)| r.to_string())
        })
        .collect()
}

// ---------------------------------------------------------------- comparing

/// One window's digests.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Window {
    pub main: String,
    pub classes: BTreeMap<String, String>,
}

/// Everything a run's digest lines say.
#[derive(Clone, Debug, Default)]
pub struct Digests {
    pub e820: Option<String>,
    /// (cpu, window) → digests.
    pub windows: BTreeMap<(u32, u64), Window>,
    /// cpu → its `done` line.
    pub done: BTreeMap<u32, String>,
}

/// Reads the digest lines.
pub fn digests(lines: &[String]) -> Digests {
    let mut d = Digests::default();
    for l in lines {
        let mut w = l.split_whitespace();
        match w.next() {
            Some("e820") => d.e820 = w.next().map(str::to_string),
            Some("win") => {
                let (Some(cpu), Some(win), Some(main)) = (w.next(), w.next(), w.next()) else {
                    continue;
                };
                let (Ok(cpu), Ok(win)) = (cpu.parse(), win.parse()) else {
                    continue;
                };
                let classes = w
                    .filter_map(|kv| kv.split_once('='))
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect();
                d.windows.insert(
                    (cpu, win),
                    Window {
                        main: main.to_string(),
                        classes,
                    },
                );
            }
            Some("done") => {
                if let Some(Ok(cpu)) = w.next().map(str::parse) {
                    d.done.insert(cpu, l.clone());
                }
            }
            _ => {}
        }
    }
    d
}

/// How two runs' digests compare.
#[derive(Clone, Debug, Default)]
pub struct Comparison {
    /// Windows whose main digests differ or that one run lacks: bugs.
    pub main_diffs: Vec<(u32, u64)>,
    /// Documented classes with differing digests, with how many windows.
    pub known: BTreeMap<String, u64>,
    /// The e820 tables differ (documented: root takes its memory and the
    /// AP page out).
    pub e820_differs: bool,
    /// Windows compared.
    pub windows: u64,
}

/// Compares the bare run's digests with the hypervisor run's.
pub fn compare(bare: &Digests, hv: &Digests) -> Comparison {
    let mut c = Comparison {
        e820_differs: bare.e820 != hv.e820,
        ..Comparison::default()
    };
    let keys: std::collections::BTreeSet<_> = bare
        .windows
        .keys()
        .chain(hv.windows.keys())
        .copied()
        .collect();
    for k in keys {
        c.windows += 1;
        match (bare.windows.get(&k), hv.windows.get(&k)) {
            (Some(b), Some(h)) => {
                if b.main != h.main {
                    c.main_diffs.push(k);
                }
                for class in CLASSES {
                    if b.classes.get(class) != h.classes.get(class) {
                        *c.known.entry(class.to_string()).or_default() += 1;
                    }
                }
            }
            _ => c.main_diffs.push(k),
        }
    }
    c
}

/// The first operation whose outcome differs between two `fuzz.log` runs
/// of the same window: (cpu, index, bare line, hypervisor line).
pub fn first_op_diff(bare: &[String], hv: &[String]) -> Option<(String, String)> {
    let ops = |lines: &[String]| -> BTreeMap<(u32, u64), String> {
        lines
            .iter()
            .filter_map(|l| {
                let rest = l.strip_prefix("op ")?;
                let mut w = rest.splitn(3, ' ');
                let cpu = w.next()?.parse().ok()?;
                let i = w.next()?.parse().ok()?;
                Some(((cpu, i), l.clone()))
            })
            .collect()
    };
    let (b, h) = (ops(bare), ops(hv));
    // What follows " | " is a documented difference's part.
    let main = |l: &str| l.split(" | ").next().unwrap_or("").to_string();
    for (k, bl) in &b {
        match h.get(k) {
            Some(hl) if main(hl) == main(bl) => {}
            other => {
                return Some((
                    bl.clone(),
                    other.cloned().unwrap_or_else(|| "(missing)".into()),
                ))
            }
        }
    }
    h.iter()
        .find(|(k, _)| !b.contains_key(k))
        .map(|(_, hl)| ("(missing)".to_string(), hl.clone()))
}

/// Reads a whole file into a string (for the driver's saved logs).
pub fn read_text(path: &Path) -> Result<String> {
    let mut s = String::new();
    std::fs::File::open(path)?.read_to_string(&mut s)?;
    Ok(s)
}

/// Writes lines to a file.
pub fn write_lines(path: &Path, lines: &[String]) -> Result<()> {
    let mut f = std::fs::File::create(path)?;
    for l in lines {
        writeln!(f, "{l}")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_header_is_one_both_loaders_take() {
        // A fake ELF with one segment at the link base.
        let mut elf = vec![0u8; 0x1000 + 0x400];
        elf[..4].copy_from_slice(b"\x7fELF");
        elf[4] = 2;
        elf[5] = 1;
        elf[0x20..0x28].copy_from_slice(&0x40u64.to_le_bytes());
        elf[0x36..0x38].copy_from_slice(&0x38u16.to_le_bytes());
        elf[0x38..0x3A].copy_from_slice(&1u16.to_le_bytes());
        let ph = 0x40;
        elf[ph..ph + 4].copy_from_slice(&1u32.to_le_bytes());
        elf[ph + 8..ph + 16].copy_from_slice(&0x1000u64.to_le_bytes());
        elf[ph + 0x10..ph + 0x18].copy_from_slice(&LINK_BASE.to_le_bytes());
        elf[ph + 0x18..ph + 0x20].copy_from_slice(&LINK_BASE.to_le_bytes());
        elf[ph + 0x20..ph + 0x28].copy_from_slice(&0x400u64.to_le_bytes());
        elf[ph + 0x28..ph + 0x30].copy_from_slice(&0x9000u64.to_le_bytes());
        elf[0x1000] = 0xFA;
        elf[0x1200] = 0x48;
        let bz = bzimage(&elf).unwrap();
        let parsed = loader::bzimage::parse(&bz).expect("root's loader takes it");
        assert_eq!(parsed.protected_mode()[0], 0xFA);
        assert_eq!(parsed.protected_mode()[0x200], 0x48);
        assert_eq!(parsed.pref_address(), LINK_BASE);
        assert_eq!(parsed.init_size(), 0x9000);
        assert_eq!(&bz[0x202..0x206], b"HdrS");
    }

    #[test]
    fn the_corpus_still_holds_the_operations_its_bugs_need() {
        for (i, (label, p)) in CORPUS.iter().enumerate() {
            let ops = stream(p);
            for (what, test) in corpus_needs(i) {
                assert!(
                    ops.iter().any(test),
                    "{label}: no {what} in the stream any more"
                );
            }
        }
    }

    #[test]
    fn digests_compare_by_window_and_class() {
        let bare = digests(&[
            "e820 00aa 5".into(),
            "win 0 0 1111 cpuid=aa".into(),
            "win 0 1 2222".into(),
            "done 0 ops=2".into(),
        ]);
        let hv = digests(&[
            "e820 00bb 6".into(),
            "win 0 0 1111 cpuid=ab".into(),
            "win 0 1 2223".into(),
        ]);
        let c = compare(&bare, &hv);
        assert!(c.e820_differs);
        assert_eq!(c.main_diffs, vec![(0, 1)]);
        assert_eq!(c.windows, 2);
        assert_eq!(bare.done.len(), 1);
    }

    #[test]
    fn block_digests_are_read_per_vcpu() {
        let lines: Vec<String> = [
            "blk 0 0 00000000000000aa",
            "blk 1 0 00000000000000bb",
            "blk 0 1 00000000000000cc",
            "blk 0 x 00000000000000dd",
            "win 0 0 1111",
            "op 0 5 Step => ok",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let b0 = block_digests(&lines, 0);
        assert_eq!(b0.len(), 2);
        assert_eq!(b0[&0], "00000000000000aa");
        assert_eq!(b0[&1], "00000000000000cc");
        let b1 = block_digests(&lines, 1);
        assert_eq!(
            b1.into_iter().collect::<Vec<_>>(),
            vec![(0, "00000000000000bb".to_string())]
        );
    }

    #[test]
    fn the_program_reads_the_runs_command_line() {
        let p = Params {
            seed: 88,
            ops: 200_000,
            cpus: 2,
            window: 50_000,
            from: 150_000,
            until: 200_000,
            record: true,
            skip: 1 << 20,
            tracer: true,
            ..Params::BASE
        };
        assert_eq!(fuzz_guest::cmdline::parse(&cmdline(&p)), Ok(p));
        assert_eq!(p.recorded(), 150_000..200_000);
        // A whole record says no range.
        let whole = Params {
            from: 0,
            until: 0,
            ..p
        };
        let line = cmdline(&whole);
        assert!(
            !line.contains("fuzz.from") && !line.contains("fuzz.until"),
            "{line}"
        );
        assert_eq!(whole.recorded(), 0..200_000);
    }

    #[test]
    fn the_empty_initrd_is_a_newc_archive() {
        let i = empty_initrd();
        assert!(i.starts_with(b"070701"));
        let path = std::env::temp_dir().join(format!("fuzz-initrd-{}", std::process::id()));
        std::fs::write(&path, &i).unwrap();
        let checked = hvtrace::vm::config::check_initrd(&path);
        let _ = std::fs::remove_file(&path);
        checked.expect("hvtrace takes it as an initramfs");
    }
}
