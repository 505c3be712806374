//! kprobe_events-style probes: spec parsing, fetch-argument evaluation,
//! the binary event record, and trace_pipe / JSON rendering.
//!
//! The syntax, defaults, limits and output are those of the Linux kernel's
//! `kprobe_events` (Documentation/trace/kprobetrace.rst; the code in
//! kernel/trace/trace_kprobe.c and trace_probe.c, as of 6.1 and 6.12), for
//! probes at a function's entry (its fentry site) and, parsed for the
//! function-graph work, at its return.
//!
//! # Flow
//!
//! 1. [`parse`] turns a line into a [`Command`]: a [`ProbeSpec`] to add or
//!    a [`DeleteSpec`]. A refusal is a [`ParseError`] that names the token
//!    and its column; [`ParseError::caret`] draws the kernel-style caret.
//! 2. [`ProbeSpec::resolve_symbols`] looks `@SYM` up once, at probe add.
//! 3. On a hit, VMX root calls [`fetch`] over the trampoline's
//!    [`trampolines::PtRegs`], a [`GuestMem`] (the guest page walker) and
//!    a [`SymbolResolver`], and stores a [`RawEvent`] with
//!    [`RawEvent::encode_into`] in the vCPU's ring.
//! 4. The host decodes with [`RawEvent::decode`] and renders with
//!    [`text_line`] (trace_pipe) or [`json_line`].
//!
//! # Syntax
//!
//! ```text
//! p[:[GRP/|GRP.][EVENT]] SYM[+0] [FETCHARGS]            entry probe
//! r[MAXACTIVE][:[GRP/|GRP.][EVENT]] SYM[+0] [FETCHARGS]  return probe
//! p[:[GRP/][EVENT]] SYM[+0]%return [FETCHARGS]           return probe
//! -:[GRP/][EVENT]                                        delete
//! ```
//!
//! - GRP defaults to `kprobes`; EVENT to `p_SYM_0` / `r_SYM_0` (with `.`
//!   made `_`, cut to 63 characters). Both must be C identifiers (GRP may
//!   contain `-`) shorter than 64 characters. MAXACTIVE is 1..=4096.
//! - `SYM+N` with N != 0 is refused: "only function entry can be probed".
//! - Up to 128 FETCHARGS, each `[NAME=]FETCHARG[:TYPE]`, the part after
//!   `NAME=` at most 63 characters, NAME a C identifier of at most 32
//!   characters, unique and not a reserved field name. Unnamed arguments
//!   are `arg1`, `arg2`, ... by position.
//!
//! | FETCHARG | value |
//! |---|---|
//! | `%REG` | a pt_regs register: `ax bx cx dx si di bp sp ip flags cs ss orig_ax r8`..`r15` (the kernel's names; `%rax` is refused with a hint) |
//! | `@ADDR` | the memory at ADDR |
//! | `@SYM`, `@SYM+OFF`, `@SYM-OFF` | the memory at a symbol (plus offset) |
//! | `$stack` | the stack pointer |
//! | `$stackN` | the N-th long at `sp + 8*N` (0..=2048; `$stack0` is the return address) |
//! | `$argN` | argument N (1..=2048): di, si, dx, cx, r8, r9, then the stack above the return address (entry probes only) |
//! | `$retval` | `ax` (return probes only) |
//! | `$comm`, `$COMM` | the current task's name (type `string` only) |
//! | `\IMM` | an immediate: decimal, `0x` hex, `0` octal, `-`/`+` signed |
//! | `\"TEXT"` | an immediate string (type `string` only) |
//! | `+OFFS(FETCHARG)`, `-OFFS(...)` | the memory at FETCHARG + OFFS, nested up to the kernel's limit (14 levels below a register) |
//! | `+uOFFS(...)`, `-uOFFS(...)` | the same, from user memory |
//!
//! | TYPE | printed as |
//! |---|---|
//! | `u8 u16 u32 u64` | unsigned decimal |
//! | `s8 s16 s32 s64` | signed decimal |
//! | `x8 x16 x32 x64` | `0x` hex (`x64` is the default) |
//! | `char` | `'c'` |
//! | `string` | `"text"`, read from kernel memory (user addresses as user memory) |
//! | `ustring` | `"text"`, read from user memory |
//! | `symbol` | `sym+0xoff/0xsize` |
//! | `symstr` | `"sym+0xoff/0xsize"` |
//! | `b<W>@<S>/<C>` | a W-bit field at bit S of a C-bit container, unsigned decimal |
//! | `%pd`, `%pD` | the name of the `struct dentry *` / `struct file *` the value is (a string) |
//!
//! # BTF arguments
//!
//! A spec that names parameters, members, `$arg*` or `%pd`/`%pD` is
//! resolved once, at probe add, against the running guest's BTF
//! ([`resolve_btf`]; a module's function through the module's split BTF).
//! Without a written type the value's BTF type decides: integers by width
//! and sign, an enum as `s32` (`s64` for a 64-bit enum), a pointer as
//! `x64`, a bitfield by shift and mask, anything else `x64`. `:string` and
//! `:ustring` need `char[]` (read in place) or `char *` (dereferenced).
//! A dereference written around a BTF variable (`+8(file)`) drops its
//! type. Refusals (an unknown member, `.` through a pointer, a string type
//! on a non-string, `void` `$retval`) name the token, as parse errors do.
//!
//! A value whose memory cannot be read prints `(fault)`. Strings are read
//! up to the kernel's `MAX_STRING_SIZE` ([`MAX_STRING_SIZE`], 4096 bytes
//! with the terminator).
//!
//! # Deviations from Linux
//!
//! - Only function entry (and, parsed, return): no `SYM+N`, no raw
//!   addresses, no `MOD:SYM`; `SYM+4` on an `endbr64` function, which
//!   Linux takes as the entry, is refused too.
//! - Not supported: array types (`:x8[4]`) and uprobe file offsets
//!   (`@+OFFS`, which kprobes refuse as well).
//! - `$argN` at a return probe and BTF arguments exist in 6.9+ kernels
//!   (BTF arguments from 6.5); we take them on every kernel with BTF.
//! - `$argN->member` is ours (the kernel takes member chains only from a
//!   parameter's name or `$retval`); a bare `$argN` stays `x64`, as in the
//!   kernel, so that the same spec prints the same values.
//! - A BTF bitfield is read from the bytes of its type (the kernel reads
//!   8 bytes and may keep bits of the next member when a field crosses its
//!   type's width).
//! - A failed read of a numeric, `symbol` or `symstr` value prints
//!   `(fault)`; the kernel prints whatever was in its ring buffer then
//!   (only strings get `(fault)` there).
//! - Stricter: text after the closing `)` of a dereference, after
//!   `-:EVENT`, or after `p`/`r` other than MAXACTIVE and `:...` is refused
//!   (the kernel ignores it), and `$retval` must be spelled exactly (6.12
//!   takes any `$retval...`).
//! - Error positions are byte offsets in the spec as written, not in the
//!   kernel's re-joined command, and messages are our own wording.
//! - trace_pipe lines have no `irq-info` column (as with the kernel's
//!   `noirq-info` option); strings print invalid UTF-8 as U+FFFD.
//! - The probe location prints the event header's `ip`. The fentry site
//!   sits where the kernel puts its own kprobe on the function: `SYM+0`,
//!   or `SYM+4` behind an `endbr64` (IBT kernels), so the two agree.

mod btf;
mod event;
mod fetch;
mod index;
pub mod json;
mod num;
mod parse;
mod render;
mod spec;

pub use btf::{needs_btf, resolve_btf};
pub use event::{
    encode_parts, encoded_len, DecodeError, EventHeader, RawEvent, EVENT_VERSION, HEADER_LEN,
    TIMESTAMP_AT,
};
pub use fetch::{
    fetch, fetch_one, try_fetch, try_fetch_into, worst_case_bytes, FetchContext, FetchedValue,
    GuestLayout, GuestMem, MemFault, NoSymbols, SymbolAt, SymbolResolver, MAX_STRING_SIZE,
    TASK_COMM_LEN,
};
pub use index::IndexSymbols;
pub use parse::{parse, parse_probe, ParseError, ParseErrorKind};
pub use render::{
    json_line, push_lossy, report_state, state_letter, state_of_letter, text_line,
    write_function_json, write_function_text, write_json, write_switch_json, write_switch_text,
    write_symbol, write_text, write_value, write_wakeup_json, write_wakeup_text, SwitchValues,
    WakeupValues, FAULT_STRING,
};
pub use spec::*;

#[cfg(test)]
mod tests;
