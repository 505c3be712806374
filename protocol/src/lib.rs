//! Control-channel wire format (filled in by the control-channel issue).
#![no_std]
