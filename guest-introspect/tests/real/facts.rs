//! Banner, BTF, `current` and the one-call discovery over the real images.

use guest_introspect::btf::{self, Btf, BtfError};
use guest_introspect::facts::{
    banner, discover, ranges_from_lstar, release_of, running_task, CurrentSource, CurrentTask,
};
use guest_introspect::scan::ScanStats;
use guest_introspect::view::SegmentView;
use guest_introspect::{Gva, GvaRange};

use crate::common::{self, Patched};

#[test]
fn banners() {
    for (img, r) in [
        (common::fast(), crate::fast()),
        (common::debian(), crate::debian()),
    ] {
        let view = img.view();
        let ranges: Vec<GvaRange> = view.ranges().collect();
        let mut st = ScanStats::default();
        let b = banner(&view, Some(&r.index), &ranges, &mut st).expect("banner via linux_banner");
        assert_eq!(release_of(&b), Some(img.release.as_str()), "{b}");
        assert_eq!(st.bytes_scanned, 0, "the symbol was enough");
        // Without symbols: by scanning.
        let scanned = banner(&view, None, &ranges, &mut st).expect("banner by scanning");
        assert_eq!(scanned, b);
        eprintln!("{b}\n  (found by scanning {} bytes)", st.bytes_scanned);
    }
}

/// Debian has BTF. The offsets checked against pahole's for this build were
/// pid 2416, comm 2976, size 9792; the test checks what any build must
/// satisfy, since the package follows Debian's security updates.
#[test]
fn debian_btf_task_layout() {
    let img = common::debian();
    let idx = &crate::debian().index;
    let view = img.view();
    let elf = img.elf();
    let sec = elf.section(".BTF").expect(".BTF section");
    let at = idx.addr_of("__start_BTF").expect("__start_BTF in kallsyms");
    assert_eq!(at.0, sec.addr);
    // Also without the symbol, by its header.
    let ranges: Vec<GvaRange> = view.ranges().collect();
    let mut st = ScanStats::default();
    assert_eq!(btf::locate(&view, None, &ranges, &mut st), Ok(at));
    eprintln!("BTF header found by scanning {} bytes", st.bytes_scanned);

    let t0 = std::time::Instant::now();
    let b = Btf::parse(&view, at).unwrap();
    let layout = btf::task_layout(&b).unwrap();
    eprintln!(
        "Debian BTF: {} types, {} B checkpoints; task_struct {layout:?}; parse+lookup {:?}",
        b.type_count(),
        b.heap_bytes(),
        t0.elapsed()
    );
    assert!(b.type_count() > 50_000);
    assert_eq!(layout.comm_len, 16);
    assert!(
        layout.pid.is_multiple_of(4) && layout.pid < layout.comm && layout.comm + 16 <= layout.size
    );
    assert!((2000..20000).contains(&layout.size));
    // thread_info and __state come first, then stack (6.1's sched.h).
    let stack = layout.stack.unwrap();
    assert!(stack >= 16 && stack < layout.pid, "{layout:?}");
    assert!(stack.is_multiple_of(8));
    // `unsigned int __state` right after thread_info, before stack; the
    // priorities between stack and pid.
    assert_eq!(layout.state, Some((stack - 8, 4)), "{layout:?}");
    let prio = layout.prio.unwrap();
    assert!(layout.exit_state.unwrap() > prio, "{layout:?}");
    // thread_info's cpu, after flags, syscall_work and status (6.1, x86).
    assert_eq!(layout.cpu, Some(20), "{layout:?}");
    assert!(
        prio > stack && prio < layout.pid && prio.is_multiple_of(4),
        "{layout:?}"
    );
    // 6.1 has no pcpu_hot.
    assert_eq!(
        btf::pcpu_hot_current_task(&b),
        Err(BtfError::NoType("pcpu_hot"))
    );
}

#[test]
fn discover_debian() {
    let img = common::debian();
    let view = img.view();
    let ranges: Vec<GvaRange> = view.ranges().collect();
    let f = discover(&view, &ranges).unwrap();
    assert_eq!(f.kaslr_slide, Some(0));
    assert!(f.btf.is_ok());
    let task = f.task.unwrap();
    let cur = f.current.unwrap();
    assert_eq!(cur.source, CurrentSource::CurrentTask);
    assert_eq!(
        Some(Gva(cur.percpu_offset)),
        f.symbols.addr_of("current_task")
    );
    assert!(cur.percpu_offset < f.symbols.addr_of("__per_cpu_end").unwrap().0);
    eprintln!(
        "Debian: current at %gs:{:#x}, task {task:?}",
        cur.percpu_offset
    );
}

/// The fast-lane kernel carries BTF (its config fragment turns it on for
/// the task layout): found through `__start_BTF` and by scanning alike, and
/// `current` is `pcpu_hot.current_task` with the member offset from BTF.
#[test]
fn discover_fast_lane_with_btf() {
    let img = common::fast();
    let view = img.view();
    let ranges: Vec<GvaRange> = view.ranges().collect();
    let f = discover(&view, &ranges).unwrap();
    let map = common::fast_map_by_name();
    assert_eq!(f.btf, Ok(Gva(map["__start_BTF"])));
    let task = f.task.unwrap();
    assert!(
        task.pid > 0 && task.comm > task.pid,
        "implausible task layout {task:?}"
    );
    assert_eq!(task.comm_len, 16);
    assert_eq!(task.cpu, Some(20), "thread_info.cpu: {task:?}");
    let (state, size) = task.state.unwrap();
    assert_eq!(size, 4, "6.12's __state is an unsigned int");
    assert!(
        task.prio.unwrap() > state && task.prio.unwrap() < task.pid,
        "{task:?}"
    );
    assert_eq!(
        f.current,
        Ok(CurrentTask {
            percpu_offset: map["pcpu_hot"],
            source: CurrentSource::PcpuHotBtf
        })
    );
    // Scanning for the header, without symbols, finds the same blob.
    let mut st = ScanStats::default();
    assert_eq!(
        btf::locate(&view, None, &ranges, &mut st),
        Ok(Gva(map["__start_BTF"]))
    );
    eprintln!("fast-lane: BTF at {:#x}, task {task:?}", map["__start_BTF"]);
}

/// Discovery in a slid image, starting from LSTAR as the hypervisor does.
#[test]
fn discover_with_kaslr_from_lstar() {
    let img = common::fast();
    let r = crate::fast();
    let slide = 0x1e0_0000u64 * 7;
    let slid = img.view().slid(slide).unwrap();
    let rb_at = r.tables.relative_base_at.0 + slide;
    let view = Patched {
        inner: slid,
        patches: vec![(
            rb_at,
            (r.tables.relative_base + slide).to_le_bytes().to_vec(),
        )],
    };
    let lstar = Gva(r.index.addr_of("entry_SYSCALL_64").unwrap().0 + slide);
    let t0 = std::time::Instant::now();
    let f = discover(&view, &[ranges_from_lstar(lstar).unwrap()]).unwrap();
    eprintln!(
        "discover from LSTAR: {:?}, {:?}",
        t0.elapsed(),
        f.locate_stats
    );
    assert_eq!(f.kaslr_slide, Some(slide as i64));
    assert_eq!(f.text_base, Some(Gva(0xffff_ffff_8100_0000 + slide)));
    assert_eq!(
        release_of(f.banner.as_deref().unwrap()),
        Some(img.release.as_str())
    );
}

/// Reading the running task through a per-cpu area and a task, laid out as
/// Debian's BTF says.
#[test]
fn running_task_from_gs_base() {
    let layout = btf::TaskLayout {
        pid: 2416,
        comm: 2976,
        comm_len: 16,
        size: 9792,
        stack: Some(32),
        prio: None,
        state: None,
        exit_state: None,
        cpu: None,
    };
    let cur = CurrentTask {
        percpu_offset: 0x1fb80,
        source: CurrentSource::CurrentTask,
    };
    let gs_base = 0xffff_8880_3f60_0000u64;
    let task = 0xffff_8880_0512_3400u64;
    let mut percpu = vec![0u8; 0x20000];
    percpu[0x1fb80..0x1fb88].copy_from_slice(&task.to_le_bytes());
    let mut t = vec![0u8; 9792];
    t[2416..2420].copy_from_slice(&4242i32.to_le_bytes());
    t[2976..2976 + 4].copy_from_slice(b"bash");
    let mut view = SegmentView::new();
    view.add(Gva(gs_base), &percpu, percpu.len() as u64);
    view.add(Gva(task), &t, t.len() as u64);
    let rt = running_task(&view, Gva(gs_base), &cur, &layout).unwrap();
    assert_eq!(
        (rt.task, rt.pid, rt.comm_bytes()),
        (Gva(task), 4242, &b"bash"[..])
    );
    // A wrong GS base faults cleanly.
    assert!(running_task(&view, Gva(0x1000), &cur, &layout).is_err());
}

/// `struct module` from each kernel's BTF: 6.1 keeps `core_layout` and
/// `init_layout`, 6.12 the `mem[]` regions. What every version shares is
/// checked exactly (`state`, then `list`, then `name[MODULE_NAME_LEN]`,
/// 64 - 8 bytes on 64-bit, at the start of the struct; `Elf64_Sym *`
/// symtab), the rest for what any build must satisfy.
#[test]
fn module_layout_from_btf() {
    use guest_introspect::module::{module_layout, ModuleMemory};
    let debian = common::debian();
    let fast = common::fast();
    let fast_map = common::fast_map_by_name();
    let debian_btf = crate::debian()
        .index
        .addr_of("__start_BTF")
        .expect("__start_BTF");
    for (what, img, at) in [
        ("Debian 6.1", debian, debian_btf),
        ("fast lane 6.12", fast, Gva(fast_map["__start_BTF"])),
    ] {
        let view = img.view();
        let b = Btf::parse(&view, at).unwrap();
        let m = module_layout(&b).unwrap_or_else(|e| panic!("{what}: {e}"));
        eprintln!("{what}: struct module {m:?}");
        assert_eq!(
            (m.state, m.list, m.name, m.name_len),
            (0, 8, 24, 56),
            "{what}"
        );
        assert_eq!(
            (
                m.states.live,
                m.states.coming,
                m.states.going,
                m.states.unformed
            ),
            (0, 1, 2, 3),
            "{what}"
        );
        assert!((500..4096).contains(&m.size), "{what}: {m:?}");
        let (ks_at, ks) = m.kallsyms.expect("CONFIG_KALLSYMS");
        assert!(ks_at > m.name && ks_at + 8 <= m.size, "{what}: {m:?}");
        // symtab, num_symtab, strtab, typetab in that order (with the core
        // copies after them).
        assert!(
            ks.symtab < ks.num_symtab && ks.num_symtab < ks.strtab,
            "{what}"
        );
        assert!(ks.typetab.is_some_and(|t| t > ks.strtab), "{what}");
        match (what, m.memory) {
            (
                "Debian 6.1",
                ModuleMemory::Layouts {
                    core,
                    init,
                    base,
                    size,
                    text_size,
                },
            ) => {
                assert!(core < init && init < m.size, "{m:?}");
                assert_eq!(base, 0);
                assert!(size == 8 && text_size == 12, "{m:?}");
            }
            (
                "fast lane 6.12",
                ModuleMemory::Regions {
                    mem,
                    count,
                    stride,
                    base,
                    size,
                    text,
                    init_text,
                },
            ) => {
                // MOD_TEXT .. MOD_INIT_RODATA (6.4 and later).
                assert_eq!((count, text, init_text), (7, 0, 4), "{m:?}");
                assert!(mem + count * stride <= m.size, "{m:?}");
                assert_eq!(base, 0);
                assert_eq!(size, 8);
            }
            (w, mem) => panic!("{w}: unexpected layout {mem:?}"),
        }
    }
}
