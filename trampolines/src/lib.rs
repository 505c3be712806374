//! Entry and return trampolines (filled in by the kprobe issue).
#![no_std]
