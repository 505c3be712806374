//! The requests' side of the control protocol as the commands see it:
//! [`Control`], what answers a request, and [`response_error`], what an
//! answer that is not the one asked for means to the user.
//!
//! Two things answer requests: a client of a VM's control socket
//! (`client::Client`) and a supervisor in this process
//! (`daemon::local::LocalControl`). Both implement [`Control`] on top of
//! this module, which depends on neither of them.

use std::time::Duration;

use anyhow::{anyhow, Result};
use protocol::{Request, Response, PROTOCOL_VERSION};

/// What answers requests: a client of a VM's control socket, or a
/// supervisor in this process. The commands that both `hvtrace run` and
/// the control commands use are written against it.
pub trait Control {
    /// Sends `request` and returns its response, waiting up to `timeout`.
    /// Events that come with the response are left out (the output of an
    /// `Exec` is put back together first).
    fn request(&mut self, request: Request, timeout: Duration) -> Result<Response>;
}

/// Turns a response that is not the expected one into an error.
pub fn response_error(response: Response) -> anyhow::Error {
    match response {
        Response::Error { message, .. } => anyhow!("{}", one_line(&message)),
        Response::VersionMismatch { ours, .. } => mismatch(ours),
        other => anyhow!("unexpected answer: {other:?}"),
    }
}

/// The error for a peer that speaks protocol version `theirs`.
pub(crate) fn mismatch(theirs: u16) -> anyhow::Error {
    anyhow!(
        "protocol version mismatch: the hypervisor speaks version {theirs}, this hvtrace speaks version {PROTOCOL_VERSION} (use the hvtrace that started the VM)"
    )
}

fn one_line(text: &str) -> String {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}
