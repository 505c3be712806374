//! Parsing of the hypervisor's log port.
//!
//! The hypervisor writes text lines to I/O port 0xE9 (Bochs `port_e9_hack`,
//! QEMU `-debugcon`). Every line of its own starts with `hvtrace: `; the
//! emulator may mix other text into the same stream (Bochs prints its banner
//! and debugger messages on the same stdout). Only these lines have a fixed
//! meaning; everything else is free text:
//!
//! ```text
//! hvtrace: guest started
//! hvtrace: exit counts: CPUID=12 MSR_READ=3 ...
//! hvtrace: guest stopped: <reason>
//! hvtrace: error: <message>
//! ```
//!
//! The hypervisor's fatal path also sends its report on the control channel
//! (COM2) as an `Event::Fatal` frame, for hosts that do not capture the log
//! port; [`HvLog::push_fault`] takes it as the same two lines the log port
//! carries (`error: <reason>`, `guest stopped: hypervisor fault`), once,
//! whichever way arrives first.

use std::collections::BTreeMap;

/// The prefix of every line the hypervisor writes.
pub const PREFIX: &str = "hvtrace: ";

/// The most hypervisor lines [`HvLog`] keeps in memory. Past it (or past
/// [`MAX_BYTES`]) the oldest quarter goes; the stop and the exit counts
/// come last, so they stay.
pub const MAX_LINES: usize = 10_000;
/// The most bytes of hypervisor lines [`HvLog`] keeps in memory.
pub const MAX_BYTES: usize = 1024 * 1024;
/// The most `error:` messages [`HvLog`] keeps (the first ones).
pub const MAX_ERRORS: usize = 64;
/// The `guest stopped:` reason of the hypervisor's fatal path.
pub const FAULT_STOP: &str = "hypervisor fault";

/// Exit reason name -> count, as printed on the `exit counts:` line.
pub type ExitCounts = BTreeMap<String, u64>;

/// What one hypervisor line says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HvEvent {
    /// `guest started`: the first VM entry is about to happen.
    GuestStarted,
    /// `exit counts: NAME=COUNT ...`, printed when the guest stops.
    ExitCounts(ExitCounts),
    /// `guest stopped: <reason>`.
    GuestStopped(String),
    /// `error: <message>`: the hypervisor gave up.
    Error(String),
    /// Any other hypervisor line (the text after the prefix).
    Text(String),
    /// A line of the fatal report that the control channel delivered first
    /// ([`HvLog::push_fault`]); not counted again.
    Repeated(String),
}

/// Extracts the hypervisor part of one output line: the text after the first
/// `hvtrace: ` prefix, or `None` when the line has none. A prefix in the middle
/// of a line is accepted, because the emulator's own output can share a line
/// with the log port's.
pub fn strip_prefix(line: &str) -> Option<&str> {
    line.find(PREFIX)
        .map(|at| line[at + PREFIX.len()..].trim_end_matches(['\r', '\n']))
}

/// Classifies the text of one hypervisor line (without the prefix).
pub fn classify(body: &str) -> HvEvent {
    let body = body.trim_end();
    if body == "guest started" {
        HvEvent::GuestStarted
    } else if let Some(rest) = body.strip_prefix("exit counts:") {
        HvEvent::ExitCounts(parse_exit_counts(rest))
    } else if let Some(rest) = body.strip_prefix("guest stopped:") {
        HvEvent::GuestStopped(rest.trim().to_string())
    } else if let Some(rest) = body.strip_prefix("error:") {
        HvEvent::Error(rest.trim().to_string())
    } else {
        HvEvent::Text(body.to_string())
    }
}

/// Parses `NAME=COUNT NAME=COUNT ...`. Tokens that are not of that form are
/// skipped; a name that appears twice keeps the sum.
pub fn parse_exit_counts(text: &str) -> ExitCounts {
    let mut counts = ExitCounts::new();
    for token in text.split_whitespace() {
        let Some((name, count)) = token.split_once('=') else {
            continue;
        };
        let Ok(count) = count.parse::<u64>() else {
            continue;
        };
        if name.is_empty() {
            continue;
        }
        *counts.entry(name.to_string()).or_insert(0) += count;
    }
    counts
}

/// What the hypervisor said so far, in order and digested. The lines are
/// the last [`MAX_LINES`] (and at most [`MAX_BYTES`]); the digest covers
/// all of them.
#[derive(Clone, Debug, Default)]
pub struct HvLog {
    /// The hypervisor's lines, without the `hvtrace: ` prefix: all of
    /// them, or the last ones when there were more than the bounds allow.
    pub lines: Vec<String>,
    /// Lines left out of [`HvLog::lines`] (the oldest).
    pub dropped_lines: u64,
    /// Bytes in [`HvLog::lines`].
    line_bytes: usize,
    /// A `guest started` line was seen.
    pub guest_started: bool,
    /// The last `exit counts:` line.
    pub exit_counts: Option<ExitCounts>,
    /// The reason of the first `guest stopped:` line.
    pub stopped: Option<String>,
    /// The messages of the `error:` lines (the first [`MAX_ERRORS`]).
    pub errors: Vec<String>,
    /// The fatal report received on the control channel, if one was.
    pub control_fault: Option<String>,
    /// Lines of the fatal report taken from the control channel before the
    /// log port delivered them: their log-port copies are dropped once.
    echoes: Vec<String>,
}

impl HvLog {
    /// Feeds one output line of the emulator. Returns the event when the line
    /// is a hypervisor line.
    pub fn push_line(&mut self, line: &str) -> Option<HvEvent> {
        let body = strip_prefix(line)?;
        if let Some(at) = self.echoes.iter().position(|e| e == body.trim_end()) {
            return Some(HvEvent::Repeated(self.echoes.remove(at)));
        }
        self.keep_line(body);
        let event = classify(body);
        match &event {
            HvEvent::GuestStarted => self.guest_started = true,
            HvEvent::ExitCounts(counts) => self.exit_counts = Some(counts.clone()),
            HvEvent::GuestStopped(reason) => {
                if self.stopped.is_none() {
                    self.stopped = Some(reason.clone());
                }
            }
            HvEvent::Error(message) => {
                if self.errors.len() < MAX_ERRORS {
                    self.errors.push(message.clone());
                }
            }
            HvEvent::Text(_) | HvEvent::Repeated(_) => {}
        }
        Some(event)
    }

    /// Takes the hypervisor's fatal report as the control channel delivered
    /// it (`Event::Fatal`): the same as its log-port lines `error: <reason>`
    /// and `guest stopped: hypervisor fault`. Whichever way arrives second
    /// adds nothing: a report the log port gave already is only noted in
    /// [`HvLog::control_fault`], and the log port's copies of one taken here
    /// are dropped. Returns whether the report was news.
    pub fn push_fault(&mut self, reason: &str) -> bool {
        // One line, as the log port would have carried it.
        let reason: String = reason
            .chars()
            .map(|c| if matches!(c, '\n' | '\r') { ' ' } else { c })
            .collect();
        let reason = reason.trim_end();
        if self.control_fault.is_some() {
            return false;
        }
        self.control_fault = Some(reason.to_string());
        if self.errors.iter().any(|e| e == reason) {
            return false;
        }
        let error = format!("error: {reason}");
        self.push_line(&format!("{PREFIX}{error}"));
        self.echoes.push(error);
        if self.stopped.is_none() {
            let stop = format!("guest stopped: {FAULT_STOP}");
            self.push_line(&format!("{PREFIX}{stop}"));
            self.echoes.push(stop);
        }
        true
    }

    /// True once the hypervisor wrote anything at all.
    pub fn alive(&self) -> bool {
        !self.lines.is_empty() || self.dropped_lines > 0
    }

    /// Adds a line to [`HvLog::lines`], dropping the oldest quarter when
    /// past a bound (at once, so that dropping costs little per line). The
    /// newest line always stays.
    fn keep_line(&mut self, body: &str) {
        self.lines.push(body.to_string());
        self.line_bytes += body.len();
        if self.lines.len() <= MAX_LINES && self.line_bytes <= MAX_BYTES {
            return;
        }
        let (max_lines, max_bytes) = (MAX_LINES / 4 * 3, MAX_BYTES / 4 * 3);
        let mut cut = 0;
        let mut bytes = self.line_bytes;
        while cut + 1 < self.lines.len()
            && (self.lines.len() - cut > max_lines || bytes > max_bytes)
        {
            bytes -= self.lines[cut].len();
            cut += 1;
        }
        self.lines.drain(..cut);
        self.line_bytes = bytes;
        self.dropped_lines += cut as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_anywhere_in_line() {
        assert_eq!(
            strip_prefix("hvtrace: guest started\r\n"),
            Some("guest started")
        );
        assert_eq!(strip_prefix("(0) foo hvtrace: x"), Some("x"));
        assert_eq!(strip_prefix("hvtrace:nospace"), None);
        assert_eq!(strip_prefix("Bochs banner"), None);
    }

    #[test]
    fn classify_contract_lines() {
        assert_eq!(classify("guest started"), HvEvent::GuestStarted);
        assert_eq!(
            classify("guest stopped: power off"),
            HvEvent::GuestStopped("power off".into())
        );
        assert_eq!(
            classify("guest stopped: unhandled exit 48 at rip=0x1"),
            HvEvent::GuestStopped("unhandled exit 48 at rip=0x1".into())
        );
        assert_eq!(
            classify("error: VMX is not supported by this CPU; try -cpu host,+vmx"),
            HvEvent::Error("VMX is not supported by this CPU; try -cpu host,+vmx".into())
        );
        assert_eq!(
            classify("vcpu0: EPT ready"),
            HvEvent::Text("vcpu0: EPT ready".into())
        );
        assert_eq!(
            classify("guest started later"),
            HvEvent::Text("guest started later".into())
        );
    }

    #[test]
    fn exit_counts() {
        let HvEvent::ExitCounts(c) = classify("exit counts: CPUID=12 MSR_READ=3 junk =4 X=y HLT=0")
        else {
            panic!("not exit counts")
        };
        assert_eq!(c.len(), 3);
        assert_eq!(c["CPUID"], 12);
        assert_eq!(c["MSR_READ"], 3);
        assert_eq!(c["HLT"], 0);
        assert!(parse_exit_counts("").is_empty());
        assert_eq!(parse_exit_counts("A=1 A=2")["A"], 3);
    }

    #[test]
    fn log_digest() {
        let mut log = HvLog::default();
        assert!(log.push_line("Bochs x86 Emulator").is_none());
        assert!(!log.alive());
        log.push_line("hvtrace: loader: bzImage 8 MiB");
        log.push_line("hvtrace: guest started");
        log.push_line("hvtrace: exit counts: CPUID=5");
        log.push_line("hvtrace: guest stopped: power off");
        log.push_line("hvtrace: guest stopped: reset");
        assert!(log.alive() && log.guest_started);
        assert_eq!(log.lines.len(), 5);
        assert_eq!(log.stopped.as_deref(), Some("power off"));
        assert_eq!(log.exit_counts.as_ref().unwrap()["CPUID"], 5);
        assert!(log.errors.is_empty());
    }

    #[test]
    fn a_fatal_report_counts_once_whichever_way_comes_first() {
        let reason = "hypervisor panic: panicked at src/main.rs:1:1: boom";
        // The control channel first, then the log port's copies.
        let mut log = HvLog::default();
        log.push_line("hvtrace: hypervisor 0.1.0 starting");
        assert!(log.push_fault(reason));
        assert_eq!(log.errors, [reason]);
        assert_eq!(log.stopped.as_deref(), Some(FAULT_STOP));
        assert_eq!(log.control_fault.as_deref(), Some(reason));
        assert!(matches!(
            log.push_line(&format!("hvtrace: error: {reason}\r\n")),
            Some(HvEvent::Repeated(_))
        ));
        assert!(matches!(
            log.push_line("hvtrace: guest stopped: hypervisor fault"),
            Some(HvEvent::Repeated(_))
        ));
        assert_eq!(log.errors, [reason]);
        assert_eq!(
            log.lines,
            [
                "hypervisor 0.1.0 starting".to_string(),
                format!("error: {reason}"),
                "guest stopped: hypervisor fault".to_string()
            ]
        );
        // A second, different error line still counts.
        log.push_line("hvtrace: error: something else");
        assert_eq!(log.errors.len(), 2);
        // A second fatal frame adds nothing.
        assert!(!log.push_fault("another"));
        assert_eq!(log.errors.len(), 2);

        // The log port first, then the control channel.
        let mut log = HvLog::default();
        log.push_line(&format!("hvtrace: error: {reason}"));
        log.push_line("hvtrace: guest stopped: hypervisor fault");
        assert!(!log.push_fault(reason));
        assert_eq!(log.errors, [reason]);
        assert_eq!(log.lines.len(), 2);
        assert_eq!(log.control_fault.as_deref(), Some(reason));

        // Line breaks in a report: one line, as the log port carries it.
        let mut log = HvLog::default();
        assert!(log.push_fault("panicked at a.rs:1:1:\nboom"));
        assert_eq!(log.errors, ["panicked at a.rs:1:1: boom"]);
    }

    #[test]
    fn the_log_keeps_its_bounds() {
        let mut log = HvLog::default();
        log.push_line("hvtrace: guest started");
        for i in 0..3 * MAX_LINES {
            log.push_line(&format!("hvtrace: line {i}"));
            log.push_line("hvtrace: error: again");
        }
        log.push_line("hvtrace: exit counts: CPUID=5");
        log.push_line("hvtrace: guest stopped: power off");
        assert!(log.lines.len() <= MAX_LINES, "{}", log.lines.len());
        assert_eq!(
            log.lines.len() as u64 + log.dropped_lines,
            6 * MAX_LINES as u64 + 3
        );
        // The digest saw everything; the last lines are there.
        assert!(log.guest_started && log.alive());
        assert_eq!(log.errors.len(), MAX_ERRORS);
        assert_eq!(log.stopped.as_deref(), Some("power off"));
        assert_eq!(
            &log.lines[log.lines.len() - 2..],
            ["exit counts: CPUID=5", "guest stopped: power off"]
        );

        // Long lines: the byte bound.
        let mut log = HvLog::default();
        let long = format!("hvtrace: {}", "x".repeat(60 * 1024));
        for _ in 0..100 {
            log.push_line(&long);
        }
        let bytes: usize = log.lines.iter().map(String::len).sum();
        assert!(bytes <= MAX_BYTES, "{bytes}");
        assert!(log.dropped_lines > 0);
        assert_eq!(log.line_bytes, bytes);
    }
}
