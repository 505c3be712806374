//! The VM's lock: a reader-writer spin lock whose writers go first.
//!
//! Root takes the shared side for the tracer's hypercalls (hits on several
//! vCPUs at once) and the whole lock for every other exit that touches the
//! VM. A plain reader-writer spin lock lets readers that keep arriving
//! starve a writer: with every vCPU but one tracing hot functions, the
//! one serving the control channel might never get in. Here a writer that
//! has to wait announces itself first, and no new reader enters while any
//! writer waits; readers already inside finish their one hypercall.

use core::sync::atomic::{AtomicU32, Ordering::SeqCst};

/// A value behind a writer-first reader-writer spin lock.
pub struct VmLock<T> {
    lock: spin::RwLock<T>,
    /// Writers waiting for the lock: while any is, no reader comes in.
    writers_waiting: AtomicU32,
}

impl<T> VmLock<T> {
    /// `value` behind the lock.
    pub const fn new(value: T) -> Self {
        VmLock {
            lock: spin::RwLock::new(value),
            writers_waiting: AtomicU32::new(0),
        }
    }

    /// The whole lock, if nobody holds either side.
    pub fn try_write(&self) -> Option<spin::RwLockWriteGuard<'_, T>> {
        self.lock.try_write()
    }

    /// The whole lock. `ticks` is the clock the wait is measured by; the
    /// ticks spent waiting are added to `wait`.
    pub fn write(&self, wait: &mut u64, ticks: impl Fn() -> u64) -> spin::RwLockWriteGuard<'_, T> {
        if let Some(g) = self.lock.try_write() {
            return g;
        }
        let t0 = ticks();
        self.writers_waiting.fetch_add(1, SeqCst);
        let g = self.lock.write();
        self.writers_waiting.fetch_sub(1, SeqCst);
        *wait = wait.saturating_add(ticks().saturating_sub(t0));
        g
    }

    /// The whole lock unless another writer holds it: waits for the
    /// readers inside (each finishes one hypercall; none enters meanwhile)
    /// but gives up on a writer, which may hold it long. The ticks spent
    /// waiting are added to `wait`.
    pub fn write_unless_written(
        &self,
        wait: &mut u64,
        ticks: impl Fn() -> u64,
    ) -> Option<spin::RwLockWriteGuard<'_, T>> {
        if let Some(g) = self.lock.try_write() {
            return Some(g);
        }
        let t0 = ticks();
        self.writers_waiting.fetch_add(1, SeqCst);
        let g = loop {
            if let Some(g) = self.lock.try_write() {
                break Some(g);
            }
            if self.lock.writer_count() != 0 {
                break None;
            }
            core::hint::spin_loop();
        };
        self.writers_waiting.fetch_sub(1, SeqCst);
        *wait = wait.saturating_add(ticks().saturating_sub(t0));
        g
    }

    /// The shared side, after every writer that waits for the whole lock;
    /// the ticks spent waiting are added to `wait`.
    pub fn read(&self, wait: &mut u64, ticks: impl Fn() -> u64) -> spin::RwLockReadGuard<'_, T> {
        let attempt = || {
            if self.writers_waiting.load(SeqCst) == 0 {
                self.lock.try_read()
            } else {
                None
            }
        };
        if let Some(g) = attempt() {
            return g;
        }
        let t0 = ticks();
        let g = loop {
            if let Some(g) = attempt() {
                break g;
            }
            core::hint::spin_loop();
        };
        *wait = wait.saturating_add(ticks().saturating_sub(t0));
        g
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicU64};
    use std::time::Instant;

    fn ticks() -> u64 {
        static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        START.get_or_init(Instant::now).elapsed().as_nanos() as u64
    }

    #[test]
    fn readers_share_and_a_writer_still_gets_in() {
        // Three readers re-take the shared side without pause; each checks
        // that the two halves of the value agree (a writer changes both).
        let lock = VmLock::new((0u64, 0u64));
        let stop = AtomicBool::new(false);
        let reads = AtomicU64::new(0);
        std::thread::scope(|s| {
            for _ in 0..3 {
                s.spawn(|| {
                    let mut wait = 0;
                    while !stop.load(SeqCst) {
                        let g = lock.read(&mut wait, ticks);
                        assert_eq!(g.0, g.1, "a reader saw half a write");
                        for _ in 0..200 {
                            core::hint::spin_loop();
                        }
                        drop(g);
                        reads.fetch_add(1, SeqCst);
                    }
                });
            }
            // Once every reader is in its loop, the writer gets the whole
            // lock 2000 times while they read.
            while reads.load(SeqCst) < 3 {
                std::thread::yield_now();
            }
            let mut wait = 0;
            for i in 1..=2000u64 {
                let mut g = lock.write(&mut wait, ticks);
                g.0 = i;
                for _ in 0..50 {
                    core::hint::spin_loop();
                }
                g.1 = i;
            }
            stop.store(true, SeqCst);
        });
        assert_eq!(*lock.read(&mut 0, ticks), (2000, 2000));
    }

    #[test]
    fn a_turn_waits_for_readers_but_not_for_a_writer() {
        let lock = VmLock::new(0u32);
        // Held by a writer: given up on at once.
        let w = lock.try_write().unwrap();
        assert!(lock.write_unless_written(&mut 0, ticks).is_none());
        drop(w);
        // Held by a reader: waited for, and no new reader enters meanwhile.
        let first = lock.read(&mut 0, ticks);
        std::thread::scope(|s| {
            let turn = s.spawn(|| {
                let mut wait = 0;
                let got = lock.write_unless_written(&mut wait, ticks).map(|mut g| {
                    *g += 1;
                });
                (got.is_some(), wait)
            });
            while lock.writers_waiting.load(SeqCst) == 0 {
                std::thread::yield_now();
            }
            assert!(lock.lock.try_read().is_some() && lock.writers_waiting.load(SeqCst) == 1);
            let reader = s.spawn(|| *lock.read(&mut 0, ticks));
            std::thread::sleep(std::time::Duration::from_millis(50));
            assert!(!reader.is_finished(), "a reader passed a waiting turn");
            drop(first);
            let (got, wait) = turn.join().unwrap();
            assert!(got && wait > 0);
            assert_eq!(reader.join().unwrap(), 1);
        });
    }

    #[test]
    fn readers_are_inside_together() {
        let lock = VmLock::new(7u32);
        let first = lock.read(&mut 0, ticks);
        // Another thread takes the shared side while this one holds it.
        let other = std::thread::scope(|s| s.spawn(|| *lock.read(&mut 0, ticks)).join());
        assert_eq!(other.unwrap(), 7);
        // The whole lock is not to be had meanwhile.
        assert!(lock.try_write().is_none());
        drop(first);
        assert!(lock.try_write().is_some());
    }

    #[test]
    fn a_waiting_writer_keeps_new_readers_out() {
        let lock = VmLock::new(0u32);
        let first = lock.read(&mut 0, ticks);
        std::thread::scope(|s| {
            let writer = s.spawn(|| {
                let mut wait = 0;
                *lock.write(&mut wait, ticks) += 1;
                wait
            });
            // Once the writer waits, a new reader cannot come in...
            while lock.writers_waiting.load(SeqCst) == 0 {
                std::thread::yield_now();
            }
            let reader = s.spawn(|| *lock.read(&mut 0, ticks));
            std::thread::sleep(std::time::Duration::from_millis(50));
            assert!(!reader.is_finished(), "a reader passed a waiting writer");
            // ... and when the reader inside leaves, the writer goes first.
            drop(first);
            assert!(
                writer.join().unwrap() > 0,
                "the writer's wait was not counted"
            );
            assert_eq!(reader.join().unwrap(), 1);
        });
    }
}
