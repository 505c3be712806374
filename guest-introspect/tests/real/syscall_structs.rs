//! The input structs of system calls, laid out from each kernel's own
//! BTF: `openat2`'s `struct open_how` (three u64: flags, mode, resolve,
//! include/uapi/linux/openat2.h) and `clone3`'s `struct clone_args`.

use crate::common;
use crate::syscalls::with_btf;
use guest_introspect::syscall_structs::{input_structs, StructField};
use guest_introspect::syscalls;

fn layouts(img: &common::Image, index: &guest_introspect::kallsyms::SymbolIndex) {
    with_btf(img, |view, btf| {
        let t = syscalls::table(view, index, Some(btf)).expect("sys_call_table");
        check(&t, btf, &img.release);
    });
}

fn check<V: guest_introspect::view::VirtMemory + ?Sized>(
    t: &[syscalls::Syscall],
    btf: &guest_introspect::btf::Btf<'_, V>,
    release: &str,
) {
    let openat2 = t.iter().find(|s| s.name == "openat2").expect("openat2");
    let s = input_structs(btf, &openat2.args);
    assert_eq!(s.len(), 1, "{:?} -> {s:?}", openat2.args);
    assert_eq!((s[0].arg, s[0].name.as_str()), (2, "open_how"));
    let f = |name: &str, offset: u32| StructField {
        name: name.into(),
        offset,
        size: 8,
        signed: false,
    };
    assert_eq!(s[0].fields, [f("flags", 0), f("mode", 8), f("resolve", 16)]);
    let clone3 = t.iter().find(|s| s.name == "clone3").expect("clone3");
    let s = input_structs(btf, &clone3.args);
    assert_eq!(s.len(), 1, "{:?}", clone3.args);
    assert_eq!(s[0].fields[0], f("flags", 0));
    assert!(s[0].fields.iter().any(|x| x.name == "exit_signal"));
    // `stat`'s buffer is filled by the call: nothing to read at the entry.
    let stat = t
        .iter()
        .find(|s| s.name == "newfstatat")
        .expect("newfstatat");
    assert!(input_structs(btf, &stat.args).is_empty());
    let with: Vec<&str> = t
        .iter()
        .filter(|s| !input_structs(btf, &s.args).is_empty())
        .map(|s| s.name.as_str())
        .collect();
    println!("{release}: calls with an input struct: {with:?}");
}

#[test]
fn debian_input_structs() {
    layouts(common::debian(), &crate::debian().index);
}

#[test]
fn fast_lane_input_structs() {
    layouts(common::fast(), &crate::fast().index);
}
