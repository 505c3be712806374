//! Tests against Debian's real stock kernel, fetched (and cached) by
//! scripts/guest/debian-kernel.sh. If the script fails, these tests fail:
//! they never pass without having looked at a real image.

mod common;
use common::*;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use loader::bootparams::{self, BootParams, GuestBootConfig};
use loader::bzimage::{self, hdr, BzImageError, LoadFlags, XLoadFlags};
use loader::e820::{E820Entry, E820Kind, E820Map};
use loader::layout::{self, Gpa};
use loader::plan;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The Debian bzImage, read once per test binary.
fn debian_kernel() -> &'static [u8] {
    static IMAGE: OnceLock<Vec<u8>> = OnceLock::new();
    IMAGE.get_or_init(|| {
        let script = repo_root().join("scripts/guest/debian-kernel.sh");
        let out = Command::new(&script)
            .current_dir(repo_root())
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "{} failed ({}); the real-kernel tests need Debian's bzImage.\n{stderr}",
            script.display(),
            out.status
        );
        let path = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        assert!(
            !path.is_empty(),
            "{} printed no path\n{stderr}",
            script.display()
        );
        std::fs::read(&path).unwrap_or_else(|e| panic!("cannot read the kernel at {path}: {e}"))
    })
}

fn u32_at(v: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(v[off..off + 4].try_into().unwrap())
}

fn u64_at(v: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(v[off..off + 8].try_into().unwrap())
}

/// A 1 GiB PC, minus the hypervisor.
fn guest_e820() -> E820Map {
    let mut m = E820Map::from_entries(&[
        E820Entry::new(0, 0x9_FC00, E820Kind::Ram),
        E820Entry::new(0x9_FC00, 0x400, E820Kind::Reserved),
        E820Entry::new(0xF_0000, 0x1_0000, E820Kind::Reserved),
        E820Entry::new(MIB, GIB - MIB - 0x2_0000, E820Kind::Ram),
        E820Entry::new(GIB - 0x2_0000, 0x2_0000, E820Kind::Acpi),
        E820Entry::new(0xFFFC_0000, 0x4_0000, E820Kind::Reserved),
    ])
    .unwrap();
    m.remove_range(layout::HV_RESERVED.0, layout::HV_RESERVED_SIZE)
        .unwrap();
    m.sanitize().unwrap();
    m
}

#[test]
fn debian_kernel_parses() {
    let image = debian_kernel();
    let img = bzimage::parse(image).unwrap_or_else(|e| panic!("{e}"));
    assert!(img.version() >= 0x020F, "protocol {:#x}", img.version());
    assert!(img.xloadflags().contains(XLoadFlags::KERNEL_64));
    assert!(image[hdr::RELOCATABLE_KERNEL] != 0);
    assert!(
        img.kernel_alignment().is_power_of_two(),
        "{:#x}",
        img.kernel_alignment()
    );
    assert!(img.kernel_alignment() >= 0x20_0000);
    assert!(u64::from(img.init_size()) > img.protected_mode().len() as u64);
    assert!(img.protected_mode().len() as u64 >= img.syssize_bytes());
    assert_eq!(img.setup_size() + img.protected_mode().len(), image.len());
    let hdr_end = 0x202 + usize::from(image[0x201]);
    assert_eq!(img.setup_header_bytes(), &image[0x1F1..hdr_end]);
    assert!(img.cmdline_size() >= 255);
    assert!(img.loadflags().contains(LoadFlags::LOADED_HIGH));
    // The protected-mode part starts with the 32-bit entry; the 64-bit one
    // is 0x200 further in.
    assert!(img.protected_mode().len() > plan::ENTRY_OFFSET_64 as usize);
}

#[test]
fn debian_boot_params_round_trip() {
    let image = debian_kernel();
    let img = bzimage::parse(image).unwrap();
    let e820 = guest_e820();
    let cmdline = b"console=ttyS0 nokaslr";
    let cfg = GuestBootConfig {
        cmdline_addr: layout::CMDLINE,
        cmdline_len: cmdline.len(),
        initrd: Some((Gpa(0x4000_0000 - 0x80_0000 - 0x2_0000), 0x7F_F123)),
        acpi_rsdp: Some(Gpa(0xF_5A40)),
    };
    let bp = bootparams::build(&img, &cfg, &e820).unwrap_or_else(|e| panic!("{e}"));
    let b = bp.to_bytes();
    assert_eq!(b.len(), 4096);
    let hdr_end = 0x202 + usize::from(image[0x201]);
    // Copied header, except what the loader sets.
    for off in 0x1F1..hdr_end {
        let loader_field =
            matches!(off, 0x210 | 0x211 | 0x218..=0x21F | 0x228..=0x22B | 0x250..=0x257);
        if !loader_field {
            assert_eq!(b[off], image[off], "header byte {off:#x}");
        }
    }
    assert!(b[hdr_end..0x290].iter().all(|&x| x == 0));
    assert_eq!(b[0x210], 0xFF);
    assert_eq!(b[0x211] & 0xE1, 0x01);
    assert_eq!(u32_at(&b, 0x228), 0x2_0000);
    assert_eq!(u32_at(&b, 0xC8), 0);
    assert_eq!(u32_at(&b, 0x218), 0x3F7E_0000);
    assert_eq!(u32_at(&b, 0x21C), 0x7F_F123);
    assert_eq!((u32_at(&b, 0xC0), u32_at(&b, 0xC4)), (0, 0));
    assert_eq!(u64_at(&b, 0x70), 0xF_5A40);
    assert_eq!(b[0x1EF], 0);
    assert_eq!(usize::from(b[0x1E8]), e820.len());
    for (i, e) in e820.iter().enumerate() {
        let raw: [u8; 20] = b[0x2D0 + 20 * i..0x2D0 + 20 * (i + 1)].try_into().unwrap();
        assert_eq!(E820Entry::from_bytes(&raw), *e);
    }
    assert_eq!(BootParams::from_bytes(&b), bp);
    assert_eq!(bp.hdr.version(), img.version());
    assert_eq!(bp.hdr.init_size(), img.init_size());

    // The longest command line the kernel takes, and one byte more.
    let max = img.cmdline_size() as usize;
    assert!(bootparams::build(
        &img,
        &GuestBootConfig {
            cmdline_len: max,
            ..cfg
        },
        &e820
    )
    .is_ok());
    assert!(bootparams::build(
        &img,
        &GuestBootConfig {
            cmdline_len: max + 1,
            ..cfg
        },
        &e820
    )
    .is_err());
}

#[test]
fn debian_kernel_placement() {
    let image = debian_kernel();
    let img = bzimage::parse(image).unwrap();
    let e820 = guest_e820();
    let load = plan::plan_kernel_load(&img, &e820, &[]).unwrap_or_else(|e| panic!("{e}"));
    let size = plan::kernel_footprint(&img);
    assert!(load.is_aligned(u64::from(img.kernel_alignment())));
    assert!(load.as_u64() >= layout::HV_RESERVED_END.as_u64());
    assert!(e820.is_ram(load.as_u64(), size));
    assert!(load.as_u64() + size <= 4 * GIB);
    // Moving a module into the way moves the kernel.
    let avoid = [(load.as_u64() + size - 1, 1)];
    let moved = plan::plan_kernel_load(&img, &e820, &avoid).unwrap();
    assert!(moved.as_u64() >= load.as_u64() + size);
}

#[test]
fn debian_kernel_malformed_derivatives() {
    let good = debian_kernel();
    let check = |v: &[u8], expect: BzImageError, words: &[&str]| {
        let e = bzimage::parse(v).unwrap_err();
        assert_eq!(e, expect);
        let msg = e.to_string();
        for w in words {
            assert!(msg.contains(w), "{msg:?} lacks {w:?}");
        }
    };

    let mut v = good.to_vec();
    v[0x202..0x206].copy_from_slice(b"HdrZ");
    check(&v, BzImageError::BadMagic { found: *b"HdrZ" }, &["HdrS"]);

    let mut v = good.to_vec();
    v[0x1FE..0x200].copy_from_slice(&0x55AAu16.to_le_bytes());
    check(
        &v,
        BzImageError::BadBootFlag { found: 0x55AA },
        &["boot flag", "0x55aa", "0xAA55"],
    );

    let mut v = good.to_vec();
    v[0x206..0x208].copy_from_slice(&0x020Bu16.to_le_bytes());
    check(
        &v,
        BzImageError::ProtocolTooOld { found: 0x020B },
        &["2.11", "too old"],
    );

    let mut v = good.to_vec();
    v[0x236..0x238].copy_from_slice(&0u16.to_le_bytes());
    check(&v, BzImageError::No64BitEntry, &["64-bit", "XLF_KERNEL_64"]);

    let mut v = good.to_vec();
    v[0x234] = 0;
    check(&v, BzImageError::NotRelocatable, &["relocatable"]);

    let setup = (usize::from(good[0x1F1]) + 1) * 512;
    let needed = setup as u64 + u64::from(u32_at(good, 0x1F4)) * 16;
    for len in [0, 1, 0x1FF, 0x200, 0x267] {
        check(
            &good[..len],
            BzImageError::TooSmall { len },
            &["not a bzImage"],
        );
    }
    let hdr_end = 0x202 + usize::from(good[0x201]);
    for len in hdr::MIN_END..hdr_end {
        check(
            &good[..len],
            BzImageError::Truncated {
                needed: hdr_end as u64,
                have: len as u64,
            },
            &["truncated"],
        );
    }
    for len in [hdr_end, 0x1000, setup] {
        check(
            &good[..len],
            BzImageError::Truncated {
                needed: setup as u64 + 1,
                have: len as u64,
            },
            &["truncated"],
        );
    }
    for len in [setup + 1, setup + 0x10_0000, needed as usize - 1] {
        check(
            &good[..len],
            BzImageError::Truncated {
                needed,
                have: len as u64,
            },
            &["truncated", &needed.to_string()],
        );
    }
    // Exactly syssize is enough (Debian appends a signature after it).
    assert!(bzimage::parse(&good[..needed as usize]).is_ok());
}

#[test]
fn debian_header_never_panics() {
    let good = debian_kernel();
    let setup = (usize::from(good[0x1F1]) + 1) * 512;
    // Work on the setup part plus a slice of the kernel, with syssize
    // shrunk to match, so that each round is cheap.
    let mut base = good[..setup + 0x1_0000].to_vec();
    base[0x1F4..0x1F8].copy_from_slice(&(0x1_0000u32 / 16).to_le_bytes());
    assert!(bzimage::parse(&base).is_ok());

    // Every truncation of the header region and beyond.
    for len in 0..=base.len() {
        let r = bzimage::parse(&base[..len]);
        assert_eq!(r.is_ok(), len == base.len(), "len {len}");
    }

    let mut rng = XorShift(0xB0B0_CAFE_1234_5678);
    let mut accepted = 0;
    let e820 = guest_e820();
    for _ in 0..100_000 {
        let mut v = base.clone();
        for _ in 0..1 + rng.below(4) {
            let at = 0x1F0 + rng.below(0xA0) as usize;
            v[at] = rng.next() as u8;
        }
        let len = if rng.below(4) == 0 {
            rng.below(v.len() as u64 + 1) as usize
        } else {
            v.len()
        };
        if let Ok(img) = bzimage::parse(&v[..len]) {
            accepted += 1;
            let cfg = GuestBootConfig {
                cmdline_addr: layout::CMDLINE,
                cmdline_len: 64,
                initrd: None,
                acpi_rsdp: None,
            };
            if let Ok(bp) = bootparams::build(&img, &cfg, &e820) {
                assert_eq!(BootParams::from_bytes(&bp.to_bytes()), bp);
            }
            let _ = plan::plan_kernel_load(&img, &e820, &[]);
        }
    }
    assert!(accepted > 1000, "{accepted}");
}
