// SPDX-License-Identifier: GPL-2.0
/*
 * hvattack: the hostile guest module of hvtrace's VM tests. It tries what
 * a rootkit would try against the tracer's hidden patches, from inside the
 * guest kernel, and reports each outcome in the kernel log as one line
 * starting with "hvattack:". The test reads those lines and the
 * hypervisor's counters.
 *
 * Parameters (addresses as the test finds them in /proc/kallsyms and in
 * the hypervisor's status):
 *   func=ADDR    read the first 9 bytes of this (hooked) function
 *   tramp=ADDR   the trampoline page: write to it through its physical
 *                frame, clear the page-table entry that maps it
 *   vmcall=1     execute VMCALL in kernel mode, outside the trampolines
 *   reads=N      with func: time N reads of its first 9 bytes (the cost of
 *                a guest read of a hooked page: the split view's round
 *                trip), counting the reads that do not show the fentry NOP5
 *                at the start or after an ENDBR64 (the guest's own bytes,
 *                which a hooked page must keep showing)
 *   nmi_storm=N  route PIT interrupts to NMI through the IOAPIC while
 *                exiting to root N thousand times (CPUID), with a gate
 *                of our own at guest-physical page 0 (where a host IDT base
 *                of 0 would point). If that gate ever runs in VMX root it
 *                prints "hvattack: NMI gate ran in VMX root" on port 0xE9.
 *   forge_e9=1   write forged hypervisor log lines to port 0xE9
 *   cr0_nw=1     MOV to CR0 with NW set and CD clear (must #GP)
 *   bad_xsetbv=1 XSETBV with AVX-512 and MPX bits half set (must #GP)
 *   getsec=1     GETSEC (must #UD: SMX is not offered)
 *   straddle=1   4-byte port accesses that straddle the control UART
 *   pci_dma=1    turn on bus mastering of the IDE controller, move its
 *                bus-master I/O BAR, and program its PRD table register
 *                (the way to make the controller DMA into any address)
 *   hwbp=1       with func: a hardware data breakpoint (DR0..3, through
 *                perf) on the function's first byte, then a read of it:
 *                the breakpoint must fire even though the page is hooked
 *                and the read is single-stepped by the hypervisor
 *   apic_base=1  move the local APIC's MMIO window to 31 MiB, inside the
 *                hypervisor's memory (must #GP), then put it back
 *   stacks=1     print THREAD_SIZE, this task's stack and the stack pointer
 *                of a hard irq_work (the CPU's IRQ stack); nmi_storm also
 *                prints the stack pointer of the first NMI it sees
 *   forge_entry=ADDR  with forge_site: jump to the entry trampoline's VMCALL
 *                at ADDR three times with forged registers (a pt_regs
 *                whose ip is not the site's, RDI not RSP, a site that is
 *                not hooked); the forged pt_regs brings us back each time
 *   forge_site=ADDR  a hooked fentry site
 *   forge_rax=N  the entry hypercall's number (RAX at the VMCALL)
 *   pm1_string=PORT  string I/O (rep insw, outsw, rep outsb) on the ACPI
 *                PM1a control port PORT, and rep insl on PCI configuration
 *                data: each must move the same data as plain IN/OUT
 *   forge_pgd=ADDR  with forge_pd and forge_hold: the kernel's own top-level
 *                table (init_top_pgt). Its last entry is pointed at a copy
 *                of the kernel's PDPT whose entry 510 (the kernel image's
 *                1 GiB) names forge_pd as its page directory; the forge is
 *                held forge_hold seconds with interrupts off, then undone.
 *                The running task's own top-level table keeps the real
 *                entry, so this code stays mapped. "hvattack: pdpt forged"
 *                goes straight to COM1 once the forge is in place.
 *   btf=ADDR     the kernel's BTF header (__start_BTF): shorten its type
 *                section by 4 bytes, through a writable alias of the page,
 *                so that a reader walks every type and only then finds the
 *                last one cut; rmmod puts the length back
 *
 *   hv_fetch=PHYS  call into the physical frame PHYS (hypervisor memory)
 *                through an executable alias of it; a #UD there is caught
 *                (a die notifier returns to the caller) and reported
 *   step_storm=N with func: N reads of the hooked function while an
 *                hrtimer fires every 10 us and the task moves itself
 *                between the online CPUs every 64 reads: interrupts land
 *                in the middle of the hypervisor's single steps, and the
 *                stepped contexts resume on the other CPU
 *   ioapic_init=1  route the PIT through the IOAPIC in delivery mode INIT
 *                to APIC 1 for about 50 ms, and report what the entry
 *                reads back
 *   lint_init=1  write LVT LINT0 of this CPU's local APIC in delivery mode
 *                INIT (masked), report what it reads back, and put it back
 *
 * Loading fails with -EAGAIN once the attempts are done, so the module can
 * be loaded again with other parameters; except with forge_pgd and btf,
 * where it stays loaded (busybox insmod runs a failed init a second time,
 * which would repeat the attack) until rmmod.
 */
#include <linux/module.h>
#include <linux/kernel.h>
#include <linux/uaccess.h>
#include <linux/io.h>
#include <linux/mm.h>
#include <linux/ktime.h>
#include <linux/string.h>
#include <linux/pgtable.h>
#include <asm/tlbflush.h>
#include <asm/special_insns.h>
#include <asm/processor.h>
#include <asm/asm.h>
#include <linux/delay.h>
#include <linux/hw_breakpoint.h>
#include <linux/perf_event.h>
#include <linux/gfp.h>
#include <asm/io_apic.h>
#include <asm/fixmap.h>
#include <asm/fpu/xcr.h>
#include <asm/nmi.h>
#include <linux/irq_work.h>
#include <linux/sched/task_stack.h>
#include <asm/tsc.h>
#include <linux/vmalloc.h>
#include <asm/msr.h>
#include <asm/apic.h>
#include <linux/kdebug.h>
#include <asm/trapnr.h>
#include <linux/hrtimer.h>
#include <linux/sched.h>
#include <linux/cpumask.h>

static unsigned long func;
module_param(func, ulong, 0);
static unsigned long tramp;
module_param(tramp, ulong, 0);
static int vmcall;
module_param(vmcall, int, 0);
static int clear_pmd;
module_param(clear_pmd, int, 0);
static int reads;
module_param(reads, int, 0);
static int nmi_storm;
module_param(nmi_storm, int, 0);
static int forge_e9;
module_param(forge_e9, int, 0);
static int cr0_nw;
module_param(cr0_nw, int, 0);
static int bad_xsetbv;
module_param(bad_xsetbv, int, 0);
static int getsec;
module_param(getsec, int, 0);
static int straddle;
module_param(straddle, int, 0);
static int apic_base;
module_param(apic_base, int, 0);
static int pci_dma;
module_param(pci_dma, int, 0);
static int pm1_string;
module_param(pm1_string, int, 0);
static int stacks;
module_param(stacks, int, 0);
static unsigned long forge_entry;
module_param(forge_entry, ulong, 0);
static unsigned long forge_site;
module_param(forge_site, ulong, 0);
static unsigned long forge_rax;
module_param(forge_rax, ulong, 0);
static int hwbp;
module_param(hwbp, int, 0);
static unsigned long forge_pgd;
module_param(forge_pgd, ulong, 0);
static unsigned long forge_pd;
module_param(forge_pd, ulong, 0);
static int forge_hold;
module_param(forge_hold, int, 0);
static unsigned long btf;
module_param(btf, ulong, 0);

/* One read of func's first 9 bytes: counted in *bad when it faults, in
 * *other when it shows neither the fentry NOP5 at the start nor one
 * after an ENDBR64 (the guest's own bytes, which a hooked page must keep
 * showing). */
static void read_nop5(int *bad, int *other)
{
	static const u8 nop5[5] = { 0x0f, 0x1f, 0x44, 0x00, 0x00 };
	static const u8 endbr64[4] = { 0xf3, 0x0f, 0x1e, 0xfa };
	u8 b[9];

	if (copy_from_kernel_nofault(b, (void *)func, sizeof(b)))
		(*bad)++;
	else if (memcmp(b, nop5, sizeof(nop5)) &&
		 (memcmp(b, endbr64, sizeof(endbr64)) ||
		  memcmp(b + sizeof(endbr64), nop5, sizeof(nop5))))
		(*other)++;
}

static void time_reads(void)
{
	u64 t0, t;
	int i, bad = 0, other = 0;

	t0 = ktime_get_ns();
	for (i = 0; i < reads; i++)
		read_nop5(&bad, &other);
	t = ktime_get_ns() - t0;
	pr_info("hvattack: timed %d reads of %lx: %llu ns (%d faulted, %d not a nop5)\n",
		reads, func, t, bad, other);
}

static void read_func(void)
{
	u8 b[9];

	if (copy_from_kernel_nofault(b, (void *)func, sizeof(b))) {
		pr_info("hvattack: read %lx faulted\n", func);
		return;
	}
	pr_info("hvattack: read %lx: %*phN\n", func, (int)sizeof(b), b);
}

static pmd_t *tramp_pmd(void)
{
	/* init_mm is not exported: walk from CR3 (the kernel PGD here). */
	pgd_t *pgd = (pgd_t *)__va(read_cr3_pa()) + pgd_index(tramp);
	p4d_t *p4d;
	pud_t *pud;

	if (pgd_none(*pgd))
		return NULL;
	p4d = p4d_offset(pgd, tramp);
	if (p4d_none(*p4d))
		return NULL;
	pud = pud_offset(p4d, tramp);
	if (pud_none(*pud) || pud_leaf(*pud))
		return NULL;
	return pmd_offset(pud, tramp);
}

/*
 * Our page-table page is outside the guest's RAM, so the kernel's own
 * walkers (lookup_address) cannot read it through the direct map: map the
 * frames by physical address instead, as an attacker with kernel rights
 * would.
 */
static void attack_tramp(void)
{
	pmd_t *pmd = tramp_pmd();
	phys_addr_t pt_phys, code_phys;
	void __iomem *pt, *code;
	unsigned int idx = pte_index(tramp);
	u64 pte, pte_after;
	u8 before, after;

	if (!pmd || !(pmd_val(*pmd) & _PAGE_PRESENT) || pmd_leaf(*pmd)) {
		pr_info("hvattack: tramp %lx has no page table\n", tramp);
		return;
	}
	pt_phys = pmd_val(*pmd) & PTE_PFN_MASK;
	pt = ioremap(pt_phys, PAGE_SIZE);
	if (!pt) {
		pr_info("hvattack: ioremap of the page table failed\n");
		return;
	}
	pte = readq(pt + idx * 8);
	code_phys = pte & PTE_PFN_MASK;
	writeq(0, pt + idx * 8);
	pte_after = readq(pt + idx * 8);
	iounmap(pt);
	pr_info("hvattack: cleared pte %llx: now %llx\n", pte, pte_after);

	code = ioremap(code_phys, PAGE_SIZE);
	if (!code) {
		pr_info("hvattack: ioremap of the trampoline page failed\n");
		return;
	}
	before = readb(code);
	writeb(before ^ 0xff, code);
	after = readb(code);
	iounmap(code);
	pr_info("hvattack: wrote tramp frame %pa: before %02x after %02x (sees %02x through the mapping)\n",
		&code_phys, before, after, *(volatile u8 *)tramp);

	if (!clear_pmd)
		return;
	pr_info("hvattack: clearing pmd %016llx\n", (unsigned long long)pmd_val(*pmd));
	set_pmd(pmd, __pmd(0));
	__flush_tlb_all();
	pr_info("hvattack: pmd now %016llx\n", (unsigned long long)pmd_val(*pmd));
}

static void try_vmcall(void)
{
	int ud = 1;

	asm volatile("1: vmcall\n\t"
		     "movl $0, %0\n\t"
		     "2:\n\t"
		     _ASM_EXTABLE(1b, 2b)
		     : "+r"(ud)
		     : "a"(0x48565401UL)
		     : "memory");
	pr_info("hvattack: vmcall %s\n", ud ? "raised #UD" : "returned");
}

/*
 * The code an attacker wants VMX root to run: position independent, it
 * prints one line on the hypervisor's log port the first time it runs,
 * then returns from the interrupt. It is copied to a page below 4 GiB,
 * where root's identity map would find it.
 */
asm(".pushsection .rodata\n"
    ".globl hva_gate_code\n"
    "hva_gate_code:\n"
    "	push %rax\n"
    "	push %rdx\n"
    "	push %rsi\n"
    "	cld\n"
    "	cmpb $0, hva_gate_once(%rip)\n"
    "	jne 2f\n"
    "	movb $1, hva_gate_once(%rip)\n"
    "	lea hva_gate_msg(%rip), %rsi\n"
    "	mov $0xe9, %dx\n"
    "1:	lodsb\n"
    "	test %al, %al\n"
    "	jz 2f\n"
    "	outb %al, %dx\n"
    "	jmp 1b\n"
    "2:	pop %rsi\n"
    "	pop %rdx\n"
    "	pop %rax\n"
    "	iretq\n"
    "hva_gate_once: .byte 0\n"
    "hva_gate_msg: .asciz \"hvattack: NMI gate ran in VMX root\\n\"\n"
    ".globl hva_gate_code_end\n"
    "hva_gate_code_end:\n"
    ".popsection\n");
extern const u8 hva_gate_code[], hva_gate_code_end[];

#define IOAPIC_BASE 0xfec00000UL
#define PIT_PIN 2
#define HPET_BASE 0xfed00000UL
#define HPET_CFG_LEGACY_ROUTE 2

static u32 ioapic_read(void __iomem *io, unsigned int reg)
{
	writel(reg, io);
	return readl(io + 0x10);
}

static void ioapic_write(void __iomem *io, unsigned int reg, u32 val)
{
	writel(reg, io);
	writel(val, io + 0x10);
}

/* The PIT's I/O APIC pin routed by an attack, and what to put back. */
struct pit_route {
	void __iomem *io, *hpet;
	u32 lo, hi, hpet_cfg;
	u32 wrote, reads;
};

/* Routes the PIT's pin as (lo, hi), takes it back from the HPET's legacy
 * replacement, and runs the PIT at about 6 kHz. Returns 0 when the I/O
 * APIC could not be mapped (nothing changed). */
static int pit_route_start(struct pit_route *r, u32 lo, u32 hi)
{
	r->io = ioremap(IOAPIC_BASE, PAGE_SIZE);
	if (!r->io) {
		pr_info("hvattack: cannot map the IOAPIC\n");
		return 0;
	}
	r->lo = ioapic_read(r->io, 0x10 + 2 * PIT_PIN);
	r->hi = ioapic_read(r->io, 0x11 + 2 * PIT_PIN);
	ioapic_write(r->io, 0x11 + 2 * PIT_PIN, hi);
	ioapic_write(r->io, 0x10 + 2 * PIT_PIN, lo);
	r->wrote = lo;
	r->reads = ioapic_read(r->io, 0x10 + 2 * PIT_PIN);
	/* With the HPET in legacy replacement mode, the PIT is cut off from
	 * IRQ0: route it back. */
	r->hpet = ioremap(HPET_BASE, PAGE_SIZE);
	if (r->hpet) {
		r->hpet_cfg = readl(r->hpet + 0x10);
		writel(r->hpet_cfg & ~HPET_CFG_LEGACY_ROUTE, r->hpet + 0x10);
	}
	/* PIT channel 0, mode 2 (rate generator), divisor 200: about 6 kHz. */
	outb(0x34, 0x43);
	outb(200 & 0xff, 0x40);
	outb(200 >> 8, 0x40);
	return 1;
}

/* Quiets the PIT (one-shot, mode 0) and puts the pin and the HPET back. */
static void pit_route_end(struct pit_route *r)
{
	outb(0x30, 0x43);
	outb(0, 0x40);
	outb(0, 0x40);
	ioapic_write(r->io, 0x10 + 2 * PIT_PIN, r->lo | (1 << 16));
	ioapic_write(r->io, 0x11 + 2 * PIT_PIN, r->hi);
	ioapic_write(r->io, 0x10 + 2 * PIT_PIN, r->lo);
	iounmap(r->io);
	if (r->hpet) {
		writel(r->hpet_cfg, r->hpet + 0x10);
		iounmap(r->hpet);
	}
}

/* The stack pointer of the first NMI seen during the storm. */
static unsigned long nmi_sp;

static int hva_nmi(unsigned int type, struct pt_regs *regs)
{
	if (!READ_ONCE(nmi_sp))
		WRITE_ONCE(nmi_sp, current_stack_pointer);
	return NMI_DONE;
}

static void storm(void)
{
	struct pit_route route;
	u8 *low, *code;
	u8 saved[16];
	u64 gate, stub;
	unsigned long exits = 0, flags;
	unsigned int eax, ebx, ecx, edx;
	u64 t0;

	code = (u8 *)__get_free_page(GFP_KERNEL | GFP_DMA32);
	if (!code) {
		pr_info("hvattack: no page for the gate code\n");
		return;
	}
	memcpy(code, hva_gate_code, hva_gate_code_end - hva_gate_code);
	stub = virt_to_phys(code);
	/* An interrupt gate at 0x20 (vector 2 of an IDT based at 0): code
	 * selector 0x08, as root's GDT has it, present, DPL 0. */
	gate = (stub & 0xffff) | (0x08ULL << 16) | (0x8eULL << 40) | ((stub >> 16) & 0xffff) << 48;
	low = memremap(0, PAGE_SIZE, MEMREMAP_WB);
	if (!low) {
		pr_info("hvattack: cannot map guest-physical page 0\n");
		free_page((unsigned long)code);
		return;
	}
	memcpy(saved, low + 0x20, 16);
	memcpy(low + 0x20, &gate, 8);
	*(u64 *)(low + 0x28) = stub >> 32;

	/* Delivery mode NMI (100b), edge, physical destination APIC 0, unmasked. */
	if (!pit_route_start(&route, 4 << 8, 0))
		goto out_low;

	nmi_sp = 0;
	register_nmi_handler(NMI_LOCAL, hva_nmi, 0, "hvattack");
	t0 = ktime_get_ns();
	local_irq_save(flags);
	/* CPUID exits to root every time: most of the storm lands there. */
	for (exits = 0; exits < (unsigned long)nmi_storm * 1000; exits++) {
		eax = 0;
		ecx = 0;
		native_cpuid(&eax, &ebx, &ecx, &edx);
	}
	local_irq_restore(flags);
	t0 = ktime_get_ns() - t0;

	pit_route_end(&route);
	unregister_nmi_handler(NMI_LOCAL, "hvattack");
	pr_info("hvattack: nmi storm: %lu exits in %llu ms\n", exits, t0 / 1000000);
	pr_info("hvattack: nmi sp %lx\n", nmi_sp);
out_low:
	memcpy(low + 0x20, saved, 16);
	memunmap(low);
	free_page((unsigned long)code);
}

static unsigned long hv_fetch;
module_param(hv_fetch, ulong, 0);
static int step_storm;
module_param(step_storm, int, 0);
static int ioapic_init;
module_param(ioapic_init, int, 0);
static int lint_init;
module_param(lint_init, int, 0);

/* The executable alias hv_fetch calls into, and whether its #UD came. */
static unsigned long fetch_at;
static int fetch_ud;

static int hva_die(struct notifier_block *nb, unsigned long val, void *data)
{
	struct die_args *args = data;
	struct pt_regs *regs = args->regs;

	if (!fetch_at || args->trapnr != X86_TRAP_UD ||
	    (regs->ip & PAGE_MASK) != fetch_at)
		return NOTIFY_DONE;
	/* Return to the caller, as a `ret` at the target would. */
	regs->ip = *(unsigned long *)regs->sp;
	regs->sp += 8;
	fetch_ud++;
	return NOTIFY_STOP;
}

static struct notifier_block hva_die_nb = { .notifier_call = hva_die };

static void try_hv_fetch(void)
{
	struct page *page = pfn_to_page(hv_fetch >> PAGE_SHIFT);
	unsigned int level;
	void *alias;
	pte_t *pte;

	if (!pfn_valid(hv_fetch >> PAGE_SHIFT)) {
		pr_info("hvattack: hv fetch: no struct page for %lx\n", hv_fetch);
		return;
	}
	alias = vmap(&page, 1, VM_MAP, PAGE_KERNEL);
	if (!alias) {
		pr_info("hvattack: hv fetch: vmap failed\n");
		return;
	}
	/* vmap keeps NX whatever it is asked: clear it in the alias's own
	 * entry (never used before, so no other CPU caches it). */
	pte = lookup_address((unsigned long)alias, &level);
	if (!pte || level != PG_LEVEL_4K) {
		pr_info("hvattack: hv fetch: no 4K entry for the alias\n");
		vunmap(alias);
		return;
	}
	set_pte(pte, pte_mkexec(*pte));
	asm volatile("invlpg (%0)" : : "r"(alias) : "memory");
	register_die_notifier(&hva_die_nb);
	fetch_ud = 0;
	WRITE_ONCE(fetch_at, (unsigned long)alias);
	asm volatile("call *%0" : : "r"(alias + (hv_fetch & ~PAGE_MASK))
		     : "memory", "rax", "rcx", "rdx", "rsi", "rdi", "r8", "r9", "r10", "r11");
	WRITE_ONCE(fetch_at, 0);
	unregister_die_notifier(&hva_die_nb);
	vunmap(alias);
	pr_info("hvattack: hv fetch %lx: returned, %d #UD\n", hv_fetch, fetch_ud);
}

static atomic_t storm_fires = ATOMIC_INIT(0);

static enum hrtimer_restart storm_tick(struct hrtimer *t)
{
	atomic_inc(&storm_fires);
	hrtimer_forward_now(t, ns_to_ktime(10000));
	return HRTIMER_RESTART;
}

static void try_step_storm(void)
{
	struct hrtimer timer;
	int i, bad = 0, other = 0, moves = 0, cpu;

	hrtimer_init(&timer, CLOCK_MONOTONIC, HRTIMER_MODE_REL);
	timer.function = storm_tick;
	atomic_set(&storm_fires, 0);
	hrtimer_start(&timer, ns_to_ktime(10000), HRTIMER_MODE_REL);
	for (i = 0; i < step_storm; i++) {
		read_nop5(&bad, &other);
		if (i % 64 == 63) {
			cpu = cpumask_next(raw_smp_processor_id(), cpu_online_mask);
			if (cpu >= nr_cpu_ids)
				cpu = cpumask_first(cpu_online_mask);
			if (!set_cpus_allowed_ptr(current, cpumask_of(cpu)))
				moves++;
		}
	}
	hrtimer_cancel(&timer);
	set_cpus_allowed_ptr(current, cpu_online_mask);
	pr_info("hvattack: step storm: %d reads of %lx (%d faulted, %d not a nop5), %d moves, %d timer fires\n",
		step_storm, func, bad, other, moves, atomic_read(&storm_fires));
}

static void try_ioapic_init(void)
{
	struct pit_route route;

	/* Delivery mode INIT (101b), edge, physical destination APIC 1. */
	if (!pit_route_start(&route, 5 << 8, 1U << 24))
		return;
	mdelay(50);
	pit_route_end(&route);
	pr_info("hvattack: ioapic init: wrote %x, reads %x\n", route.wrote, route.reads);
}

static void try_lint_init(void)
{
	void __iomem *lapic;
	u32 old, after;

	if (x2apic_enabled()) {
		pr_info("hvattack: lint0 init: the APIC is in x2APIC mode\n");
		return;
	}
	lapic = ioremap(APIC_DEFAULT_PHYS_BASE, PAGE_SIZE);
	if (!lapic) {
		pr_info("hvattack: cannot map the local APIC\n");
		return;
	}
	old = readl(lapic + APIC_LVT0);
	/* Delivery mode INIT (101b), masked. */
	writel(APIC_LVT_MASKED | (5 << 8), lapic + APIC_LVT0);
	after = readl(lapic + APIC_LVT0);
	writel(old, lapic + APIC_LVT0);
	iounmap(lapic);
	pr_info("hvattack: lint0 init: wrote %x, reads %x\n",
		APIC_LVT_MASKED | (5 << 8), after);
}

static void forge_log(void)
{
	static const char lines[] =
		"hvtrace: error: forged by the guest\n"
		"hvtrace: guest stopped: forged by the guest\n";
	const char *p;

	for (p = lines; *p; p++)
		outb(*p, 0xe9);
	pr_info("hvattack: forged %zu bytes on port 0xe9\n", sizeof(lines) - 1);
}

static void write_cr0_nw(void)
{
	unsigned long cr0 = read_cr0(), bad;
	int gp = 1;

	/* NW without CD faults on every CPU; clearing NE (which root owns)
	 * makes sure the write exits rather than faulting in the guest. */
	bad = (cr0 | X86_CR0_NW) & ~(X86_CR0_CD | X86_CR0_NE);
	asm volatile("1: mov %1, %%cr0\n\t"
		     "movl $0, %0\n\t"
		     "2:\n\t"
		     _ASM_EXTABLE(1b, 2b)
		     : "+r"(gp)
		     : "r"(bad)
		     : "memory");
	pr_info("hvattack: cr0 NW without CD %s (cr0 now %lx)\n",
		gp ? "raised #GP" : "was accepted", read_cr0());
}

static void try_xsetbv(void)
{
	u64 xcr0 = xgetbv(0);
	u64 values[] = { xcr0 | (1 << 5), xcr0 | (1 << 3), xcr0 | (1ULL << 17) };
	int i;

	for (i = 0; i < ARRAY_SIZE(values); i++) {
		int gp = 1;

		asm volatile("1: xsetbv\n\t"
			     "movl $0, %0\n\t"
			     "2:\n\t"
			     _ASM_EXTABLE(1b, 2b)
			     : "+r"(gp)
			     : "a"((u32)values[i]), "d"((u32)(values[i] >> 32)), "c"(0)
			     : "memory");
		pr_info("hvattack: xsetbv %llx %s (xcr0 now %llx)\n", values[i],
			gp ? "raised #GP" : "was accepted", xgetbv(0));
	}
}

static void try_getsec(void)
{
	int ud = 1;

	asm volatile("1: .byte 0x0f, 0x37\n\t"
		     "movl $0, %0\n\t"
		     "2:\n\t"
		     _ASM_EXTABLE(1b, 2b)
		     : "+r"(ud)
		     : "a"(0)
		     : "memory");
	pr_info("hvattack: getsec %s\n", ud ? "raised #UD" : "returned");
}

static void try_straddle(void)
{
	u32 in = inl(0x2f6);

	outl(0x41424344, 0x2f6);
	outw(0x4546, 0x2f7);
	pr_info("hvattack: straddling inl(0x2f6) = %08x\n", in);
}

static void try_pm1_string(void)
{
	u16 port = (u16)pm1_string, plain = inw(port), ins[2] = { 0, 0 };
	u8 low[2];
	u32 cfg[2] = { 0, 0 }, id;
	void *p = ins;
	unsigned long n = 2;

	/* rep insw: two reads of the register into memory. */
	asm volatile("rep insw" : "+D"(p), "+c"(n) : "d"(port) : "memory");
	pr_info("hvattack: pm1 %04x rep insw %04x %04x left %lu\n", plain, ins[0],
		ins[1], n);
	/* outsw of the value it holds (no SLP_EN): a no-op write. */
	p = &plain;
	asm volatile("outsw" : "+S"(p) : "d"(port) : "memory");
	/* rep outsb: its low byte, twice. */
	low[0] = low[1] = (u8)plain;
	p = low;
	n = 2;
	asm volatile("rep outsb" : "+S"(p), "+c"(n) : "d"(port) : "memory");
	pr_info("hvattack: pm1 after outs %04x left %lu\n", inw(port), n);
	/* rep insl on PCI configuration data: the host bridge's id, twice. */
	outl(0x80000000, 0xcf8);
	id = inl(0xcfc);
	p = cfg;
	n = 2;
	asm volatile("rep insl" : "+D"(p), "+c"(n) : "d"(0xcfc) : "memory");
	pr_info("hvattack: pci id %08x rep insl %08x %08x\n", id, cfg[0], cfg[1]);
}

/*
 * The entry trampoline after its VMCALL (RAX = 0) reloads every GPR and
 * the flags from the pt_regs at RSP and returns to pt_regs.ip with RSP =
 * pt_regs + 176 (see trampolines/src/region.rs). So a forged frame of 176
 * bytes on our own stack, with ip = the label after the jump and our own
 * callee-saved registers in it, brings execution back here.
 * Offsets are struct pt_regs's: r15 0, r14 8, r13 16, r12 24, bp 32, bx 40,
 * ip 128, flags 144.
 */
static noinline void forged_entry(unsigned long rdi_delta, unsigned long site,
				  unsigned long ip_delta)
{
	asm volatile(
		"sub $176, %%rsp\n\t"
		"mov %%r15, 0(%%rsp)\n\t"
		"mov %%r14, 8(%%rsp)\n\t"
		"mov %%r13, 16(%%rsp)\n\t"
		"mov %%r12, 24(%%rsp)\n\t"
		"mov %%rbp, 32(%%rsp)\n\t"
		"mov %%rbx, 40(%%rsp)\n\t"
		"lea 1f(%%rip), %%rax\n\t"
		"add %[ipd], %%rax\n\t"
		"mov %%rax, 128(%%rsp)\n\t"
		"pushfq\n\t"
		"pop %%rax\n\t"
		"mov %%rax, 144(%%rsp)\n\t"
		"mov %%rsp, %%rdi\n\t"
		"add %[rdid], %%rdi\n\t"
		"mov %[site], %%rsi\n\t"
		"mov %[hc], %%rax\n\t"
		"jmp *%[target]\n\t"
		"1:\n\t"
		:
		: [target] "m"(forge_entry), [hc] "m"(forge_rax), [site] "r"(site),
		  [ipd] "r"(ip_delta), [rdid] "r"(rdi_delta)
		: "rax", "rcx", "rdx", "rsi", "rdi", "r8", "r9", "r10", "r11",
		  "memory", "cc");
}

static void try_forge_entry(void)
{
	/* 1: a hooked site, RDI = RSP, but pt_regs.ip is ours, not site + 5. */
	forged_entry(0, forge_site, 0);
	pr_info("hvattack: forged entry 1 (ip not the site's) came back\n");
	/* 2: RDI is not RSP (it names memory 4 KiB above the frame). */
	forged_entry(4096, forge_site, 0);
	pr_info("hvattack: forged entry 2 (rdi not rsp) came back\n");
	/* 3: a site that is not hooked (one byte into the hooked one). */
	forged_entry(0, forge_site + 1, 0);
	pr_info("hvattack: forged entry 3 (site not hooked) came back\n");
}

static unsigned long irq_sp;

static void hva_irq_work(struct irq_work *w)
{
	irq_sp = current_stack_pointer;
}

static void show_stacks(void)
{
	struct irq_work w = IRQ_WORK_INIT_HARD(hva_irq_work);

	irq_sp = 0;
	irq_work_queue(&w);
	irq_work_sync(&w);
	pr_info("hvattack: stacks thread_size %lx task %lx irq_sp %lx\n",
		(unsigned long)THREAD_SIZE, (unsigned long)task_stack_page(current), irq_sp);
}

static u32 cfg_read(u32 addr)
{
	outl(addr, 0xcf8);
	return inl(0xcfc);
}

static void cfg_write(u32 addr, u32 val)
{
	outl(addr, 0xcf8);
	outl(val, 0xcfc);
}

static void try_pci_dma(void)
{
	u32 dev, fn, addr = 0, cmd, bar, bar_after, prd;
	unsigned long flags;
	u16 base;

	for (dev = 0; dev < 32 && !addr; dev++) {
		for (fn = 0; fn < 8; fn++) {
			u32 a = 0x80000000 | (dev << 11) | (fn << 8);

			if ((cfg_read(a) & 0xffff) == 0xffff)
				continue;
			if ((cfg_read(a | 8) >> 16) == 0x0101) {
				addr = a;
				break;
			}
		}
	}
	if (!addr) {
		pr_info("hvattack: no IDE controller\n");
		return;
	}
	local_irq_save(flags);
	cmd = cfg_read(addr | 4);
	cfg_write(addr | 4, cmd | 4);
	pr_info("hvattack: ide %x bus master %s\n", addr,
		(cfg_read(addr | 4) & 4) ? "enabled" : "refused");
	cfg_write(addr | 4, cmd);
	bar = cfg_read(addr | 0x20);
	cfg_write(addr | 0x20, 0xd001);
	bar_after = cfg_read(addr | 0x20);
	cfg_write(addr | 0x20, bar);
	pr_info("hvattack: ide bus-master bar %x -> d001: %s\n", bar,
		bar_after == bar ? "refused" : "moved");
	base = bar & 0xfff0;
	outl(0x01000000, base + 4);
	prd = inl(base + 4);
	local_irq_restore(flags);
	pr_info("hvattack: ide prd table register reads %x\n", prd);
}

static atomic_t bp_hits = ATOMIC_INIT(0);

static void bp_hit(struct perf_event *bp, struct perf_sample_data *data, struct pt_regs *regs)
{
	atomic_inc(&bp_hits);
}

static void try_hwbp(void)
{
	struct perf_event_attr attr;
	struct perf_event * __percpu *bp;
	u8 b[4];
	int faulted;

	hw_breakpoint_init(&attr);
	attr.bp_addr = func;
	attr.bp_len = HW_BREAKPOINT_LEN_1;
	attr.bp_type = HW_BREAKPOINT_R | HW_BREAKPOINT_W;
	bp = register_wide_hw_breakpoint(&attr, bp_hit, NULL);
	if (IS_ERR((void __force *)bp)) {
		pr_info("hvattack: hw breakpoint not set: %ld\n", PTR_ERR((void __force *)bp));
		return;
	}
	atomic_set(&bp_hits, 0);
	faulted = copy_from_kernel_nofault(b, (void *)func, sizeof(b));
	unregister_wide_hw_breakpoint(bp);
	pr_info("hvattack: hw breakpoint on %lx: %d hits (read %s)\n", func,
		atomic_read(&bp_hits), faulted ? "faulted" : "ok");
}

static void move_apic(void)
{
	u64 orig, now, moved;
	unsigned long flags;
	int err;

	rdmsrl(MSR_IA32_APICBASE, orig);
	moved = (orig & 0xfff) | 0x1f00000;
	local_irq_save(flags);
	err = wrmsr_safe(MSR_IA32_APICBASE, (u32)moved, (u32)(moved >> 32));
	rdmsrl(MSR_IA32_APICBASE, now);
	if (!err)
		wrmsrl(MSR_IA32_APICBASE, orig);
	local_irq_restore(flags);
	pr_info("hvattack: apic base %llx -> %llx %s (read back %llx)\n", orig, moved,
		err ? "raised #GP" : "was accepted", now);
}

/* Polled output on COM1, for a line that must appear while interrupts are off. */
static void com1_puts(const char *s)
{
	for (; *s; s++) {
		int spin = 1000000;

		while (!(inb(0x3fd) & 0x20) && --spin)
			cpu_relax();
		outb(*s, 0x3f8);
	}
}

static void forge_pdpt(void)
{
	u64 *pgd = (u64 *)forge_pgd;
	u64 *copy, *pdpt, old;
	u64 start, end, hold;
	unsigned long flags;

	old = READ_ONCE(pgd[511]);
	if (!(old & _PAGE_PRESENT) || (old & _PAGE_PSE)) {
		pr_info("hvattack: pdpt: unexpected top-level entry %llx\n", old);
		return;
	}
	copy = (u64 *)get_zeroed_page(GFP_KERNEL);
	if (!copy) {
		pr_info("hvattack: pdpt: no page\n");
		return;
	}
	pdpt = __va(old & PTE_PFN_MASK);
	memcpy(copy, pdpt, PAGE_SIZE);
	copy[510] = (forge_pd & PTE_PFN_MASK) | _PAGE_PRESENT | _PAGE_RW | _PAGE_ACCESSED;
	hold = (u64)forge_hold * tsc_khz * 1000;
	local_irq_save(flags);
	WRITE_ONCE(pgd[511], __pa(copy) | (old & ~PTE_PFN_MASK));
	com1_puts("\r\nhvattack: pdpt forged\r\n");
	start = rdtsc();
	do {
		cpu_relax();
		end = rdtsc();
	} while (end - start < hold);
	WRITE_ONCE(pgd[511], old);
	local_irq_restore(flags);
	free_page((unsigned long)copy);
	pr_info("hvattack: pdpt forged with page directory %lx for %llu ms, restored\n", forge_pd,
		tsc_khz ? (end - start) / tsc_khz : 0);
}

/* The BTF header's type_len, through our alias of its page, and its value. */
static void *btf_alias;
static u32 *btf_type_len;
static u32 btf_saved;

static void forge_btf(void)
{
	/* The header is in read-only data: write it through a mapping of our own. */
	struct page *page = virt_to_page((void *)btf);
	unsigned long off = offset_in_page(btf);

	if (off + 24 > PAGE_SIZE) {
		pr_info("hvattack: btf header at %lx crosses a page\n", btf);
		return;
	}
	btf_alias = vmap(&page, 1, VM_MAP, PAGE_KERNEL);
	if (!btf_alias) {
		pr_info("hvattack: btf: vmap failed\n");
		return;
	}
	if (*(u16 *)(btf_alias + off) != 0xeb9f) {
		pr_info("hvattack: btf: no BTF magic at %lx\n", btf);
		vunmap(btf_alias);
		btf_alias = NULL;
		return;
	}
	btf_type_len = btf_alias + off + 12;
	btf_saved = READ_ONCE(*btf_type_len);
	WRITE_ONCE(*btf_type_len, btf_saved - 4);
	pr_info("hvattack: btf header at %lx: type_len %u -> %u\n", btf, btf_saved,
		btf_saved - 4);
}

static int __init hvattack_init(void)
{
	if (forge_pgd && forge_pd && forge_hold > 0) {
		forge_pdpt();
		return 0;
	}
	if (btf) {
		forge_btf();
		return 0;
	}
	if (func && hwbp)
		try_hwbp();
	else if (func && reads > 0)
		time_reads();
	else if (func)
		read_func();
	if (tramp)
		attack_tramp();
	if (vmcall)
		try_vmcall();
	if (nmi_storm > 0)
		storm();
	if (forge_e9)
		forge_log();
	if (cr0_nw)
		write_cr0_nw();
	if (bad_xsetbv)
		try_xsetbv();
	if (getsec)
		try_getsec();
	if (straddle)
		try_straddle();
	if (apic_base)
		move_apic();
	if (pci_dma)
		try_pci_dma();
	if (pm1_string)
		try_pm1_string();
	if (stacks)
		show_stacks();
	if (forge_entry && forge_site && forge_rax)
		try_forge_entry();
	if (hv_fetch)
		try_hv_fetch();
	if (func && step_storm > 0)
		try_step_storm();
	if (ioapic_init)
		try_ioapic_init();
	if (lint_init)
		try_lint_init();
	pr_info("hvattack: done\n");
	return -EAGAIN;
}

static void __exit hvattack_exit(void)
{
	if (btf_alias) {
		WRITE_ONCE(*btf_type_len, btf_saved);
		vunmap(btf_alias);
		pr_info("hvattack: btf header restored: type_len %u\n", btf_saved);
	}
}

module_init(hvattack_init);
module_exit(hvattack_exit);
MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("hvtrace VM test: attacks the tracer's patches from the guest");
