//! The local APIC, at its architectural base (the program never moves it).

/// The APIC page.
pub const BASE: u64 = 0xFEE0_0000;

/// Register offsets the program uses.
pub const ID: u32 = 0x20;
pub const EOI: u32 = 0xB0;
pub const SVR: u32 = 0xF0;
pub const ESR: u32 = 0x280;
pub const ICR_LOW: u32 = 0x300;
pub const ICR_HIGH: u32 = 0x310;
pub const LVT_TIMER: u32 = 0x320;
pub const TIMER_INIT: u32 = 0x380;
pub const TIMER_DIV: u32 = 0x3E0;

/// Reads a 32-bit register.
pub fn read(reg: u32) -> u32 {
    // SAFETY: the APIC page is identity-mapped; an aligned 32-bit load of
    // one of its registers has no side effect beyond the register's.
    unsafe { core::ptr::read_volatile((BASE + u64::from(reg)) as *const u32) }
}

/// Writes a 32-bit register.
pub fn write(reg: u32, v: u32) {
    // SAFETY: as in `read`; the callers pick registers whose effect they
    // want.
    unsafe { core::ptr::write_volatile((BASE + u64::from(reg)) as *mut u32, v) }
}

/// Signals the end of an interrupt.
pub fn eoi() {
    write(EOI, 0);
}

/// This vCPU's APIC ID.
pub fn id() -> u32 {
    read(ID) >> 24
}

/// Enables the APIC (spurious vector 0xFF) with the timer masked.
pub fn init() {
    write(SVR, 0x1FF);
    write(LVT_TIMER, 0x1_0000);
    write(ESR, 0);
}

/// Sends an IPI and waits (boundedly) until the APIC has sent it.
pub fn ipi(dest: u32, low: u32) {
    write(ICR_HIGH, dest << 24);
    write(ICR_LOW, low);
    for _ in 0..100_000 {
        if read(ICR_LOW) & (1 << 12) == 0 {
            break;
        }
        core::hint::spin_loop();
    }
}
