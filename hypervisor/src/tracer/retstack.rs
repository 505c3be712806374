//! The function-graph return stack: for one guest kernel stack, the calls
//! whose return address VMX root replaced, kept as an array of 64-bit
//! words in the spirit of Linux's fgraph (kernel/trace/fgraph.c, 6.11+).
//!
//! # Word layout
//!
//! The array grows upwards. Each hijacked call pushes a frame, then the
//! data words its graph users asked for, then one tag word on top:
//!
//! ```text
//!   index  word
//!   top-1  TAG   type=FRAME | offset=N | users=bitmap        <- read first on pop
//!   ...    DATA  words of the users that reserved some (each block ends
//!   ...          in its own TAG of type=DATA, user index, offset=size)
//!   b+3    retp      guest address of the hijacked return slot
//!   b+2    calltime  nanoseconds at entry
//!   b+1    func      the traced function
//!   b      ret       the original return address              <- frame start = top-1-N
//! ```
//!
//! A tag word:
//!
//! ```text
//!  63            32 31      28 27                 12 11  10 9           0
//! +----------------+----------+---------------------+------+-------------+
//! |    reserved    |  DEPTH   |   USERS (bitmap)    | TYPE |   OFFSET    |
//! +----------------+----------+---------------------+------+-------------+
//! ```
//!
//! - `OFFSET` (10 bits): words from the tag back to the start of what it
//!   closes (the frame's `ret` for a FRAME tag, the first data word for a
//!   DATA tag).
//! - `TYPE` (2 bits): 0 is never written (a zero word is not a tag), 1 FRAME,
//!   2 DATA.
//! - `USERS` (16 bits): FRAME: the graph users (up to [`MAX_USERS`], e.g.
//!   two sessions with different filters and depths) that want this return.
//!   DATA: the index of the user owning the block, in bits 12..15.
//! - `DEPTH` (4 bits, FRAME only): the frame's nesting depth on this stack,
//!   modulo 16 (a consistency check when popping).
//!
//! # Matching returns
//!
//! A return is matched by `retp`, the guest stack slot that held the
//! return address, never by position alone: tasks sleep inside traced
//! functions and others run, so the hypervisor keeps one array per guest
//! kernel stack (found from `retp` and the stack size), and within one
//! stack the live frames are
//! strictly ordered by `retp` (deeper calls have lower return slots). A
//! frame whose `retp` lies below the current stack pointer of a new call on
//! the same stack can never be returned to (the stack unwound past it
//! without returning, or the task died and its stack was reused): it is
//! dropped and counted ([`RetStack::reclaim_below`]).
//!
//! Equal slots are legal: a tail call (`jmp` to another traced function)
//! enters the callee with the caller's return slot, which already holds the
//! return trampoline. The callee's frame records the trampoline as its
//! return address and sits on top of the caller's; its return pops it and
//! goes back into the trampoline, whose second return pops the caller's.

use alloc::vec::Vec;
use guest_introspect::fallible;

/// Graph users that can share frames.
pub const MAX_USERS: usize = 16;

/// Words of a frame before its data and tag: ret, func, calltime, retp.
pub const FRAME_WORDS: usize = 4;
const RET: usize = 0;
const FUNC: usize = 1;
const CALLTIME: usize = 2;
const RETP: usize = 3;

/// `OFFSET` field of a tag word.
pub const TAG_OFFSET_BITS: u32 = 10;
/// Shift of `OFFSET`.
pub const TAG_OFFSET_SHIFT: u32 = 0;
/// Mask of `OFFSET` (in place).
pub const TAG_OFFSET_MASK: u64 = ((1 << TAG_OFFSET_BITS) - 1) << TAG_OFFSET_SHIFT;
/// `TYPE` field.
pub const TAG_TYPE_BITS: u32 = 2;
/// Shift of `TYPE`.
pub const TAG_TYPE_SHIFT: u32 = TAG_OFFSET_SHIFT + TAG_OFFSET_BITS;
/// Mask of `TYPE` (in place).
pub const TAG_TYPE_MASK: u64 = ((1 << TAG_TYPE_BITS) - 1) << TAG_TYPE_SHIFT;
/// `USERS` field.
pub const TAG_USERS_BITS: u32 = MAX_USERS as u32;
/// Shift of `USERS`.
pub const TAG_USERS_SHIFT: u32 = TAG_TYPE_SHIFT + TAG_TYPE_BITS;
/// Mask of `USERS` (in place).
pub const TAG_USERS_MASK: u64 = ((1 << TAG_USERS_BITS) - 1) << TAG_USERS_SHIFT;
/// `DEPTH` field.
pub const TAG_DEPTH_BITS: u32 = 4;
/// Shift of `DEPTH`.
pub const TAG_DEPTH_SHIFT: u32 = TAG_USERS_SHIFT + TAG_USERS_BITS;
/// Mask of `DEPTH` (in place).
pub const TAG_DEPTH_MASK: u64 = ((1 << TAG_DEPTH_BITS) - 1) << TAG_DEPTH_SHIFT;

/// Largest frame-plus-data a tag can span.
pub const MAX_OFFSET: usize = (1 << TAG_OFFSET_BITS) - 1;

const _: () = assert!(TAG_DEPTH_SHIFT + TAG_DEPTH_BITS == 32);
const _: () = assert!(TAG_OFFSET_MASK & TAG_TYPE_MASK == 0);
const _: () = assert!(TAG_TYPE_MASK & TAG_USERS_MASK == 0);
const _: () = assert!(TAG_USERS_MASK & TAG_DEPTH_MASK == 0);

/// The `TYPE` of a tag word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TagType {
    /// Closes a frame.
    Frame = 1,
    /// Closes one user's data block.
    Data = 2,
}

/// A tag word, decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tag {
    /// Words back to the start of what the tag closes.
    pub offset: usize,
    /// What it closes.
    pub kind: TagType,
    /// FRAME: users bitmap. DATA: the owning user's index.
    pub users: u16,
    /// FRAME: nesting depth modulo 16.
    pub depth: u8,
}

impl Tag {
    /// The word for this tag.
    pub fn encode(self) -> u64 {
        ((self.offset as u64) << TAG_OFFSET_SHIFT) & TAG_OFFSET_MASK
            | ((self.kind as u64) << TAG_TYPE_SHIFT) & TAG_TYPE_MASK
            | (u64::from(self.users) << TAG_USERS_SHIFT) & TAG_USERS_MASK
            | (u64::from(self.depth) << TAG_DEPTH_SHIFT) & TAG_DEPTH_MASK
    }

    /// The tag in `word`, or `None` if it is not one (type 0 or 3, or
    /// reserved bits set).
    pub fn decode(word: u64) -> Option<Tag> {
        if word >> 32 != 0 {
            return None;
        }
        let kind = match (word & TAG_TYPE_MASK) >> TAG_TYPE_SHIFT {
            1 => TagType::Frame,
            2 => TagType::Data,
            _ => return None,
        };
        Some(Tag {
            offset: ((word & TAG_OFFSET_MASK) >> TAG_OFFSET_SHIFT) as usize,
            kind,
            users: ((word & TAG_USERS_MASK) >> TAG_USERS_SHIFT) as u16,
            depth: ((word & TAG_DEPTH_MASK) >> TAG_DEPTH_SHIFT) as u8,
        })
    }
}

/// A frame as popped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// The original return address.
    pub ret: u64,
    /// The traced function.
    pub func: u64,
    /// Entry time, ns.
    pub calltime: u64,
    /// The return slot on the guest stack.
    pub retp: u64,
    /// The users that wanted the return.
    pub users: u16,
    /// Nesting depth on this stack at entry (0 = outermost).
    pub depth: usize,
    /// Data blocks: (user index, words).
    pub data: Vec<(u8, Vec<u64>)>,
    /// The heap had no room to copy the data blocks out: the frame is
    /// popped all the same (its return must go back where it came from),
    /// without them.
    pub data_lost: bool,
}

/// Why a push failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PushError {
    /// Not enough words left: the call is not hijacked (a counted miss).
    Full,
    /// A frame would be out of order: its `retp` is above the current top
    /// frame's (the caller must reclaim first).
    Order,
    /// A data block larger than a tag can span, or a user index >= 16.
    Invalid,
}

/// What a return's `retp` found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PopResult {
    /// The frame for this return (dead frames above it were dropped).
    Found {
        /// The frame.
        frame: Frame,
        /// Frames dropped above it (never returned to).
        dropped: usize,
    },
    /// No frame has this `retp`: the return is not ours.
    NotFound,
}

/// A live frame seen in place ([`RetStack::frames`]).
#[derive(Debug, Clone, Copy)]
pub struct FrameView<'a> {
    /// The original return address.
    pub ret: u64,
    /// The traced function.
    pub func: u64,
    /// The return slot.
    pub retp: u64,
    /// The users that want the return.
    pub users: u16,
    /// The words between the frame's `retp` and its tag: data blocks,
    /// each closed by its DATA tag.
    blocks: &'a [u64],
}

impl<'a> FrameView<'a> {
    /// `user`'s data block, if the frame has one.
    pub fn data(&self, user: u8) -> Option<&'a [u64]> {
        let mut rest = self.blocks;
        while let Some((&word, below)) = rest.split_last() {
            let t = Tag::decode(word)?;
            let first = below.len().checked_sub(t.offset)?;
            if t.kind != TagType::Data {
                return None;
            }
            let (before, block) = below.split_at_checked(first)?;
            if t.users == u16::from(user) {
                return Some(block);
            }
            rest = before;
        }
        None
    }
}

/// Walks the frames of a [`RetStack`] from the top down.
#[derive(Debug, Clone)]
pub struct FrameIter<'a> {
    words: &'a [u64],
    end: usize,
}

impl<'a> Iterator for FrameIter<'a> {
    type Item = FrameView<'a>;

    fn next(&mut self) -> Option<FrameView<'a>> {
        // `end` never passes the array's length; past it there is nothing.
        let (&top, below) = self.words.get(..self.end)?.split_last()?;
        let tag = Tag::decode(top).filter(|t| t.kind == TagType::Frame);
        let Some((rest, w)) = tag
            .and_then(|t| below.len().checked_sub(t.offset))
            .and_then(|start| below.split_at_checked(start))
        else {
            self.end = 0; // not a frame tag: the array is corrupt; stop
            return None;
        };
        let Some((head, blocks)) = w.split_first_chunk::<FRAME_WORDS>() else {
            self.end = 0;
            return None;
        };
        self.end = rest.len();
        Some(FrameView {
            ret: head[RET],
            func: head[FUNC],
            retp: head[RETP],
            users: tag.map_or(0, |t| t.users),
            blocks,
        })
    }
}

/// One guest kernel stack's return stack.
#[derive(Debug, Clone)]
pub struct RetStack {
    words: Vec<u64>,
    cap: usize,
    depth: usize,
}

impl RetStack {
    /// An empty stack of at most `cap_words` words (it grows up to that).
    pub fn new(cap_words: usize) -> Self {
        Self {
            words: Vec::new(),
            cap: cap_words,
            depth: 0,
        }
    }

    /// Live frames.
    pub fn depth(&self) -> usize {
        self.depth
    }

    /// Words in use.
    pub fn used_words(&self) -> usize {
        self.words.len()
    }

    /// Bytes of hypervisor memory this stack holds now.
    pub fn heap_bytes(&self) -> usize {
        self.words.capacity() * 8
    }

    /// Whether no frame is live.
    pub fn is_empty(&self) -> bool {
        self.depth == 0
    }

    /// The raw words, bottom first (for inspection and tests).
    pub fn words(&self) -> &[u64] {
        &self.words
    }

    fn top_tag(&self) -> Option<(usize, Tag)> {
        let i = self.words.len().checked_sub(1)?;
        Some((i, Tag::decode(*self.words.last()?)?))
    }

    /// The top frame's `retp`, if any.
    pub fn top_retp(&self) -> Option<u64> {
        let (i, t) = self.top_tag()?;
        let start = i.checked_sub(t.offset)?;
        self.words.get(start + RETP).copied()
    }

    /// Pushes a frame with per-user `data` blocks; returns its depth.
    pub fn push(
        &mut self,
        ret: u64,
        func: u64,
        calltime: u64,
        retp: u64,
        users: u16,
        data: &[(u8, &[u64])],
    ) -> Result<usize, PushError> {
        if let Some(top) = self.top_retp() {
            // Equal slots are a tail call: the callee returns through the
            // caller's (already hijacked) slot, and both frames pop there.
            if retp > top {
                return Err(PushError::Order);
            }
        }
        let mut need = FRAME_WORDS + 1;
        for (user, block) in data {
            if usize::from(*user) >= MAX_USERS || block.len() + 1 > MAX_OFFSET {
                return Err(PushError::Invalid);
            }
            need += block.len() + 1;
        }
        if need - 1 > MAX_OFFSET {
            return Err(PushError::Invalid);
        }
        if self.words.len() + need > self.cap {
            return Err(PushError::Full);
        }
        // Grow by doubling up to the cap; an allocation failure is a full
        // stack (a miss), never an abort.
        if self.words.len() + need > self.words.capacity() {
            let want = (self.words.capacity() * 2)
                .max(self.words.len() + need)
                .max(8)
                .min(self.cap);
            if self
                .words
                .try_reserve_exact(want - self.words.len())
                .is_err()
            {
                return Err(PushError::Full);
            }
        }
        let start = self.words.len();
        self.words.extend_from_slice(&[ret, func, calltime, retp]);
        for (user, block) in data {
            self.words.extend_from_slice(block);
            self.words.push(
                Tag {
                    offset: block.len(),
                    kind: TagType::Data,
                    users: u16::from(*user),
                    depth: 0,
                }
                .encode(),
            );
        }
        let depth = self.depth;
        self.words.push(
            Tag {
                offset: self.words.len() - start,
                kind: TagType::Frame,
                users,
                depth: (depth % 16) as u8,
            }
            .encode(),
        );
        self.depth += 1;
        Ok(depth)
    }

    /// Removes the top frame.
    fn pop_top(&mut self) -> Option<Frame> {
        let (i, tag) = self.top_tag()?;
        if tag.kind != TagType::Frame {
            return None;
        }
        let start = i.checked_sub(tag.offset)?;
        // The frame's words below its tag: the frame, then its data blocks.
        let (head, blocks) = self
            .words
            .get(start..i)?
            .split_first_chunk::<FRAME_WORDS>()?;
        let mut data = Vec::new();
        let mut data_lost = false;
        // Data blocks, walked down from just below the frame tag. Their
        // copies are the one allocation of a return: it may fail (the heap
        // is root's, its size follows the guest's calls), and then the
        // frame goes without them.
        let mut rest = blocks;
        while let Some((&word, below)) = rest.split_last() {
            let t = Tag::decode(word)?;
            if t.kind != TagType::Data {
                return None;
            }
            let first = below.len().checked_sub(t.offset)?;
            let (before, block) = below.split_at_checked(first)?;
            if !data_lost {
                let copied = fallible::try_with_capacity(block.len()).and_then(|mut words| {
                    words.extend_from_slice(block);
                    fallible::try_push(&mut data, (t.users as u8, words))
                });
                if copied.is_err() {
                    data = Vec::new();
                    data_lost = true;
                }
            }
            rest = before;
        }
        data.reverse();
        let frame = Frame {
            ret: head[RET],
            func: head[FUNC],
            calltime: head[CALLTIME],
            retp: head[RETP],
            users: tag.users,
            depth: self.depth - 1,
            data,
            data_lost,
        };
        self.words.truncate(start);
        self.depth -= 1;
        Some(frame)
    }

    /// Removes the top frame without reading it (nothing is allocated).
    fn drop_top(&mut self) -> bool {
        let Some((i, tag)) = self.top_tag() else {
            return false;
        };
        let Some(start) = i.checked_sub(tag.offset) else {
            return false;
        };
        if tag.kind != TagType::Frame || start + FRAME_WORDS > i {
            return false;
        }
        self.words.truncate(start);
        self.depth = self.depth.saturating_sub(1);
        true
    }

    /// Drops frames whose return slot lies below `sp` (a call on this stack
    /// with stack pointer `sp` proves they can never be returned to).
    /// Returns how many were dropped.
    pub fn reclaim_below(&mut self, sp: u64) -> usize {
        let mut n = 0;
        while self.top_retp().is_some_and(|r| r < sp) {
            if !self.drop_top() {
                break;
            }
            n += 1;
        }
        n
    }

    /// The frame of the return through slot `retp`.
    pub fn pop(&mut self, retp: u64) -> PopResult {
        // Live frames are ordered by retp, lowest on top; a return through
        // `retp` means every frame with a lower slot is dead.
        let Some(top) = self.top_retp() else {
            return PopResult::NotFound;
        };
        if top > retp {
            return PopResult::NotFound;
        }
        let dropped = self.reclaim_below(retp);
        match self.top_retp() {
            Some(r) if r == retp => match self.pop_top() {
                Some(frame) => PopResult::Found { frame, dropped },
                None => PopResult::NotFound,
            },
            _ => PopResult::NotFound,
        }
    }

    /// Takes the users in `mask` off every frame, in place: their frames
    /// stay (the returns must still pop them) but no longer count for
    /// them. Returns how many frames had one of those users.
    pub fn clear_users(&mut self, mask: u16) -> usize {
        let mut n = 0;
        let mut end = self.words.len();
        while let Some(i) = end.checked_sub(1) {
            let Some(word) = self.words.get_mut(i) else {
                break;
            };
            let Some(mut tag) = Tag::decode(*word).filter(|t| t.kind == TagType::Frame) else {
                break;
            };
            let Some(start) = i.checked_sub(tag.offset) else {
                break;
            };
            if tag.users & mask != 0 {
                n += 1;
                tag.users &= !mask;
                *word = tag.encode();
            }
            end = start;
        }
        n
    }

    /// The live frames, top (deepest) first, without popping them.
    pub fn frames(&self) -> FrameIter<'_> {
        FrameIter {
            words: &self.words,
            end: self.words.len(),
        }
    }

    /// How many live frames carry `user`'s bit, and whether one of them
    /// holds a data block of `user` whose first word is `mark` (a graph
    /// session marks the frames of its `set_graph_notrace` functions so).
    pub fn user_view(&self, user: u8, mark: u64) -> (usize, bool) {
        let bit = 1u16 << (user as u32 % MAX_USERS as u32);
        let mut depth = 0;
        let mut marked = false;
        for f in self.frames() {
            if f.users & bit != 0 {
                depth += 1;
                marked |= f.data(user).is_some_and(|d| d.first() == Some(&mark));
            }
        }
        (depth, marked)
    }

    /// Releases the memory of an empty stack.
    pub fn shrink(&mut self) {
        if self.words.is_empty() {
            self.words = Vec::new();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::vec;

    const STACK: u64 = 0xffff_c900_0040_4000;

    #[test]
    fn tag_fields_round_trip_and_do_not_overlap() {
        for offset in [0usize, 1, 4, 5, 511, MAX_OFFSET] {
            for kind in [TagType::Frame, TagType::Data] {
                for users in [0u16, 1, 0x8001, 0xffff] {
                    for depth in [0u8, 7, 15] {
                        let t = Tag {
                            offset,
                            kind,
                            users,
                            depth,
                        };
                        let w = t.encode();
                        assert_eq!(Tag::decode(w), Some(t), "{w:#x}");
                        assert_eq!(w >> 32, 0);
                    }
                }
            }
        }
        // Field by field, by hand.
        let w = Tag {
            offset: 4,
            kind: TagType::Frame,
            users: 0b101,
            depth: 3,
        }
        .encode();
        assert_eq!(w, 4 | (1 << 10) | (0b101 << 12) | (3 << 28));
        // Zero and type 3 are not tags; neither are high bits.
        assert_eq!(Tag::decode(0), None);
        assert_eq!(Tag::decode(3 << TAG_TYPE_SHIFT), None);
        assert_eq!(Tag::decode(w | 1 << 40), None);
    }

    #[test]
    fn the_word_layout_is_as_documented() {
        let mut s = RetStack::new(64);
        s.push(
            0x1111,
            0x2222,
            0x3333,
            STACK - 8,
            0b11,
            &[(5, &[0xaa, 0xbb])],
        )
        .unwrap();
        let w = s.words();
        assert_eq!(&w[..4], &[0x1111, 0x2222, 0x3333, STACK - 8]);
        assert_eq!(&w[4..6], &[0xaa, 0xbb]);
        assert_eq!(
            Tag::decode(w[6]),
            Some(Tag {
                offset: 2,
                kind: TagType::Data,
                users: 5,
                depth: 0
            })
        );
        assert_eq!(
            Tag::decode(w[7]),
            Some(Tag {
                offset: 7,
                kind: TagType::Frame,
                users: 0b11,
                depth: 0
            })
        );
        assert_eq!(s.used_words(), 8);
    }

    #[test]
    fn nested_calls_return_in_order_with_their_data() {
        let mut s = RetStack::new(256);
        // Three nested calls: deeper calls have lower return slots.
        for d in 0..3u64 {
            let data: &[(u8, &[u64])] = if d == 1 { &[(0, &[d * 10])] } else { &[] };
            let depth = s
                .push(
                    0x100 + d,
                    0x200 + d,
                    1000 + d,
                    STACK - 64 * (d + 1),
                    1,
                    data,
                )
                .unwrap();
            assert_eq!(depth, d as usize);
        }
        for d in (0..3u64).rev() {
            match s.pop(STACK - 64 * (d + 1)) {
                PopResult::Found { frame, dropped } => {
                    assert_eq!(dropped, 0);
                    assert_eq!(
                        (frame.ret, frame.func, frame.calltime, frame.depth),
                        (0x100 + d, 0x200 + d, 1000 + d, d as usize)
                    );
                    if d == 1 {
                        assert_eq!(frame.data, vec![(0, vec![10])]);
                    } else {
                        assert!(frame.data.is_empty());
                    }
                }
                other => panic!("{other:?}"),
            }
        }
        assert!(s.is_empty());
        assert_eq!(s.used_words(), 0);
    }

    #[test]
    fn a_full_stack_refuses_and_stays_consistent() {
        // Room for exactly two plain frames (5 words each).
        let mut s = RetStack::new(10);
        s.push(1, 1, 1, STACK - 8, 1, &[]).unwrap();
        s.push(2, 2, 2, STACK - 16, 1, &[]).unwrap();
        assert_eq!(s.push(3, 3, 3, STACK - 24, 1, &[]), Err(PushError::Full));
        assert_eq!(s.depth(), 2);
        assert!(matches!(s.pop(STACK - 16), PopResult::Found { .. }));
        // The refused call returns through its own slot: not ours.
        assert_eq!(s.pop(STACK - 24), PopResult::NotFound);
        assert!(matches!(s.pop(STACK - 8), PopResult::Found { .. }));
    }

    #[test]
    fn a_tail_call_shares_the_slot_and_pops_twice() {
        const TRAMP: u64 = 0xffff_ffff_bfe0_0400;
        let mut s = RetStack::new(64);
        s.push(0x1234, 0xa, 1, STACK - 64, 1, &[]).unwrap();
        // The callee of a tail call finds the trampoline in the slot.
        assert_eq!(s.push(TRAMP, 0xb, 2, STACK - 64, 1, &[]), Ok(1));
        match s.pop(STACK - 64) {
            PopResult::Found { frame, dropped: 0 } => {
                assert_eq!((frame.func, frame.ret), (0xb, TRAMP))
            }
            other => panic!("{other:?}"),
        }
        match s.pop(STACK - 64) {
            PopResult::Found { frame, dropped: 0 } => {
                assert_eq!((frame.func, frame.ret), (0xa, 0x1234))
            }
            other => panic!("{other:?}"),
        }
        assert!(s.is_empty());
    }

    #[test]
    fn out_of_order_and_invalid_pushes_are_refused() {
        let mut s = RetStack::new(64);
        s.push(1, 1, 1, STACK - 64, 1, &[]).unwrap();
        assert_eq!(s.push(2, 2, 2, STACK - 8, 1, &[]), Err(PushError::Order));
        assert_eq!(
            s.push(2, 2, 2, STACK - 128, 1, &[(16, &[1])]),
            Err(PushError::Invalid)
        );
        assert_eq!(s.depth(), 1);
    }

    #[test]
    fn frames_skipped_by_an_unwind_are_dropped_on_the_next_return() {
        let mut s = RetStack::new(64);
        s.push(1, 1, 1, STACK - 8, 1, &[]).unwrap();
        s.push(2, 2, 2, STACK - 200, 1, &[]).unwrap();
        s.push(3, 3, 3, STACK - 300, 1, &[]).unwrap();
        // The outer function returns; the two inner never did.
        match s.pop(STACK - 8) {
            PopResult::Found { frame, dropped } => {
                assert_eq!((frame.ret, dropped), (1, 2));
            }
            other => panic!("{other:?}"),
        }
        assert!(s.is_empty());
    }

    #[test]
    fn a_new_call_reclaims_frames_below_its_stack_pointer() {
        let mut s = RetStack::new(64);
        s.push(1, 1, 1, STACK - 100, 1, &[]).unwrap();
        s.push(2, 2, 2, STACK - 200, 1, &[]).unwrap();
        // The task died; its stack was reused by a call whose return slot is
        // at STACK - 150: the frame at -200 is dead, the one at -100 may live.
        assert_eq!(s.reclaim_below(STACK - 150), 1);
        assert_eq!(s.depth(), 1);
        s.push(4, 4, 4, STACK - 150, 1, &[]).unwrap();
        assert!(matches!(s.pop(STACK - 150), PopResult::Found { .. }));
    }

    #[test]
    fn reclaiming_frames_with_data_keeps_the_live_frames_data() {
        let mut s = RetStack::new(128);
        s.push(1, 1, 1, STACK - 100, 1, &[(0, &[41, 42])]).unwrap();
        s.push(2, 2, 2, STACK - 200, 1, &[(0, &[7]), (1, &[8, 9])])
            .unwrap();
        s.push(3, 3, 3, STACK - 300, 1, &[(2, &[5])]).unwrap();
        // Two dead frames with data blocks go without being read.
        assert_eq!(s.reclaim_below(STACK - 150), 2);
        assert_eq!(s.depth(), 1);
        match s.pop(STACK - 100) {
            PopResult::Found { frame, dropped } => {
                assert_eq!((frame.ret, dropped, frame.data_lost), (1, 0, false));
                assert_eq!(frame.data, vec![(0, vec![41, 42])]);
            }
            other => panic!("{other:?}"),
        }
        assert!(s.is_empty());
    }

    #[test]
    fn frames_walk_top_down_and_users_see_their_own_depth() {
        let mut st = RetStack::new(256);
        let b = STACK + 0x3f00;
        // user 1 and 2 on the outer call, user 2 alone on the middle one
        // (with a mark block), both on the inner one with user 0 data.
        st.push(0xa, 0xf1, 1, b, 0b110, &[]).unwrap();
        st.push(0xb, 0xf2, 2, b - 0x40, 0b100, &[(2, &[0x77])])
            .unwrap();
        st.push(0xc, 0xf3, 3, b - 0x80, 0b111, &[(0, &[5, 6]), (1, &[9])])
            .unwrap();
        let f: Vec<_> = st.frames().collect();
        assert_eq!(f.len(), 3);
        assert_eq!((f[0].func, f[0].retp, f[0].users), (0xf3, b - 0x80, 0b111));
        assert_eq!(f[0].data(0), Some(&[5u64, 6][..]));
        assert_eq!(f[0].data(1), Some(&[9u64][..]));
        assert_eq!(f[0].data(2), None);
        assert_eq!(f[1].data(2), Some(&[0x77u64][..]));
        assert_eq!((f[2].func, f[2].ret), (0xf1, 0xa));
        assert_eq!(st.user_view(0, 0x77), (1, false));
        assert_eq!(st.user_view(1, 0x77), (2, false));
        assert_eq!(st.user_view(2, 0x77), (3, true));
        assert_eq!(st.user_view(3, 0x77), (0, false));
        // Popping the middle frame's mark away: user 2 is unmarked again.
        assert!(matches!(st.pop(b - 0x80), PopResult::Found { .. }));
        assert!(matches!(st.pop(b - 0x40), PopResult::Found { .. }));
        assert_eq!(st.user_view(2, 0x77), (1, false));
        assert_eq!(st.frames().count(), 1);
    }

    #[test]
    fn cleared_users_no_longer_see_their_frames_which_still_pop() {
        let mut st = RetStack::new(64);
        let b = STACK + 0x3f00;
        st.push(0xa, 0xf1, 1, b, 0b110, &[(2, &[0x77])]).unwrap();
        st.push(0xb, 0xf2, 2, b - 0x40, 0b010, &[]).unwrap();
        assert_eq!(st.clear_users(0b100), 1);
        assert_eq!(st.user_view(2, 0x77), (0, false));
        assert_eq!(st.user_view(1, 0x77), (2, false));
        assert_eq!(st.clear_users(0b010), 2);
        assert_eq!(st.frames().map(|f| f.users).collect::<Vec<_>>(), [0, 0]);
        let PopResult::Found { frame, .. } = st.pop(b - 0x40) else {
            panic!("top frame lost")
        };
        assert_eq!((frame.ret, frame.users), (0xb, 0));
        assert!(matches!(st.pop(b), PopResult::Found { .. }));
        assert!(st.is_empty());
    }

    #[test]
    fn growth_stays_within_the_cap() {
        let mut st = RetStack::new(3 * (FRAME_WORDS + 1));
        let b = STACK + 0x3f00;
        for i in 0..3 {
            st.push(i, i, i, b - i * 0x40, 1, &[]).unwrap();
            assert!(st.heap_bytes() <= 3 * (FRAME_WORDS + 1) * 8);
        }
        assert_eq!(st.push(9, 9, 9, b - 0x200, 1, &[]), Err(PushError::Full));
        assert_eq!(st.heap_bytes(), 3 * (FRAME_WORDS + 1) * 8);
    }

    #[test]
    fn a_return_above_every_frame_is_not_ours() {
        let mut s = RetStack::new(64);
        s.push(1, 1, 1, STACK - 100, 1, &[]).unwrap();
        assert_eq!(s.pop(STACK - 400), PopResult::NotFound);
        assert_eq!(s.depth(), 1, "a lower slot must not drop live frames");
    }
}
