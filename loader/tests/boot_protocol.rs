//! Host tests of bzImage parsing, the zero page and kernel placement against
//! synthetic images (the real Debian kernel is in real_kernel.rs).

mod common;
use common::*;

use loader::bootparams::{self, BootError, BootParams, GuestBootConfig, BOOT_PARAMS_SIZE};
use loader::bzimage::{self, hdr, BzImageError, LoadFlags, XLoadFlags};
use loader::e820::{E820Entry, E820Kind, E820Map};
use loader::layout::{self, Gpa};
use loader::plan;

fn put(v: &mut [u8], off: usize, bytes: &[u8]) {
    v[off..off + bytes.len()].copy_from_slice(bytes);
}

fn u16_at(v: &[u8], off: usize) -> u16 {
    u16::from_le_bytes(v[off..off + 2].try_into().unwrap())
}

fn u32_at(v: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(v[off..off + 4].try_into().unwrap())
}

fn u64_at(v: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(v[off..off + 8].try_into().unwrap())
}

/// A minimal well-formed 64-bit bzImage: `setup_sects` setup sectors and a
/// protected-mode part of `pm_len` bytes, with a 2.15 header.
fn synth(setup_sects: u8, pm_len: usize) -> Vec<u8> {
    let sects = if setup_sects == 0 {
        4
    } else {
        setup_sects as usize
    };
    let setup = (sects + 1) * 512;
    let mut v = vec![0u8; setup + pm_len];
    v[hdr::SETUP_SECTS] = setup_sects;
    put(&mut v, hdr::SYSSIZE, &((pm_len / 16) as u32).to_le_bytes());
    put(&mut v, hdr::BOOT_FLAG, &0xAA55u16.to_le_bytes());
    v[0x200] = 0xEB;
    v[hdr::JUMP_OFFSET] = 0x6A; // header ends at 0x26C
    put(&mut v, hdr::HEADER_MAGIC, b"HdrS");
    put(&mut v, hdr::VERSION, &0x020Fu16.to_le_bytes());
    v[hdr::TYPE_OF_LOADER] = 0;
    v[hdr::LOADFLAGS] = 0x01 | 0x20 | 0x40 | 0x80; // loader must clear 5..7
    put(&mut v, hdr::CODE32_START, &0x10_0000u32.to_le_bytes());
    put(&mut v, hdr::INITRD_ADDR_MAX, &0x7FFF_FFFFu32.to_le_bytes());
    put(&mut v, hdr::KERNEL_ALIGNMENT, &0x20_0000u32.to_le_bytes());
    v[hdr::RELOCATABLE_KERNEL] = 1;
    v[hdr::MIN_ALIGNMENT] = 21;
    put(&mut v, hdr::XLOADFLAGS, &0x0003u16.to_le_bytes());
    put(&mut v, hdr::CMDLINE_SIZE, &2047u32.to_le_bytes());
    put(&mut v, hdr::SETUP_DATA, &0xDEAD_0000u64.to_le_bytes()); // loader must clear
    put(&mut v, hdr::PREF_ADDRESS, &0x100_0000u64.to_le_bytes());
    put(&mut v, hdr::INIT_SIZE, &0x200_0000u32.to_le_bytes());
    put(&mut v, hdr::HANDOVER_OFFSET, &0x1234u32.to_le_bytes());
    put(&mut v, hdr::KERNEL_INFO_OFFSET, &0x5678u32.to_le_bytes());
    for (i, b) in v[setup..].iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    v
}

/// Guest RAM of a PC with `ram` bytes, minus the hypervisor, sanitized.
fn guest_e820(ram: u64) -> E820Map {
    let mut m = E820Map::from_entries(&[
        E820Entry::new(0, 0x9_FC00, E820Kind::Ram),
        E820Entry::new(0x9_FC00, 0x400, E820Kind::Reserved),
        E820Entry::new(0xF_0000, 0x1_0000, E820Kind::Reserved),
        E820Entry::new(MIB, ram - MIB, E820Kind::Ram),
    ])
    .unwrap();
    m.remove_range(layout::HV_RESERVED.0, layout::HV_RESERVED_SIZE)
        .unwrap();
    m.sanitize().unwrap();
    m
}

#[test]
fn synthetic_image_parses() {
    let v = synth(27, 0x4000);
    let img = bzimage::parse(&v).unwrap();
    assert_eq!(img.version(), 0x020F);
    assert_eq!(img.setup_size(), 28 * 512);
    assert_eq!(img.protected_mode(), &v[28 * 512..]);
    assert_eq!(img.syssize_bytes(), 0x4000);
    assert_eq!(img.setup_header_bytes(), &v[0x1F1..0x26C]);
    assert_eq!(img.kernel_alignment(), 0x20_0000);
    assert_eq!(img.init_size(), 0x200_0000);
    assert_eq!(img.pref_address(), 0x100_0000);
    assert_eq!(img.cmdline_size(), 2047);
    assert_eq!(img.initrd_addr_max(), 0x7FFF_FFFF);
    assert_eq!(img.handover_offset(), 0x1234);
    assert!(img
        .xloadflags()
        .contains(XLoadFlags::KERNEL_64 | XLoadFlags::CAN_BE_LOADED_ABOVE_4G));
    assert!(img.loadflags().contains(LoadFlags::LOADED_HIGH));
    assert_eq!(img.image().len(), v.len());
    assert!(format!("{img:?}").contains("0x020f"));
}

#[test]
fn setup_sects_zero_means_four() {
    let v = synth(0, 0x100);
    let img = bzimage::parse(&v).unwrap();
    assert_eq!(img.setup_size(), 5 * 512);
    assert_eq!(img.protected_mode().len(), 0x100);
}

#[test]
fn each_check_gives_its_error() {
    let good = synth(4, 0x1000);

    for len in 0..hdr::MIN_END {
        assert_eq!(
            bzimage::parse(&good[..len]).unwrap_err(),
            BzImageError::TooSmall { len }
        );
    }

    let mut v = good.clone();
    put(&mut v, hdr::BOOT_FLAG, &0x1234u16.to_le_bytes());
    let e = bzimage::parse(&v).unwrap_err();
    assert_eq!(e, BzImageError::BadBootFlag { found: 0x1234 });
    assert_eq!(
        e.to_string(),
        "guest kernel: not a bzImage (boot flag 0x1234, expected 0xAA55)"
    );

    let mut v = good.clone();
    put(&mut v, hdr::HEADER_MAGIC, b"HdrX");
    let e = bzimage::parse(&v).unwrap_err();
    assert_eq!(e, BzImageError::BadMagic { found: *b"HdrX" });
    assert!(e.to_string().contains("HdrS"), "{e}");

    let mut v = good.clone();
    put(&mut v, hdr::VERSION, &0x020Bu16.to_le_bytes());
    let e = bzimage::parse(&v).unwrap_err();
    assert_eq!(e, BzImageError::ProtocolTooOld { found: 0x020B });
    assert!(
        e.to_string().contains("2.11") && e.to_string().contains("2.12"),
        "{e}"
    );

    let mut v = good.clone();
    put(&mut v, hdr::VERSION, &0x020Cu16.to_le_bytes());
    assert!(bzimage::parse(&v).is_ok());

    for (jump, end) in [
        (0x00u8, 0x202usize),
        (0x65, 0x267),
        (0x8F, 0x291),
        (0xFF, 0x301),
    ] {
        let mut v = good.clone();
        v[hdr::JUMP_OFFSET] = jump;
        let e = bzimage::parse(&v).unwrap_err();
        assert_eq!(e, BzImageError::BadHeaderLength { end });
        assert!(e.to_string().contains("header length"), "{e}");
    }
    for jump in [0x66u8, 0x8E] {
        let mut v = good.clone();
        v[hdr::JUMP_OFFSET] = jump;
        assert!(bzimage::parse(&v).is_ok());
    }

    let mut v = good.clone();
    put(&mut v, hdr::XLOADFLAGS, &0xFFFEu16.to_le_bytes());
    let e = bzimage::parse(&v).unwrap_err();
    assert_eq!(e, BzImageError::No64BitEntry);
    assert!(e.to_string().contains("64-bit"), "{e}");

    let mut v = good.clone();
    v[hdr::RELOCATABLE_KERNEL] = 0;
    let e = bzimage::parse(&v).unwrap_err();
    assert_eq!(e, BzImageError::NotRelocatable);
    assert!(e.to_string().contains("relocatable"), "{e}");

    // Only the setup sectors: no protected-mode part.
    let setup = 5 * 512;
    // Inside the header, which ends at 0x26C here.
    for len in [hdr::MIN_END, 0x26B] {
        assert_eq!(
            bzimage::parse(&good[..len]).unwrap_err(),
            BzImageError::Truncated {
                needed: 0x26C,
                have: len as u64
            }
        );
    }
    for len in [0x26C, 0x300, setup - 1, setup] {
        let e = bzimage::parse(&good[..len]).unwrap_err();
        assert_eq!(
            e,
            BzImageError::Truncated {
                needed: setup as u64 + 1,
                have: len as u64
            }
        );
        assert!(e.to_string().contains("truncated"), "{e}");
    }
    // Shorter than syssize says.
    for len in [setup + 1, setup + 0x800, good.len() - 1] {
        let e = bzimage::parse(&good[..len]).unwrap_err();
        assert_eq!(
            e,
            BzImageError::Truncated {
                needed: good.len() as u64,
                have: len as u64
            }
        );
    }
    // A trailer after syssize is fine and is part of the protected-mode part.
    let mut v = good.clone();
    v.extend_from_slice(&[0xCC; 100]);
    assert_eq!(
        bzimage::parse(&v).unwrap().protected_mode().len(),
        0x1000 + 100
    );
    // A huge syssize.
    let mut v = good.clone();
    put(&mut v, hdr::SYSSIZE, &u32::MAX.to_le_bytes());
    assert_eq!(
        bzimage::parse(&v).unwrap_err(),
        BzImageError::Truncated {
            needed: setup as u64 + u64::from(u32::MAX) * 16,
            have: v.len() as u64
        }
    );
}

#[test]
fn every_error_message_is_one_line_and_prefixed() {
    let errors = [
        BzImageError::TooSmall { len: 3 },
        BzImageError::BadBootFlag { found: 0 },
        BzImageError::BadMagic { found: [0; 4] },
        BzImageError::ProtocolTooOld { found: 0x0200 },
        BzImageError::BadHeaderLength { end: 0x202 },
        BzImageError::No64BitEntry,
        BzImageError::NotRelocatable,
        BzImageError::Truncated { needed: 2, have: 1 },
    ];
    for e in errors {
        let s = e.to_string();
        assert!(s.starts_with("guest kernel: "), "{s}");
        assert!(!s.contains('\n'), "{s}");
    }
    let boot = [
        BootError::CmdlineTooLong { len: 3, max: 2 },
        BootError::TooHigh {
            what: "initrd",
            last: 1,
            max: 0,
        },
        BootError::NoRoomForKernel { size: 1, align: 1 },
    ];
    for e in boot {
        let s = e.to_string();
        assert!(s.starts_with("guest boot: "), "{s}");
        assert!(!s.contains('\n'), "{s}");
    }
}

#[test]
fn random_mutations_never_panic() {
    let good = synth(4, 0x400);
    let mut rng = XorShift(0x1357_9BDF_2468_ACE0);
    let mut accepted = 0;
    for _ in 0..100_000 {
        let mut v = good.clone();
        // Flip a few bytes, mostly in the header.
        for _ in 0..1 + rng.below(6) {
            let at = if rng.below(4) == 0 {
                rng.below(v.len() as u64)
            } else {
                0x1F0 + rng.below(0xA0)
            } as usize;
            v[at] = rng.next() as u8;
        }
        let len = if rng.below(3) == 0 {
            rng.below(v.len() as u64 + 1) as usize
        } else {
            v.len()
        };
        if let Ok(img) = bzimage::parse(&v[..len]) {
            accepted += 1;
            assert!(!img.protected_mode().is_empty());
            let h = img.setup_header_bytes().len();
            assert!((hdr::MIN_END - hdr::START..=hdr::MAX_END - hdr::START).contains(&h));
            assert!(img.setup_size() + img.syssize_bytes() as usize <= len);
            // Building boot params and planning must not panic either.
            let cfg = GuestBootConfig {
                cmdline_addr: layout::CMDLINE,
                cmdline_len: 10,
                initrd: None,
                acpi_rsdp: None,
            };
            let _ = bootparams::build(&img, &cfg, &guest_e820(GIB));
            let _ = plan::plan_kernel_load(&img, &guest_e820(GIB), &[]);
        }
    }
    assert!(
        accepted > 1000,
        "mutations too destructive to test anything: {accepted}"
    );
}

#[test]
fn boot_params_fields_at_their_offsets() {
    let v = synth(4, 0x1000);
    let img = bzimage::parse(&v).unwrap();
    let e820 = guest_e820(8 * GIB);
    let cfg = GuestBootConfig {
        cmdline_addr: Gpa(0x1_2345_6000),
        cmdline_len: 2047,
        initrd: Some((Gpa(0x2_0000_1000), 0x1_0000_0010)),
        acpi_rsdp: Some(Gpa(0xF_5A40)),
    };
    let bp = bootparams::build(&img, &cfg, &e820).unwrap();
    let b = bp.to_bytes();
    assert_eq!(b.len(), BOOT_PARAMS_SIZE);

    // The header is copied, then the loader's fields.
    assert_eq!(&b[0x1F1..0x210], &v[0x1F1..0x210]);
    assert_eq!(b[0x210], 0xFF, "type_of_loader");
    assert_eq!(b[0x211], 0x01, "loadflags: LOADED_HIGH only");
    assert_eq!(&b[0x212..0x218], &v[0x212..0x218]);
    assert_eq!(u32_at(&b, 0x218), 0x0000_1000, "ramdisk_image");
    assert_eq!(u32_at(&b, 0x21C), 0x0000_0010, "ramdisk_size");
    assert_eq!(u32_at(&b, 0x0C0), 0x2, "ext_ramdisk_image");
    assert_eq!(u32_at(&b, 0x0C4), 0x1, "ext_ramdisk_size");
    assert_eq!(u32_at(&b, 0x228), 0x2345_6000, "cmd_line_ptr");
    assert_eq!(u32_at(&b, 0x0C8), 0x1, "ext_cmd_line_ptr");
    assert_eq!(&b[0x22C..0x250], &v[0x22C..0x250]);
    assert_eq!(u64_at(&b, 0x250), 0, "setup_data");
    assert_eq!(&b[0x258..0x26C], &v[0x258..0x26C]);
    assert!(b[0x26C..0x290].iter().all(|&x| x == 0), "past the header");
    assert_eq!(u64_at(&b, 0x070), 0xF_5A40, "acpi_rsdp_addr");
    assert_eq!(b[0x1EF], 0, "sentinel");
    assert_eq!(usize::from(b[0x1E8]), e820.len(), "e820_entries");
    for (i, e) in e820.iter().enumerate() {
        let off = 0x2D0 + 20 * i;
        assert_eq!(u64_at(&b, off), { e.addr });
        assert_eq!(u64_at(&b, off + 8), { e.size });
        assert_eq!(u32_at(&b, off + 16), { e.kind });
    }
    assert!(b[0x2D0 + 20 * e820.len()..].iter().all(|&x| x == 0));
    assert!(b[..0x70].iter().all(|&x| x == 0));
    assert!(b[0x78..0xC0].iter().all(|&x| x == 0));
    assert!(b[0xCC..0x1E8].iter().all(|&x| x == 0));

    // Decoding gives back the same value.
    assert_eq!(BootParams::from_bytes(&b), bp);
    assert_eq!(bp.e820(), e820.as_slice());
    assert_eq!(bp.hdr.type_of_loader(), 0xFF);
    assert_eq!(bp.hdr.loadflags(), LoadFlags::LOADED_HIGH);
}

#[test]
fn setup_header_accessors_read_the_documented_offsets() {
    let mut bp = BootParams::zeroed();
    for (i, b) in bp.hdr.0.iter_mut().enumerate() {
        *b = (i * 7 + 3) as u8;
    }
    let b = bp.to_bytes();
    let h = &bp.hdr;
    assert_eq!(h.setup_sects(), b[0x1F1]);
    assert_eq!(h.syssize(), u32_at(&b, 0x1F4));
    assert_eq!(h.boot_flag(), u16_at(&b, 0x1FE));
    assert_eq!(h.version(), u16_at(&b, 0x206));
    assert_eq!(h.type_of_loader(), b[0x210]);
    assert_eq!(h.loadflags_raw(), b[0x211]);
    assert_eq!(h.ramdisk_image(), u32_at(&b, 0x218));
    assert_eq!(h.ramdisk_size(), u32_at(&b, 0x21C));
    assert_eq!(h.heap_end_ptr(), u16_at(&b, 0x224));
    assert_eq!(h.cmd_line_ptr(), u32_at(&b, 0x228));
    assert_eq!(h.initrd_addr_max(), u32_at(&b, 0x22C));
    assert_eq!(h.kernel_alignment(), u32_at(&b, 0x230));
    assert_eq!(h.relocatable_kernel(), b[0x234]);
    assert_eq!(h.xloadflags_raw(), u16_at(&b, 0x236));
    assert_eq!(h.cmdline_size(), u32_at(&b, 0x238));
    assert_eq!(h.setup_data(), u64_at(&b, 0x250));
    assert_eq!(h.pref_address(), u64_at(&b, 0x258));
    assert_eq!(h.init_size(), u32_at(&b, 0x260));
    assert_eq!(h.handover_offset(), u32_at(&b, 0x264));

    let mut bp = BootParams::zeroed();
    bp.hdr.set_type_of_loader(0xAB);
    bp.hdr.set_loadflags_raw(0xCD);
    bp.hdr.set_ramdisk_image(0x1122_3344);
    bp.hdr.set_ramdisk_size(0x5566_7788);
    bp.hdr.set_heap_end_ptr(0x99AA);
    bp.hdr.set_cmd_line_ptr(0xBBCC_DDEE);
    bp.hdr.set_setup_data(0x0102_0304_0506_0708);
    bp.e820_entries = 7;
    bp.sentinel = 0x55;
    bp.ext_cmd_line_ptr = 0xA;
    bp.ext_ramdisk_image = 0xB;
    bp.ext_ramdisk_size = 0xC;
    bp.acpi_rsdp_addr = 0xE_0000;
    bp.screen_info[0] = 0x77;
    let b = bp.to_bytes();
    assert_eq!(b[0x210], 0xAB);
    assert_eq!(b[0x211], 0xCD);
    assert_eq!(u32_at(&b, 0x218), 0x1122_3344);
    assert_eq!(u32_at(&b, 0x21C), 0x5566_7788);
    assert_eq!(u16_at(&b, 0x224), 0x99AA);
    assert_eq!(u32_at(&b, 0x228), 0xBBCC_DDEE);
    assert_eq!(u64_at(&b, 0x250), 0x0102_0304_0506_0708);
    assert_eq!(b[0x1E8], 7);
    assert_eq!(b[0x1EF], 0x55);
    assert_eq!(u32_at(&b, 0xC8), 0xA);
    assert_eq!(u32_at(&b, 0xC0), 0xB);
    assert_eq!(u32_at(&b, 0xC4), 0xC);
    assert_eq!(u64_at(&b, 0x70), 0xE_0000);
    assert_eq!(b[0], 0x77);
    assert_eq!(BootParams::from_bytes(&b), bp);
    let nonzero = b.iter().filter(|&&x| x != 0).count();
    assert_eq!(
        nonzero,
        1 + 1 + 4 + 4 + 2 + 4 + 8 + 1 + 1 + 1 + 1 + 1 + 1 + 1
    );
}

#[test]
fn boot_params_checks() {
    let v = synth(4, 0x1000);
    let img = bzimage::parse(&v).unwrap();
    let e820 = guest_e820(GIB);
    let base = GuestBootConfig {
        cmdline_addr: layout::CMDLINE,
        cmdline_len: 0,
        initrd: None,
        acpi_rsdp: None,
    };

    // cmdline_size counts without the NUL: 2047 is the longest allowed.
    assert!(bootparams::build(
        &img,
        &GuestBootConfig {
            cmdline_len: 2047,
            ..base
        },
        &e820
    )
    .is_ok());
    let e = bootparams::build(
        &img,
        &GuestBootConfig {
            cmdline_len: 2048,
            ..base
        },
        &e820,
    )
    .unwrap_err();
    assert_eq!(
        e,
        BootError::CmdlineTooLong {
            len: 2048,
            max: 2047
        }
    );
    assert!(e.to_string().contains("command line"), "{e}");

    // No initrd: ramdisk fields zero. No RSDP: zero.
    let bp = bootparams::build(&img, &base, &e820).unwrap();
    assert_eq!(
        (
            bp.hdr.ramdisk_image(),
            bp.hdr.ramdisk_size(),
            bp.ext_ramdisk_image,
            bp.ext_ramdisk_size
        ),
        (0, 0, 0, 0)
    );
    assert_eq!(bp.acpi_rsdp_addr, 0);
    assert_eq!(bp.hdr.cmd_line_ptr(), 0x2_0000);

    // Without XLF_CAN_BE_LOADED_ABOVE_4G: initrd below initrd_addr_max,
    // command line below 4 GiB.
    let mut v2 = v.clone();
    put(&mut v2, hdr::XLOADFLAGS, &0x0001u16.to_le_bytes());
    let low = bzimage::parse(&v2).unwrap();
    let ok = GuestBootConfig {
        initrd: Some((Gpa(0x7FFF_F000), 0x1000)),
        ..base
    };
    assert!(bootparams::build(&low, &ok, &e820).is_ok());
    let high = GuestBootConfig {
        initrd: Some((Gpa(0x7FFF_F000), 0x1001)),
        ..base
    };
    let e = bootparams::build(&low, &high, &e820).unwrap_err();
    assert_eq!(
        e,
        BootError::TooHigh {
            what: "initrd",
            last: 0x8000_0000,
            max: 0x7FFF_FFFF
        }
    );
    assert!(e.to_string().contains("initrd"), "{e}");
    let cmd = GuestBootConfig {
        cmdline_addr: Gpa(4 * GIB - 8),
        cmdline_len: 8,
        ..base
    };
    assert!(matches!(
        bootparams::build(&low, &cmd, &e820),
        Err(BootError::TooHigh {
            what: "command line",
            ..
        })
    ));
    // With the flag, both are fine.
    assert!(bootparams::build(&img, &high, &e820).is_ok());
    assert!(bootparams::build(&img, &cmd, &e820).is_ok());

    // A full e820 map goes in whole.
    let mut full = E820Map::new();
    for i in 0..128u64 {
        full.add(i * 2 * MIB, MIB, E820Kind::Ram).unwrap();
    }
    let bp = bootparams::build(&img, &base, &full).unwrap();
    assert_eq!(bp.e820_entries, 128);
    assert_eq!(bp.e820(), full.as_slice());
}

#[test]
fn kernel_placement() {
    let v = synth(4, 0x1000);
    let img = bzimage::parse(&v).unwrap();
    let e820 = guest_e820(GIB);

    // pref_address (16 MiB) lies in the hypervisor's memory: the next
    // aligned address after it wins.
    let load = plan::plan_kernel_load(&img, &e820, &[]).unwrap();
    assert_eq!(load, Gpa(32 * MIB));
    assert_eq!(plan::entry_point(load), Gpa(32 * MIB + 0x200));
    assert_eq!(plan::ENTRY_OFFSET_64, 0x200);
    assert_eq!(plan::kernel_footprint(&img), 0x200_0000);

    // Modules are avoided.
    let avoid = [(33 * MIB, 0x1000), (40 * MIB, 5 * MIB)];
    assert_eq!(
        plan::plan_kernel_load(&img, &e820, &avoid).unwrap(),
        Gpa(46 * MIB)
    );

    // When nothing fits at or above pref_address, the lowest place above
    // 1 MiB is taken: give the kernel a high pref_address.
    let mut v2 = v.clone();
    put(&mut v2, hdr::PREF_ADDRESS, &(2 * GIB).to_le_bytes());
    let img2 = bzimage::parse(&v2).unwrap();
    assert_eq!(
        plan::plan_kernel_load(&img2, &e820, &[]).unwrap(),
        Gpa(32 * MIB)
    );

    // Odd alignments: rounded up to a power of two, at least 2 MiB.
    for (align, expect) in [
        (0u32, 2 * MIB),
        (0x1000, 2 * MIB),
        (0x30_0000, 4 * MIB),
        (0x100_0000, 16 * MIB),
    ] {
        let mut v3 = v.clone();
        put(&mut v3, hdr::KERNEL_ALIGNMENT, &align.to_le_bytes());
        let img3 = bzimage::parse(&v3).unwrap();
        assert_eq!(plan::kernel_load_alignment(&img3), expect);
        let load = plan::plan_kernel_load(&img3, &e820, &[]).unwrap();
        assert!(load.is_aligned(expect));
    }

    // Below 4 GiB only, and a clear error when nothing fits.
    let mut high_only = E820Map::new();
    high_only.add(0, 0x9_F000, E820Kind::Ram).unwrap();
    high_only.add(4 * GIB, 4 * GIB, E820Kind::Ram).unwrap();
    let e = plan::plan_kernel_load(&img, &high_only, &[]).unwrap_err();
    assert_eq!(
        e,
        BootError::NoRoomForKernel {
            size: 0x200_0000,
            align: 2 * MIB
        }
    );
    assert!(e.to_string().contains("no RAM"), "{e}");

    // A kernel bigger than init_size says: the file size counts.
    let big = synth(4, 0x300_0000);
    let img4 = bzimage::parse(&big).unwrap();
    assert_eq!(plan::kernel_footprint(&img4), 0x300_0000);
}
