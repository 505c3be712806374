//! The guest shell protocol on the serial console.
//!
//! The guest's `/init` prints [`READY_LINE`] and then runs a busybox shell on
//! ttyS0. To run a command the driver sends one line
//!
//! ```text
//! echo HVT''<tok>B<n>; eval '<command>'; echo HVT''<tok>E<n>=$?
//! ```
//!
//! and waits for the line `HVT<tok>E<n>=<status>`; the command's output is
//! what lies between the line `HVT<tok>B<n>` and that line. The quotes split
//! the markers in the text sent, so a terminal that echoes input never shows
//! a complete marker, and the end marker only counts with a number after it.
//! Everything else on the console (prompts, kernel messages before the
//! command) falls outside the markers. Sending one line means the whole
//! input is received (and echoed, if echo is on) before the shell runs any
//! of it.

/// The line the guest's `/init` prints before it starts the shell.
pub const READY_LINE: &str = "HVTRACE-GUEST-READY";
/// The shell prompt.
pub const PROMPT: &str = "# ";
/// What the kernel prints when it powers the machine off.
pub const POWER_DOWN: &str = "reboot: Power down";
/// Longest command line accepted: the tty's line buffer holds 4095 bytes.
pub const MAX_LINE: usize = 3800;

/// The outcome of one command.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExecResult {
    /// What the command printed (stdout and stderr), with CR LF turned into LF.
    pub output: String,
    /// Its exit status.
    pub rc: i32,
}

/// Marker text for one session. `token` is alphanumeric.
#[derive(Clone, Debug)]
pub struct Markers {
    token: String,
}

impl Markers {
    /// Markers with the given alphanumeric token.
    pub fn new(token: &str) -> Markers {
        debug_assert!(token.chars().all(|c| c.is_ascii_alphanumeric()));
        Markers {
            token: token.to_string(),
        }
    }

    /// Markers with a token made from the process id and the clock.
    pub fn unique() -> Markers {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        Markers::new(&format!(
            "{:x}{:x}",
            std::process::id() & 0xffff,
            nanos & 0xfffff
        ))
    }

    /// The marker as printed: `HVT<tok><kind><n>`.
    pub fn printed(&self, kind: char, n: u32) -> String {
        format!("HVT{}{kind}{n}", self.token)
    }

    /// The marker as sent: `HVT''<tok><kind><n>`, which the shell prints as
    /// [`Markers::printed`].
    pub fn sent(&self, kind: char, n: u32) -> String {
        format!("HVT''{}{kind}{n}", self.token)
    }

    /// The line that runs `cmd` as command number `n`.
    pub fn exec_line(&self, n: u32, cmd: &str) -> String {
        format!(
            "echo {}; eval {}; echo {}=$?\n",
            self.sent('B', n),
            sh_quote(cmd),
            self.sent('E', n)
        )
    }

    /// The line that proves the shell reads input (sync number `n`).
    pub fn sync_line(&self, n: u32) -> String {
        format!("echo {}\n", self.sent('S', n))
    }

    /// Finds the result of command `n` in `buf` from `from`. Returns it and
    /// the index just past the end-marker line, or `None` while incomplete.
    pub fn find_exec(&self, buf: &[u8], from: usize, n: u32) -> Option<(ExecResult, usize)> {
        self.find_exec_from(buf, from, from, n)
    }

    /// [`Self::find_exec`] that looks for the end marker only from `search`
    /// on (the output before it was searched already).
    pub fn find_exec_from(
        &self,
        buf: &[u8],
        from: usize,
        search: usize,
        n: u32,
    ) -> Option<(ExecResult, usize)> {
        let end_marker = format!("{}=", self.printed('E', n));
        let (end_at, rc, after) = find_status_line(buf, search.max(from), end_marker.as_bytes())?;
        let begin = self.printed('B', n);
        let start = match find_whole_line(&buf[..end_at], from, begin.as_bytes()) {
            Some((_, line_end)) => line_end,
            None => from,
        };
        let output = clean_output(&buf[start.min(end_at)..end_at]);
        Some((ExecResult { output, rc }, after))
    }

    /// Finds the printed sync marker of any number in `numbers`; returns the
    /// index just past its line.
    pub fn find_sync(&self, buf: &[u8], from: usize, numbers: &[u32]) -> Option<usize> {
        numbers
            .iter()
            .filter_map(|&n| find_whole_line(buf, from, self.printed('S', n).as_bytes()))
            .map(|(_, end)| end)
            .min()
    }
}

/// How far back a search resumes: longer than any marker line.
pub const MARKER_MARGIN: usize = 512;

/// Quotes `s` as one shell word.
pub fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// Finds a complete line (ended by LF) that is exactly `text`, ignoring CRs,
/// blanks and shell prompts (`# `) before it. Returns the line's start and the
/// index past its LF.
pub fn find_whole_line(buf: &[u8], from: usize, text: &[u8]) -> Option<(usize, usize)> {
    let mut at = from;
    while at < buf.len() {
        let rel = find(&buf[at..], text)?;
        let pos = at + rel;
        let line_start = buf[..pos]
            .iter()
            .rposition(|&b| b == b'\n')
            .map_or(0, |i| i + 1)
            .max(from);
        let before_ok = buf[line_start..pos]
            .iter()
            .all(|&b| b.is_ascii_whitespace() || b == b'#');
        let rest = &buf[pos + text.len()..];
        if let Some(nl) = rest.iter().position(|&b| b == b'\n') {
            let after_ok = rest[..nl].iter().all(|b| b.is_ascii_whitespace());
            if before_ok && after_ok {
                return Some((line_start, pos + text.len() + nl + 1));
            }
        } else {
            return None;
        }
        at = pos + 1;
    }
    None
}

/// Finds `marker` followed by a decimal status and the end of a line.
/// Returns the marker's index, the status and the index past the line's LF.
fn find_status_line(buf: &[u8], from: usize, marker: &[u8]) -> Option<(usize, i32, usize)> {
    let mut at = from;
    while at < buf.len() {
        let pos = at + find(&buf[at..], marker)?;
        let digits_start = pos + marker.len();
        let digits = buf[digits_start..]
            .iter()
            .take_while(|b| b.is_ascii_digit())
            .count();
        let rest = &buf[digits_start + digits..];
        if digits > 0 {
            let nl = rest.iter().position(|&b| b == b'\n')?;
            if rest[..nl].iter().all(|b| b.is_ascii_whitespace()) {
                let text = std::str::from_utf8(&buf[digits_start..digits_start + digits]).ok()?;
                let rc = text.parse::<i32>().ok()?;
                return Some((pos, rc, digits_start + digits + nl + 1));
            }
        }
        at = pos + 1;
    }
    None
}

/// Byte-string search.
pub fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() {
        return Some(0);
    }
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Console bytes as command output: lossy UTF-8, CR LF (and stray CRs) as LF.
pub fn clean_output(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    text.replace("\r\n", "\n").replace('\r', "")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m() -> Markers {
        Markers::new("abc")
    }

    #[test]
    fn exec_line_shape() {
        assert_eq!(
            m().exec_line(3, "uname -r"),
            "echo HVT''abcB3; eval 'uname -r'; echo HVT''abcE3=$?\n"
        );
        assert_eq!(sh_quote("it's"), r"'it'\''s'");
    }

    #[test]
    fn parse_without_echo() {
        let buf = b"# HVTabcB1\r\n6.1.0-57-amd64\r\nHVTabcE1=0\r\n# ";
        let (res, after) = m().find_exec(buf, 0, 1).unwrap();
        assert_eq!(res.output, "6.1.0-57-amd64\n");
        assert_eq!(res.rc, 0);
        assert_eq!(&buf[after..], b"# ");
    }

    #[test]
    fn parse_with_echo() {
        let mut buf = Vec::new();
        buf.extend_from_slice(b"# ");
        buf.extend_from_slice(
            m().exec_line(2, "false; echo x")
                .replace('\n', "\r\n")
                .as_bytes(),
        );
        buf.extend_from_slice(b"HVTabcB2\r\nx\r\nHVTabcE2=1\r\n# ");
        let (res, _) = m().find_exec(&buf, 0, 2).unwrap();
        assert_eq!(res.output, "x\n");
        assert_eq!(res.rc, 1);
    }

    #[test]
    fn incomplete_and_partial() {
        assert!(m()
            .find_exec(b"HVTabcB1\r\nout\r\nHVTabcE1=12", 0, 1)
            .is_none());
        assert!(m()
            .find_exec(b"HVTabcB1\r\nout\r\nHVTabcE1=", 0, 1)
            .is_none());
        let (res, _) = m()
            .find_exec(b"HVTabcB1\r\nHVTabcE1=127\r\n", 0, 1)
            .unwrap();
        assert_eq!((res.output.as_str(), res.rc), ("", 127));
        // Output without a final newline shares the end marker's line.
        let (res, _) = m()
            .find_exec(b"HVTabcB1\r\nabcHVTabcE1=0\r\n", 0, 1)
            .unwrap();
        assert_eq!(res.output, "abc");
        // Another command's markers do not count.
        assert!(m()
            .find_exec(b"HVTabcB1\r\nHVTabcE11=0\r\n", 0, 1)
            .is_none());
    }

    #[test]
    fn sync() {
        let buf = b"HVTRACE-GUEST-READY\r\n# echo HVT''abcS1\r\nHVTabcS1\r\n# ";
        let after = m().find_sync(buf, 0, &[1]).unwrap();
        assert_eq!(&buf[after..], b"# ");
        assert!(m().find_sync(buf, 0, &[2]).is_none());
        assert!(find_whole_line(b"xx HVTRACE-GUEST-READY\n", 0, READY_LINE.as_bytes()).is_none());
        assert!(find_whole_line(b"\nHVTRACE-GUEST-READY\r\n", 0, READY_LINE.as_bytes()).is_some());
    }
}
