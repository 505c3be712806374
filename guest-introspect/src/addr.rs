//! Address types: the workspace's one definition, in the loader's layout
//! (guest-physical, host-physical and guest-virtual addresses), re-exported
//! here where introspection uses them.

pub use loader::layout::{Gpa, Gva, GvaRange, DEFAULT_TEXT_BASE, KERNEL_IMAGE_BASE};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical() {
        assert!(Gva(0).is_canonical());
        assert!(Gva(0x0000_7fff_ffff_ffff).is_canonical());
        assert!(!Gva(0x0000_8000_0000_0000).is_canonical());
        assert!(!Gva(0xffff_7fff_ffff_ffff).is_canonical());
        assert!(Gva(0xffff_8000_0000_0000).is_canonical());
        assert!(Gva(0xffff_ffff_8100_0000).is_kernel_image());
    }

    #[test]
    fn ranges() {
        let r = GvaRange::with_len(Gva(u64::MAX - 1), 10);
        assert_eq!(r.end, Gva(u64::MAX));
        assert!(r.contains(Gva(u64::MAX - 1)));
        assert!(!r.contains(Gva(u64::MAX)));
        assert!(GvaRange::new(Gva(5), Gva(2)).is_empty());
    }
}
