//! The trace.dat file, version 6 (trace-cmd's `trace-cmd.dat.v6(5)`): the
//! initial format, the header texts, the ftrace and other event formats,
//! kallsyms, the (empty) printk formats, the saved cmdlines, the CPU count,
//! an options block (the trace clock and the CPU count), and the
//! flyrecord section: per CPU an offset and a size, then each CPU's pages,
//! page-aligned. Little-endian, 8-byte longs, 4 KiB pages.

use std::collections::BTreeMap;
use std::io::{self, Write};

use super::format::{self, EventFormat};
use super::page::PAGE_SIZE;

/// The option ids this writer uses (trace-cmd's `TRACECMD_OPTION_*`).
pub const OPTION_DONE: u16 = 0;
/// The trace clock (the text of tracefs' `trace_clock`).
pub const OPTION_TRACECLOCK: u16 = 4;
/// The CPU count (a `u32`).
pub const OPTION_CPUCOUNT: u16 = 8;

/// The trace clock's text: root's clock counts nanoseconds, as `local`
/// does, so readers print seconds.
pub const TRACE_CLOCK: &str = "[local] global\n";

/// What a file holds besides its pages.
#[derive(Debug, Default)]
pub struct Header {
    /// Every event format (the `ftrace` system's go in their own section).
    pub formats: Vec<EventFormat>,
    /// `/proc/kallsyms`' text.
    pub kallsyms: String,
    /// Task names by pid (saved_cmdlines).
    pub cmdlines: BTreeMap<i32, String>,
}

/// Writes a trace.dat with `header` and one page run per CPU (`cpus[i]`
/// is CPU i's pages, whole pages). Returns the bytes written.
pub fn write(out: &mut dyn Write, header: &Header, cpus: &[Vec<u8>]) -> io::Result<u64> {
    let mut w = Counting { out, at: 0 };
    w.put(b"\x17\x08\x44tracing6\0")?;
    w.put(&[0, 8])?; // little-endian, 8-byte longs
    w.put(&(PAGE_SIZE as u32).to_le_bytes())?;

    w.put(b"header_page\0")?;
    let page = format::header_page();
    w.put(&(page.len() as u64).to_le_bytes())?;
    w.put(page.as_bytes())?;
    w.put(b"header_event\0")?;
    let event = format::header_event();
    w.put(&(event.len() as u64).to_le_bytes())?;
    w.put(event.as_bytes())?;

    let ftrace: Vec<&EventFormat> = header
        .formats
        .iter()
        .filter(|f| f.system == "ftrace")
        .collect();
    w.put(&(ftrace.len() as u32).to_le_bytes())?;
    for f in ftrace {
        w.text8(&f.text())?;
    }
    let mut systems: BTreeMap<&str, Vec<&EventFormat>> = BTreeMap::new();
    for f in header.formats.iter().filter(|f| f.system != "ftrace") {
        systems.entry(&f.system).or_default().push(f);
    }
    w.put(&(systems.len() as u32).to_le_bytes())?;
    for (system, events) in &systems {
        w.put(system.as_bytes())?;
        w.put(&[0])?;
        w.put(&(events.len() as u32).to_le_bytes())?;
        for f in events {
            w.text8(&f.text())?;
        }
    }

    let kallsyms = header.kallsyms.as_bytes();
    let len = u32::try_from(kallsyms.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "kallsyms over 4 GiB"))?;
    w.put(&len.to_le_bytes())?;
    w.put(kallsyms)?;
    w.put(&0u32.to_le_bytes())?; // printk formats: none

    let mut cmdlines = String::new();
    for (pid, comm) in &header.cmdlines {
        cmdlines.push_str(&format!("{pid} {comm}\n"));
    }
    w.text8(&cmdlines)?;

    let ncpus = cpus.len() as u32;
    w.put(&ncpus.to_le_bytes())?;
    w.put(b"options  \0")?;
    w.option(OPTION_TRACECLOCK, TRACE_CLOCK.as_bytes())?;
    w.option(OPTION_CPUCOUNT, &ncpus.to_le_bytes())?;
    w.put(&OPTION_DONE.to_le_bytes())?;

    w.put(b"flyrecord\0")?;
    let table_end = w.at + 16 * cpus.len() as u64;
    let mut at = table_end.div_ceil(PAGE_SIZE as u64) * PAGE_SIZE as u64;
    for pages in cpus {
        w.put(&at.to_le_bytes())?;
        w.put(&(pages.len() as u64).to_le_bytes())?;
        at += pages.len() as u64;
    }
    let pad = table_end.div_ceil(PAGE_SIZE as u64) * PAGE_SIZE as u64 - w.at;
    w.put(&vec![0; pad as usize])?;
    for pages in cpus {
        w.put(pages)?;
    }
    w.out.flush()?;
    Ok(w.at)
}

/// A writer that knows its offset.
struct Counting<'a> {
    out: &'a mut dyn Write,
    at: u64,
}

impl Counting<'_> {
    fn put(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.out.write_all(bytes)?;
        self.at += bytes.len() as u64;
        Ok(())
    }

    /// A text with its size as a `u64` before it.
    fn text8(&mut self, text: &str) -> io::Result<()> {
        self.put(&(text.len() as u64).to_le_bytes())?;
        self.put(text.as_bytes())
    }

    fn option(&mut self, id: u16, data: &[u8]) -> io::Result<()> {
        self.put(&id.to_le_bytes())?;
        self.put(&(data.len() as u32).to_le_bytes())?;
        self.put(data)
    }
}
