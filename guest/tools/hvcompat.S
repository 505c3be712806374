/*
 * hvcompat: a 32-bit (i386) program for hvtrace's system-call tests on
 * kernels with IA32 emulation. Built with binutils alone (as --32,
 * ld -m elf_i386) into the test initramfs (scripts/guest/initramfs.sh).
 * Through int $0x80: open("/etc/hostname", O_RDONLY), read(fd, buf, 64),
 * write(1, buf, n), close(fd), getpid(), exit(0); exit(1) when a call
 * fails.
 */
	.globl	_start
	.text
_start:
	movl	$5, %eax		/* open */
	movl	$path, %ebx
	xorl	%ecx, %ecx		/* O_RDONLY */
	xorl	%edx, %edx
	int	$0x80
	testl	%eax, %eax
	js	fail
	movl	%eax, %esi		/* fd */

	movl	$3, %eax		/* read */
	movl	%esi, %ebx
	movl	$buf, %ecx
	movl	$64, %edx
	int	$0x80
	testl	%eax, %eax
	jle	fail
	movl	%eax, %edi		/* bytes */

	movl	$4, %eax		/* write */
	movl	$1, %ebx
	movl	$buf, %ecx
	movl	%edi, %edx
	int	$0x80
	cmpl	%edi, %eax
	jne	fail

	movl	$6, %eax		/* close */
	movl	%esi, %ebx
	int	$0x80
	testl	%eax, %eax
	jnz	fail

	movl	$20, %eax		/* getpid */
	int	$0x80

	movl	$1, %eax		/* exit(0) */
	xorl	%ebx, %ebx
	int	$0x80
fail:
	movl	$1, %eax		/* exit(1) */
	movl	$1, %ebx
	int	$0x80

	.section .note.GNU-stack,"",@progbits
	.data
path:	.asciz	"/etc/hostname"
	.bss
buf:	.skip	64
