//! Guest-physical memory as the introspection code reads it.
//!
//! The hypervisor implements [`GuestMemory`] over its identity EPT; tests use
//! [`VecMemory`]. An implementation must refuse addresses that are not guest
//! RAM: the guest controls its page tables, and a walk that follows them must
//! never be turned into a read of hypervisor memory.

use alloc::vec::Vec;
use core::fmt;

use crate::addr::Gpa;

/// Why a guest-physical read failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum MemError {
    /// Some byte of `[gpa, gpa + len)` is not guest RAM (or the range wraps).
    OutOfRange {
        /// Start of the refused read.
        gpa: Gpa,
        /// Its length.
        len: usize,
    },
    /// The range is guest-physical memory the introspection code must not
    /// read, such as hypervisor-owned pages.
    Denied {
        /// Start of the refused read.
        gpa: Gpa,
    },
}

impl fmt::Display for MemError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Self::OutOfRange { gpa, len } => {
                write!(f, "guest-physical {gpa}+{len:#x} is not guest RAM")
            }
            Self::Denied { gpa } => {
                write!(f, "guest-physical {gpa} is not readable by introspection")
            }
        }
    }
}

/// Read access to guest-physical memory.
pub trait GuestMemory {
    /// Fills `buf` with the bytes at `[gpa, gpa + buf.len())`. On error the
    /// contents of `buf` are unspecified.
    fn read_phys(&self, gpa: Gpa, buf: &mut [u8]) -> Result<(), MemError>;

    /// Reads a little-endian `u64` (a page-table entry, for instance).
    fn read_u64(&self, gpa: Gpa) -> Result<u64, MemError> {
        let mut b = [0u8; 8];
        self.read_phys(gpa, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }
}

impl<T: GuestMemory + ?Sized> GuestMemory for &T {
    fn read_phys(&self, gpa: Gpa, buf: &mut [u8]) -> Result<(), MemError> {
        (**self).read_phys(gpa, buf)
    }
}

/// Guest-physical memory backed by a `Vec`: `len` bytes starting at `base`.
/// Everything outside is [`MemError::OutOfRange`].
#[derive(Clone, Debug, Default)]
pub struct VecMemory {
    base: Gpa,
    bytes: Vec<u8>,
}

impl VecMemory {
    /// `len` zero bytes at guest-physical `base`.
    pub fn new(base: Gpa, len: usize) -> Self {
        Self {
            base,
            bytes: alloc::vec![0; len],
        }
    }

    /// The first guest-physical address held.
    pub fn base(&self) -> Gpa {
        self.base
    }

    /// Number of bytes held.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    /// Whether no byte is held.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    fn span(&self, gpa: Gpa, len: usize) -> Result<core::ops::Range<usize>, MemError> {
        let err = MemError::OutOfRange { gpa, len };
        let start = gpa.0.checked_sub(self.base.0).ok_or(err)?;
        let start = usize::try_from(start).map_err(|_| err)?;
        let end = start.checked_add(len).ok_or(err)?;
        if end > self.bytes.len() {
            return Err(err);
        }
        Ok(start..end)
    }

    /// Copies `bytes` to guest-physical `gpa`.
    pub fn write(&mut self, gpa: Gpa, bytes: &[u8]) -> Result<(), MemError> {
        let span = self.span(gpa, bytes.len())?;
        let err = MemError::OutOfRange {
            gpa,
            len: bytes.len(),
        };
        self.bytes.get_mut(span).ok_or(err)?.copy_from_slice(bytes);
        Ok(())
    }

    /// Writes a little-endian `u64` at `gpa`.
    pub fn write_u64(&mut self, gpa: Gpa, value: u64) -> Result<(), MemError> {
        self.write(gpa, &value.to_le_bytes())
    }
}

impl GuestMemory for VecMemory {
    fn read_phys(&self, gpa: Gpa, buf: &mut [u8]) -> Result<(), MemError> {
        let span = self.span(gpa, buf.len())?;
        let err = MemError::OutOfRange {
            gpa,
            len: buf.len(),
        };
        buf.copy_from_slice(self.bytes.get(span).ok_or(err)?);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds() {
        let mut m = VecMemory::new(Gpa(0x1000), 0x100);
        m.write_u64(Gpa(0x10f8), 0x1122).unwrap();
        assert_eq!(m.read_u64(Gpa(0x10f8)), Ok(0x1122));
        assert!(m.read_u64(Gpa(0x10f9)).is_err());
        assert!(m.read_u64(Gpa(0xff8)).is_err());
        assert!(m.read_phys(Gpa(u64::MAX), &mut [0; 2]).is_err());
        assert!(m.read_phys(Gpa(0x1100), &mut []).is_ok());
    }
}
