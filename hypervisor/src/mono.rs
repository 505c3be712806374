//! Root's own clock: the TSC, made monotonic.
//!
//! Root and the guest share the TSC (no TSC offsetting, and the guest's
//! writes to IA32_TSC and IA32_TSC_ADJUST reach the hardware). A guest
//! that rewinds it would otherwise make every "ticks since the last turn"
//! a huge wrapped difference, and root would take a turn on every exit. A
//! reading below the previous one counts as no time passing; the clock
//! then follows the new readings from there.

/// A monotonic count of TSC ticks.
#[derive(Debug, Clone, Copy, Default)]
pub struct MonoTsc {
    last_raw: u64,
    now: u64,
}

impl MonoTsc {
    /// A clock that reads 0 at the raw TSC value `raw`.
    pub const fn starting_at(raw: u64) -> Self {
        Self {
            last_raw: raw,
            now: 0,
        }
    }

    /// Advances to the raw reading `raw` and returns the ticks since start.
    /// A reading that went backwards (or jumped by more than 2^63, which no
    /// TSC does) adds nothing.
    pub fn update(&mut self, raw: u64) -> u64 {
        self.now = self.peek(raw);
        self.last_raw = raw;
        self.now
    }

    /// The ticks since start at the raw reading `raw`, as [`Self::update`]
    /// would return them, without moving the clock (a reader of a clock
    /// others update).
    pub const fn peek(&self, raw: u64) -> u64 {
        let delta = raw.wrapping_sub(self.last_raw);
        if delta <= i64::MAX as u64 {
            self.now.saturating_add(delta)
        } else {
            self.now
        }
    }

    /// The ticks since start at the last update.
    pub const fn now(&self) -> u64 {
        self.now
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_never_runs_backwards() {
        let mut c = MonoTsc::starting_at(1_000);
        assert_eq!(c.update(1_500), 500);
        // The guest writes 0 to IA32_TSC: no time passes ...
        assert_eq!(c.update(10), 500);
        // ... and from there the clock follows the new readings.
        assert_eq!(c.update(110), 600);
        // A rewind to just below the last reading is also nothing.
        assert_eq!(c.update(109), 600);
        assert_eq!(c.update(u64::MAX), 600);
        assert_eq!(c.update(9), 610); // wrapped forward by 10 ticks
        assert_eq!(c.now(), 610);
        // A peek reads as an update would, and moves nothing.
        assert_eq!(c.peek(20), 621);
        assert_eq!(c.peek(5), 610);
        assert_eq!(c.now(), 610);
        assert_eq!(c.update(20), 621);
    }

    #[test]
    fn the_turn_test_stays_quiet_after_a_rewind() {
        // The run loop takes a turn when now - last_turn > period.
        let period = 1_000_000;
        let mut c = MonoTsc::starting_at(5_000_000_000);
        let last_turn = c.update(5_000_000_100);
        let after_rewind = c.update(42);
        assert!(after_rewind - last_turn <= period);
    }
}
