// SPDX-License-Identifier: GPL-2.0
/*
 * hvtarget: the well-behaved module of hvtrace's VM tests, a tracing
 * target in module text. Its functions have fentry sites like any module
 * function built with ftrace, and they call into the core kernel and back,
 * so that probes, the function tracer and function graphs on module code
 * can be checked against the guest's own tracers.
 *
 * Writing a number N to /sys/module/hvtarget/parameters/poke runs
 * hvtarget_poke: it parses N with the core kernel's kstrtoint, checks the
 * writer's CAP_SYS_ADMIN through the core kernel's capable() (a traceable
 * chain down to the security hooks), calls hvtarget_sum(N), which calls
 * hvtarget_leaf N times (capped at 64), and keeps the result in
 * /sys/module/hvtarget/parameters/last. Loading the
 * module runs hvtarget_sum(3) from its init function (init text).
 */
#include <linux/capability.h>
#include <linux/kernel.h>
#include <linux/module.h>
#include <linux/moduleparam.h>

static int last;
module_param(last, int, 0444);
MODULE_PARM_DESC(last, "the result of the last poke");

static noinline int hvtarget_leaf(int x)
{
	/* Keep the call: the compiler must not fold the loop into a formula. */
	barrier();
	return x * 3 + 1;
}

static noinline int hvtarget_sum(int n)
{
	int i, s = 0;

	for (i = 0; i < n && i < 64; i++)
		s += hvtarget_leaf(i);
	return s;
}

static noinline int hvtarget_poke(const char *val, const struct kernel_param *kp)
{
	int n, err;

	err = kstrtoint(val, 0, &n);
	if (err)
		return err;
	if (!capable(CAP_SYS_ADMIN))
		return -EPERM;
	last = hvtarget_sum(n);
	return 0;
}

static const struct kernel_param_ops hvtarget_poke_ops = {
	.set = hvtarget_poke,
};
module_param_cb(poke, &hvtarget_poke_ops, NULL, 0200);
MODULE_PARM_DESC(poke, "write N: run hvtarget_sum(N) through hvtarget_poke");

static int __init hvtarget_init(void)
{
	last = hvtarget_sum(3);
	return 0;
}

static void __exit hvtarget_exit(void)
{
}

module_init(hvtarget_init);
module_exit(hvtarget_exit);
MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("hvtrace test module: a tracing target in module text");
