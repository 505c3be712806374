//! Multiboot v1 information structure: the memory map, the modules and the
//! command lines that GRUB or QEMU hand to the hypervisor.
//!
//! Everything here parses byte slices, so it runs on the host in tests. The
//! hypervisor turns the physical addresses it is given into slices (memory is
//! identity mapped while it boots).

use core::fmt;

/// Value of EAX when a Multiboot v1 loader enters the image.
pub const BOOTLOADER_MAGIC: u32 = 0x2BAD_B002;

/// `flags` bit: `mem_lower`/`mem_upper` are valid.
pub const INFO_MEMORY: u32 = 1 << 0;
/// `flags` bit: `cmdline` is valid.
pub const INFO_CMDLINE: u32 = 1 << 2;
/// `flags` bit: `mods_count`/`mods_addr` are valid.
pub const INFO_MODS: u32 = 1 << 3;
/// `flags` bit: `mmap_length`/`mmap_addr` are valid.
pub const INFO_MMAP: u32 = 1 << 6;

/// Size of the fixed part of the information structure we read.
pub const INFO_SIZE: usize = 88;
/// Size of one module descriptor.
pub const MODULE_SIZE: usize = 16;

/// Errors in the information a boot loader passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MultibootError {
    /// EAX did not hold the Multiboot v1 loader magic.
    BadMagic(u32),
    /// The information structure was shorter than its fixed part.
    TooShort,
    /// The loader gave no memory map.
    NoMemoryMap,
    /// The loader gave no modules (the guest kernel is missing).
    NoModules,
    /// A memory-map entry runs past the end of the map.
    BadMemoryMap,
}

impl fmt::Display for MultibootError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::BadMagic(m) => write!(f, "not started by a Multiboot v1 loader (EAX={m:#x}, expected 0x2BADB002)"),
            Self::TooShort => write!(f, "multiboot information structure is truncated"),
            Self::NoMemoryMap => write!(f, "the boot loader passed no memory map"),
            Self::NoModules => write!(
                f,
                "no modules: pass the guest bzImage (module string `bzImage <guest cmdline>`) and the initrd as modules"
            ),
            Self::BadMemoryMap => write!(f, "the boot loader's memory map is malformed"),
        }
    }
}

fn le32(b: &[u8], off: usize) -> Option<u32> {
    b.get(off..off + 4)
        .map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
}

fn le64(b: &[u8], off: usize) -> Option<u64> {
    let lo = le32(b, off)? as u64;
    let hi = le32(b, off + 4)? as u64;
    Some(lo | (hi << 32))
}

/// The fixed part of the Multiboot v1 information structure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Info {
    /// Which fields are valid.
    pub flags: u32,
    /// Physical address of the image's own command line (if `INFO_CMDLINE`).
    pub cmdline: Option<u32>,
    /// `(count, physical address)` of the module descriptors.
    pub mods: Option<(u32, u32)>,
    /// `(length, physical address)` of the memory map.
    pub mmap: Option<(u32, u32)>,
}

impl Info {
    /// Parses the fixed part from the first [`INFO_SIZE`] bytes at the address in EBX.
    pub fn parse(magic: u32, bytes: &[u8]) -> Result<Self, MultibootError> {
        if magic != BOOTLOADER_MAGIC {
            return Err(MultibootError::BadMagic(magic));
        }
        if bytes.len() < INFO_SIZE {
            return Err(MultibootError::TooShort);
        }
        let flags = le32(bytes, 0).ok_or(MultibootError::TooShort)?;
        let get = |off| le32(bytes, off).ok_or(MultibootError::TooShort);
        Ok(Self {
            flags,
            cmdline: if flags & INFO_CMDLINE != 0 {
                Some(get(16)?)
            } else {
                None
            },
            mods: if flags & INFO_MODS != 0 {
                Some((get(20)?, get(24)?))
            } else {
                None
            },
            mmap: if flags & INFO_MMAP != 0 {
                Some((get(44)?, get(48)?))
            } else {
                None
            },
        })
    }
}

/// One entry of the boot loader's memory map (the BIOS e820 types).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MmapEntry {
    /// Start of the range.
    pub base: u64,
    /// Length of the range in bytes.
    pub len: u64,
    /// e820 type: 1 = usable RAM, 3 = ACPI reclaimable, 4 = ACPI NVS, others reserved.
    pub kind: u32,
}

/// Iterates over a Multiboot memory map (`mmap_length` bytes at `mmap_addr`).
/// Each entry is `size: u32` followed by `size` bytes of `base: u64, len: u64, type: u32`.
pub fn mmap_entries(map: &[u8]) -> impl Iterator<Item = Result<MmapEntry, MultibootError>> + '_ {
    let mut off = 0usize;
    core::iter::from_fn(move || {
        if off >= map.len() {
            return None;
        }
        let entry = (|| {
            let size = le32(map, off)? as usize;
            if size < 20 {
                return None;
            }
            let e = MmapEntry {
                base: le64(map, off + 4)?,
                len: le64(map, off + 12)?,
                kind: le32(map, off + 20)?,
            };
            off = off.checked_add(4 + size)?;
            Some(e)
        })();
        match entry {
            Some(e) => Some(Ok(e)),
            None => {
                off = map.len();
                Some(Err(MultibootError::BadMemoryMap))
            }
        }
    })
}

/// One module descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Module {
    /// First byte of the module.
    pub start: u32,
    /// One past its last byte.
    pub end: u32,
    /// Physical address of its NUL-terminated string, or 0.
    pub string: u32,
}

impl Module {
    /// Length in bytes (0 for a malformed descriptor whose end precedes its start).
    pub fn len(&self) -> u32 {
        self.end.saturating_sub(self.start)
    }

    /// Whether the module is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Parses `count` module descriptors from `bytes`.
pub fn modules(bytes: &[u8]) -> impl Iterator<Item = Module> + '_ {
    bytes.chunks_exact(MODULE_SIZE).map(|c| Module {
        start: le32(c, 0).unwrap_or(0),
        end: le32(c, 4).unwrap_or(0),
        string: le32(c, 8).unwrap_or(0),
    })
}

/// Splits a module string `NAME ARGS...` into the name and the rest (leading blanks removed).
/// For the guest kernel module the rest is the guest command line.
pub fn split_module_string(s: &str) -> (&str, &str) {
    let s = s.trim_start();
    match s.find(' ') {
        Some(i) => (&s[..i], s[i + 1..].trim_start()),
        None => (s, ""),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info_bytes(flags: u32) -> [u8; INFO_SIZE] {
        let mut b = [0u8; INFO_SIZE];
        b[0..4].copy_from_slice(&flags.to_le_bytes());
        b[16..20].copy_from_slice(&0x1000u32.to_le_bytes());
        b[20..24].copy_from_slice(&2u32.to_le_bytes());
        b[24..28].copy_from_slice(&0x2000u32.to_le_bytes());
        b[44..48].copy_from_slice(&48u32.to_le_bytes());
        b[48..52].copy_from_slice(&0x3000u32.to_le_bytes());
        b
    }

    #[test]
    fn info_fields_follow_flags() {
        let all = INFO_CMDLINE | INFO_MODS | INFO_MMAP;
        let i = Info::parse(0x2BAD_B002, &info_bytes(all)).unwrap();
        assert_eq!(i.cmdline, Some(0x1000));
        assert_eq!(i.mods, Some((2, 0x2000)));
        assert_eq!(i.mmap, Some((48, 0x3000)));
        let none = Info::parse(0x2BAD_B002, &info_bytes(0)).unwrap();
        assert_eq!((none.cmdline, none.mods, none.mmap), (None, None, None));
    }

    #[test]
    fn bad_magic_and_short_info_are_errors() {
        assert_eq!(
            Info::parse(0x1234, &info_bytes(0)),
            Err(MultibootError::BadMagic(0x1234))
        );
        assert_eq!(
            Info::parse(0x2BAD_B002, &[0u8; 10]),
            Err(MultibootError::TooShort)
        );
    }

    fn mmap_entry(base: u64, len: u64, kind: u32) -> [u8; 24] {
        let mut b = [0u8; 24];
        b[0..4].copy_from_slice(&20u32.to_le_bytes());
        b[4..12].copy_from_slice(&base.to_le_bytes());
        b[12..20].copy_from_slice(&len.to_le_bytes());
        b[20..24].copy_from_slice(&kind.to_le_bytes());
        b
    }

    #[test]
    fn memory_map_parses_and_stops_on_garbage() {
        let mut map = [0u8; 48];
        map[..24].copy_from_slice(&mmap_entry(0, 0x9fc00, 1));
        map[24..].copy_from_slice(&mmap_entry(0x100000, 0x1000_0000, 1));
        let v: Vec<_> = mmap_entries(&map).collect();
        assert_eq!(v.len(), 2);
        assert_eq!(
            v[1],
            Ok(MmapEntry {
                base: 0x100000,
                len: 0x1000_0000,
                kind: 1
            })
        );
        // A cut entry yields one error, then the iterator ends.
        let v: Vec<_> = mmap_entries(&map[..30]).collect();
        assert_eq!(v.len(), 2);
        assert_eq!(v[1], Err(MultibootError::BadMemoryMap));
        // A size field below 20 is malformed, not an endless loop.
        let mut bad = mmap_entry(0, 1, 1);
        bad[0..4].copy_from_slice(&0u32.to_le_bytes());
        assert_eq!(
            mmap_entries(&bad).collect::<Vec<_>>(),
            vec![Err(MultibootError::BadMemoryMap)]
        );
    }

    #[test]
    fn module_descriptors_and_strings() {
        let mut b = [0u8; 32];
        b[0..4].copy_from_slice(&0x200_0000u32.to_le_bytes());
        b[4..8].copy_from_slice(&0x280_0000u32.to_le_bytes());
        b[8..12].copy_from_slice(&0x9000u32.to_le_bytes());
        let m: Vec<_> = modules(&b).collect();
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].len(), 0x80_0000);
        assert!(m[1].is_empty());
        assert_eq!(
            split_module_string("bzImage console=ttyS0 quiet"),
            ("bzImage", "console=ttyS0 quiet")
        );
        assert_eq!(
            split_module_string("  /boot/bzImage"),
            ("/boot/bzImage", "")
        );
    }
}
