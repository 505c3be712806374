//! Test hooks on the hypervisor's own command line.
//!
//! The hypervisor's Multiboot command line (QEMU: `-kernel hypervisor
//! -append "..."`; GRUB: the words after `multiboot /boot/hypervisor`;
//! the launcher passes `RunConfig::hypervisor_cmdline`) is not the guest's:
//! that one travels in the first module's string. It carries no options for
//! normal use, only these test hooks, which make root misbehave on purpose
//! so that a VM test can watch how the failure is reported:
//!
//! - `hvtrace.selftest=stack-overflow`: right after root's IDT and the
//!   guard page under its stack are in place, and before the guest is
//!   loaded or VMX is looked at (so it runs on a CPU without VMX), root
//!   recurses until its stack runs into the guard page. The expected end is
//!   one `hvtrace: error: hypervisor fault in VMX root: #DF ...` line naming
//!   the guard page, then a power-off.
//! - `hvtrace.selftest=ap-stack-overflow`: the first AP, right after its
//!   own IDT and IST stacks are in place and before it enters VMX (so the
//!   machine needs VMX and two processors), recurses until its root stack
//!   runs into the guard page under it. The expected end is the same
//!   `#DF` line, naming the AP's guard page, then a power-off.
//! - `hvtrace.selftest=panic`: right after the control UART (COM2) is
//!   programmed, at the same point and so also without VMX, root panics.
//!   The expected end is the fatal report on both ways out, one
//!   `hvtrace: error: hypervisor panic: ...` line on the log port and an
//!   `Event::Fatal` frame with the same text on COM2, then a power-off.
//!
//! Only the exact word selects a hook; anything else on the line is
//! ignored.

/// A deliberate failure in root, for tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SelfTest {
    /// `hvtrace.selftest=stack-overflow`: overflow root's stack.
    StackOverflow,
    /// `hvtrace.selftest=panic`: panic in root.
    Panic,
    /// `hvtrace.selftest=ap-stack-overflow`: overflow the first AP's root
    /// stack.
    ApStackOverflow,
}

impl SelfTest {
    /// The option word that selects this hook.
    pub const fn option(self) -> &'static str {
        match self {
            Self::StackOverflow => "hvtrace.selftest=stack-overflow",
            Self::Panic => "hvtrace.selftest=panic",
            Self::ApStackOverflow => "hvtrace.selftest=ap-stack-overflow",
        }
    }

    /// The hook the command line asks for, if any. The line's words are
    /// matched whole (the first one is usually the image's path).
    pub fn from_cmdline(cmdline: &str) -> Option<SelfTest> {
        cmdline.split_ascii_whitespace().find_map(|w| {
            [Self::StackOverflow, Self::Panic, Self::ApStackOverflow]
                .into_iter()
                .find(|hook| w == hook.option())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_exact_word_selects_the_hook() {
        let hook = Some(SelfTest::StackOverflow);
        assert_eq!(
            SelfTest::from_cmdline("hypervisor hvtrace.selftest=stack-overflow"),
            hook
        );
        assert_eq!(
            SelfTest::from_cmdline("hvtrace.selftest=stack-overflow"),
            hook
        );
        assert_eq!(
            SelfTest::from_cmdline("/boot/hypervisor  a=b\thvtrace.selftest=stack-overflow x"),
            hook
        );
        for line in [
            "",
            "hypervisor",
            "hypervisor hvtrace.selftest=stack-overflow2",
            "hypervisor xhvtrace.selftest=stack-overflow",
            "hypervisor hvtrace.selftest=Stack-Overflow",
            "hypervisor hvtrace.selftest=",
            "hypervisor hvtrace.selftest stack-overflow",
            "hypervisor \"hvtrace.selftest=stack-overflow\"",
        ] {
            assert_eq!(SelfTest::from_cmdline(line), None, "{line:?}");
        }
    }

    #[test]
    fn each_hook_has_its_word() {
        assert_eq!(
            SelfTest::from_cmdline("hypervisor hvtrace.selftest=panic"),
            Some(SelfTest::Panic)
        );
        assert_eq!(
            SelfTest::from_cmdline("hypervisor hvtrace.selftest=ap-stack-overflow"),
            Some(SelfTest::ApStackOverflow)
        );
        for line in [
            "hypervisor hvtrace.selftest=ap-stack-overflow2",
            "hypervisor hvtrace.selftest=panic2",
            "hypervisor hvtrace.selftest=Panic",
            "hypervisor hvtrace.selftest=panic=1",
        ] {
            assert_eq!(SelfTest::from_cmdline(line), None, "{line:?}");
        }
    }
}
