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
 *   hvbench syscalls FILE
 *                       the system-call oracle's workload, every call made
 *                       under the comm "hvbench": openat, read and close of
 *                       /etc/hostname; openat (O_CREAT), write and close of
 *                       FILE; newfstatat of FILE; an openat that fails
 *                       (ENOENT); openat2 of /etc/hostname with an open_how
 *                       (O_RDONLY|O_CLOEXEC, RESOLVE_NO_SYMLINKS) and its
 *                       close; a fork (clone) whose child execve()s
 *                       "hvbench exec-child FILE", which reads FILE to
 *                       stdout; a wait4 for it. Prints
 *                       "hvsys child=PID status=S bytes=N"
 *   hvbench exec-child FILE
 *                       openat, read, write to stdout and close of FILE
 *   hvbench switch N    N round trips of one byte between two processes
 *                       over two pipes (2N context switches on one CPU):
 *                       the child sleeps in read(), the parent in poll()
 *                       before its read(); prints
 *                       "switches=2N ns=T ns_per_switch=X"
 *   hvbench rounds N FIFO [CPU]
 *                       the loop server of scripts/bench.sh: one process
 *                       that runs the benchmark's rounds as the host asks,
 *                       so that every round of every phase runs in the same
 *                       process. Pins itself to CPU when given
 *                       (sched_setaffinity), opens FIFO read-write (so it
 *                       never reads EOF while no writer has it open) and
 *                       serves one line at a time:
 *                         "getppid TAG"      N getppid() calls
 *                         "openat TAG PATH"  N openat(AT_FDCWD, PATH,
 *                                            O_RDONLY) calls, each followed
 *                                            by its close()
 *                         "ping TAG"         no calls
 *                         "quit"             exits 0
 *                       A loop starts SETTLE_MS after its line was read (the
 *                       shell that wrote it goes to sleep meanwhile) and is
 *                       timed alone; each line is answered on stdout, flushed:
 *                       "TAG op=OP calls=N ns=T ns_per_call=X cpu=C"
 *                       ("TAG op=ping pid=P cpu=C" for ping), or
 *                       "TAG error=WHAT" (the server goes on).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/openat2.h>
#include <sys/stat.h>
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
	fprintf(stderr,
		"usage: hvbench getppid N | vmcall | sleep MS | switch N | rounds N FIFO [CPU]\n");
	return 2;
}

/* How long a round waits after its line, before its timed loop. */
#define SETTLE_MS 100

/* The longest line `rounds` takes (a tag and a path). */
#define ROUND_LINE 512

/* `hvbench rounds N FIFO [CPU]`: see the top of the file. */
static int rounds(long n, const char *fifo, const char *cpu_arg)
{
	if (cpu_arg) {
		char *end;
		long cpu = strtol(cpu_arg, &end, 0);
		cpu_set_t set;
		if (*end || cpu < 0 || cpu >= CPU_SETSIZE)
			return usage();
		CPU_ZERO(&set);
		CPU_SET(cpu, &set);
		if (sched_setaffinity(0, sizeof set, &set)) {
			fprintf(stderr, "hvbench: sched_setaffinity(%ld): %s\n", cpu, strerror(errno));
			return 1;
		}
	}
	int fd = open(fifo, O_RDWR);
	if (fd < 0) {
		fprintf(stderr, "hvbench: %s: %s\n", fifo, strerror(errno));
		return 1;
	}
	FILE *in = fdopen(fd, "r");
	if (!in)
		return 1;
	setvbuf(stdout, NULL, _IOLBF, 0);
	char line[ROUND_LINE];
	while (fgets(line, sizeof line, in)) {
		char op[16] = "", tag[64] = "", path[ROUND_LINE] = "";
		int words = sscanf(line, "%15s %63s %511s", op, tag, path);
		if (words < 1)
			continue;
		if (!strcmp(op, "quit"))
			return 0;
		if (words < 2) {
			printf("- error=no-tag\n");
			continue;
		}
		if (!strcmp(op, "ping")) {
			printf("%s op=ping pid=%d cpu=%d\n", tag, (int)getpid(), sched_getcpu());
			continue;
		}
		int open_loop = !strcmp(op, "openat");
		if (!open_loop && strcmp(op, "getppid")) {
			printf("%s error=unknown-op\n", tag);
			continue;
		}
		if (open_loop && words < 3) {
			printf("%s error=no-path\n", tag);
			continue;
		}
		struct timespec settle = { 0, SETTLE_MS * 1000000L };
		nanosleep(&settle, NULL);
		long failed = 0;
		long long t0 = now_ns();
		if (open_loop) {
			for (long i = 0; i < n; i++) {
				long f = syscall(SYS_openat, AT_FDCWD, path, O_RDONLY);
				if (f < 0)
					failed++;
				else
					close((int)f);
			}
		} else {
			for (long i = 0; i < n; i++)
				syscall(SYS_getppid);
		}
		long long t = now_ns() - t0;
		if (failed)
			printf("%s error=openat-failed-%ld-of-%ld\n", tag, failed, n);
		else
			printf("%s op=%s calls=%ld ns=%lld ns_per_call=%lld cpu=%d\n", tag, op, n, t,
			       t / n, sched_getcpu());
	}
	return 1;
}

static int cat_file(const char *path)
{
	char buf[256];
	int fd = open(path, O_RDONLY);
	if (fd < 0)
		return 1;
	ssize_t n = read(fd, buf, sizeof buf);
	if (n > 0 && write(1, buf, (size_t)n) != n)
		return 1;
	close(fd);
	return n > 0 ? 0 : 1;
}

static int syscalls_workload(const char *file)
{
	char buf[256];
	int fd = open("/etc/hostname", O_RDONLY);
	if (fd < 0)
		return 1;
	ssize_t n = read(fd, buf, sizeof buf);
	close(fd);
	if (n <= 0)
		return 1;
	int out = open(file, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0640);
	if (out < 0 || write(out, buf, (size_t)n) != n)
		return 1;
	close(out);
	struct stat st;
	if (stat(file, &st) || st.st_size != n)
		return 1;
	if (open("/nonexistent/hvsys", O_RDONLY) >= 0)
		return 1;
	struct open_how how = { .flags = O_RDONLY | O_CLOEXEC, .resolve = RESOLVE_NO_SYMLINKS };
	long fd2 = syscall(SYS_openat2, AT_FDCWD, "/etc/hostname", &how, sizeof how);
	if (fd2 < 0)
		return 1;
	close((int)fd2);
	fflush(stdout);
	pid_t child = fork();
	if (child < 0)
		return 1;
	if (child == 0) {
		/*
		 * The exec's strings in the child's own memory, as a shell has
		 * them: a literal of this static binary sits in a file-backed
		 * page that fork() does not copy into the child's page tables,
		 * so until the kernel faults it in, a read from outside (or the
		 * kernel's own nofault string fetch) finds nothing there.
		 */
		char path[] = "/bin/hvbench", arg0[] = "hvbench", arg1[] = "exec-child";
		char arg2[256];
		snprintf(arg2, sizeof arg2, "%s", file);
		char *args[] = { arg0, arg1, arg2, NULL };
		execv(path, args);
		_exit(127);
	}
	int status = 0;
	if (waitpid(child, &status, 0) != child)
		return 1;
	printf("hvsys child=%d status=%d bytes=%zd\n", (int)child, status, n);
	return status != 0;
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
	if (!strcmp(argv[1], "syscalls") && argc == 3)
		return syscalls_workload(argv[2]);
	if (!strcmp(argv[1], "exec-child") && argc == 3)
		return cat_file(argv[2]);
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
	if (!strcmp(argv[1], "rounds") && (argc == 4 || argc == 5)) {
		long n = strtol(argv[2], NULL, 0);
		if (n <= 0)
			return usage();
		return rounds(n, argv[3], argc == 5 ? argv[4] : NULL);
	}
	return usage();
}
