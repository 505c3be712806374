//! The guest's stack layout from kallsyms and BTF, over both real images,
//! against what pahole prints for `struct cea_exception_stacks` of these
//! builds (4 KiB guards, six 8 KiB stacks) and `THREAD_SIZE` = 16 KiB.

use guest_introspect::btf::Btf;
use guest_introspect::budget::{block_on, Budget};
use guest_introspect::stacks::{layout_paced, Source};

use crate::common;

#[test]
fn stack_layouts_of_the_real_images() {
    for (img, r) in [
        (common::fast(), crate::fast()),
        (common::debian(), crate::debian()),
    ] {
        let view = img.view();
        let btf = r
            .index
            .addr_of("__start_BTF")
            .map(|at| Btf::parse(&view, at).expect("BTF parses"));
        let l = block_on(layout_paced(&r.index, btf.as_ref(), &Budget::unlimited()));
        eprintln!("{}: {l:?}", img.release);
        assert_eq!(l.thread_size, 16 * 1024, "{}", img.release);
        assert_eq!(l.thread_size_source, Source::Kallsyms, "{}", img.release);
        assert_eq!(l.irq_size, 16 * 1024, "{}", img.release);
        assert!(
            l.irq_ptr.is_some(),
            "{}: the hardirq stack pointer",
            img.release
        );
        assert!(
            l.exception_ptr.is_some(),
            "{}: cea_exception_stacks",
            img.release
        );
        if btf.is_some() {
            assert_eq!(l.exception_source, Source::Btf, "{}", img.release);
            let got: Vec<_> = l
                .exception_stacks
                .iter()
                .map(|e| (e.name, e.offset, e.size))
                .collect();
            assert_eq!(
                got,
                [
                    ("DF", 4096, 8192),
                    ("NMI", 16384, 8192),
                    ("DB", 28672, 8192),
                    ("MCE", 40960, 8192),
                    ("VC", 53248, 8192),
                    ("VC2", 65536, 8192),
                ],
                "{}",
                img.release
            );
        }
    }
}
