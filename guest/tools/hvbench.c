/*
 * hvbench: the guest side of hvtrace's VM tests and benchmarks. Built
 * statically into the test initramfs (scripts/guest/initramfs.sh).
 *
 *   hvbench getppid N   N getppid() system calls; prints
 *                       "calls=N ns=T ns_per_call=X" (CLOCK_MONOTONIC)
 *   hvbench vmcall      executes VMCALL in user mode; prints "SIGILL" and
 *                       exits 0 when the CPU (or hypervisor) raises #UD,
 *                       prints "returned" and exits 1 otherwise
 *   hvbench sleep MS    sleeps MS milliseconds in nanosleep
 *   hvbench switch N    N round trips of one byte between two processes
 *                       over two pipes (2N context switches on one CPU):
 *                       the child sleeps in read(), the parent in poll()
 *                       before its read(); prints
 *                       "switches=2N ns=T ns_per_switch=X"
 */
#define _GNU_SOURCE
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static long long now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void on_sigill(int sig)
{
	(void)sig;
	static const char msg[] = "SIGILL\n";
	if (write(1, msg, sizeof msg - 1) < 0)
		_exit(2);
	_exit(0);
}

static int usage(void)
{
	fprintf(stderr, "usage: hvbench getppid N | vmcall | sleep MS | switch N\n");
	return 2;
}

int main(int argc, char **argv)
{
	if (argc < 2)
		return usage();
	if (!strcmp(argv[1], "getppid") && argc == 3) {
		long n = strtol(argv[2], NULL, 0);
		if (n <= 0)
			return usage();
		long long t0 = now_ns();
		for (long i = 0; i < n; i++)
			syscall(SYS_getppid);
		long long t = now_ns() - t0;
		printf("calls=%ld ns=%lld ns_per_call=%lld\n", n, t, t / n);
		return 0;
	}
	if (!strcmp(argv[1], "vmcall") && argc == 2) {
		signal(SIGILL, on_sigill);
		__asm__ volatile("vmcall" ::: "memory");
		printf("returned\n");
		return 1;
	}
	if (!strcmp(argv[1], "sleep") && argc == 3) {
		long ms = strtol(argv[2], NULL, 0);
		struct timespec ts = { ms / 1000, (ms % 1000) * 1000000L };
		nanosleep(&ts, NULL);
		return 0;
	}
	if (!strcmp(argv[1], "switch") && argc == 3) {
		long n = strtol(argv[2], NULL, 0);
		int there[2], back[2];
		if (n <= 0)
			return usage();
		if (pipe(there) || pipe(back))
			return 1;
		pid_t child = fork();
		if (child < 0)
			return 1;
		char b = 0;
		if (child == 0) {
			for (long i = 0; i < n; i++) {
				if (read(there[0], &b, 1) != 1 || write(back[1], &b, 1) != 1)
					_exit(1);
			}
			_exit(0);
		}
		long long t0 = now_ns();
		for (long i = 0; i < n; i++) {
			struct pollfd p = { .fd = back[0], .events = POLLIN };
			if (write(there[1], &b, 1) != 1 || poll(&p, 1, -1) != 1 ||
			    read(back[0], &b, 1) != 1)
				return 1;
		}
		long long t = now_ns() - t0;
		int status = 0;
		waitpid(child, &status, 0);
		printf("switches=%ld ns=%lld ns_per_switch=%lld\n", 2 * n, t, t / (2 * n));
		return 0;
	}
	return usage();
}
