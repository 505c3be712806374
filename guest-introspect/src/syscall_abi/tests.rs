use super::*;
use alloc::borrow::ToOwned;
use alloc::vec;

const TBL: &str = "\
# SPDX-License-Identifier: GPL-2.0
#
# <number> <abi> <name> <entry point> [<compat entry point> [noreturn]]

0\tcommon\tread\t\t\tsys_read
2\t64\topen\t\t\tsys_open
4\tcommon\tstat\t\t\tsys_newstat
13\tx32\trt_sigaction\t\tcompat_sys_rt_sigaction
60\tcommon\texit\t\t\tsys_exit\t\t\t-\t\t\tnoreturn
134\t64\tuselib
x\tcommon\tbad\t\t\tsys_bad
7 common poll sys_poll # a trailing comment
5\ti386\topen\t\t\tsys_open\t\t\tcompat_sys_open
   
";

fn tbl(nr: u32, abi: &str, name: &str, entry: &str) -> TblEntry {
    TblEntry {
        nr,
        abi: abi.to_owned(),
        name: name.to_owned(),
        entry: entry.to_owned(),
        compat: None,
        noreturn: false,
    }
}

#[test]
fn tbl_keeps_the_given_abis_with_entry_points() {
    let exit = TblEntry {
        noreturn: true,
        ..tbl(60, "common", "exit", "sys_exit")
    };
    assert_eq!(
        parse_tbl(TBL, &["common", "64"]),
        vec![
            tbl(0, "common", "read", "sys_read"),
            tbl(2, "64", "open", "sys_open"),
            tbl(4, "common", "stat", "sys_newstat"),
            exit,
            tbl(7, "common", "poll", "sys_poll"),
        ]
    );
    let open = TblEntry {
        compat: Some("compat_sys_open".to_owned()),
        ..tbl(5, "i386", "open", "sys_open")
    };
    assert_eq!(parse_tbl(TBL, &["i386"]), vec![open.clone()]);
    assert_eq!(open.symbol("__ia32_"), "__ia32_compat_sys_open");
    assert_eq!(
        tbl(0, "common", "read", "sys_read").symbol("__x64_"),
        "__x64_sys_read"
    );
    assert_eq!(parse_tbl(TBL, &["x32"]).len(), 1);
    assert_eq!(parse_tbl("", &["common"]), vec![]);
}

const HEADER: &str = r#"/* SPDX-License-Identifier: GPL-2.0-only */
/* asmlinkage long sys_in_comment(int a); */
// asmlinkage long sys_in_line_comment(int a);
#define __SYSCALL_DEFINEx(x, name, ...)					\
	asmlinkage long sys##name(__MAP(x,__SC_DECL,__VA_ARGS__))	\
		__attribute__((alias(__stringify(__se_sys##name))));	\
	asmlinkage long sys_in_macro(int a);
asmlinkage long sys_read(unsigned int fd, char __user *buf, size_t count);
asmlinkage long sys_execve(const char __user *filename,
		const char __user *const __user *argv,
		const char __user *const __user *envp);
asmlinkage long sys_getpid(void);
asmlinkage long sys_io_setup(unsigned nr_reqs, aio_context_t __user *ctx);
asmlinkage long sys_io_submit(aio_context_t, long,
			struct iocb __user * __user *);
asmlinkage long sys_socket(int, int, int);
asmlinkage long compat_sys_open(const char __user *filename, int flags,
				umode_t mode);
asmlinkage long sys_pipe2(int fildes[2], int flags);
asmlinkage long sys_mknodat(int dfd, const char __user * filename, umode_t mode,
			    unsigned dev);
asmlinkage long sys_get_robust_list(int pid,
				    struct robust_list_head __user * __user *head_ptr,
				    size_t __user *len_ptr);
asmlinkage long sys_fp(int sig, void (*handler)(int));
asmlinkage long sys_body(int a) { return 0; }
asmlinkage long sys_unterminated(int a)
asmlinkage long sys_keyword(unsigned long, int);
asmlinkage long sys_tag(struct stat);
asmlinkage long sys_qualified(const sigset_t);
asmlinkage long sys_matrix(int m[2][2]);
asmlinkage long sys_empty();
#ifdef CONFIG_ARCH_SPLIT_ARG64
asmlinkage long sys_twice(int fd, unsigned int mask_1, unsigned int mask_2);
#else
asmlinkage long sys_twice(int fd, u64 mask);
#endif
asmlinkage long sys_same(int a);
asmlinkage long sys_same(int a);
asmlinkage long sys_odd_first(int);
asmlinkage long sys_odd_first(int a);
asmlinkage long sys_commented(unsigned int fd /* the file */, char __user *buf);
long ksys_read(unsigned int fd, char __user *buf, size_t count);
"#;

fn proto(name: &str, args: &[(&str, &str)]) -> Proto {
    Proto {
        name: name.to_owned(),
        args: args
            .iter()
            .map(|&(t, n)| (t.to_owned(), n.to_owned()))
            .collect(),
        duplicates: 0,
        differs: false,
    }
}

#[test]
fn prototypes_with_named_parameters_only() {
    let twice = Proto {
        duplicates: 1,
        differs: true,
        ..proto(
            "sys_twice",
            &[
                ("int", "fd"),
                ("unsigned int", "mask_1"),
                ("unsigned int", "mask_2"),
            ],
        )
    };
    let same = Proto {
        duplicates: 1,
        ..proto("sys_same", &[("int", "a")])
    };
    assert_eq!(
        parse_prototypes(HEADER),
        vec![
            proto(
                "sys_read",
                &[
                    ("unsigned int", "fd"),
                    ("char *", "buf"),
                    ("size_t", "count")
                ]
            ),
            proto(
                "sys_execve",
                &[
                    ("const char *", "filename"),
                    ("const char *const *", "argv"),
                    ("const char *const *", "envp"),
                ]
            ),
            proto("sys_getpid", &[]),
            proto(
                "sys_io_setup",
                &[("unsigned", "nr_reqs"), ("aio_context_t *", "ctx")]
            ),
            proto("sys_pipe2", &[("int *", "fildes"), ("int", "flags")]),
            proto(
                "sys_mknodat",
                &[
                    ("int", "dfd"),
                    ("const char *", "filename"),
                    ("umode_t", "mode"),
                    ("unsigned", "dev"),
                ]
            ),
            proto(
                "sys_get_robust_list",
                &[
                    ("int", "pid"),
                    ("struct robust_list_head **", "head_ptr"),
                    ("size_t *", "len_ptr"),
                ]
            ),
            twice,
            same,
            proto(
                "sys_commented",
                &[("unsigned int", "fd"), ("char *", "buf")]
            ),
        ]
    );
    assert_eq!(parse_prototypes(""), vec![]);
    assert_eq!(parse_prototypes("asmlinkage"), vec![]);
    assert_eq!(parse_prototypes("asmlinkage long sys_x("), vec![]);
    assert_eq!(parse_prototypes("asmlinkage sys_x(int a);"), vec![]);
}

#[test]
fn kernel_version_from_the_makefile() {
    let mk = "# SPDX\nVERSION = 6\nPATCHLEVEL = 12\nSUBLEVEL = 118\nEXTRAVERSION =\nNAME = x\n";
    assert_eq!(kernel_version(mk).as_deref(), Some("6.12.118"));
    let rc = "VERSION = 6\nPATCHLEVEL = 13\nSUBLEVEL = 0\nEXTRAVERSION = -rc1\n";
    assert_eq!(kernel_version(rc).as_deref(), Some("6.13.0-rc1"));
    assert_eq!(kernel_version("VERSION = 6\nPATCHLEVEL = 1\n"), None);
}

#[test]
fn generated_source_as_rustfmt_lays_it_out() {
    let tbl = "\
1\tcommon\twrite\t\t\tsys_write
0\tcommon\tread\t\t\tsys_read
0\tcommon\tread_again\t\tsys_read
41\tcommon\tsocket\t\t\tsys_socket
59\t64\texecve\t\t\tsys_execve
302\tcommon\tprlimit64\t\tsys_prlimit64
999\tcommon\tlong_one\t\tsys_long_one
";
    let h = "\
asmlinkage long sys_read(unsigned int fd, char __user *buf, size_t count);
asmlinkage long sys_write(unsigned int fd, int b);
asmlinkage long sys_socket(int, int, int);
asmlinkage long sys_execve(const char __user *filename,
		const char __user *const __user *argv,
		const char __user *const __user *envp);
asmlinkage long sys_prlimit64(pid_t pid, unsigned int resource,
				const struct rlimit64 __user *new_rlim,
				struct rlimit64 __user *old_rlim);
asmlinkage long sys_long_one(const struct a_rather_long_structure_name_here __user *an_argument);
";
    let expected = r#"//! The x86-64 system calls of Linux 9.9.9: numbers, names and entry points from
//! `arch/x86/entry/syscalls/syscall_64.tbl` (ABI `common`, `64`), argument
//! types and names from the `sys_` prototypes of `include/linux/syscalls.h`.
//!
//! Generated by `scripts/gen-syscall-abi.sh` (`cargo run -p guest-introspect
//! --example gen_syscall_abi -- KERNEL_SOURCE`) from the kernel source; do not
//! edit.
//!
//! 6 calls, 5 with arguments (`typed`). The others have no prototype with named
//! parameters in syscalls.h, or one per configuration under `#if`:
//! `sys_socket`.

use super::AbiCall;

/// The x86-64 system calls of Linux 9.9.9, by number.
pub static CALLS: &[AbiCall] = &[
    AbiCall {
        nr: 0,
        name: "read",
        entry: "__x64_sys_read",
        typed: true,
        args: &[
            ("unsigned int", "fd"),
            ("char *", "buf"),
            ("size_t", "count"),
        ],
    },
    AbiCall {
        nr: 1,
        name: "write",
        entry: "__x64_sys_write",
        typed: true,
        args: &[("unsigned int", "fd"), ("int", "b")],
    },
    AbiCall {
        nr: 41,
        name: "socket",
        entry: "__x64_sys_socket",
        typed: false,
        args: &[],
    },
    AbiCall {
        nr: 59,
        name: "execve",
        entry: "__x64_sys_execve",
        typed: true,
        args: &[
            ("const char *", "filename"),
            ("const char *const *", "argv"),
            ("const char *const *", "envp"),
        ],
    },
    AbiCall {
        nr: 302,
        name: "prlimit64",
        entry: "__x64_sys_prlimit64",
        typed: true,
        args: &[
            ("pid_t", "pid"),
            ("unsigned int", "resource"),
            ("const struct rlimit64 *", "new_rlim"),
            ("struct rlimit64 *", "old_rlim"),
        ],
    },
    AbiCall {
        nr: 999,
        name: "long_one",
        entry: "__x64_sys_long_one",
        typed: true,
        args: &[(
            "const struct a_rather_long_structure_name_here *",
            "an_argument",
        )],
    },
];
"#;
    assert_eq!(generate(Arch::X86_64, tbl, h, "9.9.9"), expected);
}

/// A few calls, numbered as on x86-64.
const ABI: &[AbiCall] = &[
    AbiCall {
        nr: 0,
        name: "read",
        entry: "__x64_sys_read",
        typed: true,
        args: &[("unsigned int", "fd")],
    },
    AbiCall {
        nr: 1,
        name: "write",
        entry: "__x64_sys_write",
        typed: false,
        args: &[],
    },
    AbiCall {
        nr: 2,
        name: "open",
        entry: "__x64_sys_open",
        typed: false,
        args: &[],
    },
    AbiCall {
        nr: 4,
        name: "stat",
        entry: "__x64_sys_newstat",
        typed: false,
        args: &[],
    },
    AbiCall {
        nr: 5,
        name: "fstat",
        entry: "__x64_sys_newfstat",
        typed: false,
        args: &[],
    },
    AbiCall {
        nr: 156,
        name: "_sysctl",
        entry: "__x64_sys_ni_syscall",
        typed: false,
        args: &[],
    },
];

#[test]
fn lookups() {
    assert_eq!(lookup(ABI, "stat").map(|c| c.nr), Some(4));
    assert_eq!(lookup(ABI, "newstat"), None);
    assert_eq!(
        lookup_entry(ABI, "__x64_sys_newstat").map(|c| c.nr),
        Some(4)
    );
    assert_eq!(by_number(ABI, 5).map(|c| c.name), Some("fstat"));
    assert_eq!(by_number(ABI, 3), None);
    let sys = |entry| AbiCall { entry, ..ABI[0] }.sys_name();
    assert_eq!(sys("__x64_sys_newstat"), "newstat");
    assert_eq!(sys("__ia32_compat_sys_open"), "open");
    assert_eq!(sys("__ia32_sys_write"), "write");
    assert_eq!(sys("odd"), "odd");
}

#[test]
fn crosscheck_sorts_the_guest_calls() {
    let guest = [
        (0, "read"),
        (4, "newstat"),
        (5, "open"),
        (7, "write"),
        (9, "stat"),
        (400, "fancy"),
    ];
    let c = crosscheck_with(ABI, guest.iter().copied()).unwrap();
    assert_eq!(c.agree, [0, 4]);
    assert_eq!(
        c.differ,
        [
            Mismatch {
                nr: 5,
                name: "open".to_owned(),
                table_name: Some("fstat"),
                table_nr: Some(2),
            },
            Mismatch {
                nr: 7,
                name: "write".to_owned(),
                table_name: None,
                table_nr: Some(1),
            },
        ]
    );
    assert_eq!(c.missing, [(1, "write"), (2, "open")]);
    // `stat` is the ABI's name of `newstat`, not a wrapper's.
    assert_eq!(
        c.unknown,
        [(9, "stat".to_owned()), (400, "fancy".to_owned())]
    );
    assert_eq!(
        alloc::format!("{c}"),
        "2 agree, 2 differ, 2 missing from the guest, 2 unknown to the table"
    );
    let none = crosscheck_with(ABI, core::iter::empty()).unwrap();
    assert_eq!(none.missing.len(), ABI.len() - 1);
}

/// The committed tables: sorted, one call a number, wrappers of their
/// architecture, the well-known calls where the ABI puts them.
#[test]
fn committed_tables() {
    for (table, prefix) in [(x86_64::CALLS, "__x64_sys_"), (i386::CALLS, "__ia32_")] {
        assert!(table.windows(2).all(|w| w[0].nr < w[1].nr));
        assert!(table.iter().all(|c| c.entry.starts_with(prefix)));
        assert!(table.iter().all(|c| c.typed || c.args.is_empty()));
        assert!(table.iter().all(|c| c.args.len() <= 6));
    }
    let openat = lookup(x86_64::CALLS, "openat").unwrap();
    assert_eq!(openat.nr, 257);
    assert_eq!(
        openat.args,
        [
            ("int", "dfd"),
            ("const char *", "filename"),
            ("int", "flags"),
            ("umode_t", "mode")
        ]
    );
    assert_eq!(lookup(i386::CALLS, "write").map(|c| c.nr), Some(4));
}
