//! The supervisor's buffer of trace lines.
//!
//! The hypervisor streams rendered trace lines ([`protocol::Event::TraceText`])
//! once a client asked for them; the supervisor keeps them here, so that
//! clients read at their own pace, each from its own cursor
//! ([`protocol::Request::TraceRead`]).
//!
//! - Every entry has an absolute number that never changes: the cursor.
//!   Entries are lines (each with its format) and loss notes (events the
//!   hypervisor reported lost at that point of the stream).
//! - The buffer is bounded ([`MAX_ENTRIES`], [`MAX_BYTES`]); the oldest
//!   entries are dropped first. A reader whose cursor lies before the first
//!   entry still buffered skips ahead and is told how many it missed.
//! - A reader asks for one format; lines of the other format (written while
//!   the stream was switched to it for another reader) are skipped.
//! - Every line keeps its source ([`protocol::Event::TraceText`]: 0 for
//!   probes and the function tracer, N for function-graph session N). A
//!   reader asks for one source or for all of them; lines of other sources
//!   are skipped like lines of another format.

use std::collections::VecDeque;

use protocol::TraceFormat;

/// Most entries kept.
pub const MAX_ENTRIES: usize = 200_000;
/// Most bytes of line text kept.
pub const MAX_BYTES: usize = 32 << 20;
/// Text bytes per answer, so that a [`protocol::Response::Trace`] fits a
/// frame ([`protocol::MAX_FRAME`]) with room to spare. An answer holds at
/// least one line whatever its length.
pub const READ_BUDGET: usize = 3000;
/// Longest line kept, newline included; longer ones are cut (a line this
/// long alone still fits a frame). The hypervisor's own frames keep its
/// lines shorter than this, so it is a safeguard only.
pub const MAX_LINE: usize = 4000;
/// Loss notes that fell off the front and are remembered, so that a reader
/// far behind is told the events they stood for, not one per note.
const DROPPED_NOTES: usize = 4096;

#[derive(Clone, Debug, PartialEq, Eq)]
enum Entry {
    /// One line, ending in a newline.
    Line {
        format: TraceFormat,
        source: u32,
        text: String,
    },
    /// The hypervisor lost this many events here.
    Lost(u64),
}

/// What one read returns.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TraceChunk {
    /// Where the next read continues.
    pub next: u64,
    /// Complete lines of the format and source asked for.
    pub text: String,
    /// Lines dropped from the buffer before the reader got to them, and
    /// events the hypervisor lost, between the cursor and `next`.
    pub lost: u64,
}

impl TraceChunk {
    /// Nothing to report: no text and no loss.
    pub fn is_empty(&self) -> bool {
        self.text.is_empty() && self.lost == 0
    }
}

/// Counters over the buffer's life.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TraceBufferStats {
    /// Lines received.
    pub lines: u64,
    /// Line bytes received.
    pub bytes: u64,
    /// Lines dropped from the front to stay within the bounds.
    pub dropped: u64,
    /// Events the hypervisor reported lost.
    pub hv_lost: u64,
    /// Lines cut to [`MAX_LINE`].
    pub cut: u64,
}

/// A bounded buffer of trace lines, read by cursor.
#[derive(Debug)]
pub struct TraceBuffer {
    entries: VecDeque<Entry>,
    /// The number of `entries[0]`.
    first: u64,
    /// Line text bytes in `entries`.
    bytes: usize,
    max_entries: usize,
    max_bytes: usize,
    /// Loss notes dropped from the front: (number, events), oldest first.
    dropped_notes: VecDeque<(u64, u64)>,
    stats: TraceBufferStats,
}

impl Default for TraceBuffer {
    fn default() -> Self {
        TraceBuffer::new()
    }
}

impl TraceBuffer {
    /// An empty buffer with the default bounds.
    pub fn new() -> TraceBuffer {
        TraceBuffer::with_limits(MAX_ENTRIES, MAX_BYTES)
    }

    /// An empty buffer keeping at most `max_entries` entries and
    /// `max_bytes` bytes of text (each at least 1).
    pub fn with_limits(max_entries: usize, max_bytes: usize) -> TraceBuffer {
        TraceBuffer {
            entries: VecDeque::new(),
            first: 0,
            bytes: 0,
            max_entries: max_entries.max(1),
            max_bytes: max_bytes.max(1),
            dropped_notes: VecDeque::new(),
            stats: TraceBufferStats::default(),
        }
    }

    /// The number of the oldest entry still buffered.
    pub fn start(&self) -> u64 {
        self.first
    }

    /// The number the next entry will get.
    pub fn end(&self) -> u64 {
        self.first + self.entries.len() as u64
    }

    /// The counters so far.
    pub fn stats(&self) -> TraceBufferStats {
        self.stats
    }

    /// Adds the lines of `text`, all of `format` and from `source`
    /// (complete lines, each ending in a newline; a last line without one
    /// gets one). Returns how many were added.
    pub fn push_text(&mut self, format: TraceFormat, source: u32, text: &str) -> usize {
        let mut added = 0;
        for line in text.split_inclusive('\n') {
            let mut line = line.to_string();
            if !line.ends_with('\n') {
                line.push('\n');
            }
            if line.len() > MAX_LINE {
                let mut cut = MAX_LINE - 1;
                while !line.is_char_boundary(cut) {
                    cut -= 1;
                }
                line.truncate(cut);
                line.push('\n');
                self.stats.cut += 1;
            }
            self.stats.lines += 1;
            self.stats.bytes += line.len() as u64;
            self.bytes += line.len();
            self.entries.push_back(Entry::Line {
                format,
                source,
                text: line,
            });
            added += 1;
            self.trim();
        }
        added
    }

    /// Notes that the hypervisor lost `count` events at this point.
    pub fn push_lost(&mut self, count: u64) {
        if count == 0 {
            return;
        }
        self.stats.hv_lost += count;
        self.entries.push_back(Entry::Lost(count));
        self.trim();
    }

    /// Reads from `cursor`: the lines of `format` from `source` (`None`:
    /// from every source), up to about `budget` bytes (at least one line
    /// when there is one), and the losses on the way. Lines of other
    /// formats or sources are passed over. A cursor before the buffer's
    /// start skips ahead, counting what it skipped as lost; one past the
    /// end reads from the end.
    ///
    /// Losses are reported to every reader, whatever its source: the
    /// hypervisor does not say whose events it lost.
    pub fn read(
        &self,
        cursor: u64,
        format: TraceFormat,
        source: Option<u32>,
        budget: usize,
    ) -> TraceChunk {
        let mut lost = 0;
        let mut pos = cursor;
        if pos < self.first {
            lost += self.dropped_between(pos, self.first);
            pos = self.first;
        }
        let end = self.end();
        pos = pos.min(end);
        let mut text = String::new();
        while pos < end {
            let Some(entry) = self.entries.get((pos - self.first) as usize) else {
                break;
            };
            match entry {
                Entry::Line {
                    format: f,
                    source: s,
                    text: t,
                } if *f == format && source.is_none_or(|want| want == *s) => {
                    if !text.is_empty() && text.len() + t.len() > budget {
                        break;
                    }
                    text.push_str(t);
                }
                Entry::Line { .. } => {}
                Entry::Lost(n) => lost += n,
            }
            pos += 1;
        }
        TraceChunk {
            next: pos,
            text,
            lost,
        }
    }

    /// What the dropped entries `from..to` stood for: one per line, and the
    /// events of each loss note.
    fn dropped_between(&self, from: u64, to: u64) -> u64 {
        let extra: u64 = self
            .dropped_notes
            .iter()
            .filter(|(at, _)| (from..to).contains(at))
            .map(|(_, n)| n - 1)
            .sum();
        (to - from) + extra
    }

    /// Drops the oldest entries until the buffer is within its bounds.
    fn trim(&mut self) {
        while self.entries.len() > self.max_entries || self.bytes > self.max_bytes {
            let Some(entry) = self.entries.pop_front() else {
                break;
            };
            match entry {
                Entry::Line { text, .. } => {
                    self.bytes -= text.len();
                    self.stats.dropped += 1;
                }
                Entry::Lost(n) => {
                    if self.dropped_notes.len() == DROPPED_NOTES {
                        self.dropped_notes.pop_front();
                    }
                    self.dropped_notes.push_back((self.first, n));
                }
            }
            self.first += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: TraceFormat = TraceFormat::Text;
    const JSON: TraceFormat = TraceFormat::Json;

    fn lines(range: std::ops::Range<u32>) -> String {
        range.map(|i| format!("line {i}\n")).collect()
    }

    #[test]
    fn reads_from_a_cursor() {
        let mut b = TraceBuffer::new();
        assert_eq!(b.read(0, TEXT, None, READ_BUDGET), TraceChunk::default());
        assert_eq!(b.push_text(TEXT, 0, "a\nb\n"), 2);
        b.push_text(TEXT, 0, "c");
        let all = b.read(0, TEXT, None, READ_BUDGET);
        assert_eq!(
            all,
            TraceChunk {
                next: 3,
                text: "a\nb\nc\n".into(),
                lost: 0
            }
        );
        let rest = b.read(1, TEXT, None, READ_BUDGET);
        assert_eq!((rest.next, rest.text.as_str()), (3, "b\nc\n"));
        // At the end, and past it (a cursor from elsewhere): nothing.
        assert!(b.read(3, TEXT, None, READ_BUDGET).is_empty());
        assert_eq!(b.read(99, TEXT, None, READ_BUDGET).next, 3);
        assert_eq!(b.stats().lines, 3);
    }

    #[test]
    fn answers_stay_within_the_budget() {
        let mut b = TraceBuffer::new();
        b.push_text(TEXT, 0, &lines(0..1000));
        let mut cursor = 0;
        let mut all = String::new();
        let mut reads = 0;
        loop {
            let chunk = b.read(cursor, TEXT, None, 100);
            if chunk.is_empty() {
                break;
            }
            assert!(chunk.text.len() <= 100, "{}", chunk.text.len());
            assert!(chunk.text.ends_with('\n'));
            all.push_str(&chunk.text);
            cursor = chunk.next;
            reads += 1;
        }
        assert_eq!(all, lines(0..1000));
        assert!(reads > 50);
        // A line longer than the budget still goes, alone.
        let long = format!("{}\n", "x".repeat(500));
        b.push_text(TEXT, 0, &long);
        b.push_text(TEXT, 0, "after\n");
        let chunk = b.read(cursor, TEXT, None, 100);
        assert_eq!(chunk.text, long);
        assert_eq!(b.read(chunk.next, TEXT, None, 100).text, "after\n");
    }

    #[test]
    fn the_oldest_lines_go_first_and_count_as_lost() {
        let mut b = TraceBuffer::with_limits(10, usize::MAX);
        b.push_text(TEXT, 0, &lines(0..25));
        assert_eq!((b.start(), b.end()), (15, 25));
        assert_eq!(b.stats().dropped, 15);
        let chunk = b.read(0, TEXT, None, READ_BUDGET);
        assert_eq!(chunk.lost, 15);
        assert_eq!(chunk.text, lines(15..25));
        assert_eq!(chunk.next, 25);
        // A reader that had got as far as line 12 missed 3.
        assert_eq!(b.read(12, TEXT, None, READ_BUDGET).lost, 3);
        assert_eq!(b.read(15, TEXT, None, READ_BUDGET).lost, 0);
    }

    #[test]
    fn the_byte_bound_holds() {
        let mut b = TraceBuffer::with_limits(usize::MAX, 100);
        // Ten bytes per line, so ten lines fit.
        for i in 0..50 {
            b.push_text(TEXT, 0, &format!("{i:09}\n"));
        }
        assert_eq!(b.end() - b.start(), 10);
        let chunk = b.read(0, TEXT, None, READ_BUDGET);
        assert_eq!(chunk.lost, 40);
        assert!(chunk.text.starts_with("000000040\n"));
    }

    #[test]
    fn hypervisor_losses_are_reported_where_they_happened() {
        let mut b = TraceBuffer::new();
        b.push_text(TEXT, 0, "a\n");
        b.push_lost(7);
        b.push_lost(0);
        b.push_text(TEXT, 0, "b\n");
        let all = b.read(0, TEXT, None, READ_BUDGET);
        assert_eq!((all.text.as_str(), all.lost, all.next), ("a\nb\n", 7, 3));
        // Past the note, nothing is lost.
        assert_eq!(b.read(2, TEXT, None, READ_BUDGET).lost, 0);
        // A loss at the end is reported at once, without text.
        b.push_lost(2);
        let tail = b.read(3, TEXT, None, READ_BUDGET);
        assert_eq!((tail.text.as_str(), tail.lost, tail.next), ("", 2, 4));
        assert!(!tail.is_empty());
        assert_eq!(b.stats().hv_lost, 9);
    }

    #[test]
    fn dropped_loss_notes_count_their_events() {
        let mut b = TraceBuffer::with_limits(4, usize::MAX);
        b.push_text(TEXT, 0, "a\n");
        b.push_lost(100);
        b.push_text(TEXT, 0, &lines(0..6));
        // Entries 0 (a), 1 (the note) and 2..4 are gone.
        assert_eq!(b.start(), 4);
        assert_eq!(b.read(0, TEXT, None, READ_BUDGET).lost, 4 + 99);
        assert_eq!(b.read(2, TEXT, None, READ_BUDGET).lost, 2);
    }

    #[test]
    fn other_formats_are_skipped() {
        let mut b = TraceBuffer::new();
        b.push_text(TEXT, 0, "t1\n");
        b.push_text(JSON, 0, "{\"j\":1}\n{\"j\":2}\n");
        b.push_text(TEXT, 0, "t2\n");
        let text = b.read(0, TEXT, None, READ_BUDGET);
        assert_eq!((text.text.as_str(), text.next), ("t1\nt2\n", 4));
        let json = b.read(0, JSON, None, READ_BUDGET);
        assert_eq!(json.text, "{\"j\":1}\n{\"j\":2}\n");
        // Only lines of the other format: nothing, but the cursor moves on.
        let skipped = b.read(1, TEXT, None, 1);
        assert_eq!(skipped.text, "t2\n");
        let json_from_1 = b.read(1, JSON, None, READ_BUDGET);
        assert_eq!(json_from_1.text, "{\"j\":1}\n{\"j\":2}\n");
        assert!(b.read(3, JSON, None, READ_BUDGET).is_empty());
        assert_eq!(b.read(3, JSON, None, READ_BUDGET).next, 4);
    }

    #[test]
    fn a_reader_of_one_source_sees_only_its_lines() {
        let mut b = TraceBuffer::new();
        b.push_text(TEXT, 0, "p1\n");
        b.push_text(TEXT, 1, "g1\ng2\n");
        b.push_text(TEXT, 0, "p2\n");
        b.push_text(TEXT, 2, "h1\n");
        b.push_text(TEXT, 1, "g3\n");
        assert_eq!(b.end(), 6);
        let one = b.read(0, TEXT, Some(1), READ_BUDGET);
        assert_eq!(
            one,
            TraceChunk {
                next: 6,
                text: "g1\ng2\ng3\n".into(),
                lost: 0
            }
        );
        let zero = b.read(0, TEXT, Some(0), READ_BUDGET);
        assert_eq!((zero.text.as_str(), zero.next), ("p1\np2\n", 6));
        let two = b.read(0, TEXT, Some(2), READ_BUDGET);
        assert_eq!((two.text.as_str(), two.next), ("h1\n", 6));
        // `None` reads every source, in the order the lines came.
        let all = b.read(0, TEXT, None, READ_BUDGET);
        assert_eq!(all.text, "p1\ng1\ng2\np2\nh1\ng3\n");
        // A source with no lines: nothing, but the cursor moves past the
        // lines of the others.
        let none = b.read(0, TEXT, Some(7), READ_BUDGET);
        assert!(none.is_empty());
        assert_eq!(none.next, 6);
        // The source and the format must both match.
        assert!(b.read(0, JSON, Some(1), READ_BUDGET).is_empty());
    }

    #[test]
    fn a_source_filter_moves_the_cursor_past_skipped_lines() {
        let mut b = TraceBuffer::new();
        b.push_text(TEXT, 1, "g1\n");
        b.push_text(TEXT, 0, &lines(0..5));
        b.push_text(TEXT, 1, "g2\n");
        b.push_text(TEXT, 0, "p\n");
        // A budget of one line: each read stops at its next own line that
        // does not fit, past the other source's lines before it.
        let first = b.read(0, TEXT, Some(1), 1);
        assert_eq!((first.text.as_str(), first.next), ("g1\n", 6));
        let second = b.read(first.next, TEXT, Some(1), 1);
        assert_eq!((second.text.as_str(), second.next), ("g2\n", 8));
        assert!(b.read(second.next, TEXT, Some(1), 1).is_empty());
        // Only the other source's lines: nothing, and the cursor moves on.
        let skipped = b.read(1, TEXT, Some(1), 1);
        assert_eq!((skipped.text.as_str(), skipped.next), ("g2\n", 8));
        let rest = b.read(7, TEXT, Some(1), READ_BUDGET);
        assert_eq!((rest.text.as_str(), rest.next, rest.lost), ("", 8, 0));
        // Source 0 reads the lines source 1 skipped.
        let zero = b.read(1, TEXT, Some(0), READ_BUDGET);
        assert_eq!(zero.text, lines(0..5) + "p\n");
    }

    #[test]
    fn losses_reach_readers_of_every_source() {
        let mut b = TraceBuffer::new();
        b.push_text(TEXT, 0, "p1\n");
        b.push_lost(5);
        b.push_text(TEXT, 1, "g1\n");
        for source in [Some(0), Some(1), Some(3), None] {
            let chunk = b.read(0, TEXT, source, READ_BUDGET);
            assert_eq!((chunk.lost, chunk.next), (5, 3), "{source:?}");
        }
        // Lines dropped from the front count as lost for every reader,
        // whatever their source.
        let mut b = TraceBuffer::with_limits(2, usize::MAX);
        b.push_text(TEXT, 1, "g1\ng2\n");
        b.push_text(TEXT, 0, "p1\np2\n");
        assert_eq!(b.start(), 2);
        let one = b.read(0, TEXT, Some(1), READ_BUDGET);
        assert_eq!((one.text.as_str(), one.lost, one.next), ("", 2, 4));
        let zero = b.read(0, TEXT, Some(0), READ_BUDGET);
        assert_eq!((zero.text.as_str(), zero.lost), ("p1\np2\n", 2));
    }

    #[test]
    fn overlong_lines_are_cut_at_a_character() {
        let mut b = TraceBuffer::new();
        let long = "é".repeat(MAX_LINE);
        b.push_text(TEXT, 0, &format!("{long}\n"));
        let chunk = b.read(0, TEXT, None, READ_BUDGET);
        assert!(chunk.text.len() <= MAX_LINE, "{}", chunk.text.len());
        assert!(chunk.text.ends_with("é\n"));
        assert_eq!(b.stats().cut, 1);
        // It fits one answer frame.
        let frame = protocol::Frame::response(
            u32::MAX,
            protocol::Response::Trace {
                next: u64::MAX,
                text: chunk.text,
                lost: u64::MAX,
            },
        );
        protocol::encode(&frame, &mut Vec::new()).unwrap();
    }

    #[test]
    fn a_full_budget_answer_fits_a_frame() {
        let mut b = TraceBuffer::new();
        b.push_text(TEXT, 0, &lines(0..2000));
        let chunk = b.read(0, TEXT, None, READ_BUDGET);
        assert!(chunk.text.len() <= READ_BUDGET);
        let frame = protocol::Frame::response(
            u32::MAX,
            protocol::Response::Trace {
                next: u64::MAX,
                text: chunk.text,
                lost: u64::MAX,
            },
        );
        protocol::encode(&frame, &mut Vec::new()).unwrap();
    }
}
