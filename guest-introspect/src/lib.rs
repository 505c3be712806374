//! Guest introspection: memory, page walk, kallsyms (filled in by the introspection issue).
#![no_std]
