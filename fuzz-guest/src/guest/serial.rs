//! COM1, polled: the program's only output. One lock keeps the vCPUs'
//! lines whole.

use core::fmt::{self, Write};
use core::sync::atomic::{AtomicBool, Ordering};

const COM1: u16 = 0x3F8;

static LOCK: AtomicBool = AtomicBool::new(false);

fn outb(port: u16, v: u8) {
    // SAFETY: COM1's registers; the program owns the port.
    unsafe { core::arch::asm!("out dx, al", in("dx") port, in("al") v, options(nomem, nostack)) };
}

fn inb(port: u16) -> u8 {
    let v: u8;
    // SAFETY: as above; a read of the line status has no side effect.
    unsafe { core::arch::asm!("in al, dx", in("dx") port, out("al") v, options(nomem, nostack)) };
    v
}

/// 115200 baud, 8N1, FIFOs on, interrupts off.
pub fn init() {
    outb(COM1 + 1, 0);
    outb(COM1 + 3, 0x80);
    outb(COM1, 1);
    outb(COM1 + 1, 0);
    outb(COM1 + 3, 0x03);
    outb(COM1 + 2, 0xC7);
    outb(COM1 + 4, 0x03);
}

struct Port;

impl Write for Port {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        for b in s.bytes() {
            if b == b'\n' {
                put(b'\r');
            }
            put(b);
        }
        Ok(())
    }
}

fn put(b: u8) {
    for _ in 0..1_000_000 {
        if inb(COM1 + 5) & 0x20 != 0 {
            break;
        }
    }
    outb(COM1, b);
}

/// Waits for a byte on COM1 and returns it.
pub fn wait_byte() -> u8 {
    while inb(COM1 + 5) & 1 == 0 {
        core::hint::spin_loop();
    }
    inb(COM1)
}

/// Prints `fuzz: <args>` and a newline as one line.
pub fn line(args: fmt::Arguments<'_>) {
    while LOCK
        .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
        .is_err()
    {
        core::hint::spin_loop();
    }
    let _ = Port.write_str(fuzz_guest::LINE_PREFIX);
    let _ = Port.write_fmt(args);
    let _ = Port.write_str("\n");
    LOCK.store(false, Ordering::Release);
}
