//! The control-channel wire format of hvtrace, shared by the hypervisor
//! (`no_std` + `alloc`) and the host CLI (feature `std`).
//!
//! The CLI sends [`Request`]s, the hypervisor answers each with a
//! [`Response`] carrying the same sequence number and streams [`Event`]s in
//! between. All three travel in a [`Frame`], so both ends run the same
//! [`FrameDecoder`].
//!
//! # Layers
//! - **Messages** ([`message`]): plain Rust types, serialized with
//!   [serde](https://serde.rs) and [postcard](https://docs.rs/postcard).
//!   Both are widely used, maintained, `no_std`, and postcard has a
//!   documented, stable wire format: a hand-written serializer would be more
//!   code to get wrong and to keep in step with the types.
//! - **Framing** ([`codec`]): a fixed header (version, sequence number) read
//!   before the body, a CRC-32 ([`crc32`]), COBS ([`cobs`]) and `0x00`
//!   delimiters, so that a receiver is back in step after noise or a cut frame.
//!   These parts are small and are written here.
//! - **Blocking I/O** ([`io`], feature `std`): frame reader and writer over
//!   `std::io`.
//!
//! # Robustness
//! Decoding never panics, whatever the input: the crate denies indexing,
//! `unwrap`, `expect`, `panic!` and unchecked arithmetic outside tests. The
//! decoder's memory is one buffer of [`MAX_FRAME`] + 4 bytes. What a body
//! allocates grows with the bytes the frame really has, never with a length
//! it claims (postcard trusts a length prefix no further than the bytes that
//! remain): at most about 40 heap bytes per body byte, for the largest element
//! type (`ExitCount`), and only the text of strings for a `Request`.
//!
//! # Versioning
//! [`PROTOCOL_VERSION`] names the whole format. A frame of another version
//! fails with [`DecodeError::UnsupportedVersion`]; the hypervisor answers it
//! with [`Response::VersionMismatch`]. See [`message`] for what needs a bump.
#![no_std]
#![cfg_attr(
    not(test),
    deny(
        clippy::indexing_slicing,
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::arithmetic_side_effects,
        clippy::unreachable,
        clippy::todo,
        clippy::unimplemented
    )
)]
#![warn(missing_docs)]

extern crate alloc;

mod bytes;
pub mod cobs;
pub mod codec;
pub mod crc32;
#[cfg(feature = "std")]
pub mod io;
pub mod message;
pub mod ring;

pub use codec::{
    encode, encode_fatal, DecodeError, EncodeError, FrameDecoder, Frames, CRC_LEN, FATAL_SEQ,
    FATAL_WIRE_MAX, HEADER_LEN, MAX_FATAL_REASON, MAX_FRAME, MAX_WIRE_FRAME,
};
pub use message::{
    Body, ChannelReport, CountFilter, CountPage, ErrorKind, Event, ExitCount, Frame, FunctionCount,
    GraphFilter, GraphSessionReport, GuardReport, GuestState, HistFilter, HistKey, HistRow,
    KernelReport, ModulesReport, ProbeInfo, RenderContext, Request, Response, RingAt, RootTime,
    StatusReport, SymbolInfo, SymbolsPart, SyscallField, SyscallInfo, SyscallStruct, TaskInfo,
    TraceChannel, TraceFormat, TracerReport, VcpuReport, LATENCY_BUCKETS, RECORD_CONTINUES,
    RECORD_LEN_MASK, RECORD_MORE,
};

/// The version of the wire format: the frame header, the framing and every
/// message type. Both ends must agree exactly.
pub const PROTOCOL_VERSION: u16 = 20;

#[cfg(test)]
mod tests;
