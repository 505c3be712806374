//! bzImage parsing for the 64-bit Linux boot protocol.
//!
//! A bzImage starts with the real-mode setup code, `setup_sects` 512-byte
//! sectors after the boot sector, which holds the setup header at 0x1F1. The
//! protected-mode kernel (the decompressor with its compressed payload)
//! follows. We only use the header and the protected-mode part: the guest
//! enters the kernel at its 64-bit entry point, never the real-mode code.
//! Field meanings: Documentation/arch/x86/boot.rst ("The real-mode kernel
//! header", "Details of header fields", "64-bit boot protocol").
//!
//! Everything here reads untrusted bytes: no input may cause a panic.

use core::fmt;

use bitflags::bitflags;

/// Offsets of the setup-header fields we use, counted from the start of the
/// image file. The header is copied verbatim into `boot_params` at the same
/// offset, so these are also its offsets in the zero page.
pub mod hdr {
    /// First byte of the setup header (`setup_sects`).
    pub const START: usize = 0x1F1;
    /// u8: size of the setup code in 512-byte sectors; 0 means 4.
    pub const SETUP_SECTS: usize = 0x1F1;
    /// u32: size of the protected-mode code in 16-byte paragraphs.
    pub const SYSSIZE: usize = 0x1F4;
    /// u16: 0xAA55.
    pub const BOOT_FLAG: usize = 0x1FE;
    /// u8: the second byte of the jump instruction at 0x200. The header ends
    /// at `0x202 + this byte`.
    pub const JUMP_OFFSET: usize = 0x201;
    /// The base the jump offset counts from.
    pub const JUMP_BASE: usize = 0x202;
    /// u32: the magic "HdrS".
    pub const HEADER_MAGIC: usize = 0x202;
    /// u16: boot protocol version, major in the high byte.
    pub const VERSION: usize = 0x206;
    /// u8: boot loader identifier.
    pub const TYPE_OF_LOADER: usize = 0x210;
    /// u8: boot protocol option flags (see [`super::LoadFlags`]).
    pub const LOADFLAGS: usize = 0x211;
    /// u32: 32-bit load address of the protected-mode code.
    pub const CODE32_START: usize = 0x214;
    /// u32: low 32 bits of the initrd address.
    pub const RAMDISK_IMAGE: usize = 0x218;
    /// u32: low 32 bits of the initrd size.
    pub const RAMDISK_SIZE: usize = 0x21C;
    /// u16: end of the setup heap (real-mode only).
    pub const HEAP_END_PTR: usize = 0x224;
    /// u32: low 32 bits of the command line address.
    pub const CMD_LINE_PTR: usize = 0x228;
    /// u32: highest address the initrd may occupy.
    pub const INITRD_ADDR_MAX: usize = 0x22C;
    /// u32: physical alignment the kernel needs.
    pub const KERNEL_ALIGNMENT: usize = 0x230;
    /// u8: nonzero when the kernel is relocatable.
    pub const RELOCATABLE_KERNEL: usize = 0x234;
    /// u8: minimum alignment, as a power of two.
    pub const MIN_ALIGNMENT: usize = 0x235;
    /// u16: extended load flags (see [`super::XLoadFlags`]).
    pub const XLOADFLAGS: usize = 0x236;
    /// u32: maximum command line length, without the terminating NUL.
    pub const CMDLINE_SIZE: usize = 0x238;
    /// u32: hardware subarchitecture.
    pub const HARDWARE_SUBARCH: usize = 0x23C;
    /// u32: offset of the compressed payload from the protected-mode start.
    pub const PAYLOAD_OFFSET: usize = 0x248;
    /// u32: length of the compressed payload.
    pub const PAYLOAD_LENGTH: usize = 0x24C;
    /// u64: physical address of the first `setup_data` node.
    pub const SETUP_DATA: usize = 0x250;
    /// u64: preferred load address.
    pub const PREF_ADDRESS: usize = 0x258;
    /// u32: bytes of linear memory the kernel needs from its load address
    /// until it can set up its own memory map.
    pub const INIT_SIZE: usize = 0x260;
    /// u32: offset of the EFI handover entry point.
    pub const HANDOVER_OFFSET: usize = 0x264;
    /// u32: offset of `kernel_info` (protocol 2.15).
    pub const KERNEL_INFO_OFFSET: usize = 0x268;
    /// End of the last field of protocol 2.12 (`handover_offset`): every
    /// kernel we accept has a header at least this long.
    pub const MIN_END: usize = 0x268;
    /// Where the header area of `boot_params` ends (`edd_mbr_sig_buffer`
    /// follows), so no header can be longer than this.
    pub const MAX_END: usize = 0x290;
}

/// The "HdrS" magic at [`hdr::HEADER_MAGIC`].
pub const HEADER_MAGIC: [u8; 4] = *b"HdrS";
/// The boot sector signature at [`hdr::BOOT_FLAG`].
pub const BOOT_FLAG: u16 = 0xAA55;
/// Oldest boot protocol we accept: 2.12 added `xloadflags` and with it the
/// 64-bit entry point flag.
pub const MIN_PROTOCOL: u16 = 0x020C;
/// Size of a setup sector.
pub const SECTOR_SIZE: usize = 512;

bitflags! {
    /// `loadflags` (boot.rst).
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub struct LoadFlags: u8 {
        /// The protected-mode code is loaded at 0x100000 or above.
        const LOADED_HIGH = 1 << 0;
        /// Internal to the kernel: KASLR status from the decompressor.
        const KASLR_FLAG = 1 << 1;
        /// Suppress early messages.
        const QUIET_FLAG = 1 << 5;
        /// Obsolete.
        const KEEP_SEGMENTS = 1 << 6;
        /// `heap_end_ptr` is valid.
        const CAN_USE_HEAP = 1 << 7;
    }
}

bitflags! {
    /// `xloadflags` (boot.rst).
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub struct XLoadFlags: u16 {
        /// There is a 64-bit entry point at load address + 0x200.
        const KERNEL_64 = 1 << 0;
        /// The kernel, boot_params, command line and initrd may be above 4 GiB.
        const CAN_BE_LOADED_ABOVE_4G = 1 << 1;
        /// 32-bit EFI handover entry point.
        const EFI_HANDOVER_32 = 1 << 2;
        /// 64-bit EFI handover entry point.
        const EFI_HANDOVER_64 = 1 << 3;
        /// EFI kexec support.
        const EFI_KEXEC = 1 << 4;
        /// The kernel supports 5-level paging.
        const FIVE_LEVEL = 1 << 5;
        /// 5-level paging is enabled in the kernel.
        const FIVE_LEVEL_ENABLED = 1 << 6;
    }
}

/// Why an image is not a bootable 64-bit bzImage.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum BzImageError {
    /// Shorter than the smallest header we accept.
    TooSmall {
        /// Length of the image.
        len: usize,
    },
    /// No 0xAA55 at 0x1FE.
    BadBootFlag {
        /// The value found.
        found: u16,
    },
    /// No "HdrS" at 0x202.
    BadMagic {
        /// The bytes found.
        found: [u8; 4],
    },
    /// Boot protocol older than 2.12.
    ProtocolTooOld {
        /// The version found.
        found: u16,
    },
    /// The header length given by the byte at 0x201 is outside what the
    /// protocol version and the zero page allow.
    BadHeaderLength {
        /// Where the header claims to end.
        end: usize,
    },
    /// `xloadflags` lacks `XLF_KERNEL_64`.
    No64BitEntry,
    /// `relocatable_kernel` is 0.
    NotRelocatable,
    /// The file is shorter than its header says.
    Truncated {
        /// Bytes the header implies.
        needed: u64,
        /// Bytes present.
        have: u64,
    },
}

impl fmt::Display for BzImageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            BzImageError::TooSmall { len } => write!(
                f,
                "guest kernel: not a bzImage (only {len} bytes, a setup header needs {})",
                hdr::MIN_END
            ),
            BzImageError::BadBootFlag { found } => write!(
                f,
                "guest kernel: not a bzImage (boot flag {found:#06x}, expected {BOOT_FLAG:#06X})"
            ),
            BzImageError::BadMagic { found } => write!(
                f,
                "guest kernel: not a bzImage (setup header magic {:02x} {:02x} {:02x} {:02x}, expected \"HdrS\")",
                found[0], found[1], found[2], found[3]
            ),
            BzImageError::ProtocolTooOld { found } => write!(
                f,
                "guest kernel: boot protocol {}.{:02} is too old (need {}.{:02} or newer for the 64-bit entry)",
                found >> 8,
                found & 0xFF,
                MIN_PROTOCOL >> 8,
                MIN_PROTOCOL & 0xFF
            ),
            BzImageError::BadHeaderLength { end } => write!(
                f,
                "guest kernel: setup header length invalid (ends at {end:#x}, expected {:#x}..={:#x})",
                hdr::MIN_END,
                hdr::MAX_END
            ),
            BzImageError::No64BitEntry => f.write_str(
                "guest kernel: no 64-bit entry point (xloadflags bit XLF_KERNEL_64 is clear)",
            ),
            BzImageError::NotRelocatable => f.write_str(
                "guest kernel: not relocatable (relocatable_kernel is 0)",
            ),
            BzImageError::Truncated { needed, have } => write!(
                f,
                "guest kernel: image truncated ({have} bytes, its header needs at least {needed})"
            ),
        }
    }
}

/// A parsed bzImage, borrowing the image bytes.
#[derive(Clone, Copy)]
pub struct BzImage<'a> {
    image: &'a [u8],
    header_end: usize,
    setup_size: usize,
    version: u16,
    loadflags: LoadFlags,
    xloadflags: XLoadFlags,
    kernel_alignment: u32,
    init_size: u32,
    pref_address: u64,
    cmdline_size: u32,
    initrd_addr_max: u32,
    handover_offset: u32,
    syssize: u32,
}

impl fmt::Debug for BzImage<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BzImage")
            .field("len", &self.image.len())
            .field("version", &format_args!("{:#06x}", self.version))
            .field("setup_size", &self.setup_size)
            .field("header_end", &format_args!("{:#x}", self.header_end))
            .field("loadflags", &self.loadflags)
            .field("xloadflags", &self.xloadflags)
            .field(
                "kernel_alignment",
                &format_args!("{:#x}", self.kernel_alignment),
            )
            .field("init_size", &format_args!("{:#x}", self.init_size))
            .field("pref_address", &format_args!("{:#x}", self.pref_address))
            .field("cmdline_size", &self.cmdline_size)
            .field(
                "initrd_addr_max",
                &format_args!("{:#x}", self.initrd_addr_max),
            )
            .finish()
    }
}

fn bytes<const N: usize>(image: &[u8], off: usize) -> Option<[u8; N]> {
    image.get(off..off.checked_add(N)?)?.try_into().ok()
}

fn read_u8(image: &[u8], off: usize) -> Option<u8> {
    image.get(off).copied()
}

fn read_u16(image: &[u8], off: usize) -> Option<u16> {
    bytes(image, off).map(u16::from_le_bytes)
}

fn read_u32(image: &[u8], off: usize) -> Option<u32> {
    bytes(image, off).map(u32::from_le_bytes)
}

fn read_u64(image: &[u8], off: usize) -> Option<u64> {
    bytes(image, off).map(u64::from_le_bytes)
}

/// Parses and checks a bzImage for the 64-bit boot protocol.
pub fn parse(image: &[u8]) -> Result<BzImage<'_>, BzImageError> {
    let len = image.len();
    let too_small = BzImageError::TooSmall { len };
    if len < hdr::MIN_END {
        return Err(too_small);
    }

    let boot_flag = read_u16(image, hdr::BOOT_FLAG).ok_or(too_small)?;
    if boot_flag != BOOT_FLAG {
        return Err(BzImageError::BadBootFlag { found: boot_flag });
    }
    let magic: [u8; 4] = bytes(image, hdr::HEADER_MAGIC).ok_or(too_small)?;
    if magic != HEADER_MAGIC {
        return Err(BzImageError::BadMagic { found: magic });
    }
    let version = read_u16(image, hdr::VERSION).ok_or(too_small)?;
    if version < MIN_PROTOCOL {
        return Err(BzImageError::ProtocolTooOld { found: version });
    }
    let header_end =
        hdr::JUMP_BASE + usize::from(read_u8(image, hdr::JUMP_OFFSET).ok_or(too_small)?);
    if !(hdr::MIN_END..=hdr::MAX_END).contains(&header_end) {
        return Err(BzImageError::BadHeaderLength { end: header_end });
    }
    if header_end > len {
        return Err(BzImageError::Truncated {
            needed: header_end as u64,
            have: len as u64,
        });
    }

    let xloadflags =
        XLoadFlags::from_bits_retain(read_u16(image, hdr::XLOADFLAGS).ok_or(too_small)?);
    if !xloadflags.contains(XLoadFlags::KERNEL_64) {
        return Err(BzImageError::No64BitEntry);
    }
    if read_u8(image, hdr::RELOCATABLE_KERNEL).ok_or(too_small)? == 0 {
        return Err(BzImageError::NotRelocatable);
    }

    let setup_sects = match read_u8(image, hdr::SETUP_SECTS).ok_or(too_small)? {
        0 => 4,
        n => usize::from(n),
    };
    // At most 256 sectors: no overflow.
    let setup_size = (setup_sects + 1) * SECTOR_SIZE;
    // The protected-mode part must not be empty.
    if len <= setup_size {
        return Err(BzImageError::Truncated {
            needed: setup_size as u64 + 1,
            have: len as u64,
        });
    }
    let syssize = read_u32(image, hdr::SYSSIZE).ok_or(too_small)?;
    let needed = setup_size as u64 + u64::from(syssize) * 16;
    if (len as u64) < needed {
        return Err(BzImageError::Truncated {
            needed,
            have: len as u64,
        });
    }

    Ok(BzImage {
        image,
        header_end,
        setup_size,
        version,
        loadflags: LoadFlags::from_bits_retain(read_u8(image, hdr::LOADFLAGS).ok_or(too_small)?),
        xloadflags,
        kernel_alignment: read_u32(image, hdr::KERNEL_ALIGNMENT).ok_or(too_small)?,
        init_size: read_u32(image, hdr::INIT_SIZE).ok_or(too_small)?,
        pref_address: read_u64(image, hdr::PREF_ADDRESS).ok_or(too_small)?,
        cmdline_size: read_u32(image, hdr::CMDLINE_SIZE).ok_or(too_small)?,
        initrd_addr_max: read_u32(image, hdr::INITRD_ADDR_MAX).ok_or(too_small)?,
        handover_offset: read_u32(image, hdr::HANDOVER_OFFSET).ok_or(too_small)?,
        syssize,
    })
}

impl<'a> BzImage<'a> {
    /// The whole image.
    pub fn image(&self) -> &'a [u8] {
        self.image
    }

    /// The setup header as it is in the file: from 0x1F1 up to
    /// `0x202 + byte[0x201]`. Copy it to the same offset of a zeroed
    /// `boot_params`.
    pub fn setup_header_bytes(&self) -> &'a [u8] {
        // parse() checked START < header_end <= len.
        self.image.get(hdr::START..self.header_end).unwrap_or(&[])
    }

    /// The protected-mode kernel: everything after the setup sectors, to be
    /// loaded at the kernel's load address. It may be longer than
    /// [`syssize_bytes`](Self::syssize_bytes) (a trailing signature, for
    /// instance); loading the tail too is harmless.
    pub fn protected_mode(&self) -> &'a [u8] {
        // parse() checked setup_size < len.
        self.image.get(self.setup_size..).unwrap_or(&[])
    }

    /// Size of the real-mode setup in bytes: `(setup_sects + 1) * 512`, with
    /// `setup_sects == 0` read as 4. This is the file offset of
    /// [`protected_mode`](Self::protected_mode).
    pub fn setup_size(&self) -> usize {
        self.setup_size
    }

    /// Size of the protected-mode code as `syssize` gives it, in bytes.
    pub fn syssize_bytes(&self) -> u64 {
        u64::from(self.syssize) * 16
    }

    /// Boot protocol version (`0x020F` is 2.15).
    pub fn version(&self) -> u16 {
        self.version
    }

    /// `loadflags` as found in the image.
    pub fn loadflags(&self) -> LoadFlags {
        self.loadflags
    }

    /// `xloadflags`.
    pub fn xloadflags(&self) -> XLoadFlags {
        self.xloadflags
    }

    /// `kernel_alignment`: the physical alignment the kernel wants. Not
    /// checked by [`parse`]; [`crate::plan`] copes with odd values.
    pub fn kernel_alignment(&self) -> u32 {
        self.kernel_alignment
    }

    /// `init_size`: bytes the kernel needs from its load address.
    pub fn init_size(&self) -> u32 {
        self.init_size
    }

    /// `pref_address`: where the kernel would like to be loaded.
    pub fn pref_address(&self) -> u64 {
        self.pref_address
    }

    /// `cmdline_size`: the longest command line, without its NUL.
    pub fn cmdline_size(&self) -> u32 {
        self.cmdline_size
    }

    /// `initrd_addr_max`: the highest address the initrd may occupy.
    pub fn initrd_addr_max(&self) -> u32 {
        self.initrd_addr_max
    }

    /// `handover_offset`: the EFI handover entry (unused here).
    pub fn handover_offset(&self) -> u32 {
        self.handover_offset
    }
}
