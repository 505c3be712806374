//! The zero page (`struct boot_params`) for the 64-bit boot protocol.
//!
//! Layout: arch/x86/include/uapi/asm/bootparam.h. We declare the fields we
//! write and cover the rest with byte padding; every offset is asserted at
//! compile time. The hypervisor copies [`BootParams::to_bytes`] to
//! [`crate::layout::ZERO_PAGE`] and passes that address to the kernel in RSI.

use core::fmt;
use core::mem::{offset_of, size_of};

use crate::bzimage::{hdr, BzImage, LoadFlags, XLoadFlags};
use crate::e820::{E820Entry, E820Map, E820_MAX_ENTRIES};
use crate::layout::{Gpa, FOUR_GIB};

/// `type_of_loader` for a boot loader without an assigned id.
pub const LOADER_TYPE_UNDEFINED: u8 = 0xFF;

/// Size of the setup-header area of the zero page: 0x1F1 up to
/// `edd_mbr_sig_buffer` at 0x290. The kernel's `struct setup_header` plus
/// the padding after it.
pub const SETUP_HEADER_AREA: usize = hdr::MAX_END - hdr::START;

/// The setup-header area of the zero page, kept as raw bytes in file order
/// (it is unaligned and its length depends on the protocol version), with
/// typed accessors. Offsets are those of [`crate::bzimage::hdr`].
#[derive(Clone, PartialEq, Eq)]
#[repr(transparent)]
pub struct SetupHeader(pub [u8; SETUP_HEADER_AREA]);

macro_rules! header_fields {
    ($($(#[$doc:meta])* $get:ident $(/ $set:ident)? : $ty:ty = $off:path;)*) => {
        impl SetupHeader {
            $(
                $(#[$doc])*
                pub fn $get(&self) -> $ty {
                    <$ty>::from_le_bytes(self.read($off))
                }
                $(
                    #[doc = concat!("Sets `", stringify!($get), "`.")]
                    pub fn $set(&mut self, value: $ty) {
                        self.write($off, value.to_le_bytes());
                    }
                )?
            )*
        }
    };
}

header_fields! {
    /// `setup_sects` as stored (0 means 4).
    setup_sects: u8 = hdr::SETUP_SECTS;
    /// `syssize`, in 16-byte paragraphs.
    syssize: u32 = hdr::SYSSIZE;
    /// `boot_flag` (0xAA55).
    boot_flag: u16 = hdr::BOOT_FLAG;
    /// `version`, the boot protocol version.
    version: u16 = hdr::VERSION;
    /// `type_of_loader`.
    type_of_loader / set_type_of_loader: u8 = hdr::TYPE_OF_LOADER;
    /// `loadflags` as a raw byte (see [`LoadFlags`]).
    loadflags_raw / set_loadflags_raw: u8 = hdr::LOADFLAGS;
    /// `ramdisk_image`: low 32 bits of the initrd address.
    ramdisk_image / set_ramdisk_image: u32 = hdr::RAMDISK_IMAGE;
    /// `ramdisk_size`: low 32 bits of the initrd size.
    ramdisk_size / set_ramdisk_size: u32 = hdr::RAMDISK_SIZE;
    /// `heap_end_ptr`.
    heap_end_ptr / set_heap_end_ptr: u16 = hdr::HEAP_END_PTR;
    /// `cmd_line_ptr`: low 32 bits of the command line address.
    cmd_line_ptr / set_cmd_line_ptr: u32 = hdr::CMD_LINE_PTR;
    /// `initrd_addr_max`.
    initrd_addr_max: u32 = hdr::INITRD_ADDR_MAX;
    /// `kernel_alignment`.
    kernel_alignment: u32 = hdr::KERNEL_ALIGNMENT;
    /// `relocatable_kernel`.
    relocatable_kernel: u8 = hdr::RELOCATABLE_KERNEL;
    /// `xloadflags` as a raw value (see [`XLoadFlags`]).
    xloadflags_raw: u16 = hdr::XLOADFLAGS;
    /// `cmdline_size`.
    cmdline_size: u32 = hdr::CMDLINE_SIZE;
    /// `setup_data`: head of the `setup_data` list (0: none).
    setup_data / set_setup_data: u64 = hdr::SETUP_DATA;
    /// `pref_address`.
    pref_address: u64 = hdr::PREF_ADDRESS;
    /// `init_size`.
    init_size: u32 = hdr::INIT_SIZE;
    /// `handover_offset`.
    handover_offset: u32 = hdr::HANDOVER_OFFSET;
}

impl SetupHeader {
    /// An all-zero header area.
    pub const fn zeroed() -> Self {
        Self([0; SETUP_HEADER_AREA])
    }

    // `off` is an absolute zero-page offset from `hdr`; all of those lie in
    // the area, which the tests check for every accessor.
    fn read<const N: usize>(&self, off: usize) -> [u8; N] {
        let mut out = [0u8; N];
        out.copy_from_slice(&self.0[off - hdr::START..off - hdr::START + N]);
        out
    }

    fn write<const N: usize>(&mut self, off: usize, value: [u8; N]) {
        self.0[off - hdr::START..off - hdr::START + N].copy_from_slice(&value);
    }

    /// `loadflags`.
    pub fn loadflags(&self) -> LoadFlags {
        LoadFlags::from_bits_retain(self.loadflags_raw())
    }

    /// Sets `loadflags`.
    pub fn set_loadflags(&mut self, flags: LoadFlags) {
        self.set_loadflags_raw(flags.bits());
    }

    /// `xloadflags`.
    pub fn xloadflags(&self) -> XLoadFlags {
        XLoadFlags::from_bits_retain(self.xloadflags_raw())
    }
}

impl fmt::Debug for SetupHeader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SetupHeader")
            .field("version", &format_args!("{:#06x}", self.version()))
            .field(
                "type_of_loader",
                &format_args!("{:#04x}", self.type_of_loader()),
            )
            .field("loadflags", &self.loadflags())
            .field("cmd_line_ptr", &format_args!("{:#x}", self.cmd_line_ptr()))
            .field(
                "ramdisk_image",
                &format_args!("{:#x}", self.ramdisk_image()),
            )
            .field("ramdisk_size", &format_args!("{:#x}", self.ramdisk_size()))
            .finish_non_exhaustive()
    }
}

/// `struct boot_params` (arch/x86/include/uapi/asm/bootparam.h), 4 KiB.
#[derive(Clone, PartialEq, Eq, Debug)]
#[repr(C)]
pub struct BootParams {
    /// `screen_info` (0x000). Left zero: the guest finds its console itself.
    pub screen_info: [u8; 0x40],
    /// `apm_bios_info`, `_pad2`, `tboot_addr`, `ist_info` (0x040).
    pad_040: [u8; 0x30],
    /// `acpi_rsdp_addr` (0x070, protocol 2.14): the ACPI RSDP, or 0 for the
    /// kernel to search for it.
    pub acpi_rsdp_addr: u64,
    /// `_pad3`, `hd0_info`, `hd1_info`, `sys_desc_table`, `olpc_ofw_header`
    /// (0x078).
    pad_078: [u8; 0x48],
    /// `ext_ramdisk_image` (0x0C0): high 32 bits of the initrd address.
    pub ext_ramdisk_image: u32,
    /// `ext_ramdisk_size` (0x0C4): high 32 bits of the initrd size.
    pub ext_ramdisk_size: u32,
    /// `ext_cmd_line_ptr` (0x0C8): high 32 bits of the command line address.
    pub ext_cmd_line_ptr: u32,
    /// `_pad4`, `cc_blob_address`, `edid_info`, `efi_info`, `alt_mem_k`,
    /// `scratch` (0x0CC).
    pad_0cc: [u8; 0x1E8 - 0xCC],
    /// `e820_entries` (0x1E8): used entries of `e820_table`.
    pub e820_entries: u8,
    /// `eddbuf_entries`, `edd_mbr_sig_buf_entries`, `kbd_status`,
    /// `secure_boot`, `_pad5` (0x1E9).
    pad_1e9: [u8; 6],
    /// `sentinel` (0x1EF): must stay 0, or the kernel takes the boot loader
    /// for one that copies the zero page blindly and clears fields.
    pub sentinel: u8,
    /// `_pad6` (0x1F0).
    pad_1f0: [u8; 1],
    /// `hdr` (0x1F1): the setup header and the padding after it.
    pub hdr: SetupHeader,
    /// `edd_mbr_sig_buffer` (0x290).
    pad_290: [u8; 0x40],
    /// `e820_table` (0x2D0).
    pub e820_table: [E820Entry; E820_MAX_ENTRIES],
    /// `_pad8`, `eddbuf`, `_pad9` (0xCD0).
    pad_cd0: [u8; 0x1000 - 0xCD0],
}

/// Size of the zero page.
pub const BOOT_PARAMS_SIZE: usize = 4096;

const _: () = {
    assert!(size_of::<BootParams>() == BOOT_PARAMS_SIZE);
    assert!(size_of::<SetupHeader>() == 0x290 - 0x1F1);
    assert!(offset_of!(BootParams, screen_info) == 0x000);
    assert!(offset_of!(BootParams, pad_040) == 0x040);
    assert!(offset_of!(BootParams, acpi_rsdp_addr) == 0x070);
    assert!(offset_of!(BootParams, pad_078) == 0x078);
    assert!(offset_of!(BootParams, ext_ramdisk_image) == 0x0C0);
    assert!(offset_of!(BootParams, ext_ramdisk_size) == 0x0C4);
    assert!(offset_of!(BootParams, ext_cmd_line_ptr) == 0x0C8);
    assert!(offset_of!(BootParams, pad_0cc) == 0x0CC);
    assert!(offset_of!(BootParams, e820_entries) == 0x1E8);
    assert!(offset_of!(BootParams, pad_1e9) == 0x1E9);
    assert!(offset_of!(BootParams, sentinel) == 0x1EF);
    assert!(offset_of!(BootParams, pad_1f0) == 0x1F0);
    assert!(offset_of!(BootParams, hdr) == 0x1F1);
    assert!(offset_of!(BootParams, hdr) == hdr::START);
    assert!(offset_of!(BootParams, pad_290) == 0x290);
    assert!(offset_of!(BootParams, pad_290) == hdr::MAX_END);
    assert!(offset_of!(BootParams, e820_table) == 0x2D0);
    assert!(offset_of!(BootParams, pad_cd0) == 0xCD0);
    assert!(E820_MAX_ENTRIES <= u8::MAX as usize);
};

impl Default for BootParams {
    fn default() -> Self {
        Self::zeroed()
    }
}

/// Copies `src` into `out` at `off`.
fn put(out: &mut [u8; BOOT_PARAMS_SIZE], off: usize, src: &[u8]) {
    out[off..off + src.len()].copy_from_slice(src);
}

/// `N` bytes of `src` at `off`.
fn get<const N: usize>(src: &[u8; BOOT_PARAMS_SIZE], off: usize) -> [u8; N] {
    let mut out = [0u8; N];
    out.copy_from_slice(&src[off..off + N]);
    out
}

impl BootParams {
    /// An all-zero zero page.
    pub const fn zeroed() -> Self {
        Self {
            screen_info: [0; 0x40],
            pad_040: [0; 0x30],
            acpi_rsdp_addr: 0,
            pad_078: [0; 0x48],
            ext_ramdisk_image: 0,
            ext_ramdisk_size: 0,
            ext_cmd_line_ptr: 0,
            pad_0cc: [0; 0x1E8 - 0xCC],
            e820_entries: 0,
            pad_1e9: [0; 6],
            sentinel: 0,
            pad_1f0: [0; 1],
            hdr: SetupHeader::zeroed(),
            pad_290: [0; 0x40],
            e820_table: [E820Entry {
                addr: 0,
                size: 0,
                kind: 0,
            }; E820_MAX_ENTRIES],
            pad_cd0: [0; 0x1000 - 0xCD0],
        }
    }

    /// The e820 entries in use.
    pub fn e820(&self) -> &[E820Entry] {
        let n = usize::from(self.e820_entries).min(E820_MAX_ENTRIES);
        &self.e820_table[..n]
    }

    /// Writes the zero page as the kernel reads it (little-endian, each
    /// field at its `offset_of!`) into `out`.
    pub fn write_to(&self, out: &mut [u8; BOOT_PARAMS_SIZE]) {
        *out = [0; BOOT_PARAMS_SIZE];
        put(out, offset_of!(Self, screen_info), &self.screen_info);
        put(out, offset_of!(Self, pad_040), &self.pad_040);
        put(
            out,
            offset_of!(Self, acpi_rsdp_addr),
            &self.acpi_rsdp_addr.to_le_bytes(),
        );
        put(out, offset_of!(Self, pad_078), &self.pad_078);
        put(
            out,
            offset_of!(Self, ext_ramdisk_image),
            &self.ext_ramdisk_image.to_le_bytes(),
        );
        put(
            out,
            offset_of!(Self, ext_ramdisk_size),
            &self.ext_ramdisk_size.to_le_bytes(),
        );
        put(
            out,
            offset_of!(Self, ext_cmd_line_ptr),
            &self.ext_cmd_line_ptr.to_le_bytes(),
        );
        put(out, offset_of!(Self, pad_0cc), &self.pad_0cc);
        put(out, offset_of!(Self, e820_entries), &[self.e820_entries]);
        put(out, offset_of!(Self, pad_1e9), &self.pad_1e9);
        put(out, offset_of!(Self, sentinel), &[self.sentinel]);
        put(out, offset_of!(Self, pad_1f0), &self.pad_1f0);
        put(out, offset_of!(Self, hdr), &self.hdr.0);
        put(out, offset_of!(Self, pad_290), &self.pad_290);
        for (i, e) in self.e820_table.iter().enumerate() {
            put(
                out,
                offset_of!(Self, e820_table) + i * E820Entry::SIZE,
                &e.to_bytes(),
            );
        }
        put(out, offset_of!(Self, pad_cd0), &self.pad_cd0);
    }

    /// The zero page as the kernel reads it; see [`write_to`](Self::write_to).
    pub fn to_bytes(&self) -> [u8; BOOT_PARAMS_SIZE] {
        let mut out = [0u8; BOOT_PARAMS_SIZE];
        self.write_to(&mut out);
        out
    }

    /// Decodes a zero page (the inverse of [`to_bytes`](Self::to_bytes)).
    pub fn from_bytes(src: &[u8; BOOT_PARAMS_SIZE]) -> Self {
        let mut bp = Self::zeroed();
        bp.screen_info = get(src, offset_of!(Self, screen_info));
        bp.pad_040 = get(src, offset_of!(Self, pad_040));
        bp.acpi_rsdp_addr = u64::from_le_bytes(get(src, offset_of!(Self, acpi_rsdp_addr)));
        bp.pad_078 = get(src, offset_of!(Self, pad_078));
        bp.ext_ramdisk_image = u32::from_le_bytes(get(src, offset_of!(Self, ext_ramdisk_image)));
        bp.ext_ramdisk_size = u32::from_le_bytes(get(src, offset_of!(Self, ext_ramdisk_size)));
        bp.ext_cmd_line_ptr = u32::from_le_bytes(get(src, offset_of!(Self, ext_cmd_line_ptr)));
        bp.pad_0cc = get(src, offset_of!(Self, pad_0cc));
        bp.e820_entries = src[offset_of!(Self, e820_entries)];
        bp.pad_1e9 = get(src, offset_of!(Self, pad_1e9));
        bp.sentinel = src[offset_of!(Self, sentinel)];
        bp.pad_1f0 = get(src, offset_of!(Self, pad_1f0));
        bp.hdr = SetupHeader(get(src, offset_of!(Self, hdr)));
        bp.pad_290 = get(src, offset_of!(Self, pad_290));
        for (i, e) in bp.e820_table.iter_mut().enumerate() {
            *e = E820Entry::from_bytes(&get(
                src,
                offset_of!(Self, e820_table) + i * E820Entry::SIZE,
            ));
        }
        bp.pad_cd0 = get(src, offset_of!(Self, pad_cd0));
        bp
    }
}

/// What the loader tells the kernel besides its own header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GuestBootConfig {
    /// Where the NUL-terminated command line is (normally
    /// [`crate::layout::CMDLINE`]).
    pub cmdline_addr: Gpa,
    /// Length of the command line without its NUL.
    pub cmdline_len: usize,
    /// The initrd's address and size, if there is one.
    pub initrd: Option<(Gpa, u64)>,
    /// The ACPI RSDP, if the loader knows it (else the kernel scans the BIOS
    /// areas for it).
    pub acpi_rsdp: Option<Gpa>,
}

/// Why the guest cannot be booted as configured.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum BootError {
    /// The command line is longer than the kernel's `cmdline_size`.
    CmdlineTooLong {
        /// Its length without NUL.
        len: usize,
        /// `cmdline_size` from the header.
        max: u32,
    },
    /// Something lies above what the kernel can reach.
    TooHigh {
        /// What: "command line" or "initrd".
        what: &'static str,
        /// Last byte of it.
        last: u64,
        /// Highest address allowed.
        max: u64,
    },
    /// No RAM range can hold the kernel.
    NoRoomForKernel {
        /// Bytes needed.
        size: u64,
        /// Alignment needed.
        align: u64,
    },
}

impl fmt::Display for BootError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            BootError::CmdlineTooLong { len, max } => write!(
                f,
                "guest boot: command line is {len} bytes, the kernel takes at most {max}"
            ),
            BootError::TooHigh { what, last, max } => write!(
                f,
                "guest boot: {what} ends at {last:#x}, above the kernel's limit {max:#x}"
            ),
            BootError::NoRoomForKernel { size, align } => write!(
                f,
                "guest boot: no RAM below 4 GiB for the kernel ({size:#x} bytes aligned to {align:#x})"
            ),
        }
    }
}

/// Last byte of `[addr, addr + len)`, saturating (an empty range counts as
/// its first byte).
fn last_byte(addr: u64, len: u64) -> u64 {
    addr.saturating_add(len.saturating_sub(1))
}

/// Builds the zero page for `img` (Documentation/arch/x86/boot.rst,
/// "64-bit Boot Protocol"): the image's setup header copied into a zeroed
/// page, then the loader's fields.
///
/// - `type_of_loader` = 0xFF (no assigned id);
/// - `loadflags`: LOADED_HIGH set; QUIET_FLAG, KEEP_SEGMENTS and
///   CAN_USE_HEAP clear (we run none of the real-mode code);
/// - `setup_data` = 0 (we pass none);
/// - command line and initrd addresses split into the low 32 bits in the
///   header and the high 32 bits in the `ext_*` fields;
/// - the e820 table (an [`E820Map`] never holds more than the 128 entries
///   the zero page has room for);
/// - `acpi_rsdp_addr` if given; `sentinel` stays 0.
pub fn build(
    img: &BzImage<'_>,
    cfg: &GuestBootConfig,
    e820: &E820Map,
) -> Result<BootParams, BootError> {
    let max = img.cmdline_size();
    if u64::try_from(cfg.cmdline_len).map_or(true, |len| len > u64::from(max)) {
        return Err(BootError::CmdlineTooLong {
            len: cfg.cmdline_len,
            max,
        });
    }
    let above_4g = img
        .xloadflags()
        .contains(XLoadFlags::CAN_BE_LOADED_ABOVE_4G);
    let cmdline_last = last_byte(cfg.cmdline_addr.as_u64(), cfg.cmdline_len as u64 + 1);
    if !above_4g && cmdline_last >= FOUR_GIB {
        return Err(BootError::TooHigh {
            what: "command line",
            last: cmdline_last,
            max: FOUR_GIB - 1,
        });
    }
    if let Some((addr, size)) = cfg.initrd {
        let last = last_byte(addr.as_u64(), size);
        let limit = u64::from(img.initrd_addr_max());
        if !above_4g && last > limit {
            return Err(BootError::TooHigh {
                what: "initrd",
                last,
                max: limit,
            });
        }
    }

    let mut bp = BootParams::zeroed();
    let header = img.setup_header_bytes();
    let n = header.len().min(SETUP_HEADER_AREA);
    bp.hdr.0[..n].copy_from_slice(&header[..n]);

    bp.hdr.set_type_of_loader(LOADER_TYPE_UNDEFINED);
    let flags = (bp.hdr.loadflags() | LoadFlags::LOADED_HIGH)
        - (LoadFlags::QUIET_FLAG | LoadFlags::KEEP_SEGMENTS | LoadFlags::CAN_USE_HEAP);
    bp.hdr.set_loadflags(flags);
    bp.hdr.set_setup_data(0);

    let cmdline = cfg.cmdline_addr.as_u64();
    bp.hdr.set_cmd_line_ptr(cmdline as u32);
    bp.ext_cmd_line_ptr = (cmdline >> 32) as u32;

    let (initrd_addr, initrd_size) = cfg.initrd.map_or((0, 0), |(a, s)| (a.as_u64(), s));
    bp.hdr.set_ramdisk_image(initrd_addr as u32);
    bp.ext_ramdisk_image = (initrd_addr >> 32) as u32;
    bp.hdr.set_ramdisk_size(initrd_size as u32);
    bp.ext_ramdisk_size = (initrd_size >> 32) as u32;

    for (slot, e) in bp.e820_table.iter_mut().zip(e820.iter()) {
        *slot = *e;
    }
    // An E820Map holds at most E820_MAX_ENTRIES (128) entries.
    bp.e820_entries = e820.len().min(E820_MAX_ENTRIES) as u8;

    bp.acpi_rsdp_addr = cfg.acpi_rsdp.map_or(0, Gpa::as_u64);
    bp.sentinel = 0;
    Ok(bp)
}
