//! Grace periods: a writer can wait until every lookup that started before a point in time has
//! finished, while lookups never wait for anything.
//!
//! Readers count themselves in one of two counters chosen by the parity of a global epoch
//! (striped over cache lines so reader threads do not share one counter). A writer advances
//! the epoch and waits until the previous parity's counters drain, twice (so readers on
//! either parity are covered). This is the two-counter scheme of user-space RCU; readers only
//! do two atomic read-modify-writes per lookup. A writer that must not wait (one reclaiming
//! run pages) flips with [`Grace::start`] and checks [`Grace::ended`] later.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

const STRIPES: usize = 16;

#[repr(align(128))]
#[derive(Default)]
struct Stripe {
    active: [AtomicUsize; 2],
}

pub(super) struct Grace {
    epoch: AtomicUsize,
    stripes: Box<[Stripe]>,
    /// Serialises writers' grace periods (the two-counter scheme allows one at a time).
    writer: Mutex<()>,
}

/// A lookup in progress; a writer's [`Grace::synchronize`] waits for it to drop.
pub(super) struct ReadGuard<'a> {
    counter: &'a AtomicUsize,
}

impl Drop for ReadGuard<'_> {
    fn drop(&mut self) {
        self.counter.fetch_sub(1, Ordering::SeqCst);
    }
}

fn stripe_of_thread() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static STRIPE: usize = NEXT.fetch_add(1, Ordering::Relaxed) % STRIPES;
    }
    STRIPE.with(|s| *s)
}

impl Default for Grace {
    fn default() -> Self {
        Self {
            epoch: AtomicUsize::new(0),
            stripes: (0..STRIPES).map(|_| Stripe::default()).collect(),
            writer: Mutex::new(()),
        }
    }
}

impl Grace {
    /// Enters a read-side critical section. Never blocks: it retries only if the epoch moved
    /// between its two loads (once per writer's `synchronize`, at most).
    pub fn read(&self) -> ReadGuard<'_> {
        let stripe = &self.stripes[stripe_of_thread()];
        loop {
            let e = self.epoch.load(Ordering::SeqCst);
            let counter = &stripe.active[e & 1];
            counter.fetch_add(1, Ordering::SeqCst);
            if self.epoch.load(Ordering::SeqCst) == e {
                return ReadGuard { counter };
            }
            counter.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Flips the epoch without waiting: the parity to pass to [`Grace::ended`]. None if a
    /// [`Grace::synchronize`] is under way (try again later). A grace period is two flips,
    /// each followed by its parity draining (readers may sit on either parity).
    pub fn start(&self) -> Option<usize> {
        let _one = self.writer.try_lock().ok()?;
        Some(self.epoch.fetch_add(1, Ordering::SeqCst) & 1)
    }

    /// True when no read-side section counted on `parity` is open (sections that entered
    /// later on the same parity only delay the answer). After a flip and this, the readers
    /// that entered on that parity before the flip are done; after two, every reader.
    pub fn ended(&self, parity: usize) -> bool {
        self.stripes.iter().all(|s| s.active[parity].load(Ordering::SeqCst) == 0)
    }

    /// Waits until every read-side section entered before this call has ended. Concurrent
    /// callers take turns.
    pub fn synchronize(&self) {
        let _one = self.writer.lock().unwrap_or_else(PoisonError::into_inner);
        // Two flips: readers that entered before this call are on either parity (an earlier
        // `start` may have flipped without waiting), and each flip drains one.
        for _ in 0..2 {
            let old = self.epoch.fetch_add(1, Ordering::SeqCst) & 1;
            let mut spins = 0u32;
            while !self.ended(old) {
                spins += 1;
                if spins < 64 {
                    std::hint::spin_loop();
                } else if spins < 256 {
                    std::thread::yield_now();
                } else {
                    std::thread::sleep(Duration::from_micros(20));
                }
            }
        }
    }
}
