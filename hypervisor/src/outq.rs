//! Root's output to the control channel: whole frames in two lanes, so
//! that answers overtake the trace stream (see [`OutQueue`]).

use alloc::collections::VecDeque;
use alloc::vec::Vec;

/// Which output queue a frame goes to.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Lane {
    /// Answers to requests.
    Answers,
    /// Unsolicited events (the trace stream).
    Events,
}

/// Root's output to COM2, as whole frames in two lanes. A frame once begun
/// is finished before the next is chosen (the byte stream must stay frame
/// aligned); the next one is an answer if any waits.
#[derive(Default)]
pub struct OutQueue {
    answers: VecDeque<Vec<u8>>,
    events: VecDeque<Vec<u8>>,
    answer_bytes: usize,
    event_bytes: usize,
    current: Vec<u8>,
    sent: usize,
}

impl OutQueue {
    pub fn queued(&self, lane: Lane) -> usize {
        match lane {
            Lane::Answers => self.answer_bytes,
            Lane::Events => self.event_bytes,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.sent >= self.current.len() && self.answers.is_empty() && self.events.is_empty()
    }

    pub fn try_reserve(&mut self, lane: Lane) -> Result<(), alloc::collections::TryReserveError> {
        match lane {
            Lane::Answers => self.answers.try_reserve(1),
            Lane::Events => self.events.try_reserve(1),
        }
    }

    pub fn push(&mut self, lane: Lane, frame: Vec<u8>) {
        match lane {
            Lane::Answers => {
                self.answer_bytes += frame.len();
                self.answers.push_back(frame);
            }
            Lane::Events => {
                self.event_bytes += frame.len();
                self.events.push_back(frame);
            }
        }
    }

    /// Hands bytes to `write` (which returns how many it took) until it
    /// takes none or nothing is left; returns the bytes written.
    pub fn write_to(&mut self, mut write: impl FnMut(&[u8]) -> usize) -> usize {
        let mut total = 0;
        loop {
            if self.sent >= self.current.len() {
                let next = if let Some(f) = self.answers.pop_front() {
                    self.answer_bytes -= f.len();
                    f
                } else if let Some(f) = self.events.pop_front() {
                    self.event_bytes -= f.len();
                    f
                } else {
                    self.current.clear();
                    self.sent = 0;
                    return total;
                };
                self.current = next;
                self.sent = 0;
            }
            // `sent` is within the frame here: a used-up frame was replaced
            // just above and `sent` reset to 0.
            let n = write(self.current.get(self.sent..).unwrap_or(&[]));
            if n == 0 {
                return total;
            }
            self.sent += n;
            total += n;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_overtakes_queued_events_at_the_next_frame_boundary() {
        let mut q = OutQueue::default();
        for i in 0..10u8 {
            q.push(Lane::Events, vec![i; 100]);
        }
        // The UART takes 30 bytes per turn.
        let mut out = Vec::new();
        let turn = |q: &mut OutQueue, out: &mut Vec<u8>| {
            let mut room = 30;
            q.write_to(|b| {
                let n = b.len().min(room);
                room -= n;
                out.extend_from_slice(&b[..n]);
                n
            })
        };
        assert_eq!(turn(&mut q, &mut out), 30);
        q.push(Lane::Answers, vec![0xaa; 10]);
        assert_eq!(q.queued(Lane::Answers), 10);
        assert_eq!(q.queued(Lane::Events), 900);
        // Event 0 finishes (70 more bytes), then the answer goes out.
        while out.len() < 110 {
            turn(&mut q, &mut out);
        }
        assert!(out[..100].iter().all(|&b| b == 0));
        assert_eq!(&out[100..110], &[0xaa; 10]);
        assert_eq!(out[110], 1);
        while !q.is_empty() {
            turn(&mut q, &mut out);
        }
        assert_eq!(out.len(), 1010);
        assert_eq!(q.queued(Lane::Answers) + q.queued(Lane::Events), 0);
    }

    #[test]
    fn a_full_uart_takes_nothing_and_loses_nothing() {
        let mut q = OutQueue::default();
        q.push(Lane::Answers, vec![1, 2, 3]);
        assert_eq!(q.write_to(|_| 0), 0);
        assert!(!q.is_empty());
        let mut got = Vec::new();
        q.write_to(|b| {
            got.extend_from_slice(b);
            b.len()
        });
        assert_eq!(got, vec![1, 2, 3]);
        assert!(q.is_empty());
    }
}
