//! The hypervisor's path: the image in guest-physical memory behind the
//! guest's own page tables, with a KASLR slide, found from LSTAR alone.

use guest_introspect::facts::{discover, ranges_from_lstar};
use guest_introspect::fentry::survey;
use guest_introspect::Gva;

use crate::common::{self, PagedGuest};
use test_support::Rng;

fn guest_path(img: &common::Image, r: &crate::Recovered) {
    let mut rng = Rng(test_support::seed());
    let slide = (1 + rng.below(400)) << 21;
    let t0 = std::time::Instant::now();
    let g = PagedGuest::new(img, slide, r.tables.relative_base_at.0);
    let setup = t0.elapsed();
    let view = g.view();
    // All the hypervisor knows: the guest's IA32_LSTAR.
    let lstar = Gva(r.index.addr_of("entry_SYSCALL_64").unwrap().0 + slide);
    let t0 = std::time::Instant::now();
    let f = discover(&view, &[ranges_from_lstar(lstar).unwrap()]).unwrap();
    let took = t0.elapsed();
    assert_eq!(f.kaslr_slide, Some(slide as i64));
    assert_eq!(f.symbols.len(), r.index.len());
    for (a, b) in r.index.iter().zip(f.symbols.iter()) {
        let absolute = a.kind.letter() == 'A' && a.addr.0 < 0x100_0000;
        assert_eq!(b.addr.0, if absolute { a.addr.0 } else { a.addr.0 + slide });
    }
    let t0 = std::time::Instant::now();
    let s = survey(&view, &f.symbols, false);
    let surveyed = t0.elapsed();
    assert_eq!(s.unreadable, 0);
    let unslid = survey(&img.view(), &r.index, false);
    assert_eq!(s.traceable, unslid.traceable);
    eprintln!(
        "{} through page tables, slide {slide:#x}: discover {took:?} ({:?}), survey {surveyed:?} \
         ({} traceable); guest memory set up in {setup:?}",
        img.release, f.locate_stats, s.traceable
    );
}

#[test]
fn fast_lane_through_page_tables() {
    guest_path(common::fast(), crate::fast());
}

#[test]
fn debian_through_page_tables() {
    guest_path(common::debian(), crate::debian());
}
