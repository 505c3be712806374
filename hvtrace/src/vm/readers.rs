//! The threads that read a VM's emulator for the whole run: its stdout
//! and stderr (the hypervisor's log port among them), the guest console
//! (COM1) and the control channel (COM2). They feed the state the `Vm`
//! shares with them and wake whoever waits on it.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use super::bounded::{self, CappedLog};
use super::channel::Channel;
use super::hvlog::{self, HvEvent};
use super::logport;
use super::{Echo, Shared, TapCopy};

/// How many lines of the emulator's own output are kept for messages.
const TAIL_LINES: usize = 40;
/// How many hypervisor lines (other than the milestones and errors) are
/// shown as progress; the rest are only in `emulator.stdout.log`.
const MAX_NOTED_HV_LINES: u32 = 1000;

/// Reads COM2 for the whole run: hands the hypervisor's fatal report
/// (`Event::Fatal`) to the log digest and copies every byte to whoever took
/// the channel.
pub(super) fn spawn_control_tap(
    mut stream: Channel,
    shared: Arc<Shared>,
    copy: Arc<Mutex<TapCopy>>,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut decoder = protocol::FrameDecoder::new();
        let mut buf = [0u8; 4096];
        while let Some(n) = read_some(&mut stream, &mut buf) {
            let data = &buf[..n];
            for result in decoder.feed(data) {
                if let Ok(protocol::Frame {
                    body: protocol::Body::Event(protocol::Event::Fatal { reason }),
                    ..
                }) = result
                {
                    shared.fault(&reason);
                }
            }
            let mut copy = copy.lock().unwrap_or_else(|e| e.into_inner());
            if let TapCopy::To(to) = &mut *copy {
                if to.write_all(data).is_err() {
                    *copy = TapCopy::Gone;
                }
            }
        }
        // Dropping the copy's socket ends the taker's reads.
        *copy.lock().unwrap_or_else(|e| e.into_inner()) = TapCopy::Closed;
        shared.lock().control_eof = true;
        shared.cv.notify_all();
    })
}

/// Reads the emulator's stdout or stderr: cuts it into lines (lines
/// longer than [`bounded::MAX_LINE`] in pieces) and, on stdout, the trace
/// frames of the log port ([`logport`]), which go to the trace sink; logs
/// the lines (up to [`bounded::LOG_CAP`]), feeds the hypervisor lines to
/// the log digest and keeps a tail of the rest.
pub(super) fn spawn_line_reader(
    mut stream: impl Read + Send + 'static,
    log_path: PathBuf,
    shared: Arc<Shared>,
    is_stdout: bool,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut log = CappedLog::create(&log_path, bounded::LOG_CAP).ok();
        let mut demux = logport::LogDemux::new(bounded::MAX_LINE);
        let mut buf = vec![0u8; 64 * 1024];
        let mut noted = 0u32;
        let mut piece = |p: logport::Piece<'_>| match p {
            logport::Piece::Line(line) => {
                if let Some(log) = log.as_mut() {
                    let _ = log.append(line);
                }
                take_line(&shared, line, &mut noted, &log_path);
            }
            logport::Piece::Frame(frame, wire_len) => {
                let mut bulk = shared.bulk.lock().unwrap_or_else(|e| e.into_inner());
                match *frame {
                    Ok(frame) if is_stdout => bulk.frame(frame, wire_len as u64),
                    _ => bulk.stats.bad += 1,
                }
            }
        };
        while let Some(n) = read_some(&mut stream, &mut buf) {
            demux.feed(&buf[..n], &mut piece);
            // Bochs writes the log port a byte per `write`: after a short
            // read, a millisecond lets the pipe fill, so that a busy trace
            // stream costs a read per kilobyte, not a read per byte (the
            // scale test's supervisor spent 37 CPU seconds on 53 MB
            // before).
            if n < SHORT_READ {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        demux.finish(&mut piece);
        let mut inner = shared.lock();
        if is_stdout {
            inner.stdout_eof = true;
        } else {
            inner.stderr_eof = true;
        }
        drop(inner);
        shared.cv.notify_all();
    })
}

/// One line of the emulator's output: the hypervisor's go to the digest
/// (and the first [`MAX_NOTED_HV_LINES`] to the progress notes), the
/// others to the tail.
fn take_line(shared: &Shared, raw: &[u8], noted: &mut u32, log_path: &Path) {
    let line = String::from_utf8_lossy(raw);
    let line = line.trim_end_matches(['\r', '\n']);
    let mut inner = shared.lock();
    let first = !inner.hv.alive();
    match inner.hv.push_line(line) {
        Some(event) => {
            drop(inner);
            if first {
                shared.note("hypervisor started");
            }
            match event {
                HvEvent::GuestStarted => shared.note("guest started"),
                HvEvent::Error(e) => shared.note(&format!("hypervisor error: {e}")),
                HvEvent::GuestStopped(_) | HvEvent::Repeated(_) => {}
                HvEvent::ExitCounts(_) | HvEvent::Text(_) => {
                    *noted = noted.saturating_add(1);
                    if *noted == MAX_NOTED_HV_LINES + 1 {
                        shared.note(&format!(
                            "more than {MAX_NOTED_HV_LINES} hypervisor lines; the rest are only in {}",
                            log_path.display()
                        ));
                    } else if *noted <= MAX_NOTED_HV_LINES {
                        if let Some(body) = hvlog::strip_prefix(line) {
                            shared.note(&format!("hypervisor: {body}"));
                        }
                    }
                }
            }
        }
        None => {
            inner.tail.push_back(line.to_string());
            if inner.tail.len() > TAIL_LINES {
                inner.tail.pop_front();
            }
            drop(inner);
        }
    }
    shared.cv.notify_all();
}

/// A read of fewer bytes than this from the emulator's output is followed
/// by a millisecond's pause ([`spawn_line_reader`]).
const SHORT_READ: usize = 512;

/// Reads what `stream` has into `buf`; `None` at its end or on an error.
/// A read interrupted by a signal (the CLI catches Ctrl-C, which may land
/// in a reader thread) is tried again.
fn read_some(stream: &mut impl Read, buf: &mut [u8]) -> Option<usize> {
    loop {
        match stream.read(buf) {
            Ok(0) => return None,
            Ok(n) => return Some(n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return None,
        }
    }
}

/// Reads the guest console: logs it (up to `cap` bytes, the run's
/// [`RunConfig::console_cap`](super::config::RunConfig::console_cap)),
/// keeps its last bytes (the console buffer's bound) and echoes it when
/// asked.
pub(super) fn spawn_serial_reader(
    mut stream: Channel,
    log_path: PathBuf,
    cap: u64,
    shared: Arc<Shared>,
) -> JoinHandle<()> {
    // A TCP channel acknowledges each read at once: Bochs sends the console
    // a byte per write, with Nagle's algorithm on.
    std::thread::spawn(move || {
        let mut log = CappedLog::create(&log_path, cap).ok();
        let mut buf = [0u8; 4096];
        while let Some(n) = read_some(&mut stream, &mut buf) {
            let data = &buf[..n];
            if let Some(log) = log.as_mut() {
                let _ = log.append(data);
            }
            match shared.echo.load(Ordering::Relaxed) {
                x if x == Echo::Stderr as u8 => {
                    let mut err = std::io::stderr().lock();
                    let _ = err.write_all(data).and_then(|_| err.flush());
                }
                x if x == Echo::Stdout as u8 => {
                    let mut out = std::io::stdout().lock();
                    let _ = out.write_all(data).and_then(|_| out.flush());
                }
                _ => {}
            }
            shared.lock().console.push(data);
            shared.cv.notify_all();
        }
        shared.cv.notify_all();
    })
}
