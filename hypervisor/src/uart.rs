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
        while n < buf.len() && self.inp(LSR) & LSR_DR != 0 {
            buf[n] = self.inp(RBR_THR);
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
        for &b in &bytes[..n] {
            self.out(RBR_THR, b);
        }
        n
    }
}
