//! kprobe_events-style probes: spec parsing, fetch-argument evaluation and
//! trace_pipe rendering (filled in by the kprobe issue).
