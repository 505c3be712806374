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

use std::collections::BTreeMap;

/// The prefix of every line the hypervisor writes.
pub const PREFIX: &str = "hvtrace: ";

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

/// Everything the hypervisor said so far, in order and digested.
#[derive(Clone, Debug, Default)]
pub struct HvLog {
    /// Every hypervisor line, without the `hvtrace: ` prefix.
    pub lines: Vec<String>,
    /// A `guest started` line was seen.
    pub guest_started: bool,
    /// The last `exit counts:` line.
    pub exit_counts: Option<ExitCounts>,
    /// The reason of the first `guest stopped:` line.
    pub stopped: Option<String>,
    /// The messages of all `error:` lines.
    pub errors: Vec<String>,
}

impl HvLog {
    /// Feeds one output line of the emulator. Returns the event when the line
    /// is a hypervisor line.
    pub fn push_line(&mut self, line: &str) -> Option<HvEvent> {
        let body = strip_prefix(line)?;
        self.lines.push(body.to_string());
        let event = classify(body);
        match &event {
            HvEvent::GuestStarted => self.guest_started = true,
            HvEvent::ExitCounts(counts) => self.exit_counts = Some(counts.clone()),
            HvEvent::GuestStopped(reason) => {
                if self.stopped.is_none() {
                    self.stopped = Some(reason.clone());
                }
            }
            HvEvent::Error(message) => self.errors.push(message.clone()),
            HvEvent::Text(_) => {}
        }
        Some(event)
    }

    /// True once the hypervisor wrote anything at all.
    pub fn alive(&self) -> bool {
        !self.lines.is_empty()
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
}
