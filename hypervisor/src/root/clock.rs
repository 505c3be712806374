//! Time in VMX root: the TSC, calibrated once against the PIT before the
//! guest owns the PIT (8254 channel 2, gated through port 0x61, mode 0).

use crate::arch::instructions::{inb, outb, rdtsc};

const PIT_HZ: u64 = 1_193_182;
/// Calibration window: 10 ms.
const WINDOW_DIV: u64 = 100;

/// TSC ticks per second, measured.
pub fn calibrate_tsc() -> u64 {
    let count = (PIT_HZ / WINDOW_DIV) as u16;
    // SAFETY: the guest has not started; the PIT and port 0x61 are ours until
    // VM entry, and we leave channel 2 gated off again.
    unsafe {
        let gate = inb(0x61);
        outb(0x61, (gate & !0x02) | 0x01);
        outb(0x43, 0xb0);
        outb(0x42, count as u8);
        outb(0x42, (count >> 8) as u8);
        let t0 = rdtsc();
        let mut spins = 0u64;
        while inb(0x61) & 0x20 == 0 && spins < 100_000_000 {
            spins += 1;
        }
        let t1 = rdtsc();
        outb(0x61, gate);
        (t1 - t0).saturating_mul(WINDOW_DIV).max(1)
    }
}

/// Nanoseconds between two TSC readings.
pub fn tsc_to_ns(ticks: u64, hz: u64) -> u64 {
    ((ticks as u128 * 1_000_000_000) / hz.max(1) as u128) as u64
}
