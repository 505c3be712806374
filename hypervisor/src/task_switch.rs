//! Hardware task switches, emulated for a guest in legacy protected mode
//! (SDM Vol. 3A 7.3 "Task Switching", 28.4.2 "Treatment of Task Switches").
//!
//! VMX does not let a task switch happen in non-root operation: every one
//! exits, before the old TSS, the new TSS, their descriptors, RFLAGS.NT or
//! TR change. In IA-32e mode CALL/JMP to a TSS and task gates raise #GP
//! before any exit, so only a guest in legacy protected mode can cause one.
//! Root then does what the CPU would have done: [`switch`] over a plain
//! copy of the register state ([`TaskCpu`]) and the guest's memory seen
//! through its own paging ([`Linear`]); the exit handler copies the state
//! from and back to the VMCS.
//!
//! What is done, in the SDM's order:
//! 1. the new TSS descriptor is read from the GDT and checked (type,
//!    present, limit; DPL for CALL and JMP); a fault here leaves
//!    everything as it was;
//! 2. the old task's state is saved into its TSS (busy flag cleared for
//!    JMP and IRET, NT cleared in the saved EFLAGS for IRET);
//! 3. CALL and task gates write the back link and set NT; everything but
//!    IRET marks the new descriptor busy; TR is loaded (the commit point);
//! 4. CR3 (with paging), EIP, EFLAGS, the general registers, the LDT and
//!    the segment registers are loaded from the new TSS with the checks of
//!    a segment load; a fault after the commit point is raised in the new
//!    task, as the SDM says;
//! 5. CR0.TS is set; an error code of an exception delivered through a
//!    task gate is pushed on the new stack; the TSS's T bit asks for #DB.
//!
//! 16-bit TSSs (types 1 and 3) are handled with their own layout. Accessed
//! bits of descriptors are set as the CPU sets them; accessed and dirty
//! bits of page-table entries are not.

/// A segment register as VMX holds it: selector, base, limit (bytes) and
/// access rights in the VMCS format (bit 16: unusable).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Seg {
    /// Selector.
    pub selector: u16,
    /// Base address.
    pub base: u32,
    /// Limit in bytes (granularity applied).
    pub limit: u32,
    /// Access rights, VMCS format.
    pub ar: u32,
}

/// The VMCS access-rights "unusable" bit.
pub const AR_UNUSABLE: u32 = 1 << 16;

/// What a task switch reads and changes.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TaskCpu {
    /// EAX, ECX, EDX, EBX, ESP, EBP, ESI, EDI.
    pub gpr: [u32; 8],
    /// EIP (of the instruction or event that switches).
    pub eip: u32,
    /// EFLAGS.
    pub eflags: u32,
    /// ES, CS, SS, DS, FS, GS.
    pub seg: [Seg; 6],
    /// LDTR.
    pub ldtr: Seg,
    /// TR.
    pub tr: Seg,
    /// GDTR base and limit.
    pub gdtr: (u32, u32),
    /// CR0.
    pub cr0: u32,
    /// CR3.
    pub cr3: u32,
}

/// Segment register indices in [`TaskCpu::seg`].
const ES: usize = 0;
const CS: usize = 1;
const SS: usize = 2;
const DS: usize = 3;
const FS: usize = 4;
const GS: usize = 5;

const EFLAGS_NT: u32 = 1 << 14;
/// The EFLAGS bits that exist (CF, PF, AF, ZF, SF, TF, IF, DF, OF, IOPL,
/// NT, RF, VM, AC, VIF, VIP, ID).
const EFLAGS_DEFINED: u32 = 0x003f_7fd5;
const EFLAGS_VM: u32 = 1 << 17;
const CR0_PG: u32 = 1 << 31;
const CR0_TS: u32 = 1 << 3;

/// What caused the switch (exit qualification bits 31:30).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// CALL (or a call gate to a task gate).
    Call,
    /// IRET with NT set.
    Iret,
    /// JMP.
    Jmp,
    /// An event delivered through a task gate in the IDT.
    Gate,
}

impl Source {
    /// From the exit qualification.
    pub fn from_qualification(q: u64) -> Self {
        match (q >> 30) & 3 {
            0 => Self::Call,
            1 => Self::Iret,
            2 => Self::Jmp,
            _ => Self::Gate,
        }
    }
}

/// A fault the switch raises (vector and error code).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// #TS with a selector error code.
    Ts(u16),
    /// #NP with a selector error code.
    Np(u16),
    /// #SS with a selector error code.
    Ss(u16),
    /// #GP with a selector error code.
    Gp(u16),
    /// #PF at a linear address, with an error code.
    Pf(u32, u32),
}

impl Fault {
    /// The exception vector and error code to inject.
    pub fn vector_and_code(self) -> (u8, u32) {
        match self {
            Self::Ts(s) => (10, u32::from(s & !3)),
            Self::Np(s) => (11, u32::from(s & !3)),
            Self::Ss(s) => (12, u32::from(s & !3)),
            Self::Gp(s) => (13, u32::from(s & !3)),
            Self::Pf(_, code) => (14, code),
        }
    }
}

/// The guest's linear memory under its current paging.
pub trait Linear {
    /// Reads `buf.len()` bytes at `la`; the error is the #PF error code.
    fn read(&mut self, la: u32, buf: &mut [u8]) -> Result<(), u32>;
    /// Writes `buf` at `la`; the error is the #PF error code.
    fn write(&mut self, la: u32, buf: &[u8]) -> Result<(), u32>;
    /// The guest loads a new CR3 (paging on): later accesses use it.
    /// `Err` when the CPU would refuse it (PAE PDPTEs with reserved bits
    /// set): nothing changes.
    fn set_cr3(&mut self, cr3: u32) -> Result<(), BadPdptes>;
}

/// A new CR3 whose PAE PDPTEs the CPU would refuse.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BadPdptes;

/// What happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The new task runs. `debug_trap`: its TSS's T bit is set (#DB at
    /// its first instruction).
    Switched { debug_trap: bool },
    /// A fault before the commit point: nothing changed; raise it.
    FaultBefore(Fault),
    /// A fault after the commit point: the new task's state is (partly)
    /// loaded; raise it there.
    FaultAfter(Fault),
}

/// What the switch needs besides the state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// The new TSS's selector (exit qualification bits 15:0).
    pub selector: u16,
    /// Why.
    pub source: Source,
    /// EIP to save in the old TSS: after the instruction for CALL, JMP,
    /// IRET and software interrupts, the current one for other events.
    pub return_eip: u32,
    /// An error code to push on the new task's stack (an exception
    /// delivered through a task gate).
    pub error_code: Option<u32>,
}

fn rd<M: Linear + ?Sized, const N: usize>(m: &mut M, la: u32) -> Result<[u8; N], Fault> {
    let mut b = [0u8; N];
    m.read(la, &mut b).map_err(|c| Fault::Pf(la, c))?;
    Ok(b)
}

fn wr<M: Linear + ?Sized>(m: &mut M, la: u32, b: &[u8]) -> Result<(), Fault> {
    m.write(la, b).map_err(|c| Fault::Pf(la, c))
}

/// A raw 8-byte descriptor and where it lives.
#[derive(Debug, Clone, Copy)]
struct Desc {
    raw: u64,
    at: u32,
}

impl Desc {
    fn present(&self) -> bool {
        self.raw & (1 << 47) != 0
    }
    fn dpl(&self) -> u8 {
        ((self.raw >> 45) & 3) as u8
    }
    /// S (bit 44) and type (43:40).
    fn s(&self) -> bool {
        self.raw & (1 << 44) != 0
    }
    fn ty(&self) -> u8 {
        ((self.raw >> 40) & 0xf) as u8
    }
    fn base(&self) -> u32 {
        (((self.raw >> 16) & 0xff_ffff) | ((self.raw >> 32) & 0xff00_0000)) as u32
    }
    fn limit(&self) -> u32 {
        let raw = ((self.raw & 0xffff) | ((self.raw >> 32) & 0xf_0000)) as u32;
        if self.raw & (1 << 55) != 0 {
            (raw << 12) | 0xfff
        } else {
            raw
        }
    }
    /// The VMCS access rights: type, S, DPL, P (7:0), AVL, L, D/B, G
    /// (15:12).
    fn ar(&self) -> u32 {
        ((self.raw >> 40) & 0xff) as u32 | (((self.raw >> 52) & 0xf) as u32) << 12
    }
    fn seg(&self, selector: u16) -> Seg {
        Seg {
            selector,
            base: self.base(),
            limit: self.limit(),
            ar: self.ar(),
        }
    }
}

/// Reads the descriptor for `selector` from the GDT or the current LDT;
/// `None` when it is past the table's limit.
fn descriptor<M: Linear + ?Sized>(
    cpu: &TaskCpu,
    m: &mut M,
    selector: u16,
) -> Result<Option<Desc>, Fault> {
    let (base, limit) = if selector & 4 != 0 {
        if cpu.ldtr.ar & AR_UNUSABLE != 0 {
            return Ok(None);
        }
        (cpu.ldtr.base, cpu.ldtr.limit)
    } else {
        cpu.gdtr
    };
    let off = u32::from(selector & !7);
    if off.checked_add(7).is_none_or(|end| end > limit) {
        return Ok(None);
    }
    let at = base.wrapping_add(off);
    Ok(Some(Desc {
        raw: u64::from_le_bytes(rd(m, at)?),
        at,
    }))
}

/// Sets the accessed bit of a code or data descriptor, as a load does.
fn set_accessed<M: Linear + ?Sized>(m: &mut M, d: &Desc) -> Result<(), Fault> {
    if d.raw & (1 << 40) == 0 {
        let byte = ((d.raw >> 40) as u8) | 1;
        wr(m, d.at.wrapping_add(5), &[byte])?;
    }
    Ok(())
}

/// TSS offsets of one layout.
struct Layout {
    /// 32-bit: registers are 4 bytes and 4 apart (2 and 2 in a 16-bit
    /// TSS), and FS and GS exist.
    big: bool,
    eip: u32,
    eflags: u32,
    gpr: u32,
    seg: u32,
    ldt: u32,
    min_limit: u32,
}

const TSS32: Layout = Layout {
    big: true,
    eip: 0x20,
    eflags: 0x24,
    gpr: 0x28,
    seg: 0x48,
    ldt: 0x60,
    min_limit: 0x67,
};

const TSS16: Layout = Layout {
    big: false,
    eip: 0x0e,
    eflags: 0x10,
    gpr: 0x12,
    seg: 0x22,
    ldt: 0x2a,
    min_limit: 0x2b,
};

impl Layout {
    /// Bytes between register slots.
    fn step(&self) -> u32 {
        if self.big {
            4
        } else {
            2
        }
    }

    /// Segment registers it holds (ES, CS, SS, DS, and FS, GS when 32-bit).
    fn segs(&self) -> usize {
        if self.big {
            6
        } else {
            4
        }
    }
}

/// The layout of a TSS descriptor type (available or busy), if it is one.
fn layout_of(ty: u8) -> Option<&'static Layout> {
    match ty {
        0x9 | 0xb => Some(&TSS32),
        0x1 | 0x3 => Some(&TSS16),
        _ => None,
    }
}

/// Toggles the busy bit (type bit 1) of the TSS descriptor at `at`.
fn set_busy<M: Linear + ?Sized>(m: &mut M, d: &Desc, busy: bool) -> Result<(), Fault> {
    let ty = (d.raw >> 40) as u8;
    let byte = if busy { ty | 2 } else { ty & !2 };
    wr(m, d.at.wrapping_add(5), &[byte])
}

/// The `N` little-endian bytes at `off` of a TSS image. The layouts'
/// offsets all lie inside the image; past its end would read as zeros.
fn tss_bytes<const N: usize>(image: &[u8; 0x68], off: u32) -> [u8; N] {
    image
        .get(off as usize..)
        .and_then(|b| b.first_chunk())
        .copied()
        .unwrap_or([0; N])
}

/// Performs the task switch `req` on `cpu` through `m`.
pub fn switch<M: Linear + ?Sized>(cpu: &mut TaskCpu, m: &mut M, req: Request) -> Outcome {
    match switch_inner(cpu, m, req) {
        Ok(o) => o,
        Err((f, committed)) => {
            if committed {
                Outcome::FaultAfter(f)
            } else {
                Outcome::FaultBefore(f)
            }
        }
    }
}

fn switch_inner<M: Linear + ?Sized>(
    cpu: &mut TaskCpu,
    m: &mut M,
    req: Request,
) -> Result<Outcome, (Fault, bool)> {
    let before = |f: Fault| (f, false);
    let sel = req.selector;
    // 1. The new TSS descriptor: in the GDT, a TSS, present, big enough.
    // Not a usable TSS: IRET raises #TS, the others #GP.
    let refused = before(match req.source {
        Source::Iret => Fault::Ts(sel),
        _ => Fault::Gp(sel),
    });
    if sel & 4 != 0 {
        return Err(refused);
    }
    let new = descriptor(cpu, m, sel).map_err(before)?.ok_or(refused)?;
    let busy = new.ty() & 2 != 0;
    let layout = match layout_of(new.ty()).filter(|_| !new.s()) {
        Some(l) if busy == (req.source == Source::Iret) => l,
        _ => return Err(refused),
    };
    // The privilege checks of CALL and JMP (against the TSS descriptor,
    // or against a task gate, whose TSS descriptor's DPL is then not
    // checked) happen before the exit: the qualification cannot say
    // which applied, and the CPU already passed them.
    if !new.present() {
        return Err(before(Fault::Np(sel)));
    }
    if new.limit() < layout.min_limit {
        return Err(before(Fault::Ts(sel)));
    }
    // The old TSS: its descriptor (for the busy flag) and layout.
    let old = descriptor(cpu, m, cpu.tr.selector)
        .map_err(before)?
        .ok_or(before(Fault::Ts(cpu.tr.selector)))?;
    let old_layout =
        layout_of((cpu.tr.ar & 0xf) as u8).ok_or(before(Fault::Ts(cpu.tr.selector)))?;
    // Read the whole new TSS image first: a #PF on it is a fault before
    // the commit point.
    let mut image = [0u8; 0x68];
    // Both layouts' minimum limits lie inside the 0x68-byte image (a 32-bit
    // TSS is 0x68 bytes, a 16-bit one 0x2c), so this never refuses.
    let part = image
        .get_mut(..layout.min_limit as usize + 1)
        .ok_or(refused)?;
    m.read(new.base(), part)
        .map_err(|c| before(Fault::Pf(new.base(), c)))?;
    // 2. Save the old task.
    let mut eflags = cpu.eflags;
    if req.source == Source::Iret {
        eflags &= !EFLAGS_NT;
    }
    let ob = cpu.tr.base;
    let step = old_layout.step();
    let put = |m: &mut M, off: u32, v: u32| -> Result<(), (Fault, bool)> {
        let b = v.to_le_bytes();
        let b: &[u8] = if old_layout.big { &b } else { &b[..2] };
        wr(m, ob.wrapping_add(off), b).map_err(before)
    };
    put(m, old_layout.eip, req.return_eip)?;
    put(m, old_layout.eflags, eflags)?;
    for (i, &r) in cpu.gpr.iter().enumerate() {
        put(m, old_layout.gpr + step * i as u32, r)?;
    }
    for (i, s) in cpu.seg.iter().take(old_layout.segs()).enumerate() {
        // Selectors are 16-bit in both layouts; 32-bit slots are 4 apart.
        wr(
            m,
            ob.wrapping_add(old_layout.seg + step * i as u32),
            &s.selector.to_le_bytes(),
        )
        .map_err(before)?;
    }
    if matches!(req.source, Source::Jmp | Source::Iret) {
        set_busy(m, &old, false).map_err(before)?;
    }
    // 3. Link, busy, TR: the commit point.
    let get32 = |off: u32| -> u32 { u32::from_le_bytes(tss_bytes(&image, off)) };
    let get16 = |off: u32| -> u16 { u16::from_le_bytes(tss_bytes(&image, off)) };
    let get = |off: u32| -> u32 {
        if layout.big {
            get32(off)
        } else {
            u32::from(get16(off))
        }
    };
    let mut new_eflags = get(layout.eflags);
    if matches!(req.source, Source::Call | Source::Gate) {
        wr(m, new.base(), &cpu.tr.selector.to_le_bytes()).map_err(before)?;
        new_eflags |= EFLAGS_NT;
    }
    if req.source != Source::Iret {
        set_busy(m, &new, true).map_err(before)?;
    }
    let tr_ar = new.ar() | 2;
    cpu.tr = Seg {
        ar: tr_ar,
        ..new.seg(sel)
    };
    // From here on, faults belong to the new task. One that comes before
    // its CS and SS are loaded leaves the old task's registers (with the
    // new TR and TS): a half-loaded CS/SS pair would fail VM entry.
    let after = |f: Fault| (f, true);
    cpu.cr0 |= CR0_TS;
    let committed = cpu.clone();
    // 4. Load the new task's state.
    if layout.big && cpu.cr0 & CR0_PG != 0 {
        let cr3 = get32(0x1c);
        if m.set_cr3(cr3).is_err() {
            return Err(after(Fault::Gp(0)));
        }
        cpu.cr3 = cr3;
    }
    cpu.eip = get(layout.eip);
    if !layout.big {
        new_eflags |= cpu.eflags & 0xffff_0000 & !EFLAGS_VM;
    }
    // Reserved bits read as the CPU keeps them (bit 1 set, 3, 5, 15 and
    // 22..31 clear): VM entry refuses anything else.
    cpu.eflags = (new_eflags & EFLAGS_DEFINED) | 2;
    let step = layout.step();
    for (i, r) in (0u32..).zip(cpu.gpr.iter_mut()) {
        let v = get(layout.gpr + step * i);
        *r = if layout.big {
            v
        } else {
            (*r & 0xffff_0000) | v
        };
    }
    let nseg = layout.segs();
    let mut selectors = [0u16; 6];
    for (i, s) in selectors.iter_mut().take(nseg).enumerate() {
        *s = get16(layout.seg + step * i as u32);
    }
    let ldt = get16(layout.ldt);
    let debug_trap = layout.big && image[0x64] & 1 != 0;
    if let Err((f, stack_loaded)) = load_segments(cpu, m, &selectors, nseg, ldt) {
        if !stack_loaded {
            let (tr, cr3, ldtr) = (cpu.tr, cpu.cr3, cpu.ldtr);
            *cpu = committed;
            cpu.tr = tr;
            cpu.cr3 = cr3;
            cpu.ldtr = ldtr;
        }
        return Err(after(f));
    }
    // 5. An exception's error code goes on the new stack.
    if let Some(code) = req.error_code {
        let big_stack = cpu.seg[SS].ar & (1 << 14) != 0;
        let size = if layout.big { 4 } else { 2 };
        let esp = if big_stack {
            cpu.gpr[4].wrapping_sub(size)
        } else {
            (cpu.gpr[4] & 0xffff_0000) | (cpu.gpr[4].wrapping_sub(size) & 0xffff)
        };
        let off = if big_stack { esp } else { esp & 0xffff };
        let la = cpu.seg[SS].base.wrapping_add(off);
        let bytes = code.to_le_bytes();
        let bytes: &[u8] = if layout.big { &bytes } else { &bytes[..2] };
        wr(m, la, bytes).map_err(after)?;
        cpu.gpr[4] = esp;
    }
    Ok(Outcome::Switched { debug_trap })
}

/// Loads the LDT and the segment registers of the new task. CS and SS are
/// both checked before either is loaded; data registers are unusable until
/// their own load succeeds. The error says whether CS and SS were loaded.
fn load_segments<M: Linear + ?Sized>(
    cpu: &mut TaskCpu,
    m: &mut M,
    selectors: &[u16; 6],
    nseg: usize,
    ldt: u16,
) -> Result<(), (Fault, bool)> {
    cpu.ldtr = Seg {
        selector: ldt,
        ar: AR_UNUSABLE,
        ..Seg::default()
    };
    load_ldt(cpu, m, ldt).map_err(|f| (f, false))?;
    if cpu.eflags & EFLAGS_VM != 0 {
        for (s, &sel) in cpu.seg.iter_mut().zip(selectors) {
            *s = Seg {
                selector: sel,
                base: u32::from(sel) << 4,
                limit: 0xffff,
                ar: 0xf3,
            };
        }
        return Ok(());
    }
    let cpl = (selectors[CS] & 3) as u8;
    let cs = check_segment(cpu, m, selectors[CS], Load::Code).map_err(|f| (f, false))?;
    let ss = check_segment(cpu, m, selectors[SS], Load::Stack(cpl)).map_err(|f| (f, false))?;
    // ES, DS, FS and GS, in that order; a 16-bit TSS has no FS and GS:
    // they keep their values.
    let is_data = |i: usize| matches!(i, ES | DS | FS | GS) && i < nseg;
    for (i, (s, &selector)) in cpu.seg.iter_mut().zip(selectors).enumerate() {
        if is_data(i) {
            *s = Seg {
                selector,
                ar: AR_UNUSABLE,
                ..Seg::default()
            };
        }
    }
    commit_segment(m, &mut cpu.seg[CS], cs).map_err(|f| (f, false))?;
    commit_segment(m, &mut cpu.seg[SS], ss).map_err(|f| (f, true))?;
    for (i, &sel) in selectors.iter().enumerate().filter(|&(i, _)| is_data(i)) {
        if let Some(d) = check_segment(cpu, m, sel, Load::Data(cpl)).map_err(|f| (f, true))? {
            // `selectors` and `cpu.seg` both have six entries.
            if let Some(reg) = cpu.seg.get_mut(i) {
                commit_segment(m, reg, Some(d)).map_err(|f| (f, true))?;
            }
        }
    }
    Ok(())
}

fn load_ldt<M: Linear + ?Sized>(cpu: &mut TaskCpu, m: &mut M, sel: u16) -> Result<(), Fault> {
    if sel & !3 == 0 {
        cpu.ldtr = Seg {
            selector: sel,
            ar: AR_UNUSABLE,
            ..Seg::default()
        };
        return Ok(());
    }
    if sel & 4 != 0 {
        return Err(Fault::Ts(sel));
    }
    let d = descriptor(cpu, m, sel)?.ok_or(Fault::Ts(sel))?;
    if d.s() || d.ty() != 2 {
        return Err(Fault::Ts(sel));
    }
    if !d.present() {
        return Err(Fault::Ts(sel));
    }
    cpu.ldtr = d.seg(sel);
    Ok(())
}

/// What a selector is loaded as, for its checks (SDM 5.5, 5.6).
#[derive(Clone, Copy)]
enum Load {
    /// CS: code, DPL = RPL (non-conforming) or DPL <= RPL (conforming).
    Code,
    /// SS: writable data, RPL = DPL = CPL.
    Stack(u8),
    /// DS, ES, FS, GS: data or readable code; unless conforming code,
    /// DPL >= max(CPL, RPL). Null is allowed (the register is unusable).
    Data(u8),
}

/// Checks `sel` for `load`; `None` for a null data selector (the register
/// becomes unusable).
fn check_segment<M: Linear + ?Sized>(
    cpu: &TaskCpu,
    m: &mut M,
    sel: u16,
    load: Load,
) -> Result<Option<(u16, Desc)>, Fault> {
    if sel & !3 == 0 {
        return match load {
            Load::Data(_) => Ok(None),
            _ => Err(Fault::Ts(sel)),
        };
    }
    let d = descriptor(cpu, m, sel)?.ok_or(Fault::Ts(sel))?;
    let (ty, dpl, rpl) = (d.ty(), d.dpl(), (sel & 3) as u8);
    let code = ty & 8 != 0;
    let conforming = code && ty & 4 != 0;
    let ok = d.s()
        && match load {
            Load::Code => code && if conforming { dpl <= rpl } else { dpl == rpl },
            Load::Stack(cpl) => !code && ty & 2 != 0 && rpl == cpl && dpl == cpl,
            Load::Data(cpl) => (!code || ty & 2 != 0) && (conforming || dpl >= cpl.max(rpl)),
        };
    if !ok {
        return Err(Fault::Ts(sel));
    }
    if !d.present() {
        return Err(match load {
            Load::Stack(_) => Fault::Ss(sel),
            _ => Fault::Np(sel),
        });
    }
    Ok(Some((sel, d)))
}

/// Loads a checked descriptor into segment register `reg`, setting its
/// accessed bit.
fn commit_segment<M: Linear + ?Sized>(
    m: &mut M,
    reg: &mut Seg,
    checked: Option<(u16, Desc)>,
) -> Result<(), Fault> {
    if let Some((sel, d)) = checked {
        set_accessed(m, &d)?;
        *reg = d.seg(sel);
        reg.ar |= 1;
    }
    Ok(())
}

/// Legacy (non-IA-32e) paging over guest-physical memory: off, 32-bit
/// (with 4 MiB pages when CR4.PSE) or PAE (with the four PDPTEs VMX keeps
/// in the VMCS). Permission bits are not checked: a task switch's TSS and
/// descriptor accesses are supervisor accesses of the CPU itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LegacyPaging {
    /// CR0.PG clear: linear = physical.
    Off,
    /// 32-bit paging.
    Bits32 {
        /// CR3.
        cr3: u32,
        /// CR4.PSE.
        pse: bool,
    },
    /// PAE paging.
    Pae {
        /// The PDPTEs.
        pdptes: [u64; 4],
    },
}

/// A legacy walk's result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Walked {
    /// The guest-physical address.
    pub gpa: u64,
    /// Writable at every level.
    pub writable: bool,
    /// User-accessible at every level.
    pub user: bool,
}

/// Guest-physical memory, refused where it is not guest RAM.
pub trait Phys {
    /// Reads at `gpa`; false when refused.
    fn read(&self, gpa: u64, buf: &mut [u8]) -> bool;
    /// Writes at `gpa`; false when refused.
    fn write(&mut self, gpa: u64, buf: &[u8]) -> bool;
}

const PF_NOT_PRESENT: u32 = 0;
const PF_WRITE: u32 = 2;
const ADDR_PAE: u64 = 0x000f_ffff_ffff_f000;
/// Reserved bits of a present PAE PDPTE (bits 2:1, 8:5, 63:52): loading
/// one with any set is #GP (and would fail VM entry).
const PDPTE_RESERVED: u64 = 0xfff0_0000_0000_01e6;

impl LegacyPaging {
    /// The guest-physical address of `la`, or the #PF error code.
    pub fn translate<P: Phys + ?Sized>(&self, p: &P, la: u32, write: bool) -> Result<u64, u32> {
        self.walk(p, la, write).map(|w| w.gpa)
    }

    /// [`Self::translate`] with the permissions of the walk (writable and
    /// user-accessible at every level; PAE PDPTEs carry neither).
    pub fn walk<P: Phys + ?Sized>(&self, p: &P, la: u32, write: bool) -> Result<Walked, u32> {
        let code = PF_NOT_PRESENT | if write { PF_WRITE } else { 0 };
        let entry32 = |gpa: u64| -> Result<u32, u32> {
            let mut b = [0u8; 4];
            if p.read(gpa, &mut b) {
                Ok(u32::from_le_bytes(b))
            } else {
                Err(code)
            }
        };
        let entry64 = |gpa: u64| -> Result<u64, u32> {
            let mut b = [0u8; 8];
            if p.read(gpa, &mut b) {
                Ok(u64::from_le_bytes(b))
            } else {
                Err(code)
            }
        };
        match *self {
            Self::Off => Ok(Walked {
                gpa: u64::from(la),
                writable: true,
                user: true,
            }),
            Self::Bits32 { cr3, pse } => {
                let pde = entry32(u64::from(cr3 & !0xfff) + 4 * u64::from(la >> 22))?;
                if pde & 1 == 0 {
                    return Err(code);
                }
                if pse && pde & 0x80 != 0 {
                    let high = u64::from((pde >> 13) & 0xff) << 32;
                    return Ok(Walked {
                        gpa: high | u64::from(pde & 0xffc0_0000) | u64::from(la & 0x3f_ffff),
                        writable: pde & 2 != 0,
                        user: pde & 4 != 0,
                    });
                }
                let pte = entry32(u64::from(pde & !0xfff) + 4 * u64::from((la >> 12) & 0x3ff))?;
                if pte & 1 == 0 {
                    return Err(code);
                }
                Ok(Walked {
                    gpa: u64::from(pte & !0xfff) | u64::from(la & 0xfff),
                    writable: pde & pte & 2 != 0,
                    user: pde & pte & 4 != 0,
                })
            }
            Self::Pae { pdptes } => {
                // `la >> 30` of a 32-bit address is 0..=3: always one of the four.
                let pdpte = pdptes.get((la >> 30) as usize).copied().unwrap_or(0);
                if pdpte & 1 == 0 {
                    return Err(code);
                }
                let pde = entry64((pdpte & ADDR_PAE) + 8 * u64::from((la >> 21) & 0x1ff))?;
                if pde & 1 == 0 {
                    return Err(code);
                }
                if pde & 0x80 != 0 {
                    return Ok(Walked {
                        gpa: (pde & ADDR_PAE & !0x1f_ffff) | u64::from(la & 0x1f_ffff),
                        writable: pde & 2 != 0,
                        user: pde & 4 != 0,
                    });
                }
                let pte = entry64((pde & ADDR_PAE) + 8 * u64::from((la >> 12) & 0x1ff))?;
                if pte & 1 == 0 {
                    return Err(code);
                }
                Ok(Walked {
                    gpa: (pte & ADDR_PAE) | u64::from(la & 0xfff),
                    writable: pde & pte & 2 != 0,
                    user: pde & pte & 4 != 0,
                })
            }
        }
    }
}

/// [`Linear`] over [`Phys`] with [`LegacyPaging`], byte by byte across
/// pages. A new CR3 in PAE mode reloads the PDPTEs from it (as MOV to CR3
/// does); `pdptes_changed` tells the caller to write them to the VMCS.
pub struct LegacyLinear<'p, P: Phys + ?Sized> {
    /// The paging in force.
    pub paging: LegacyPaging,
    /// Guest-physical memory.
    pub phys: &'p mut P,
    /// Set when a new CR3 loaded new PDPTEs.
    pub pdptes_changed: bool,
}

impl<P: Phys + ?Sized> Linear for LegacyLinear<'_, P> {
    fn read(&mut self, la: u32, buf: &mut [u8]) -> Result<(), u32> {
        for (i, b) in buf.iter_mut().enumerate() {
            let a = la.wrapping_add(i as u32);
            let gpa = self.paging.translate(&*self.phys, a, false)?;
            if !self.phys.read(gpa, core::slice::from_mut(b)) {
                *b = 0xff;
            }
        }
        Ok(())
    }

    fn write(&mut self, la: u32, buf: &[u8]) -> Result<(), u32> {
        for (i, b) in buf.iter().enumerate() {
            let a = la.wrapping_add(i as u32);
            let gpa = self.paging.translate(&*self.phys, a, true)?;
            // Not guest RAM: the write goes nowhere, as to an empty bus.
            let _ = self.phys.write(gpa, core::slice::from_ref(b));
        }
        Ok(())
    }

    fn set_cr3(&mut self, cr3: u32) -> Result<(), BadPdptes> {
        match &mut self.paging {
            LegacyPaging::Off => {}
            LegacyPaging::Bits32 { cr3: c, .. } => *c = cr3,
            LegacyPaging::Pae { pdptes } => {
                let base = u64::from(cr3 & !0x1f);
                let mut new = [0u64; 4];
                for (i, e) in new.iter_mut().enumerate() {
                    let mut b = [0u8; 8];
                    if !self.phys.read(base + 8 * i as u64, &mut b) {
                        return Err(BadPdptes);
                    }
                    *e = u64::from_le_bytes(b);
                    if *e & 1 != 0 && *e & PDPTE_RESERVED != 0 {
                        return Err(BadPdptes);
                    }
                }
                *pdptes = new;
                self.pdptes_changed = true;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// Flat guest memory (paging off).
    #[derive(Default)]
    struct Mem(HashMap<u32, u8>);

    impl Linear for Mem {
        fn read(&mut self, la: u32, buf: &mut [u8]) -> Result<(), u32> {
            for (i, b) in buf.iter_mut().enumerate() {
                *b = *self.0.get(&la.wrapping_add(i as u32)).unwrap_or(&0);
            }
            Ok(())
        }
        fn write(&mut self, la: u32, buf: &[u8]) -> Result<(), u32> {
            for (i, b) in buf.iter().enumerate() {
                self.0.insert(la.wrapping_add(i as u32), *b);
            }
            Ok(())
        }
        fn set_cr3(&mut self, _: u32) -> Result<(), BadPdptes> {
            Ok(())
        }
    }

    impl Mem {
        fn put(&mut self, at: u32, b: &[u8]) {
            Linear::write(self, at, b).unwrap();
        }
        fn u32(&mut self, at: u32) -> u32 {
            u32::from_le_bytes(rd::<_, 4>(self, at).unwrap())
        }
        fn u64(&mut self, at: u32) -> u64 {
            u64::from_le_bytes(rd::<_, 8>(self, at).unwrap())
        }
    }

    /// A descriptor: base, limit (bytes, < 1 MiB), type, S, DPL, present,
    /// D/B.
    fn desc(base: u32, limit: u32, ty: u8, s: bool, dpl: u8, p: bool, db: bool) -> u64 {
        let mut d = u64::from(limit & 0xffff) | (u64::from(base & 0xff_ffff) << 16);
        d |= u64::from(ty) << 40 | u64::from(s) << 44 | u64::from(dpl) << 45 | u64::from(p) << 47;
        d |= u64::from((limit >> 16) & 0xf) << 48 | u64::from(db) << 54;
        d | (u64::from(base >> 24) << 56)
    }

    const GDT: u32 = 0x1000;
    const OLD_TSS: u32 = 0x2000;
    const NEW_TSS: u32 = 0x3000;

    /// GDT: 1 code (0x08), 2 data (0x10), 3 old TSS busy (0x18), 4 new TSS
    /// available (0x20), 5 LDT (0x28), 6 not-present data (0x30), 7 a
    /// ring-3 code (0x3b).
    fn machine() -> (TaskCpu, Mem) {
        let mut m = Mem::default();
        let gdt = [
            0,
            desc(0, 0xfffff, 0xa, true, 0, true, true),
            desc(0, 0xfffff, 0x2, true, 0, true, true),
            desc(OLD_TSS, 0x67, 0xb, false, 0, true, false),
            desc(NEW_TSS, 0x67, 0x9, false, 0, true, false),
            desc(0x4000, 0x17, 0x2, false, 0, true, false),
            desc(0, 0xfffff, 0x2, true, 0, false, true),
            desc(0, 0xfffff, 0xa, true, 3, true, true),
        ];
        for (i, d) in gdt.iter().enumerate() {
            m.put(GDT + 8 * i as u32, &d.to_le_bytes());
        }
        // The new task: EIP 0x5000, EFLAGS 0x202, registers 1..8, CS 0x08,
        // SS/DS/ES 0x10, FS/GS null, LDT 0x28, CR3 0x9000.
        m.put(NEW_TSS + 0x1c, &0x9000u32.to_le_bytes());
        m.put(NEW_TSS + 0x20, &0x5000u32.to_le_bytes());
        m.put(NEW_TSS + 0x24, &0x202u32.to_le_bytes());
        for i in 0..8u32 {
            m.put(NEW_TSS + 0x28 + 4 * i, &(i + 1).to_le_bytes());
        }
        for (i, s) in [0x10u16, 0x08, 0x10, 0x10, 0, 0].iter().enumerate() {
            m.put(NEW_TSS + 0x48 + 4 * i as u32, &s.to_le_bytes());
        }
        m.put(NEW_TSS + 0x60, &0x28u16.to_le_bytes());
        let code = Seg {
            selector: 0x08,
            base: 0,
            limit: 0xffff_ffff,
            ar: 0xc09b,
        };
        let data = Seg {
            selector: 0x10,
            base: 0,
            limit: 0xffff_ffff,
            ar: 0xc093,
        };
        let cpu = TaskCpu {
            gpr: [0xa0, 0xa1, 0xa2, 0xa3, 0x8000, 0xa5, 0xa6, 0xa7],
            eip: 0x100,
            eflags: 0x246,
            seg: [data, code, data, data, data, data],
            ldtr: Seg {
                ar: AR_UNUSABLE,
                ..Seg::default()
            },
            tr: Seg {
                selector: 0x18,
                base: OLD_TSS,
                limit: 0x67,
                ar: 0x8b,
            },
            gdtr: (GDT, 8 * 8 - 1),
            cr0: 0x11,
            cr3: 0,
        };
        (cpu, m)
    }

    fn req(source: Source, selector: u16) -> Request {
        Request {
            selector,
            source,
            return_eip: 0x105,
            error_code: None,
        }
    }

    #[test]
    fn a_call_saves_the_old_task_links_and_loads_the_new() {
        let (mut cpu, mut m) = machine();
        let out = switch(&mut cpu, &mut m, req(Source::Call, 0x20));
        assert_eq!(out, Outcome::Switched { debug_trap: false });
        // Old TSS: EIP after the CALL, EFLAGS, registers, selectors.
        assert_eq!(m.u32(OLD_TSS + 0x20), 0x105);
        assert_eq!(m.u32(OLD_TSS + 0x24), 0x246);
        assert_eq!(m.u32(OLD_TSS + 0x28), 0xa0);
        assert_eq!(m.u32(OLD_TSS + 0x38), 0x8000, "ESP");
        assert_eq!(m.u32(OLD_TSS + 0x4c) & 0xffff, 0x08, "CS");
        // The back link, NT, both busy.
        assert_eq!(m.u32(NEW_TSS) & 0xffff, 0x18);
        assert_ne!(cpu.eflags & EFLAGS_NT, 0);
        assert_eq!((m.u64(GDT + 0x20) >> 40) & 0xf, 0xb, "new busy");
        assert_eq!((m.u64(GDT + 0x18) >> 40) & 0xf, 0xb, "old stays busy");
        // The new state.
        assert_eq!(cpu.eip, 0x5000);
        assert_eq!(cpu.gpr, [1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(cpu.tr.selector, 0x20);
        assert_eq!(cpu.tr.base, NEW_TSS);
        assert_eq!(cpu.tr.ar & 0xf, 0xb);
        assert_eq!(cpu.seg[CS].selector, 0x08);
        assert_eq!(cpu.seg[FS].ar & AR_UNUSABLE, AR_UNUSABLE);
        assert_eq!(cpu.ldtr.base, 0x4000);
        assert_ne!(cpu.cr0 & CR0_TS, 0);
        assert_eq!(cpu.cr3, 0, "no paging, CR3 untouched");
    }

    #[test]
    fn a_jmp_frees_the_old_descriptor_and_an_iret_goes_back() {
        let (mut cpu, mut m) = machine();
        assert_eq!(
            switch(&mut cpu, &mut m, req(Source::Jmp, 0x20)),
            Outcome::Switched { debug_trap: false }
        );
        assert_eq!((m.u64(GDT + 0x18) >> 40) & 0xf, 0x9, "old available");
        assert_eq!(cpu.eflags & EFLAGS_NT, 0, "no link, no NT");
        // IRET to an available TSS is #TS.
        let (mut cpu, mut m) = machine();
        assert_eq!(
            switch(&mut cpu, &mut m, req(Source::Iret, 0x20)),
            Outcome::FaultBefore(Fault::Ts(0x20))
        );
        // CALL then IRET: back in the old task, the new one available.
        let (mut cpu, mut m) = machine();
        switch(&mut cpu, &mut m, req(Source::Call, 0x20));
        let back = Request {
            return_eip: 0x5003,
            ..req(Source::Iret, 0x18)
        };
        assert_eq!(
            switch(&mut cpu, &mut m, back),
            Outcome::Switched { debug_trap: false }
        );
        assert_eq!(cpu.eip, 0x105);
        assert_eq!(cpu.gpr[4], 0x8000);
        assert_eq!((m.u64(GDT + 0x20) >> 40) & 0xf, 0x9);
        assert_eq!(
            m.u32(NEW_TSS + 0x24) & EFLAGS_NT,
            0,
            "NT cleared in the saved image"
        );
    }

    #[test]
    fn bad_descriptors_fault_before_anything_changes() {
        for (sel, source, fault) in [
            (0x24, Source::Call, Fault::Gp(0x24)), // in the LDT
            (0x80, Source::Jmp, Fault::Gp(0x80)),  // past the GDT
            (0x10, Source::Call, Fault::Gp(0x10)), // a data segment
            (0x18, Source::Call, Fault::Gp(0x18)), // busy
        ] {
            let (mut cpu, mut m) = machine();
            let before = cpu.clone();
            let gdt_before: Vec<u64> = (0..8).map(|i| m.u64(GDT + 8 * i)).collect();
            assert_eq!(
                switch(&mut cpu, &mut m, req(source, sel)),
                Outcome::FaultBefore(fault),
                "{sel:#x} {source:?}"
            );
            assert_eq!(cpu, before);
            let gdt_after: Vec<u64> = (0..8).map(|i| m.u64(GDT + 8 * i)).collect();
            assert_eq!(gdt_after, gdt_before);
        }
        // Not present: #NP; too small: #TS.
        let (mut cpu, mut m) = machine();
        m.put(
            GDT + 0x20,
            &desc(NEW_TSS, 0x67, 0x9, false, 0, false, false).to_le_bytes(),
        );
        assert_eq!(
            switch(&mut cpu, &mut m, req(Source::Call, 0x20)),
            Outcome::FaultBefore(Fault::Np(0x20))
        );
        let (mut cpu, mut m) = machine();
        m.put(
            GDT + 0x20,
            &desc(NEW_TSS, 0x50, 0x9, false, 0, true, false).to_le_bytes(),
        );
        assert_eq!(
            switch(&mut cpu, &mut m, req(Source::Call, 0x20)),
            Outcome::FaultBefore(Fault::Ts(0x20))
        );
    }

    #[test]
    fn privilege_was_checked_before_the_exit_and_eflags_keep_their_reserved_bits() {
        // A ring-3 CALL through a task gate reaches a DPL-0 TSS: the gate's
        // DPL was checked, the TSS's is not.
        let (mut cpu, mut m) = machine();
        cpu.seg[CS].selector = 0x3b;
        m.put(NEW_TSS + 0x24, &0xffff_ffffu32.to_le_bytes());
        assert_eq!(
            switch(&mut cpu, &mut m, req(Source::Call, 0x23)),
            Outcome::Switched { debug_trap: false }
        );
        assert_eq!(cpu.eflags & !EFLAGS_DEFINED, 2, "{:#x}", cpu.eflags);
        // Invalid PDPTEs for the new CR3 are #GP(0) in the new task, with
        // the old CR3 kept.
        struct NoPae(Mem);
        impl Linear for NoPae {
            fn read(&mut self, la: u32, buf: &mut [u8]) -> Result<(), u32> {
                self.0.read(la, buf)
            }
            fn write(&mut self, la: u32, buf: &[u8]) -> Result<(), u32> {
                self.0.write(la, buf)
            }
            fn set_cr3(&mut self, _: u32) -> Result<(), BadPdptes> {
                Err(BadPdptes)
            }
        }
        let (mut cpu, m) = machine();
        cpu.cr0 |= CR0_PG;
        cpu.cr3 = 0x7000;
        let mut m = NoPae(m);
        assert_eq!(
            switch(&mut cpu, &mut m, req(Source::Jmp, 0x20)),
            Outcome::FaultAfter(Fault::Gp(0))
        );
        assert_eq!(cpu.cr3, 0x7000);
        assert_eq!(cpu.tr.selector, 0x20);
    }

    #[test]
    fn bad_segments_in_the_new_tss_fault_in_the_new_task() {
        // DS not present: #NP after the commit point, TR already new.
        let (mut cpu, mut m) = machine();
        m.put(NEW_TSS + 0x54, &0x30u16.to_le_bytes());
        assert_eq!(
            switch(&mut cpu, &mut m, req(Source::Jmp, 0x20)),
            Outcome::FaultAfter(Fault::Np(0x30))
        );
        assert_eq!(cpu.tr.selector, 0x20);
        assert_eq!(cpu.seg[DS].selector, 0x30);
        // A null CS, an SS whose RPL is not the CPL, a ring-3 CS with a
        // ring-0 SS, an LDT selector that is not an LDT: #TS.
        for (off, sel, fault) in [
            (0x4c, 0x00u16, Fault::Ts(0)),
            (0x50, 0x13, Fault::Ts(0x13)),
            (0x4c, 0x3b, Fault::Ts(0x10)),
            (0x60, 0x10, Fault::Ts(0x10)),
        ] {
            let (mut cpu, mut m) = machine();
            m.put(NEW_TSS + off, &sel.to_le_bytes());
            let old_cs = cpu.seg[CS];
            assert_eq!(
                switch(&mut cpu, &mut m, req(Source::Call, 0x20)),
                Outcome::FaultAfter(fault),
                "{off:#x} = {sel:#x}"
            );
            // CS and SS never half-load: the old pair stays with the new TR.
            assert_eq!(cpu.seg[CS], old_cs);
            assert_eq!(cpu.tr.selector, 0x20);
        }
    }

    #[test]
    fn a_gate_pushes_the_error_code_and_the_t_bit_asks_for_a_trap() {
        let (mut cpu, mut m) = machine();
        m.put(NEW_TSS + 0x64, &1u16.to_le_bytes());
        let r = Request {
            error_code: Some(0x1234),
            return_eip: 0x100,
            ..req(Source::Gate, 0x20)
        };
        assert_eq!(
            switch(&mut cpu, &mut m, r),
            Outcome::Switched { debug_trap: true }
        );
        assert_eq!(cpu.gpr[4], 5 - 4);
        assert_eq!(m.u32(1), 0x1234);
        assert_eq!(m.u32(OLD_TSS + 0x20), 0x100);
        assert_eq!(m.u32(NEW_TSS) & 0xffff, 0x18, "a gate links like a call");
    }

    #[test]
    fn paging_loads_cr3_and_walks_32_bit_and_pae_tables() {
        let (mut cpu, mut m) = machine();
        cpu.cr0 |= CR0_PG;
        switch(&mut cpu, &mut m, req(Source::Jmp, 0x20));
        assert_eq!(cpu.cr3, 0x9000);

        struct P(HashMap<u64, u8>);
        impl Phys for P {
            fn read(&self, gpa: u64, buf: &mut [u8]) -> bool {
                for (i, b) in buf.iter_mut().enumerate() {
                    *b = *self.0.get(&(gpa + i as u64)).unwrap_or(&0);
                }
                gpa < 1 << 32
            }
            fn write(&mut self, gpa: u64, buf: &[u8]) -> bool {
                for (i, b) in buf.iter().enumerate() {
                    self.0.insert(gpa + i as u64, *b);
                }
                true
            }
        }
        let mut p = P(HashMap::new());
        fn put(p: &mut P, at: u64, v: u64, n: usize) {
            for i in 0..n {
                p.0.insert(at + i as u64, (v >> (8 * i)) as u8);
            }
        }
        // 32-bit: PDE 1 -> table at 0x20000; PTE 2 -> frame 0x55000. PDE 2
        // is a 4 MiB page at 0x1_0040_0000 (PSE-36 bits).
        put(&mut p, 0x10004, 0x20001, 4);
        put(&mut p, 0x20008, 0x55003, 4);
        put(&mut p, 0x10008, 0x0040_2083, 4);
        // PAE: PDPTE 0 -> directory 0x30000; PDE 0 -> table 0x31000; PTE 3
        // -> 0x77000.
        put(&mut p, 0x30000, 0x31001, 8);
        put(&mut p, 0x31018, 0x77003, 8);
        let bits32 = LegacyPaging::Bits32 {
            cr3: 0x10000,
            pse: true,
        };
        assert_eq!(bits32.translate(&p, 0x0040_2abc, false), Ok(0x55abc));
        assert_eq!(bits32.translate(&p, 0x0080_1234, false), Ok(0x1_0040_1234));
        assert_eq!(bits32.translate(&p, 0x00c0_0000, true), Err(PF_WRITE));
        let pae = LegacyPaging::Pae {
            pdptes: [0x30001, 0, 0, 0],
        };
        assert_eq!(pae.translate(&p, 0x3def, false), Ok(0x77def));
        assert_eq!(pae.translate(&p, 0x4000_0000, false), Err(0));
        // A new CR3 in PAE mode reloads the PDPTEs.
        put(&mut p, 0x40000, 0x30001, 8);
        let mut l = LegacyLinear {
            paging: LegacyPaging::Pae { pdptes: [0; 4] },
            phys: &mut p,
            pdptes_changed: false,
        };
        assert_eq!(l.set_cr3(0x40000), Ok(()));
        assert!(l.pdptes_changed);
        let mut b = [0u8; 1];
        assert_eq!(Linear::read(&mut l, 0x3000, &mut b), Ok(()));
        // A PDPTE with a reserved bit: refused, the old ones stay.
        let mut p2 = P(HashMap::new());
        put(&mut p2, 0x50000, 0x30001 | 1 << 7, 8);
        let mut l = LegacyLinear {
            paging: LegacyPaging::Pae { pdptes: [7; 4] },
            phys: &mut p2,
            pdptes_changed: false,
        };
        assert_eq!(l.set_cr3(0x50000), Err(BadPdptes));
        assert!(!l.pdptes_changed);
        assert_eq!(l.paging, LegacyPaging::Pae { pdptes: [7; 4] });
    }
}
