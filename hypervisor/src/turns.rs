//! Root's turns: how often each vCPU gives root's control service and the
//! tracer a share of its time, and the VMX-preemption timer value that
//! brings the next turn (SDM 25.5.1: the timer counts down at the TSC's
//! rate shifted right by IA32_VMX_MISC bits 4:0).

/// Turns a second while nothing waits to go out.
pub const IDLE_TURNS_PER_SEC: u64 = 200;
/// Turns a second while output waits (a busy stream, queued answers).
pub const BUSY_TURNS_PER_SEC: u64 = 5000;

/// TSC ticks between turns.
pub fn period_ticks(tsc_hz: u64, busy: bool) -> u64 {
    tsc_hz
        / if busy {
            BUSY_TURNS_PER_SEC
        } else {
            IDLE_TURNS_PER_SEC
        }
}

/// The preemption timer's value for one period, the timer ticking at the
/// TSC's rate shifted right by `shift`: at least 1 (a zero value exits at
/// the entry, before the guest runs an instruction) and at most the
/// field's 32 bits.
pub fn timer_value(tsc_hz: u64, busy: bool, shift: u32) -> u32 {
    let ticks = period_ticks(tsc_hz, busy).checked_shr(shift).unwrap_or(0);
    ticks.clamp(1, u64::from(u32::MAX)) as u32
}

/// Whether a turn is due: more than `period` ticks since the last turn's
/// TSC. A TSC the guest set back reads as due (the difference wraps), and
/// the turn starts the count again from there.
pub fn due(now_tsc: u64, last_turn_tsc: u64, period: u64) -> bool {
    now_tsc.wrapping_sub(last_turn_tsc) > period
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busy_turns_come_twenty_five_times_as_often() {
        let hz = 3_000_000_000;
        assert_eq!(period_ticks(hz, false), 15_000_000);
        assert_eq!(period_ticks(hz, true), 600_000);
        // Bochs and KVM report a shift of 5 (the timer ticks every 32 TSC
        // ticks) or 0.
        assert_eq!(timer_value(hz, false, 5), 468_750);
        assert_eq!(timer_value(hz, true, 0), 600_000);
    }

    #[test]
    fn the_timer_never_fires_at_once_and_fits_its_field() {
        assert_eq!(timer_value(0, true, 0), 1);
        assert_eq!(timer_value(1000, true, 31), 1);
        assert_eq!(timer_value(1000, true, 64), 1, "a shift past the width");
        assert_eq!(timer_value(u64::MAX, false, 0), u32::MAX);
    }

    #[test]
    fn a_turn_is_due_after_its_period_and_when_the_tsc_went_back() {
        assert!(!due(1_000, 400, 600));
        assert!(due(1_001, 400, 600));
        assert!(due(100, 400, 600), "the guest set the TSC back");
        assert!(!due(5, 5, 0));
    }
}
