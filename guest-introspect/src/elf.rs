//! Just enough ELF64 to place a vmlinux in a [`SegmentView`]: the file
//! header, the program headers, and the section headers by name.
//!
//! Layouts: the System V gABI, "ELF Header", "Program Header" and "Section
//! Header" (include/uapi/linux/elf.h has the same structures). Only
//! little-endian ELF64 is accepted.

use core::fmt;

use crate::addr::Gva;
use crate::view::SegmentView;

/// Why an ELF image was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ElfError {
    /// Not `\x7fELF`, or not ELFCLASS64 / ELFDATA2LSB.
    NotElf64Le,
    /// A header or table lies outside the file.
    Truncated,
    /// Two `PT_LOAD` segments overlap, or one wraps the address space.
    BadSegment,
}

impl fmt::Display for ElfError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::NotElf64Le => "not a little-endian ELF64 file",
            Self::Truncated => "ELF header or table outside the file",
            Self::BadSegment => "overlapping or wrapping PT_LOAD segments",
        })
    }
}

/// `p_type` of a loadable segment.
pub const PT_LOAD: u32 = 1;

/// One program header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProgramHeader {
    /// `p_type`.
    pub kind: u32,
    /// `p_flags` (PF_X = 1, PF_W = 2, PF_R = 4).
    pub flags: u32,
    /// `p_offset`: where the bytes are in the file.
    pub offset: u64,
    /// `p_vaddr`.
    pub vaddr: u64,
    /// `p_paddr`: where a loader that places by physical address puts it.
    pub paddr: u64,
    /// `p_filesz`.
    pub file_size: u64,
    /// `p_memsz`.
    pub mem_size: u64,
}

/// One section header, with its name resolved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SectionHeader<'a> {
    /// The name, from `.shstrtab`.
    pub name: &'a [u8],
    /// `sh_type`.
    pub kind: u32,
    /// `sh_addr`.
    pub addr: u64,
    /// `sh_offset`.
    pub offset: u64,
    /// `sh_size`.
    pub size: u64,
    /// `sh_link`.
    pub link: u32,
    /// `sh_entsize`.
    pub entsize: u64,
}

/// The `N` bytes at `off`.
fn bytes_at<const N: usize>(b: &[u8], off: usize) -> Result<[u8; N], ElfError> {
    b.get(off..)
        .and_then(<[u8]>::first_chunk)
        .copied()
        .ok_or(ElfError::Truncated)
}

fn u16_at(b: &[u8], off: usize) -> Result<u16, ElfError> {
    bytes_at(b, off).map(u16::from_le_bytes)
}

fn u32_at(b: &[u8], off: usize) -> Result<u32, ElfError> {
    bytes_at(b, off).map(u32::from_le_bytes)
}

fn u64_at(b: &[u8], off: usize) -> Result<u64, ElfError> {
    bytes_at(b, off).map(u64::from_le_bytes)
}

fn usize_of(v: u64) -> Result<usize, ElfError> {
    usize::try_from(v).map_err(|_| ElfError::Truncated)
}

/// A parsed ELF64 little-endian image (borrowing the file's bytes).
#[derive(Clone, Copy, Debug)]
pub struct Elf<'a> {
    bytes: &'a [u8],
    phoff: usize,
    phentsize: usize,
    phnum: usize,
    shoff: usize,
    shentsize: usize,
    shnum: usize,
    shstrndx: usize,
}

impl<'a> Elf<'a> {
    /// Checks the identification and reads the file header.
    pub fn parse(bytes: &'a [u8]) -> Result<Self, ElfError> {
        // ELFCLASS64, ELFDATA2LSB.
        if bytes.len() < 64 || !matches!(bytes, [0x7f, b'E', b'L', b'F', 2, 1, ..]) {
            return Err(ElfError::NotElf64Le);
        }
        Ok(Self {
            bytes,
            phoff: usize_of(u64_at(bytes, 0x20)?)?,
            shoff: usize_of(u64_at(bytes, 0x28)?)?,
            phentsize: u16_at(bytes, 0x36)? as usize,
            phnum: u16_at(bytes, 0x38)? as usize,
            shentsize: u16_at(bytes, 0x3a)? as usize,
            shnum: u16_at(bytes, 0x3c)? as usize,
            shstrndx: u16_at(bytes, 0x3e)? as usize,
        })
    }

    /// The whole file.
    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// The program headers.
    pub fn program_headers(&self) -> impl Iterator<Item = Result<ProgramHeader, ElfError>> + '_ {
        (0..self.phnum).map(move |i| {
            let o = i
                .checked_mul(self.phentsize)
                .and_then(|x| x.checked_add(self.phoff))
                .ok_or(ElfError::Truncated)?;
            if self.phentsize < 56 {
                return Err(ElfError::Truncated);
            }
            Ok(ProgramHeader {
                kind: u32_at(self.bytes, o)?,
                flags: u32_at(self.bytes, o + 4)?,
                offset: u64_at(self.bytes, o + 8)?,
                vaddr: u64_at(self.bytes, o + 16)?,
                paddr: u64_at(self.bytes, o + 24)?,
                file_size: u64_at(self.bytes, o + 32)?,
                mem_size: u64_at(self.bytes, o + 40)?,
            })
        })
    }

    fn raw_section(&self, i: usize) -> Result<(u32, SectionHeader<'a>), ElfError> {
        if self.shentsize < 64 {
            return Err(ElfError::Truncated);
        }
        let o = i
            .checked_mul(self.shentsize)
            .and_then(|x| x.checked_add(self.shoff))
            .ok_or(ElfError::Truncated)?;
        Ok((
            u32_at(self.bytes, o)?,
            SectionHeader {
                name: &[],
                kind: u32_at(self.bytes, o + 4)?,
                addr: u64_at(self.bytes, o + 16)?,
                offset: u64_at(self.bytes, o + 24)?,
                size: u64_at(self.bytes, o + 32)?,
                link: u32_at(self.bytes, o + 40)?,
                entsize: u64_at(self.bytes, o + 56)?,
            },
        ))
    }

    /// The section headers, names resolved through `.shstrtab`.
    pub fn sections(&self) -> impl Iterator<Item = Result<SectionHeader<'a>, ElfError>> + '_ {
        (0..self.shnum).map(move |i| {
            let (name_off, mut sh) = self.raw_section(i)?;
            let (_, strtab) = self.raw_section(self.shstrndx)?;
            let strs = self.data(&strtab)?;
            let rest = strs.get(name_off as usize..).ok_or(ElfError::Truncated)?;
            sh.name = rest
                .iter()
                .position(|&c| c == 0)
                .and_then(|end| rest.get(..end))
                .ok_or(ElfError::Truncated)?;
            Ok(sh)
        })
    }

    /// The section called `name`, if any.
    pub fn section(&self, name: &str) -> Option<SectionHeader<'a>> {
        self.sections()
            .filter_map(Result::ok)
            .find(|s| s.name == name.as_bytes())
    }

    /// The file bytes of a section (empty for `SHT_NOBITS`).
    pub fn data(&self, sh: &SectionHeader<'_>) -> Result<&'a [u8], ElfError> {
        const SHT_NOBITS: u32 = 8;
        if sh.kind == SHT_NOBITS {
            return Ok(&[]);
        }
        let start = usize_of(sh.offset)?;
        let end = start
            .checked_add(usize_of(sh.size)?)
            .ok_or(ElfError::Truncated)?;
        self.bytes.get(start..end).ok_or(ElfError::Truncated)
    }

    /// Every `PT_LOAD` segment whose virtual address satisfies `keep`, placed
    /// at that address. A vmlinux has one segment at virtual address 0, the
    /// per-cpu template (`.data..percpu`); pass `Gva::is_kernel_image` to
    /// leave it out, as the running kernel's mapping does.
    pub fn load_segments(&self, keep: impl Fn(Gva) -> bool) -> Result<SegmentView<'a>, ElfError> {
        let mut view = SegmentView::new();
        for ph in self.program_headers() {
            let ph = ph?;
            if ph.kind != PT_LOAD || !keep(Gva(ph.vaddr)) {
                continue;
            }
            let start = usize_of(ph.offset)?;
            let end = start
                .checked_add(usize_of(ph.file_size)?)
                .ok_or(ElfError::Truncated)?;
            let data = self.bytes.get(start..end).ok_or(ElfError::Truncated)?;
            if !view.add(Gva(ph.vaddr), data, ph.mem_size) {
                return Err(ElfError::BadSegment);
            }
        }
        Ok(view)
    }
}
