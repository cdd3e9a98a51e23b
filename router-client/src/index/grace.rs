//! Grace periods: a writer can wait until every lookup that started before a point in time has
//! finished, while lookups never wait for anything.
//!
//! Readers count themselves in one of two counters chosen by the parity of a global epoch
//! (striped over cache lines so reader threads do not share one counter). A writer advances
//! the epoch and waits until the previous parity's counters drain, twice (so readers on
//! either parity are covered). This is the two-counter scheme of user-space RCU; readers only
//! do two atomic read-modify-writes per lookup.
//!
//! Writers that must not wait (those reclaiming run pages and table slots) use *numbered*
//! grace periods instead: something retired takes a [`Grace::ticket`] after the writes that
//! retire it, and may be reused once [`Grace::periods_ended`] is greater than the ticket. The
//! periods are moved on by [`Grace::advance`], which never waits: each call starts a period,
//! or takes its next flip, or ends it, when the readers it waits for have drained. Ticket `t`
//! is the number of periods started when it was taken; period `t + 1` starts after it (its
//! counter increment reads the ticket's read-modify-write, so the retiring writes happen
//! before its flips), so every reader that could still see the retired thing entered before
//! that period's second flip, and has left when the period ends.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError, TryLockError};
use std::time::Duration;

use super::Padded;

const STRIPES: usize = 16;

#[repr(align(128))]
#[derive(Default)]
struct Stripe {
    active: [AtomicUsize; 2],
}

pub(super) struct Grace {
    /// Read by every lookup; written only by flips. Alone on its lines: writers take a ticket
    /// (a read-modify-write of `started`) for every slot that dies.
    epoch: Padded<AtomicUsize>,
    stripes: Box<[Stripe]>,
    writers: Padded<Writers>,
}

/// The writers' side of [`Grace`].
#[derive(Default)]
struct Writers {
    /// Serialises the flips (the two-counter scheme allows one grace period at a time): a
    /// `synchronize`'s two, and the steps of the numbered period under way, if any.
    writer: Mutex<Option<Step>>,
    /// Numbered periods started, and the last one ended (see [`Grace::ticket`]).
    started: AtomicU64,
    ended: AtomicU64,
}

/// Where the numbered period under way is: the parity its last flip gave, and whether that
/// flip was its second.
#[derive(Clone, Copy)]
struct Step {
    parity: usize,
    second: bool,
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
            epoch: Padded::default(),
            stripes: (0..STRIPES).map(|_| Stripe::default()).collect(),
            writers: Padded::default(),
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

    /// A ticket for something retired by this thread's writes before this call: it may be
    /// reused once [`Grace::periods_ended`] is greater than the ticket. A read-modify-write,
    /// so that the period that makes it pass starts after those writes (module docs).
    pub fn ticket(&self) -> u64 {
        self.writers.started.fetch_add(0, Ordering::SeqCst)
    }

    /// The number of numbered periods ended so far: a ticket `t` has passed once this is
    /// greater than `t`.
    pub fn periods_ended(&self) -> u64 {
        self.writers.ended.load(Ordering::SeqCst)
    }

    /// Moves the numbered periods on without waiting (module docs): starts one if none is
    /// under way, takes the next flip or ends it if the readers it waits for have drained.
    /// Does nothing while another writer holds the flips (a [`Grace::synchronize`]).
    pub fn advance(&self) {
        let mut step = match self.writers.writer.try_lock() {
            Ok(step) => step,
            Err(TryLockError::Poisoned(e)) => e.into_inner(),
            Err(TryLockError::WouldBlock) => return,
        };
        *step = match *step {
            None => {
                self.writers.started.fetch_add(1, Ordering::SeqCst);
                Some(Step { parity: self.epoch.fetch_add(1, Ordering::SeqCst) & 1, second: false })
            }
            Some(Step { parity, second: false }) if self.ended(parity) => {
                Some(Step { parity: self.epoch.fetch_add(1, Ordering::SeqCst) & 1, second: true })
            }
            Some(Step { parity, second: true }) if self.ended(parity) => {
                self.writers.ended.store(self.writers.started.load(Ordering::SeqCst), Ordering::SeqCst);
                None
            }
            waiting => waiting,
        };
    }

    /// True when no read-side section counted on `parity` is open (sections that entered
    /// later on the same parity only delay the answer). After a flip and this, the readers
    /// that entered on that parity before the flip are done; after two, every reader. (A
    /// `synchronize` between a period's flips flips twice, so the period's second flip still
    /// gives the other parity.)
    fn ended(&self, parity: usize) -> bool {
        self.stripes.iter().all(|s| s.active[parity].load(Ordering::SeqCst) == 0)
    }

    /// Waits until every read-side section entered before this call has ended. Concurrent
    /// callers take turns.
    pub fn synchronize(&self) {
        let _one = self.writers.writer.lock().unwrap_or_else(PoisonError::into_inner);
        // Two flips: readers that entered before this call are on either parity (a numbered
        // period may have flipped without waiting), and each flip drains one.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ticket_passes_only_once_every_reader_present_when_it_was_taken_has_left() {
        let g = Grace::default();
        // No reader: three steps (flip, flip, end) end the first period.
        let t = g.ticket();
        assert_eq!(t, 0);
        g.advance();
        g.advance();
        assert_eq!(g.periods_ended(), 0);
        g.advance();
        assert_eq!(g.periods_ended(), 1);
        // A reader inside when the ticket is taken holds the next period at its first flip.
        let reader = g.read();
        let t = g.ticket();
        assert_eq!(t, 1);
        for _ in 0..100 {
            g.advance();
        }
        assert_eq!(g.periods_ended(), 1);
        // Once it leaves, two steps end the period.
        drop(reader);
        g.advance();
        assert_eq!(g.periods_ended(), 1);
        g.advance();
        assert_eq!(g.periods_ended(), 2);
        // A synchronize between a period's flips (two flips of its own) leaves the period's
        // second flip on the other parity: a reader that entered after the synchronize holds
        // the period until it leaves.
        g.advance();
        g.synchronize();
        let late = g.read();
        for _ in 0..10 {
            g.advance();
        }
        assert_eq!(g.periods_ended(), 2);
        drop(late);
        g.advance();
        assert_eq!(g.periods_ended(), 3);
    }
}
