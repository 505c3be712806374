//! The hypervisor's log: I/O port 0xE9 (QEMU isa-debugcon, Bochs
//! port_e9_hack). It is output only and separate from the guest's COM1.
//! Every line starts with `hvtrace: `; the host launcher parses a few of them
//! (`guest started`, `exit counts:`, `guest stopped:`, `error:`).

use crate::arch::instructions::rep_outsb;
use core::fmt::{self, Write};
use spin::Mutex;

/// The debug port.
pub const DEBUG_PORT: u16 = 0xe9;

pub struct DebugPort;

impl Write for DebugPort {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        // SAFETY: port 0xE9 is the emulator's debug console, owned by the
        // hypervisor and never exposed to the guest as a device.
        unsafe { rep_outsb(DEBUG_PORT, s.as_bytes()) };
        Ok(())
    }
}

/// Writes one encoded control frame (`0x00`, COBS bytes, `0x00`: no other
/// `0x00` inside) to the log port, between whole lines: the host's reader
/// takes everything between two delimiters as a frame and the rest as
/// text. The log lock keeps other vCPUs' lines out of the frame.
pub fn write_frame(wire: &[u8]) {
    let _lines = LOG.lock();
    // SAFETY: as in `DebugPort::write_str`; the frame is plain bytes.
    unsafe { rep_outsb(DEBUG_PORT, wire) };
}

pub static LOG: Mutex<DebugPort> = Mutex::new(DebugPort);

/// Prints one `hvtrace: ` line.
#[macro_export]
macro_rules! hvprintln {
    ($($arg:tt)*) => {{
        use core::fmt::Write as _;
        let mut w = $crate::logger::LOG.lock();
        let _ = w.write_str("hvtrace: ");
        let _ = writeln!(w, $($arg)*);
    }};
}

struct Logger;

impl log::Log for Logger {
    fn enabled(&self, m: &log::Metadata<'_>) -> bool {
        m.level() <= log::Level::Info
    }
    fn log(&self, r: &log::Record<'_>) {
        if self.enabled(r.metadata()) {
            let level = match r.level() {
                log::Level::Error => "error",
                log::Level::Warn => "warn",
                log::Level::Info => "info",
                log::Level::Debug => "debug",
                log::Level::Trace => "trace",
            };
            let mut w = LOG.lock();
            let _ = writeln!(w, "hvtrace: [cpu0] {level}: {}", r.args());
        }
    }
    fn flush(&self) {}
}

static LOGGER: Logger = Logger;

/// Routes the `log` macros to the debug port.
pub fn init() {
    if log::set_logger(&LOGGER).is_ok() {
        log::set_max_level(log::LevelFilter::Info);
    }
}
