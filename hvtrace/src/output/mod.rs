//! Output formats and the terminal: JSON, Chrome traces, escaping of guest
//! text.

pub mod chrome;
pub mod json;
pub mod report;
pub mod term;
