//! Grace periods: a writer can wait until every lookup that started before a point in time has
//! finished, while lookups never wait for anything.
//!
//! **Readers.** Each thread that reads has a word of its own (a *slot*, alone on its cache
//! lines) in every index it reads. Entering a read-side section stores the global epoch into
//! the slot with one `SeqCst` swap (a full barrier: the slot is visible before any word the
//! section reads); leaving stores 0 with a plain `Release` store (every read of the section
//! happens before it). So a lookup costs one locked instruction, where two counters shared by
//! threads cost two read-modify-writes, and a lookup-thread-owned line is written by no one
//! else. A slot holds `epoch << DEPTH_BITS | depth`: a section opened inside another one only
//! counts itself, and the outer one's epoch keeps protecting both.
//!
//! **Writers.** A grace period flips the epoch (one read-modify-write: `E` becomes the current
//! epoch) and has passed once every slot is 0 or holds an epoch of at least `E`. A reader that
//! entered before the flip holds an older epoch until it leaves. One that loaded the old epoch
//! but stored it only after the writer had read its slot as 0 does not hold the period, and
//! need not: its swap comes after the writer's read in the single order of `SeqCst`
//! operations, and so after the flip and every write before the flip; what it reads is the
//! state those writes left. (Until it leaves, its older epoch only makes later periods wait a
//! little longer.)
//!
//! Writers that must not wait (those reclaiming run pages and table slots) use *numbered*
//! grace periods: something retired takes a [`Grace::ticket`] after the writes that retire
//! it, and may be reused once [`Grace::periods_ended`] is greater than the ticket. The periods
//! are moved on by [`Grace::advance`], which never waits: each call starts a period (its
//! flip), or ends the one under way if its readers have left. Ticket `t` is the number of
//! periods started when it was taken; period `t + 1` starts after it (its counter increment
//! reads the ticket's read-modify-write, so the retiring writes happen before its flip), so
//! every reader that could still see the retired thing entered before that flip, and has left
//! when the period ends.
//!
//! **Threads.** A thread takes the smallest free thread number the first time it reads any
//! index, and gives it back when it exits (a thread-local's destructor), so the slots a writer
//! reads stay as many as the threads that read at once. Slot `n` of an index is in chunk `k`
//! (chunk `k` has `16 << k` slots), allocated the first time a thread with such a number reads
//! it. A section opened where the thread's number is no longer available (in another
//! thread-local's destructor, after ours ran) counts itself in a shared counter instead, and a
//! period passes only while that counter is 0.

use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError, TryLockError};
use std::time::Duration;

use super::Padded;

/// Low bits of a slot: how many sections of its thread are open.
const DEPTH_BITS: u32 = 16;
const DEPTH: u64 = (1 << DEPTH_BITS) - 1;
/// Chunks of slots: `16 << k` in chunk `k`, over a million threads in all.
const CHUNKS: usize = 16;
const FIRST_CHUNK: usize = 16;

pub(super) struct Grace {
    /// Read by every lookup; written only by flips. Starts at 1 (a slot of 0 is idle).
    epoch: Padded<AtomicU64>,
    slots: [OnceLock<Box<[Padded<AtomicU64>]>>; CHUNKS],
    /// Sections of threads without a number (module docs).
    shared: Padded<AtomicU64>,
    writers: Padded<Writers>,
}

/// The writers' side of [`Grace`].
#[derive(Default)]
struct Writers {
    /// Serialises the flips and the steps of the numbered period under way: the epoch it
    /// waits for, if one is.
    writer: Mutex<Option<u64>>,
    /// Numbered periods started, and the last one ended (see [`Grace::ticket`]).
    started: AtomicU64,
    ended: AtomicU64,
}

/// A read-side section in progress; a writer's [`Grace::synchronize`] waits for it to drop.
pub(super) struct ReadGuard<'a> {
    word: &'a AtomicU64,
    numbered: bool,
    /// Not `Send`: a numbered guard's drop writes its thread's slot, which only that thread may.
    _thread: PhantomData<*const ()>,
}

impl Drop for ReadGuard<'_> {
    fn drop(&mut self) {
        if self.numbered {
            // Only this thread writes its slot.
            let v = self.word.load(Ordering::Relaxed);
            self.word.store(if v & DEPTH == 1 { 0 } else { v - 1 }, Ordering::Release);
        } else {
            self.word.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// Thread numbers: the smallest free one is taken, and given back when its thread exits.
static NUMBERS: Mutex<Numbers> = Mutex::new(Numbers { next: 0, free: Vec::new() });

struct Numbers {
    next: usize,
    free: Vec<usize>,
}

/// This thread's number, held for the thread's life.
struct ThreadNumber(usize);

impl Numbers {
    /// The smallest free number, so that numbers (and the slots writers read) stay few.
    fn take(&mut self) -> usize {
        match self.free.iter().enumerate().min_by_key(|&(_, &k)| k) {
            Some((i, _)) => self.free.swap_remove(i),
            None => {
                self.next += 1;
                self.next - 1
            }
        }
    }

    fn give(&mut self, n: usize) {
        self.free.push(n);
    }
}

fn numbers() -> std::sync::MutexGuard<'static, Numbers> {
    NUMBERS.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Drop for ThreadNumber {
    fn drop(&mut self) {
        // Every section of this thread has ended: its slots are 0 in every index.
        numbers().give(self.0);
    }
}

thread_local! {
    static NUMBER: ThreadNumber = ThreadNumber(numbers().take());
}

/// The chunk and the index in it of slot `n`.
fn place(n: usize) -> (usize, usize) {
    let k = (usize::BITS - 1 - (n / FIRST_CHUNK + 1).leading_zeros()) as usize;
    (k, n - FIRST_CHUNK * ((1 << k) - 1))
}

impl Default for Grace {
    fn default() -> Self {
        Self {
            epoch: Padded(AtomicU64::new(1)),
            slots: [const { OnceLock::new() }; CHUNKS],
            shared: Padded::default(),
            writers: Padded::default(),
        }
    }
}

impl Grace {
    /// Enters a read-side section. Never waits for a writer: only a thread's first section
    /// takes a lock (to take its thread number), and the first one numbered into a chunk not
    /// yet allocated allocates it.
    pub fn read(&self) -> ReadGuard<'_> {
        let Some(word) = NUMBER.try_with(|n| self.slot(n.0)).ok().flatten() else {
            self.shared.fetch_add(1, Ordering::SeqCst);
            return ReadGuard { word: &self.shared, numbered: false, _thread: PhantomData };
        };
        let v = word.load(Ordering::Relaxed);
        if v != 0 {
            // Inside a section of this thread: its epoch already covers this one.
            assert!(v & DEPTH != DEPTH, "grace: too many nested read-side sections");
            word.store(v + 1, Ordering::Relaxed);
        } else {
            word.swap(self.epoch.load(Ordering::SeqCst) << DEPTH_BITS | 1, Ordering::SeqCst);
        }
        ReadGuard { word, numbered: true, _thread: PhantomData }
    }

    /// Slot `n`, its chunk allocated on first use; `None` past the last chunk.
    fn slot(&self, n: usize) -> Option<&AtomicU64> {
        let (k, i) = place(n);
        let chunk = self.slots.get(k)?.get_or_init(|| (0..FIRST_CHUNK << k).map(|_| Padded::default()).collect());
        Some(&chunk[i].0)
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
    /// under way, else ends it if the readers it waits for have left. Does nothing while
    /// another writer holds the flips (a [`Grace::synchronize`]).
    pub fn advance(&self) {
        let mut step = match self.writers.writer.try_lock() {
            Ok(step) => step,
            Err(TryLockError::Poisoned(e)) => e.into_inner(),
            Err(TryLockError::WouldBlock) => return,
        };
        *step = match *step {
            None => {
                self.writers.started.fetch_add(1, Ordering::SeqCst);
                Some(self.flip())
            }
            Some(e) if self.passed(e) => {
                self.writers.ended.store(self.writers.started.load(Ordering::SeqCst), Ordering::SeqCst);
                None
            }
            waiting => waiting,
        };
    }

    /// Starts a period: the epoch it waits for.
    fn flip(&self) -> u64 {
        self.epoch.fetch_add(1, Ordering::SeqCst) + 1
    }

    /// True when every section open now entered at epoch `e` or later (sections that enter
    /// later only delay the answer).
    fn passed(&self, e: u64) -> bool {
        self.shared.load(Ordering::SeqCst) == 0
            && self.slots.iter().filter_map(OnceLock::get).flat_map(|c| c.iter()).all(|w| {
                let v = w.load(Ordering::SeqCst);
                v == 0 || v >> DEPTH_BITS >= e
            })
    }

    /// Waits until every read-side section entered before this call has ended. Concurrent
    /// callers take turns. Not to be called inside a read-side section of this thread.
    pub fn synchronize(&self) {
        let _one = self.writers.writer.lock().unwrap_or_else(PoisonError::into_inner);
        // A numbered period under way waits for an epoch no later than this one: it passes
        // at its next step, if not before.
        let e = self.flip();
        let mut spins = 0u32;
        while !self.passed(e) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::{mpsc, Arc};

    #[test]
    fn a_ticket_passes_only_once_every_reader_present_when_it_was_taken_has_left() {
        let g = Grace::default();
        // No reader: two steps (the flip, the end) end the first period.
        let t = g.ticket();
        assert_eq!(t, 0);
        g.advance();
        assert_eq!(g.periods_ended(), 0);
        g.advance();
        assert_eq!(g.periods_ended(), 1);
        // A reader inside when the ticket is taken holds the next period at its flip.
        let reader = g.read();
        let t = g.ticket();
        assert_eq!(t, 1);
        for _ in 0..100 {
            g.advance();
        }
        assert_eq!(g.periods_ended(), 1);
        // Once it leaves, the next step ends the period.
        drop(reader);
        g.advance();
        assert_eq!(g.periods_ended(), 2);
        // A reader that entered after a period's flip does not hold it.
        g.advance();
        let late = g.read();
        g.advance();
        assert_eq!(g.periods_ended(), 3);
        // It holds the next one, started while it is inside.
        g.advance();
        g.advance();
        assert_eq!(g.periods_ended(), 3);
        drop(late);
        g.advance();
        assert_eq!(g.periods_ended(), 4);
        // A synchronize between a period's flip and its end leaves it to end at its next step.
        g.advance();
        g.synchronize();
        assert_eq!(g.periods_ended(), 4);
        g.advance();
        assert_eq!(g.periods_ended(), 5);
    }

    #[test]
    fn a_nested_section_is_covered_by_the_outer_one_and_leaves_it_open() {
        let g = Grace::default();
        let outer = g.read();
        g.advance();
        let inner = g.read();
        drop(inner);
        // The outer section, entered before the flip, still holds the period.
        for _ in 0..10 {
            g.advance();
        }
        assert_eq!(g.periods_ended(), 0);
        // Dropped in the other order: the outer guard first. The second one keeps the section
        // open (and the outer epoch in the slot) until it drops too.
        let again = g.read();
        drop(outer);
        g.advance();
        assert_eq!(g.periods_ended(), 0, "the second guard still covers the thread");
        drop(again);
        g.advance();
        assert_eq!(g.periods_ended(), 1);
    }

    #[test]
    fn sections_without_a_thread_number_hold_every_period_while_open() {
        let g = Grace::default();
        // What `read` does when this thread's number is gone (a thread-local destructor).
        g.shared.fetch_add(1, Ordering::SeqCst);
        for _ in 0..10 {
            g.advance();
        }
        assert_eq!(g.periods_ended(), 0);
        drop(ReadGuard { word: &g.shared, numbered: false, _thread: PhantomData });
        g.advance();
        assert_eq!(g.periods_ended(), 1);
    }

    #[test]
    fn synchronize_waits_for_a_reader_of_another_thread() {
        let g = Arc::new(Grace::default());
        let (entered_tx, entered) = mpsc::channel();
        let (leave_tx, leave) = mpsc::channel::<()>();
        let reader = {
            let g = g.clone();
            std::thread::spawn(move || {
                let guard = g.read();
                entered_tx.send(()).unwrap();
                leave.recv().unwrap();
                drop(guard);
            })
        };
        entered.recv().unwrap();
        let done = Arc::new(AtomicBool::new(false));
        let waiter = {
            let (g, done) = (g.clone(), done.clone());
            std::thread::spawn(move || {
                g.synchronize();
                done.store(true, Ordering::SeqCst);
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        assert!(!done.load(Ordering::SeqCst), "synchronize returned while a reader that entered before it was inside");
        leave_tx.send(()).unwrap();
        reader.join().unwrap();
        waiter.join().unwrap();
        assert!(done.load(Ordering::SeqCst));
    }

    #[test]
    fn thread_numbers_are_the_smallest_free_and_slots_fill_their_chunks() {
        let mut n = Numbers { next: 0, free: Vec::new() };
        assert_eq!((n.take(), n.take(), n.take(), n.take()), (0, 1, 2, 3));
        n.give(2);
        n.give(0);
        assert_eq!((n.take(), n.take(), n.take()), (0, 2, 4));
        // Chunk k holds 16 << k slots, one after the other.
        assert_eq!(
            [place(0), place(15), place(16), place(47), place(48), place(111), place(112)],
            [(0, 0), (0, 15), (1, 0), (1, 31), (2, 0), (2, 63), (3, 0)]
        );
        let g = Grace::default();
        assert!(std::ptr::eq(g.slot(47).unwrap(), g.slot(47).unwrap()));
        assert_eq!(g.slots.iter().filter(|c| c.get().is_some()).count(), 1);
        assert_eq!(g.slots[1].get().map(|c| c.len()), Some(32));
        // Past the last chunk there is no slot (such a thread counts in the shared counter).
        let last = FIRST_CHUNK * ((1 << CHUNKS) - 1);
        assert!(g.slot(last - 1).is_some());
        assert!(g.slot(last).is_none());
    }

    #[test]
    fn a_thread_that_exits_gives_its_number_back() {
        // 400 readers one after the other. Without reuse they would take 400 new numbers;
        // with it, no more than the readers alive at once in this process (other tests' threads
        // take and give numbers meanwhile: a few dozen at most).
        let g = Arc::new(Grace::default());
        let before = numbers().next;
        for _ in 0..400 {
            let g = g.clone();
            std::thread::spawn(move || drop(g.read())).join().unwrap();
        }
        let grew = numbers().next - before;
        assert!(grew < 200, "400 threads one after the other took {grew} new numbers");
    }
}
