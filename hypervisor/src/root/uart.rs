//! A polled 16550 UART driver for the control channel on COM2 (0x2F8).
//! VMX root owns the port range: the I/O bitmap makes every guest access to
//! it exit, and the guest sees an empty bus there. No interrupts are used;
//! the run loop polls the UART on the hypervisor's turns.
//!
//! Register offsets and bits: the PC16550D data sheet (RBR/THR 0, IER 1,
//! IIR/FCR 2, LCR 3, MCR 4, LSR 5; LSR.DR bit 0, LSR.THRE bit 5).

use crate::arch::instructions::{inb, outb};

const RBR_THR: u16 = 0;
const IER: u16 = 1;
const FCR: u16 = 2;
const LCR: u16 = 3;
const MCR: u16 = 4;
const LSR: u16 = 5;
const SCR: u16 = 7;
const LSR_DR: u8 = 1 << 0;
const LSR_THRE: u8 = 1 << 5;
const LSR_TEMT: u8 = 1 << 6;
/// Bytes the transmit FIFO takes when THRE is set.
pub const TX_FIFO: usize = 16;

/// The control UART.
pub struct Uart {
    base: u16,
}

impl Uart {
    /// Programs the UART at `base`: 115200 8N1 (divisor 1), FIFOs on and
    /// cleared, no interrupts. Returns `None` when no UART answers there
    /// (scratch register test).
    pub fn init(base: u16) -> Option<Self> {
        let u = Self { base };
        u.out(SCR, 0x5a);
        if u.inp(SCR) != 0x5a {
            return None;
        }
        u.out(IER, 0);
        u.out(LCR, 0x80);
        u.out(RBR_THR, 1);
        u.out(IER, 0);
        u.out(LCR, 0x03);
        u.out(FCR, 0x07);
        u.out(MCR, 0x03);
        Some(u)
    }

    fn out(&self, reg: u16, v: u8) {
        // SAFETY: the control UART's ports belong to VMX root (the guest's
        // accesses to them are intercepted).
        unsafe { outb(self.base + reg, v) }
    }

    fn inp(&self, reg: u16) -> u8 {
        // SAFETY: as in `out`; reading RBR consumes a byte we then own.
        unsafe { inb(self.base + reg) }
    }

    /// Reads every byte waiting (up to `buf.len()`); returns how many.
    pub fn read_available(&mut self, buf: &mut [u8]) -> usize {
        let mut n = 0;
        for slot in buf.iter_mut() {
            if self.inp(LSR) & LSR_DR == 0 {
                break;
            }
            *slot = self.inp(RBR_THR);
            n += 1;
        }
        n
    }

    /// Whether every byte written has left the UART (transmitter empty).
    pub fn tx_idle(&self) -> bool {
        self.inp(LSR) & LSR_TEMT != 0
    }

    /// Writes up to one FIFO's worth of `bytes` if the transmitter is empty;
    /// returns how many were taken. Never waits.
    pub fn write_some(&mut self, bytes: &[u8]) -> usize {
        if self.inp(LSR) & LSR_THRE == 0 {
            return 0;
        }
        let n = bytes.len().min(TX_FIFO);
        for &b in bytes.iter().take(n) {
            self.out(RBR_THR, b);
        }
        n
    }
}

/// LSR polls the fatal path spends on the UART in all; past them it gives
/// up. At 115200 baud a byte leaves in about 87 us, a 16-byte FIFO in
/// 1.4 ms; one LSR read takes about a microsecond on real hardware, so a
/// working UART sends the longest fatal frame ([`protocol::FATAL_WIRE_MAX`])
/// in a few percent of this.
const FATAL_POLLS: u32 = 2_000_000;

/// The control UART as the fatal path drives it: by its port numbers
/// alone. The [`Uart`] belongs to the control channel, which may be the
/// code that failed (in the middle of a write, say); this takes no lock,
/// allocates nothing and waits for the transmitter a bounded number of LSR
/// polls in all, so a dead or wedged UART cannot hang the fatal path.
pub struct FatalTx {
    base: u16,
    /// Bytes the FIFO takes before THRE is polled again.
    room: usize,
    /// LSR polls left.
    polls: u32,
}

impl FatalTx {
    /// Takes over the UART at `base`, which [`Uart::init`] programmed: the
    /// line control is set again (8N1, divisor latch off) in case the fault
    /// hit in the middle of programming it.
    pub fn new(base: u16) -> Self {
        let tx = Self {
            base,
            room: 0,
            polls: FATAL_POLLS,
        };
        // SAFETY: the control UART's ports belong to VMX root; LCR 0x03
        // only selects 8N1 with the data registers visible.
        unsafe { outb(base + LCR, 0x03) };
        tx
    }

    /// Polls LSR until `bit` is set or the budget is spent; false then.
    fn wait_for(&mut self, bit: u8) -> bool {
        while self.polls > 0 {
            self.polls -= 1;
            // SAFETY: as in `new`; reading LSR has no side effect on the
            // transmitter.
            if unsafe { inb(self.base + LSR) } & bit != 0 {
                return true;
            }
            core::hint::spin_loop();
        }
        false
    }

    /// Sends one byte, or drops it once the budget is spent.
    pub fn put(&mut self, byte: u8) {
        if self.room == 0 {
            if !self.wait_for(LSR_THRE) {
                return;
            }
            self.room = TX_FIFO;
        }
        self.room -= 1;
        // SAFETY: as in `new`; THRE said the FIFO has room.
        unsafe { outb(self.base + RBR_THR, byte) };
    }

    /// Waits (within the budget) until the last byte has left the UART, so
    /// that a power-off right after does not cut the frame. Returns whether
    /// it did.
    pub fn drain(&mut self) -> bool {
        self.wait_for(LSR_TEMT)
    }
}
