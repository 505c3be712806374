//! The fuzzing guest: a bare-metal x86-64 program booted as Linux is.
//!
//! The boot CPU reads its command line and e820 from `boot_params`, starts
//! the other vCPUs, and every vCPU then runs its own seeded stream of
//! operations (`fuzz_guest::ops`), digesting the outcomes per window and
//! printing the digests on COM1:
//!
//! ```text
//! fuzz: start seed=S ops=N cpus=C window=W
//! fuzz: e820 <digest> <entries>
//! fuzz: win <cpu> <window> <main digest> [<class>=<digest> ...]
//! fuzz: op <cpu> <index> <op> => <outcome>      (fuzz.log=K only)
//! fuzz: done <cpu> ops=N nmis=.. irqs=.. stray=.. rescued=..
//! fuzz: end
//! ```
#![no_std]
#![no_main]

mod apic;
mod boot;
mod exec;
mod hooked;
mod percpu;
mod run;
mod serial;
mod traps;

use core::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use fuzz_guest::cmdline::{self, Params};
use fuzz_guest::digest::Digest;
use fuzz_guest::known::{self, Env, CLASSES};
use fuzz_guest::ops::{self, Shape};
use fuzz_guest::query::{self, Query};
use fuzz_guest::rng::Rng;

pub use fuzz_guest::MAX_CPUS;

/// The parameters, written by the boot CPU before any AP starts.
static mut PARAMS: Params = Params::BASE;

/// Set once the boot CPU may start its stream (in tracer mode, once the
/// host said go); the APs wait for it too.
static GO: AtomicU32 = AtomicU32::new(0);

/// APs that reached Rust code.
static ALIVE: AtomicU32 = AtomicU32::new(0);

/// The IDE bus-master block's first port (from the PIIX IDE function's
/// BAR4, read by the boot CPU before any operation).
static IDE_BUSMASTER: AtomicU32 = AtomicU32::new(0);

/// vCPUs that finished their stream.
static DONE: AtomicU32 = AtomicU32::new(0);

/// Set per vCPU once its stream ended.
static FINISHED: [AtomicBool; MAX_CPUS] = [const { AtomicBool::new(false) }; MAX_CPUS];

/// Set by a watching vCPU before it sends an NMI to a stalled one: the
/// stalled vCPU's NMI handler then prints where it was (`traps`).
pub static STALL_ASKED: [AtomicBool; MAX_CPUS] = [const { AtomicBool::new(false) }; MAX_CPUS];

/// TSC ticks without a new operation after which a vCPU counts as stalled
/// (about 20 s of emulated time at Bochs' 50 M instructions a second
/// here; no operation takes a hundredth of this).
const STALL_TICKS: u64 = 1 << 30;

fn halt() -> ! {
    loop {
        // SAFETY: stops this vCPU.
        unsafe { core::arch::asm!("cli", "hlt", options(nomem, nostack)) };
    }
}

#[panic_handler]
fn panic(info: &core::panic::PanicInfo<'_>) -> ! {
    serial::line(format_args!("FATAL panic: {info}"));
    halt()
}

/// Reads `len` bytes at physical address `at` (identity-mapped).
fn phys<T: Copy>(at: u64) -> T {
    // SAFETY: boot_params and the command line are in RAM the loader gave
    // us, inside the identity map; unaligned reads are fine on x86.
    unsafe { core::ptr::read_unaligned(at as *const T) }
}

/// The command line from `boot_params` (at most 1 KiB, up to its NUL).
fn command_line(bp: u64, buf: &mut [u8; 1024]) -> &str {
    let low: u32 = phys(bp + 0x228);
    let high: u32 = phys(bp + 0xC8);
    let at = u64::from(high) << 32 | u64::from(low);
    if at == 0 {
        return "";
    }
    let mut n = 0;
    while n < buf.len() {
        let b: u8 = phys(at + n as u64);
        if b == 0 {
            break;
        }
        buf[n] = b;
        n += 1;
    }
    core::str::from_utf8(&buf[..n]).unwrap_or("")
}

/// One e820 entry.
#[derive(Clone, Copy)]
struct E820 {
    addr: u64,
    size: u64,
    kind: u32,
}

fn e820(bp: u64, out: &mut [E820; 128]) -> usize {
    let n = usize::from(phys::<u8>(bp + 0x1E8)).min(128);
    for (i, e) in out.iter_mut().enumerate().take(n) {
        let at = bp + 0x2D0 + 20 * i as u64;
        *e = E820 {
            addr: phys(at),
            size: phys(at + 8),
            kind: phys(at + 16),
        };
    }
    n
}

/// A page below 1 MiB for the APs' start-up code: the highest usable page
/// under 0x9F000 that the e820 calls RAM.
fn ap_page(map: &[E820]) -> Option<u64> {
    let mut best = None;
    for e in map.iter().filter(|e| e.kind == 1) {
        let lo = (e.addr + 0xFFF) & !0xFFF;
        let hi = (e.addr + e.size).min(0x9F000) & !0xFFF;
        let lo = lo.max(0x1_0000);
        if hi >= lo + 0x1000 {
            best = best.max(Some(hi - 0x1000));
        }
    }
    best
}

/// The PIIX IDE function's (00:01.1) bus-master block, from its BAR4.
fn ide_busmaster() -> u16 {
    let address: u32 = 0x8000_0000 | 1 << 11 | 1 << 8 | 0x20;
    let bar: u32;
    // SAFETY: a PCI configuration read of one register by the boot CPU,
    // before any operation runs.
    unsafe {
        core::arch::asm!(
            "out dx, eax", "mov dx, 0xCFC", "in eax, dx",
            inout("eax") address => bar, inout("dx") 0xCF8u16 => _, options(nomem, nostack)
        );
    }
    if bar & 1 == 1 && bar != 0xFFFF_FFFF {
        (bar & 0xFFFC) as u16
    } else {
        0
    }
}

fn spin(n: u64) {
    for _ in 0..n {
        core::hint::spin_loop();
    }
}

/// Starts vCPU `cpu` (APIC ID `cpu`) through the page at `page`.
fn start_ap(page: u64, cpu: u32) -> bool {
    let (start, end) = (
        core::ptr::addr_of!(boot::fz_ap16) as u64,
        core::ptr::addr_of!(boot::fz_ap16_end) as u64,
    );
    let len = (end - start) as usize;
    // SAFETY: the page is free RAM below 1 MiB (from the e820), identity
    // mapped; the code fits well inside its first 0xFF0 bytes.
    unsafe {
        core::ptr::copy_nonoverlapping(
            start as *const u8,
            page as *mut u8,
            len.min(boot::AP_STACK_SLOT),
        );
        // SAFETY: only the address of the stacks is taken.
        let stacks = core::ptr::addr_of!(boot::fz_stacks) as u64;
        let top = stacks + (u64::from(cpu) + 1) * percpu::STACK_SIZE as u64;
        core::ptr::write_volatile((page + boot::AP_STACK_SLOT as u64) as *mut u32, top as u32);
        core::ptr::write_volatile((page + boot::AP_CPU_SLOT as u64) as *mut u32, cpu);
    }
    let vector = (page >> 12) as u32;
    apic::ipi(cpu, 0x4500);
    spin(20_000);
    apic::ipi(cpu, 0x600 | vector);
    spin(2_000);
    apic::ipi(cpu, 0x600 | vector);
    for _ in 0..50_000_000u64 {
        if ALIVE.load(Ordering::Acquire) >= cpu {
            return true;
        }
        core::hint::spin_loop();
    }
    false
}

/// Sets up what every vCPU needs: IDT, APIC, CR0.WP, CR4.OSXSAVE.
fn cpu_init(cpu: u32) {
    let pc = percpu::this();
    pc.cpu = u64::from(cpu);
    pc.vector = 0xFF;
    traps::load();
    traps::load_tss(cpu as usize);
    apic::init();
    // SAFETY: the same control registers on every path in: CR0 = PG, WP
    // (our read-only scratch page must fault), NE, ET, MP, PE (the loaders
    // leave NE and MP differently); CR4 = PAE and, where the CPU has
    // XSAVE, OSXSAVE (so that XSETBV can be tried) with XCR0 = x87.
    unsafe {
        core::arch::asm!(
            "mov {t}, 0x80010033", "mov cr0, {t}", "mov {t}, 0x20", "mov cr4, {t}",
            t = out(reg) _, options(nostack)
        );
        let ecx: u32;
        core::arch::asm!("push rbx", "cpuid", "pop rbx", inout("eax") 1u32 => _, inout("ecx") 0u32 => ecx, out("edx") _, options(nostack));
        if ecx & (1 << 26) != 0 {
            core::arch::asm!(
                "mov {t}, cr4", "or {t}, 0x40000", "mov cr4, {t}",
                "xor ecx, ecx", "xor edx, edx", "mov eax, 1", "xsetbv",
                t = out(reg) _, out("eax") _, out("ecx") _, out("edx") _, options(nostack)
            );
        }
    }
}

/// Entered by each vCPU in long mode on its own stack: the boot CPU with
/// `boot_params`, an AP with 0.
#[no_mangle]
extern "C" fn fz_main(boot_params: u64, cpu: u64) -> ! {
    let cpu = cpu as u32;
    if cpu == 0 {
        serial::init();
        exec::init_code16();
        // The first scratch page is read-only (the ReadOnly fault).
        // SAFETY: the program's own page table, before any vCPU uses it.
        unsafe { (*core::ptr::addr_of_mut!(boot::fz_scratch_pt))[0] &= !2 };
        hooked::map();
    }
    cpu_init(cpu);
    hooked::set_lstar();
    let params = if cpu == 0 {
        let mut buf = [0u8; 1024];
        let line = command_line(boot_params, &mut buf);
        let params = match cmdline::parse(line) {
            Ok(p) => p,
            Err(word) => {
                serial::line(format_args!("FATAL bad command-line word {word:?}"));
                halt()
            }
        };
        // SAFETY: written before any AP starts, read-only afterwards.
        unsafe { PARAMS = params };
        serial::line(format_args!(
            "start seed={} ops={} cpus={} window={} apic={}",
            params.seed,
            params.ops,
            params.cpus,
            params.window,
            apic::id()
        ));
        let mut map = [E820 {
            addr: 0,
            size: 0,
            kind: 0,
        }; 128];
        let n = e820(boot_params, &mut map);
        let mut d = Digest::new();
        for e in &map[..n] {
            d.add(e.addr);
            d.add(e.size);
            d.add(u64::from(e.kind));
        }
        serial::line(format_args!("e820 {:016x} {}", d.0, n));
        if params.record && !record_fits(&map[..n], &params) {
            serial::line(format_args!(
                "FATAL fuzz.record needs {:?} bytes of RAM from {:#x}",
                query::record_bytes(params.recorded().end - params.recorded().start, params.cpus),
                query::RECORD_BASE
            ));
            halt()
        }
        let bm = ide_busmaster();
        IDE_BUSMASTER.store(u32::from(bm), Ordering::Release);
        serial::line(format_args!("ide-busmaster {bm:#x}"));
        if params.cpus > 1 {
            let Some(page) = ap_page(&map[..n]) else {
                serial::line(format_args!("FATAL no page below 1 MiB for the APs"));
                halt()
            };
            for ap in 1..params.cpus {
                if !start_ap(page, ap) {
                    serial::line(format_args!("FATAL cpu {ap} did not start"));
                    halt()
                }
            }
        }
        if params.tracer {
            serial::line(format_args!(
                "ready hooked={:#x}+{:#x}: send a byte on COM1 to go",
                fuzz_guest::HOOKED_VMA,
                hooked::len()
            ));
            serial::wait_byte();
        }
        boot::trip_wire();
        boot::guard_null();
        GO.store(1, Ordering::Release);
        params
    } else {
        // SAFETY: the boot CPU wrote it before starting us.
        let p = unsafe { PARAMS };
        ALIVE.fetch_add(1, Ordering::AcqRel);
        while GO.load(Ordering::Acquire) == 0 {
            core::hint::spin_loop();
        }
        p
    };
    fuzz(params, cpu);
}

/// Runs this vCPU's stream.
fn fuzz(p: Params, cpu: u32) -> ! {
    let shape = Shape {
        cpu,
        cpus: p.cpus,
        tracer: p.tracer,
    };
    let env = Env {
        cpus: p.cpus,
        ide_busmaster: IDE_BUSMASTER.load(Ordering::Acquire) as u16,
    };
    let mut rng = Rng::new(p.seed, cpu);
    let mut main = Digest::new();
    let mut classes = [Digest::new(); CLASSES.len()];
    let mut seen = [false; CLASSES.len()];
    let kept = p.recorded();
    // The boot CPU unmapped the first 2 MiB before the go.
    boot::flush_tlb();
    let pc = percpu::this();
    for i in 0..p.ops {
        pc.op = i;
        let op = ops::draw(&mut rng, shape);
        let out = if p.skip & (1 << ops::kind(&op)) != 0 {
            known::Outcome {
                vector: known::NO_FAULT,
                error: 0,
                addr: 0,
                vals: [0; 4],
            }
        } else {
            run::execute(&op, cpu as usize)
        };
        let window = i / p.window;
        known::fold(i, &op, &out, &mut main, &mut classes, &mut seen, &env);
        if p.record && kept.contains(&i) {
            let at = query::record_at(&kept, cpu, i) as *mut [u64; 7];
            // SAFETY: this vCPU's own slot of the record, in RAM the e820
            // gives the program (checked at boot) and identity-mapped.
            unsafe { core::ptr::write_volatile(at, pack(&out)) };
        }
        if p.log == Some(window) {
            print_op(cpu, i, &op, &out, &env);
        }
        if (i + 1) % p.window == 0 || i + 1 == p.ops {
            print_window(cpu, window, &main, &classes, &seen);
            main = Digest::new();
            classes = [Digest::new(); CLASSES.len()];
            seen = [false; CLASSES.len()];
        }
    }
    let pc = percpu::this();
    serial::line(format_args!(
        "done {cpu} ops={} nmis={} irqs={} stray={} rescued={}",
        p.ops, pc.nmis, pc.irqs, pc.stray, pc.rescued
    ));
    FINISHED[cpu as usize].store(true, Ordering::Release);
    DONE.fetch_add(1, Ordering::AcqRel);
    watch_others(cpu, p.cpus);
    if cpu == 0 {
        serial::line(format_args!("end"));
        if p.record {
            serve(&p, &env);
        }
    }
    halt()
}

fn pack(o: &known::Outcome) -> [u64; 7] {
    [
        u64::from(o.vector),
        o.error,
        o.addr,
        o.vals[0],
        o.vals[1],
        o.vals[2],
        o.vals[3],
    ]
}

fn unpack(w: &[u64; 7]) -> known::Outcome {
    known::Outcome {
        vector: w[0] as u8,
        error: w[1],
        addr: w[2],
        vals: [w[3], w[4], w[5], w[6]],
    }
}

/// Whether the e820 gives the program RAM for the record.
fn record_fits(map: &[E820], p: &Params) -> bool {
    let kept = p.recorded();
    let Some(len) = query::record_bytes(kept.end - kept.start, p.cpus) else {
        return false;
    };
    let (lo, hi) = (query::RECORD_BASE, query::RECORD_BASE.saturating_add(len));
    map.iter()
        .any(|e| e.kind == 1 && e.addr <= lo && e.addr.saturating_add(e.size) >= hi)
}

/// Outcome `i` of vCPU `cpu`, from the record.
fn recorded(p: &Params, cpu: u32, i: u64) -> known::Outcome {
    // SAFETY: written by that vCPU during its stream, which has ended;
    // inside the record (i in `p.recorded()`, cpu < cpus: `query::parse`
    // and `answer`).
    unsafe {
        unpack(&core::ptr::read_volatile(
            query::record_at(&p.recorded(), cpu, i) as *const [u64; 7],
        ))
    }
}

/// Answers the host's questions about the record, for good
/// ([`fuzz_guest::query`]).
fn serve(p: &Params, env: &Env) -> ! {
    serial::line(format_args!("serving"));
    let mut line = [0u8; 128];
    loop {
        let mut n = 0;
        loop {
            let b = serial::wait_byte();
            if b == b'\n' || b == b'\r' {
                break;
            }
            if n < line.len() {
                line[n] = b;
                n += 1;
            }
        }
        let text = core::str::from_utf8(&line[..n]).unwrap_or("");
        if text.trim().is_empty() {
            continue;
        }
        match query::parse(text, p.cpus, &p.recorded()) {
            Ok(q) => answer(p, env, q),
            Err(why) => serial::line(format_args!("qerr {why}")),
        }
        serial::line(format_args!("qdone"));
    }
}

fn answer(p: &Params, env: &Env, q: Query) {
    let (cpu, from, end) = match q {
        Query::Blocks { cpu, from, len, n } => (
            cpu,
            from,
            from.saturating_add(len * n).min(p.recorded().end),
        ),
        Query::Ops { cpu, from, count } => (cpu, from, from + count),
    };
    let shape = Shape {
        cpu,
        cpus: p.cpus,
        tracer: p.tracer,
    };
    let mut rng = Rng::new(p.seed, cpu);
    let mut block = Digest::new();
    for i in 0..end {
        let op = ops::draw(&mut rng, shape);
        if i < from {
            continue;
        }
        let out = recorded(p, cpu, i);
        match q {
            Query::Blocks { len, .. } => {
                known::fold_main(i, &op, &out, &mut block, env);
                if (i + 1 - from).is_multiple_of(len) || i + 1 == end {
                    serial::line(format_args!(
                        "blk {cpu} {} {:016x}",
                        (i - from) / len,
                        block.0
                    ));
                    block = Digest::new();
                }
            }
            Query::Ops { .. } => print_op(cpu, i, &op, &out, env),
        }
    }
}

fn rdtsc() -> u64 {
    let (lo, hi): (u32, u32);
    // SAFETY: reads the time-stamp counter.
    unsafe { core::arch::asm!("rdtsc", out("eax") lo, out("edx") hi, options(nomem, nostack)) };
    u64::from(hi) << 32 | u64::from(lo)
}

/// Waits for every vCPU's stream to end. One that runs no new operation
/// for [`STALL_TICKS`] is named, and sent an NMI that makes it print where
/// it is: a stall shows its operation and state, not only a timeout.
fn watch_others(cpu: u32, cpus: u32) {
    let mut last = [u64::MAX; MAX_CPUS];
    let mut since = [0u64; MAX_CPUS];
    let mut told = [false; MAX_CPUS];
    while DONE.load(Ordering::Acquire) < cpus {
        for other in 0..cpus {
            let k = other as usize;
            if other == cpu || told[k] || FINISHED[k].load(Ordering::Acquire) {
                continue;
            }
            // SAFETY: a volatile read of another vCPU's operation index
            // (a plain word it stores once per operation).
            let op = unsafe {
                core::ptr::read_volatile(core::ptr::addr_of!((*percpu::of_cpu(other)).op))
            };
            let now = rdtsc();
            if op != last[k] {
                last[k] = op;
                since[k] = now;
            } else if now.wrapping_sub(since[k]) > STALL_TICKS {
                // Foreign code gets taken back and the vCPU goes on (a
                // new operation, so it may be named again); anything else
                // is a stall, named once.
                // SAFETY: a volatile read of the other vCPU's flag.
                let foreign = unsafe {
                    core::ptr::read_volatile(core::ptr::addr_of!((*percpu::of_cpu(other)).foreign))
                };
                told[k] = foreign == 0;
                since[k] = now;
                if foreign == 0 {
                    serial::line(format_args!(
                        "STALL cpu {other}: no new operation since {op} for {STALL_TICKS} TSC ticks; asking it where it is (NMI)"
                    ));
                }
                STALL_ASKED[k].store(true, Ordering::Release);
                // All but self: with more vCPUs, the others count an NMI.
                apic::ipi(0, 0xC_0400);
            }
        }
        core::hint::spin_loop();
    }
}

/// One operation with its outcome: the part every run must agree on, then
/// the documented part.
fn print_op(cpu: u32, i: u64, op: &ops::Op, out: &known::Outcome, env: &Env) {
    match known::split(op, out, env) {
        (main, None) => serial::line(format_args!("op {cpu} {i} {op:?} => {main:?}")),
        (main, Some((c, k))) => serial::line(format_args!(
            "op {cpu} {i} {op:?} => {main:?} | {}: {k:?}",
            CLASSES[c]
        )),
    }
}

fn print_window(cpu: u32, window: u64, main: &Digest, classes: &[Digest], seen: &[bool]) {
    let mut text = [0u8; 512];
    let mut w = Cursor {
        buf: &mut text,
        len: 0,
    };
    for (i, d) in classes.iter().enumerate() {
        if seen[i] {
            let _ =
                core::fmt::Write::write_fmt(&mut w, format_args!(" {}={:016x}", CLASSES[i], d.0));
        }
    }
    let len = w.len;
    let extra = core::str::from_utf8(&text[..len]).unwrap_or("");
    serial::line(format_args!("win {cpu} {window} {:016x}{extra}", main.0));
}

struct Cursor<'a> {
    buf: &'a mut [u8],
    len: usize,
}

impl core::fmt::Write for Cursor<'_> {
    fn write_str(&mut self, s: &str) -> core::fmt::Result {
        let end = self.len + s.len();
        if end > self.buf.len() {
            return Err(core::fmt::Error);
        }
        self.buf[self.len..end].copy_from_slice(s.as_bytes());
        self.len = end;
        Ok(())
    }
}
