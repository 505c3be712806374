//! The guest shell protocol on the serial console.
//!
//! The guest's `/init` prints [`READY_LINE`] and then runs a busybox shell on
//! ttyS0. To run a command the driver sends one line
//!
//! ```text
//! echo HVT''<tok>B<n>; eval "$(printf '<command, escaped>')"; echo HVT''<tok>E<n>=$?
//! ```
//!
//! The command goes through the tty as printable ASCII only
//! ([`printf_format`]): its control bytes (`^C`, `^D`, `^S`, `^U`, line
//! ends...) are sent as octal escapes, which the shell's `printf` turns back
//! into the bytes, so the tty's line discipline never acts on them and the
//! command reaches `eval` exactly as it was. The driver then waits for the
//! line `HVT<tok>E<n>=<status>`; the command's output is
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

/// The most bytes of guest console output kept in memory
/// ([`ConsoleBuffer`]): past it (plus an eighth, so that trimming costs
/// little per byte) the oldest output goes. A command whose output is
/// longer loses its start.
pub const CONSOLE_KEEP: usize = 8 * 1024 * 1024;

/// The guest console's output, its last [`CONSOLE_KEEP`] bytes. Positions
/// count from the first byte the guest ever wrote, so they stay valid
/// when old output is dropped.
#[derive(Clone, Debug)]
pub struct ConsoleBuffer {
    data: Vec<u8>,
    /// The position of `data[0]`: bytes dropped so far.
    base: usize,
    keep: usize,
}

impl Default for ConsoleBuffer {
    fn default() -> ConsoleBuffer {
        ConsoleBuffer::with_keep(CONSOLE_KEEP)
    }
}

impl ConsoleBuffer {
    /// A buffer that keeps the last `keep` bytes (at least).
    pub fn with_keep(keep: usize) -> ConsoleBuffer {
        ConsoleBuffer {
            data: Vec::new(),
            base: 0,
            keep: keep.max(1),
        }
    }

    /// Appends output; drops the oldest when past the bound.
    pub fn push(&mut self, bytes: &[u8]) {
        self.data.extend_from_slice(bytes);
        if self.data.len() > self.keep + self.keep / 8 {
            let cut = self.data.len() - self.keep;
            self.data.drain(..cut);
            self.base += cut;
        }
    }

    /// How many of the last bytes the buffer keeps (at least).
    pub fn keep(&self) -> usize {
        self.keep
    }

    /// The position of the first byte kept (the bytes dropped so far).
    pub fn start(&self) -> usize {
        self.base
    }

    /// The position just past the last byte.
    pub fn end(&self) -> usize {
        self.base + self.data.len()
    }

    /// The bytes kept.
    pub fn bytes(&self) -> &[u8] {
        &self.data
    }

    /// The index in [`ConsoleBuffer::bytes`] of position `pos` (0 for a
    /// position that was dropped).
    pub fn index(&self, pos: usize) -> usize {
        pos.saturating_sub(self.base).min(self.data.len())
    }

    /// The bytes kept from position `pos` on.
    pub fn since(&self, pos: usize) -> &[u8] {
        &self.data[self.index(pos)..]
    }
}

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

    /// The line that runs `cmd` as command number `n`: printable ASCII
    /// and its final newline, whatever `cmd` holds ([`printf_format`]).
    pub fn exec_line(&self, n: u32, cmd: &str) -> String {
        format!(
            "echo {}; eval \"$(printf '{}')\"; echo {}=$?\n",
            self.sent('B', n),
            printf_format(cmd),
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

/// `cmd` as a `printf` format that prints it back exactly, made of
/// printable ASCII only, to go between single quotes: the bytes from space
/// to `~` stand for themselves, except `'` and `\`, which are escaped like
/// every other byte (control bytes, DEL, UTF-8 sequences) as a
/// three-digit octal escape (`\003`), and `%`, which is doubled. A leading
/// `-` is escaped too, so that `printf` never takes it for an option. A
/// NUL byte would end the text: refuse such commands before.
pub fn printf_format(cmd: &str) -> String {
    let mut out = String::with_capacity(cmd.len() + 8);
    for (i, &b) in cmd.as_bytes().iter().enumerate() {
        match b {
            b'%' => out.push_str("%%"),
            b'-' if i == 0 => out.push_str("\\055"),
            b'\'' | b'\\' => out.push_str(&format!("\\{b:03o}")),
            0x20..=0x7e => out.push(char::from(b)),
            _ => out.push_str(&format!("\\{b:03o}")),
        }
    }
    out
}

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
            "echo HVT''abcB3; eval \"$(printf 'uname -r')\"; echo HVT''abcE3=$?\n"
        );
        assert_eq!(sh_quote("it's"), r"'it'\''s'");
    }

    /// What `printf FORMAT` prints, for the formats [`printf_format`]
    /// makes: `%%` and three-digit octal escapes.
    fn printf_decode(format: &str) -> Vec<u8> {
        let b = format.as_bytes();
        let mut out = Vec::new();
        let mut i = 0;
        while i < b.len() {
            match b[i] {
                b'%' => {
                    assert_eq!(b.get(i + 1), Some(&b'%'), "a lone % in {format:?}");
                    out.push(b'%');
                    i += 2;
                }
                b'\\' => {
                    let digits = &format[i + 1..i + 4];
                    out.push(u8::from_str_radix(digits, 8).unwrap());
                    i += 4;
                }
                c => {
                    out.push(c);
                    i += 1;
                }
            }
        }
        out
    }

    /// Commands whose bytes the tty would act on, or that quoting makes
    /// hard.
    fn awkward_commands() -> Vec<String> {
        vec![
            "echo \x03 \x04 \x13 \x11 \x15 \x17 \x12 \x16 \x1a \x1c \x7f done".to_string(),
            "printf '%s\\n' \"it's\" 'a \"b\"' \\\\; echo 100%; echo %d %%".to_string(),
            "echo one\necho two\r\necho three\n\n".to_string(),
            "-n is not an option".to_string(),
            "echo 'é ü ☃' \\0101 \\x41 $HOME `true`".to_string(),
            String::new(),
            (1u8..=127).map(char::from).collect(),
        ]
    }

    #[test]
    fn commands_go_to_the_tty_as_printable_ascii_and_decode_exactly() {
        for cmd in awkward_commands() {
            let format = printf_format(&cmd);
            assert!(
                format.bytes().all(|b| (0x20..=0x7e).contains(&b)),
                "{format:?}"
            );
            assert!(!format.contains('\''), "{format:?}");
            assert!(!format.starts_with('-'), "{format:?}");
            assert_eq!(printf_decode(&format), cmd.as_bytes(), "{cmd:?}");
            let line = m().exec_line(7, &cmd);
            let (body, end) = line.split_at(line.len() - 1);
            assert_eq!(end, "\n");
            assert!(body.bytes().all(|b| (0x20..=0x7e).contains(&b)), "{line:?}");
        }
        // Plain commands stay as they are.
        assert_eq!(printf_format("uname -r"), "uname -r");
        assert_eq!(printf_format("a\x03b"), "a\\003b");
        assert_eq!(printf_format("it's"), "it\\047s");
    }

    /// Where the host has busybox (the guest's shell) or a POSIX `sh`, the
    /// shell's own `printf` and `eval` get the command back byte for byte.
    #[test]
    fn a_real_shell_decodes_the_command() {
        use std::process::Command;
        for shell in [&["busybox", "sh"][..], &["sh"][..]] {
            let run = |script: &str| {
                Command::new(shell[0])
                    .args(&shell[1..])
                    .arg("-c")
                    .arg(script)
                    .output()
                    .ok()
                    .filter(|o| o.status.success())
                    .map(|o| o.stdout)
            };
            if run("true").is_none() {
                continue;
            }
            for cmd in awkward_commands() {
                let format = printf_format(&cmd);
                assert_eq!(
                    run(&format!("printf '{format}'")).as_deref(),
                    Some(cmd.as_bytes()),
                    "{shell:?} {cmd:?}"
                );
            }
            // And `eval` runs it as it was written.
            let cmd = "x='a\x03b'; printf '%s|' \"$x\" \"it's\" 50%\necho \"end\"";
            let script = format!("eval \"$(printf '{}')\"", printf_format(cmd));
            assert_eq!(
                run(&script).as_deref(),
                Some(&b"a\x03b|it's|50%|end\n"[..]),
                "{shell:?}"
            );
        }
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
    fn the_console_buffer_keeps_its_bound_and_its_positions() {
        let mut c = ConsoleBuffer::with_keep(16);
        c.push(b"0123456789");
        assert_eq!((c.start(), c.end()), (0, 10));
        assert_eq!(c.since(4), b"456789");
        c.push(b"abcdefghij");
        // 20 bytes > 16 + 2: the oldest 4 went.
        assert_eq!((c.start(), c.end()), (4, 20));
        assert_eq!(c.bytes(), b"456789abcdefghij");
        assert_eq!(c.since(10), b"abcdefghij");
        assert_eq!(c.since(0), c.bytes());
        assert_eq!(c.index(2), 0);
        assert_eq!(c.index(100), 16);
        // A flood keeps the buffer bounded.
        for _ in 0..100_000 {
            c.push(b"flood without end ");
        }
        assert!(c.bytes().len() <= 16 + 2 + 18, "{}", c.bytes().len());
        assert_eq!(c.end(), 20 + 100_000 * 18);
        let mut big = ConsoleBuffer::default();
        for _ in 0..3000 {
            big.push(&[b'x'; 4096]);
        }
        assert!(big.bytes().len() <= CONSOLE_KEEP + CONSOLE_KEEP / 8);
        assert_eq!(big.end(), 3000 * 4096);
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
