//! The kernel ring buffer's page format, as ftrace's `header_page` and
//! `header_event` texts describe it (and trace.dat's flyrecord section
//! holds it), for one CPU:
//!
//! - a page is [`PAGE_SIZE`] bytes: a `u64` timestamp (the time of its
//!   first event), a `u64` commit (the bytes of events that follow, with
//!   the missed-events flags in bits 31 and 30), then the events;
//! - an event starts with a `u32` whose low 5 bits are `type_len` and the
//!   other 27 its time since the previous event (or the page's timestamp).
//!   `type_len` 1 to 28 says the payload has that many 4-byte words and
//!   follows at once; 0 says the next `u32` holds the payload's padded
//!   length plus 4 (payloads over 112 bytes); 30 is a time extend (the next `u32`
//!   holds the delta's bits above 27, and the event after it carries a
//!   delta of 0); 29 is padding and 31 an absolute timestamp (this writer
//!   writes neither);
//! - everything is 4-byte aligned, little-endian.

/// Bytes in a page (the guest's and ours).
pub const PAGE_SIZE: usize = 4096;

/// Bytes of the page header (timestamp and commit).
pub const PAGE_HEADER: usize = 16;

/// Bytes of events a page holds.
pub const PAGE_DATA: usize = PAGE_SIZE - PAGE_HEADER;

/// Largest payload a `type_len` of 1 to 28 describes.
pub const MAX_SMALL_DATA: usize = 28 * 4;

/// `type_len` of a padding record.
pub const TYPE_PADDING: u32 = 29;

/// `type_len` of a time extend.
pub const TYPE_TIME_EXTEND: u32 = 30;

/// `type_len` of an absolute timestamp.
pub const TYPE_TIME_STAMP: u32 = 31;

/// The delta bits of an event header.
pub const DELTA_BITS: u32 = 27;

/// The commit's flag: events were lost before this page.
pub const MISSED_EVENTS: u64 = 1 << 31;

/// The commit's flag: their count is stored after the events (a `u64`).
pub const MISSED_STORED: u64 = 1 << 30;

/// The payload's place on the page: its header word(s) and padded size.
fn record_size(payload: usize) -> usize {
    let padded = payload.max(1).div_ceil(4) * 4;
    if payload <= MAX_SMALL_DATA {
        4 + padded
    } else {
        8 + padded
    }
}

/// Largest payload one page holds (with a time extend before it).
pub const MAX_PAYLOAD: usize = PAGE_DATA - 8 - 8 - 8;

/// Writes one CPU's events into pages.
#[derive(Debug, Default)]
pub struct PageWriter {
    /// Finished pages, each [`PAGE_SIZE`] bytes.
    pages: Vec<u8>,
    /// The page being filled: its events (without the header).
    data: Vec<u8>,
    /// The page's timestamp (its first event's).
    page_ts: u64,
    /// The last event's time.
    last_ts: u64,
    /// Events lost before the page being filled: `None` when none,
    /// `Some(None)` when the count is unknown.
    missed: Option<Option<u64>>,
    /// Events written.
    events: u64,
    /// Payloads refused (longer than a page).
    refused: u64,
}

impl PageWriter {
    /// A writer with no pages.
    pub fn new() -> PageWriter {
        PageWriter::default()
    }

    /// Appends an event at `ts` (nanoseconds, never before the previous
    /// event's: an earlier one is written at the previous time) with
    /// `payload` (its fields, the common ones first). A payload longer
    /// than [`MAX_PAYLOAD`] is refused (counted, `false`).
    pub fn push(&mut self, ts: u64, payload: &[u8]) -> bool {
        if payload.len() > MAX_PAYLOAD {
            self.refused += 1;
            return false;
        }
        // A time extend holds 59 bits of delta: a longer gap is shortened.
        let mut delta = ts.saturating_sub(self.last_ts).min((1 << 59) - 1);
        let ts = self.last_ts + delta;
        let size = record_size(payload.len());
        let extend = if delta >> DELTA_BITS != 0 { 8 } else { 0 };
        // The missed count, when stored, takes 8 bytes after the events.
        let reserve = if matches!(self.missed, Some(Some(_))) {
            8
        } else {
            0
        };
        if self.data.is_empty() || self.data.len() + extend + size + reserve > PAGE_DATA {
            if !self.data.is_empty() {
                self.finish_page();
            }
            self.page_ts = ts;
            delta = 0;
        }
        if delta >> DELTA_BITS != 0 {
            self.word(TYPE_TIME_EXTEND | ((delta as u32 & ((1 << DELTA_BITS) - 1)) << 5));
            self.word((delta >> DELTA_BITS) as u32);
            delta = 0;
        }
        let delta = delta as u32;
        // An empty payload takes one word, as the kernel rounds a length
        // of 0 up to 1.
        let padded = payload.len().max(1).div_ceil(4) * 4;
        if payload.len() <= MAX_SMALL_DATA {
            self.word((padded / 4) as u32 | (delta << 5));
        } else {
            // The long form's length word counts itself, as the kernel's.
            self.word(delta << 5);
            self.word(padded as u32 + 4);
        }
        self.data.extend_from_slice(payload);
        self.data
            .resize(self.data.len() + padded - payload.len(), 0);
        self.last_ts = ts;
        self.events += 1;
        true
    }

    /// Marks a loss: the next event starts a page whose header says
    /// `count` events (`None`: an unknown number) were missed before it.
    pub fn lost(&mut self, count: Option<u64>) {
        if !self.data.is_empty() {
            self.finish_page();
        }
        self.missed = Some(match (self.missed, count) {
            (Some(Some(a)), Some(b)) => Some(a.saturating_add(b)),
            (None, c) => c,
            _ => None,
        });
    }

    fn word(&mut self, w: u32) {
        self.data.extend_from_slice(&w.to_le_bytes());
    }

    fn finish_page(&mut self) {
        let mut commit = self.data.len() as u64;
        let mut tail = Vec::new();
        match self.missed.take() {
            Some(Some(n)) => {
                commit |= MISSED_EVENTS | MISSED_STORED;
                tail.extend_from_slice(&n.to_le_bytes());
            }
            Some(None) => commit |= MISSED_EVENTS,
            None => {}
        }
        self.pages.extend_from_slice(&self.page_ts.to_le_bytes());
        self.pages.extend_from_slice(&commit.to_le_bytes());
        self.pages.extend_from_slice(&self.data);
        self.pages.extend_from_slice(&tail);
        let used = PAGE_HEADER + self.data.len() + tail.len();
        self.pages.resize(self.pages.len() + PAGE_SIZE - used, 0);
        self.data.clear();
    }

    /// Events written.
    pub fn events(&self) -> u64 {
        self.events
    }

    /// Payloads refused for their size.
    pub fn refused(&self) -> u64 {
        self.refused
    }

    /// Bytes of pages so far, the page being filled counted whole.
    pub fn bytes(&self) -> u64 {
        let open = if self.data.is_empty() { 0 } else { PAGE_SIZE };
        (self.pages.len() + open) as u64
    }

    /// Ends the last page and gives the pages.
    pub fn finish(mut self) -> Vec<u8> {
        if !self.data.is_empty() || self.missed.is_some() {
            self.finish_page();
        }
        self.pages
    }
}
