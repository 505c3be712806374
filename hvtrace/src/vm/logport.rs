//! The log port's two streams: the hypervisor's text lines, and the trace
//! frames it writes there once the host chose the log port as the trace
//! stream's path (`Request::TraceChannel`).
//!
//! The emulator's stdout carries both (Bochs `port_e9_hack` and QEMU
//! `-debugcon stdio` write each byte of port 0xE9 as it comes, with the
//! emulator's own messages among them). A frame is the control channel's
//! wire form: `0x00`, COBS bytes (no `0x00` among them), `0x00`; a text line
//! never holds `0x00`. So [`LogDemux`] reads text until a `0x00`, a frame
//! until the next one, and text again. Root writes a frame whole under its
//! log lock, so no line of its own lands inside one.
//!
//! Were a delimiter ever lost (the emulator killed in the middle of a
//! frame), text would be read as a frame and the next frame as text. A
//! segment that does not decode and holds the log's line prefix is such
//! text: its lines are given back as text, and the delimiter that ended it
//! is taken as the start of a frame, which puts the reader back in step.

use protocol::{DecodeError, Frame, FrameDecoder, MAX_WIRE_FRAME};

use super::hvlog::PREFIX;

/// One piece of the log port's stream.
#[derive(Debug)]
pub enum Piece<'a> {
    /// A text line, with its newline when it had one (a line longer than
    /// the demultiplexer's limit comes in pieces).
    Line(&'a [u8]),
    /// A frame, decoded (or why it could not be), and its bytes on the
    /// wire (delimiters included).
    Frame(Box<Result<Frame, DecodeError>>, usize),
}

/// Splits a byte stream into text lines and frames.
pub struct LogDemux {
    in_frame: bool,
    line: Vec<u8>,
    /// The segment since the opening delimiter (without it).
    segment: Vec<u8>,
    /// The segment outgrew any frame: the rest up to the delimiter is
    /// skipped.
    overlong: bool,
    max_line: usize,
    decoder: FrameDecoder,
}

impl LogDemux {
    /// A demultiplexer that cuts text lines at `max_line` bytes.
    pub fn new(max_line: usize) -> LogDemux {
        LogDemux {
            in_frame: false,
            line: Vec::new(),
            segment: Vec::new(),
            overlong: false,
            max_line: max_line.max(1),
            decoder: FrameDecoder::new(),
        }
    }

    /// Takes the next bytes of the stream; hands each complete piece to
    /// `out`, in order.
    pub fn feed(&mut self, mut data: &[u8], out: &mut dyn FnMut(Piece<'_>)) {
        while !data.is_empty() {
            if self.in_frame {
                match data.iter().position(|&b| b == 0) {
                    Some(at) => {
                        self.take_segment(&data[..at]);
                        data = &data[at + 1..];
                        self.end_segment(out);
                    }
                    None => {
                        self.take_segment(data);
                        data = &[];
                    }
                }
            } else {
                let stop = data.iter().position(|&b| b == 0 || b == b'\n');
                match stop {
                    Some(at) if data[at] == b'\n' => {
                        self.take_text(&data[..=at], out);
                        self.flush_line(out);
                        data = &data[at + 1..];
                    }
                    Some(at) => {
                        self.take_text(&data[..at], out);
                        // A partial line before a frame stays, to be ended
                        // by the text after it.
                        self.in_frame = true;
                        data = &data[at + 1..];
                    }
                    None => {
                        self.take_text(data, out);
                        data = &[];
                    }
                }
            }
        }
    }

    /// The end of the stream: a partial line is given out; a frame cut
    /// short is reported as such.
    pub fn finish(&mut self, out: &mut dyn FnMut(Piece<'_>)) {
        if self.in_frame && (self.overlong || !self.segment.is_empty()) {
            out(Piece::Frame(
                Box::new(Err(DecodeError::Truncated {
                    len: self.segment.len(),
                })),
                self.segment.len() + 1,
            ));
        }
        self.in_frame = false;
        self.segment.clear();
        self.overlong = false;
        self.flush_line(out);
    }

    fn take_text(&mut self, mut text: &[u8], out: &mut dyn FnMut(Piece<'_>)) {
        while !text.is_empty() {
            let room = self.max_line - self.line.len();
            let n = text.len().min(room);
            self.line.extend_from_slice(&text[..n]);
            text = &text[n..];
            if self.line.len() >= self.max_line {
                self.flush_line(out);
            }
        }
    }

    fn flush_line(&mut self, out: &mut dyn FnMut(Piece<'_>)) {
        if !self.line.is_empty() {
            out(Piece::Line(&self.line));
            self.line.clear();
        }
    }

    fn take_segment(&mut self, bytes: &[u8]) {
        if self.overlong {
            return;
        }
        if self.segment.len() + bytes.len() > MAX_WIRE_FRAME {
            self.overlong = true;
            return;
        }
        self.segment.extend_from_slice(bytes);
    }

    /// The closing delimiter of a segment.
    fn end_segment(&mut self, out: &mut dyn FnMut(Piece<'_>)) {
        self.in_frame = false;
        if self.overlong {
            self.overlong = false;
            self.segment.clear();
            out(Piece::Frame(
                Box::new(Err(DecodeError::TooLong {
                    len: MAX_WIRE_FRAME,
                })),
                MAX_WIRE_FRAME,
            ));
            return;
        }
        if self.segment.is_empty() {
            // Two delimiters in a row: the end of one frame and the start
            // of the next were read as an empty frame; the next frame
            // starts here.
            self.in_frame = true;
            return;
        }
        let mut segment = std::mem::take(&mut self.segment);
        let mut wire = Vec::with_capacity(segment.len() + 2);
        wire.push(0);
        wire.extend_from_slice(&segment);
        wire.push(0);
        self.decoder.reset();
        let result = self
            .decoder
            .feed(&wire)
            .last()
            .unwrap_or(Err(DecodeError::Truncated { len: segment.len() }));
        let wire_len = wire.len();
        match result {
            Ok(frame) => out(Piece::Frame(Box::new(Ok(frame)), wire_len)),
            Err(e) => match find(&segment, PREFIX.as_bytes()) {
                // Out of step: a frame cut short, then text from the log
                // prefix on; the delimiter just read opens a frame.
                Some(at) => {
                    if at > 0 {
                        out(Piece::Frame(
                            Box::new(Err(DecodeError::Truncated { len: at })),
                            at + 1,
                        ));
                    }
                    for line in segment[at..].split_inclusive(|&b| b == b'\n') {
                        self.take_text(line, out);
                        if line.ends_with(b"\n") {
                            self.flush_line(out);
                        }
                    }
                    self.in_frame = true;
                }
                None => out(Piece::Frame(Box::new(Err(e)), wire_len)),
            },
        }
        segment.clear();
        self.segment = segment;
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() {
        return None;
    }
    hay.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;
    use protocol::{encode, Event, TraceFormat};

    #[derive(Debug, PartialEq)]
    enum Got {
        Line(String),
        Text(u32, String),
        Bad,
    }

    fn run(demux: &mut LogDemux, chunks: &[&[u8]], end: bool) -> Vec<Got> {
        let mut got = Vec::new();
        let mut out = |p: Piece<'_>| {
            got.push(match p {
                Piece::Line(l) => Got::Line(String::from_utf8_lossy(l).into_owned()),
                Piece::Frame(f, _) => match *f {
                    Ok(Frame {
                        seq,
                        body: protocol::Body::Event(Event::TraceText { text, .. }),
                        ..
                    }) => Got::Text(seq, text),
                    _ => Got::Bad,
                },
            })
        };
        for c in chunks {
            demux.feed(c, &mut out);
        }
        if end {
            demux.finish(&mut out);
        }
        got
    }

    fn frame(seq: u32, text: &str) -> Vec<u8> {
        let mut wire = Vec::new();
        encode(
            &Frame::event(
                seq,
                Event::TraceText {
                    format: TraceFormat::Text,
                    source: 0,
                    lost: 0,
                    text: text.into(),
                },
            ),
            &mut wire,
        )
        .unwrap();
        wire
    }

    #[test]
    fn lines_and_frames_come_apart_in_order_whatever_the_chunks() {
        let mut stream = b"bochs banner\nhvtrace: guest started\n".to_vec();
        stream.extend(frame(0, "a\n"));
        stream.extend(frame(1, "b\nc\n"));
        stream.extend(b"hvtrace: exit counts: CPUID=3\n");
        stream.extend(frame(2, "d\n"));
        stream.extend(b"tail without newline");
        let want = vec![
            Got::Line("bochs banner\n".into()),
            Got::Line("hvtrace: guest started\n".into()),
            Got::Text(0, "a\n".into()),
            Got::Text(1, "b\nc\n".into()),
            Got::Line("hvtrace: exit counts: CPUID=3\n".into()),
            Got::Text(2, "d\n".into()),
            Got::Line("tail without newline".into()),
        ];
        // Whole, a byte at a time, and in every split in two.
        assert_eq!(run(&mut LogDemux::new(1024), &[&stream], true), want);
        let bytes: Vec<&[u8]> = stream.chunks(1).collect();
        assert_eq!(run(&mut LogDemux::new(1024), &bytes, true), want);
        for at in 0..stream.len() {
            let (a, b) = stream.split_at(at);
            assert_eq!(
                run(&mut LogDemux::new(1024), &[a, b], true),
                want,
                "split at {at}"
            );
        }
    }

    #[test]
    fn a_partial_line_before_a_frame_is_ended_by_the_text_after_it() {
        // Another writer's text cut by a frame (the emulator's, not
        // root's, which writes frames between its lines).
        let mut stream = b"half ".to_vec();
        stream.extend(frame(5, "x\n"));
        stream.extend(b"line\n");
        assert_eq!(
            run(&mut LogDemux::new(1024), &[&stream], true),
            vec![Got::Text(5, "x\n".into()), Got::Line("half line\n".into())]
        );
    }

    #[test]
    fn damage_costs_one_frame_and_the_reader_keeps_its_step() {
        let mut bad = frame(1, "lost\n");
        let mid = bad.len() / 2;
        bad[mid] ^= 0x20;
        let mut stream = frame(0, "ok\n");
        stream.extend(&bad);
        stream.extend(b"hvtrace: between\n");
        stream.extend(frame(2, "ok again\n"));
        assert_eq!(
            run(&mut LogDemux::new(1024), &[&stream], true),
            vec![
                Got::Text(0, "ok\n".into()),
                Got::Bad,
                Got::Line("hvtrace: between\n".into()),
                Got::Text(2, "ok again\n".into()),
            ]
        );
    }

    #[test]
    fn a_lost_delimiter_is_recovered_at_the_next_hypervisor_line() {
        // A frame's closing delimiter is lost: the lines after it are read
        // as a frame until the next frame's opening delimiter; they do not
        // decode and hold the log prefix, so the bytes before the prefix
        // are the cut frame, the rest comes back as text, and the next
        // frame is read as one.
        let mut cut = frame(0, "cut\n");
        cut.pop();
        let mut stream = cut;
        stream.extend(b"hvtrace: after the cut\n");
        stream.extend(frame(1, "next\n"));
        stream.extend(b"hvtrace: last\n");
        let got = run(&mut LogDemux::new(1024), &[&stream], true);
        assert_eq!(
            got,
            vec![
                Got::Bad,
                Got::Line("hvtrace: after the cut\n".into()),
                Got::Text(1, "next\n".into()),
                Got::Line("hvtrace: last\n".into()),
            ]
        );
    }

    #[test]
    fn overlong_segments_and_lines_are_bounded() {
        let mut stream = vec![0u8];
        stream.extend(std::iter::repeat_n(b'x', MAX_WIRE_FRAME * 3));
        stream.push(0);
        stream.extend(frame(9, "fine\n"));
        stream.extend(std::iter::repeat_n(b'y', 10));
        stream.push(b'\n');
        let got = run(&mut LogDemux::new(4), &[&stream], true);
        assert_eq!(
            got,
            vec![
                Got::Bad,
                Got::Text(9, "fine\n".into()),
                Got::Line("yyyy".into()),
                Got::Line("yyyy".into()),
                Got::Line("yy\n".into()),
            ]
        );
    }

    #[test]
    fn a_frame_cut_by_the_end_of_the_stream_is_reported() {
        let mut cut = frame(0, "cut\n");
        cut.truncate(cut.len() - 3);
        assert_eq!(run(&mut LogDemux::new(64), &[&cut], true), vec![Got::Bad]);
        assert_eq!(run(&mut LogDemux::new(64), &[&[0u8]], true), vec![]);
    }
}
