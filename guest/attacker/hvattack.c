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
 *                a guest read of a hooked page: the split view's round trip)
 *
 * Loading always fails with -EAGAIN once the attempts are done, so the
 * module can be loaded again with other parameters.
 */
#include <linux/module.h>
#include <linux/kernel.h>
#include <linux/uaccess.h>
#include <linux/io.h>
#include <linux/mm.h>
#include <linux/ktime.h>
#include <linux/pgtable.h>
#include <asm/tlbflush.h>
#include <asm/special_insns.h>
#include <asm/processor.h>
#include <asm/asm.h>

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

static void time_reads(void)
{
	u8 b[9];
	u64 t0, t;
	int i, bad = 0;

	t0 = ktime_get_ns();
	for (i = 0; i < reads; i++)
		bad += copy_from_kernel_nofault(b, (void *)func, sizeof(b)) != 0;
	t = ktime_get_ns() - t0;
	pr_info("hvattack: timed %d reads of %lx: %llu ns (%d faulted)\n", reads, func, t, bad);
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

static int __init hvattack_init(void)
{
	if (func && reads > 0)
		time_reads();
	else if (func)
		read_func();
	if (tramp)
		attack_tramp();
	if (vmcall)
		try_vmcall();
	pr_info("hvattack: done\n");
	return -EAGAIN;
}

module_init(hvattack_init);
MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("hvtrace VM test: attacks the tracer's patches from the guest");
