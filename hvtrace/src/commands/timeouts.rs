//! How long the control commands wait for the supervisor's answer to each
//! kind of request: past the supervisor's own limit for it, so that the
//! supervisor's error reaches the user before a timeout of the command's.
//! The control commands, the trace reader, `graph` and `count` share them.

use std::time::Duration;

use crate::daemon::link::{longest_wait, DEFAULT_TIMEOUT, HOOK_TIMEOUT};

/// How long a status report may take: the hypervisor answers within
/// [`DEFAULT_TIMEOUT`] (stretched by the emulator's pace), or the
/// supervisor says why not before this.
pub const STATUS_TIMEOUT: Duration = longest_wait(DEFAULT_TIMEOUT, Duration::from_secs(30));

/// How long a guest command may take, a little past the supervisor's own
/// limit so that its error arrives first.
pub const EXEC_TIMEOUT: Duration =
    Duration::from_secs(crate::daemon::supervisor::EXEC_TIMEOUT.as_secs() + 30);

/// How long a stop may take.
pub const STOP_TIMEOUT: Duration =
    Duration::from_secs(crate::daemon::supervisor::STOP_TIMEOUT.as_secs() + 30);

/// How long a probe, function or graph request may take: the hypervisor
/// answers within [`HOOK_TIMEOUT`] (stretched by the emulator's pace), or
/// the supervisor says why not before this.
pub const PROBE_TIMEOUT: Duration = longest_wait(HOOK_TIMEOUT, Duration::from_secs(30));
