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
 *
 * Loading always fails with -EAGAIN once the attempts are done, so the
 * module can be loaded again with other parameters.
 */
#include <linux/module.h>
#include <linux/kernel.h>
#include <linux/uaccess.h>
#include <linux/io.h>
#include <linux/mm.h>
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

static void attack_tramp(void)
{
	unsigned int level;
	pte_t *pte = lookup_address(tramp, &level);
	phys_addr_t phys;
	void __iomem *p;
	u8 before, after;
	pmd_t *pmd;

	if (!pte || !pte_present(*pte) || level != PG_LEVEL_4K) {
		pr_info("hvattack: tramp %lx not mapped\n", tramp);
		return;
	}
	phys = (phys_addr_t)pte_pfn(*pte) << PAGE_SHIFT;
	p = ioremap(phys, PAGE_SIZE);
	if (!p) {
		pr_info("hvattack: ioremap %pa failed\n", &phys);
		return;
	}
	before = readb(p);
	writeb(before ^ 0xff, p);
	after = readb(p);
	iounmap(p);
	pr_info("hvattack: wrote tramp frame %pa: before %02x after %02x (sees %02x through the mapping)\n",
		&phys, before, after, *(volatile u8 *)tramp);

	if (!clear_pmd)
		return;
	pmd = tramp_pmd();
	if (!pmd) {
		pr_info("hvattack: no pmd for %lx\n", tramp);
		return;
	}
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
	if (func)
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
