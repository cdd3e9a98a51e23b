//! Runs: each holder's blocks in the order they were stored, in pages of [`PAGE`] hashes, so a
//! lookup that found a holder's entry for block `i` checks block `i + 1` by reading the next
//! entry of the same page (contiguous memory) instead of probing the table.
//!
//! A *holder* is a packed `(worker, tag, tier)` (`packed::holder`). Each of its live table slots
//! names one *entry* (`page * PAGE + offset`, `packed::entry_of`): the page position where its
//! hash was written when the slot was created. An entry's bit in its page's `valid` word is set
//! exactly while that slot is live, so
//!
//! > a valid entry of a page owned by holder `h` means `h` holds the entry's hash.
//!
//! That is all a lookup relies on: a valid entry whose hash equals the request's next block
//! proves the holder holds it; anything else (an invalid or different entry, the page's end,
//! a slot with no entry) proves nothing, and the lookup probes the table as before.
//!
//! Pages are written only by their holder's writers (who hold its stripe of `cursors`); an
//! entry is written once, before its valid bit is set (`Release`). A page whose entries are all
//! invalid is freed, but reused (possibly by another holder) only after a grace period, so a
//! lookup that got an entry from a live slot never reads a page that changed owner under it.
//! Writers do not wait for that grace period: they start one and check at later allocations
//! whether it has ended, taking fresh pages meanwhile.
//!
//! **Links.** Where a holder's next block was not written right after the previous one (a
//! stored event continuing an earlier event of its holder: a conversation's next turn; or an
//! event crossing into a new page), the writer leaves a *link* in the previous entry's page:
//! "after entry `k`, go on at entry `t`". A page has [`LINKS`] link slots, chosen by offset (a
//! newer link of the same slot replaces an older one). A link is only a hint: a lookup that
//! follows one proves nothing by it, it checks the target entry as it checks any entry, and
//! because the target page was not reached through a live slot (so the grace period does not
//! keep it from changing owner), it also checks the page's *stamp* before and after reading it.
//! The stamp is the page's owner and an epoch that rises each time the page is handed out; a
//! lookup that reads the same owned stamp before and after the page's entries read them within
//! one owner's tenure, where a valid entry proves that owner holds its hash.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

use super::grace::Grace;
use super::packed;
use super::prefetch::prefetch;
use super::{lock, Padded};

/// Entries per page: one `valid` word covers a page.
pub(super) const PAGE: u32 = 64;
/// Pages per chunk of the pool (a chunk is allocated whole, on first use).
const CHUNK: usize = 512;
/// Chunks in the directory: up to 2^26 entries (64M (holder, block) pairs, about a gigabyte
/// of index), well within `packed::ENTRY_BITS`. Beyond that, new slots get no entry: their
/// lookups probe block by block, exactly as before.
const CHUNKS: usize = (1 << 26) / PAGE as usize / CHUNK;
/// Stripes of the holder cursors (the holder locks).
const STRIPES: usize = 64;
/// Link slots per page (see the module docs, Links).
const LINKS: usize = 8;
/// Bits of a link's target entry (entries stop below 2^26: `CHUNKS`).
const LINK_BITS: u32 = 26;
const LINK_TARGET: u32 = (1 << LINK_BITS) - 1;

/// A page's stamp while a holder owns it: this bit, the epoch (bits 32..63) and the holder's
/// bits (`holder >> 34`, 30 bits). A free page's stamp has only its epoch.
const OWNED: u64 = 1 << 31;
const STAMP_HOLDER: u64 = OWNED - 1;
const HOLDER_SHIFT: u32 = 34;

/// True if `stamp` is a page's stamp while `holder` owns it (some tenure of it).
#[inline]
pub(super) fn owned_by(stamp: u64, holder: u64) -> bool {
    stamp & (OWNED | STAMP_HOLDER) == OWNED | (holder >> HOLDER_SHIFT)
}

/// The holder of an owned stamp (`None` if free).
#[inline]
pub(super) fn owner(stamp: u64) -> Option<u64> {
    (stamp & OWNED != 0).then_some((stamp & STAMP_HOLDER) << HOLDER_SHIFT)
}

/// The link slot of offset `k`: spreads offsets a multiple of 8 apart (events of 8 blocks).
#[inline]
fn link_slot(k: u32) -> usize {
    ((k ^ (k >> 3)) as usize) % LINKS
}

pub(super) struct Page {
    /// Bit `k`: entry `k` is the entry of a live slot.
    valid: AtomicU64,
    /// Owner and epoch (see [`owned_by`]).
    stamp: AtomicU64,
    /// `offset << LINK_BITS | target entry`: after entry `offset`, the holder's blocks go on at
    /// `target` (a hint; see the module docs, Links).
    links: [AtomicU32; LINKS],
    hashes: [AtomicU64; PAGE as usize],
}

impl Page {
    fn new() -> Self {
        Self {
            valid: AtomicU64::new(0),
            stamp: AtomicU64::new(0),
            links: std::array::from_fn(|_| AtomicU32::new(0)),
            hashes: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }

    /// The page's stamp (`Acquire`: entries read after it are at least as new).
    #[inline]
    pub fn stamp(&self) -> u64 {
        self.stamp.load(Ordering::Acquire)
    }

    /// True if the page's stamp is still `stamp` after the reads of its entries before this
    /// call (a seqlock's second read: every page change of a new tenure is written after its
    /// stamp, behind a `Release` fence).
    #[inline]
    pub fn still(&self, stamp: u64) -> bool {
        fence(Ordering::Acquire);
        self.stamp.load(Ordering::Relaxed) == stamp
    }

    /// The entry a link says follows entry `offset` of this page, if there is one (a hint).
    #[inline]
    pub fn link(&self, offset: u32) -> Option<u32> {
        let l = self.links[link_slot(offset)].load(Ordering::Relaxed);
        (l >> LINK_BITS == offset).then_some(l & LINK_TARGET)
    }

    /// Sets the `valid` word to `valid` (`Release`: the entries it makes valid were written
    /// before). Only the page's holder's writers write it, under its lock (module docs), so the
    /// caller's load and this store need no read-modify-write, which would also wait for every
    /// store and load before it.
    #[inline]
    fn set_valid(&self, valid: u64) {
        self.valid.store(valid, Ordering::Release);
    }

    /// Asks for the lines holding the `valid` word and entry `offset` (see `Table::prefetch`).
    #[inline]
    pub fn prefetch(&self, offset: u32) {
        prefetch(&self.valid);
        prefetch(&self.hashes[(offset % PAGE) as usize]);
    }

    /// How many entries from `offset` on are valid and equal `hashes`, in order.
    #[inline]
    pub fn matching(&self, offset: u32, hashes: &[u64]) -> usize {
        if offset >= PAGE {
            return 0;
        }
        let valid = self.valid.load(Ordering::Acquire) >> offset;
        let room = (PAGE - offset) as usize;
        let n = hashes.len().min(room).min(valid.trailing_ones() as usize);
        let page = &self.hashes[offset as usize..offset as usize + n];
        page.iter().zip(&hashes[..n]).take_while(|(e, &h)| e.load(Ordering::Relaxed) == h).count()
    }
}

/// Whether a page left with `left` valid entries (a quarter or less) is compacted, given
/// whether the pages in use are half empty (asked only when it matters): always at a
/// sixteenth or less; at a quarter only when pages are half empty, so that page slack stays
/// bounded. Compacting every quarter-full page cost a probe per moved entry and, in a cache's
/// churn, used more pages, not fewer: the pages it would empty mostly empty themselves
/// (`docs/benchmarks.md`).
pub(super) fn compact_now(left: u32, half_empty: impl FnOnce() -> bool) -> bool {
    left <= PAGE / 16 || (left <= PAGE / 4 && half_empty())
}

/// Where a holder appends: its current page and how many entries of it are used.
#[derive(Clone, Copy, Debug)]
pub(super) struct Cursor {
    page: u32,
    used: u32,
}

impl Cursor {
    /// A holder's cursor before its first entry: no page (the first append takes one).
    pub const NEW: Cursor = Cursor { page: NO_PAGE, used: PAGE };
}

/// One stripe of holders: their cursors. Holding it is holding the lock of its holders.
pub(super) type Cursors = HashMap<u64, Cursor, BuildHasherDefault<WordHasher>>;

/// Hashes a word with one multiply, for the index's small maps on hot paths whose keys are few
/// or not chosen by an adversary: the holder cursors (on every store's and removal's path)
/// and a lookup thread's kept candidates (at most `MEMO_KEYS` keys).
#[derive(Default)]
pub(super) struct WordHasher(u64);

impl Hasher for WordHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ b as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    fn write_u64(&mut self, x: u64) {
        self.0 = (self.0 ^ x).wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(29);
    }
}

#[derive(Default)]
struct PoolState {
    /// Pages handed out so far (ids below this exist).
    fresh: u32,
    /// Free pages, reusable now.
    free: Vec<u32>,
    /// Freed pages and their grace tickets, oldest first: reusable once the ticket passed.
    retired: VecDeque<(u32, u64)>,
}
/// The page of a cursor that has none yet.
const NO_PAGE: u32 = u32::MAX;

/// The pages of every holder.
pub(super) struct Runs {
    /// Fixed directory of lazily allocated chunks, so lookups read pages without a lock.
    chunks: Box<[OnceLock<Box<[Page]>>]>,
    /// Locked at every page handed out or freed; apart from `chunks`, which lookups read at
    /// every page.
    state: Padded<Mutex<PoolState>>,
    cursors: Box<[Mutex<Cursors>]>,
}

impl Default for Runs {
    fn default() -> Self {
        Self {
            chunks: (0..CHUNKS).map(|_| OnceLock::new()).collect(),
            state: Padded::default(),
            cursors: (0..STRIPES).map(|_| Mutex::default()).collect(),
        }
    }
}

impl Runs {
    /// The page of `entry` (None for `NO_ENTRY` or a page never handed out).
    #[inline]
    pub fn page(&self, entry: u32) -> Option<&Page> {
        let page = (entry / PAGE) as usize;
        self.chunks.get(page / CHUNK)?.get().map(|c| &c[page % CHUNK])
    }

    /// Leaves a link in `from`'s page: after `from`, `holder`'s blocks go on at `to`. Caller
    /// holds the holder's lock and `from` is the entry of a live slot of the holder (so its page
    /// is the holder's). Nothing when either has no entry.
    pub fn link(&self, from: u32, to: u32) {
        if from == packed::NO_ENTRY || to > LINK_TARGET {
            return;
        }
        if let Some(p) = self.page(from) {
            let k = from % PAGE;
            p.links[link_slot(k)].store((k << LINK_BITS) | to, Ordering::Relaxed);
        }
    }

    /// Records that `next` follows `prev` among a holder's blocks: nothing when `next` is the
    /// entry after `prev` in the same page (lookups read on), else a link. Same conditions as
    /// [`Runs::link`].
    pub fn join(&self, prev: u32, next: u32) {
        if next != prev.wrapping_add(1) || prev % PAGE == PAGE - 1 {
            self.link(prev, next);
        }
    }

    /// The link after `entry`, if its page has one (a hint).
    pub fn link_of(&self, entry: u32) -> Option<u32> {
        self.page(entry)?.link(entry % PAGE)
    }

    /// The lock of `holder`'s pages (a stripe shared with other holders). Writers of a holder
    /// hold it around every change of the holder's slots.
    pub fn lock(&self, holder: u64) -> MutexGuard<'_, Cursors> {
        let x = (holder >> 34).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        lock(&self.cursors[(x >> 58) as usize % STRIPES])
    }

    /// Writes `hash` as `holder`'s next entry and marks it valid; the caller then publishes
    /// the slot naming it. `cursor` is the holder's (the caller holds its lock). `NO_ENTRY`
    /// when the pool is exhausted (the slot then has none).
    pub fn append(&self, cursor: &mut Cursor, holder: u64, hash: u64, grace: &Grace) -> u32 {
        if cursor.used == PAGE {
            let Some(page) = self.alloc(holder, grace) else {
                return packed::NO_ENTRY;
            };
            if cursor.page != NO_PAGE {
                self.free_if_empty(cursor.page, grace);
            }
            *cursor = Cursor { page, used: 0 };
        }
        let p = self.page(cursor.page * PAGE).expect("an allocated page exists");
        p.hashes[cursor.used as usize].store(hash, Ordering::Relaxed);
        p.set_valid(p.valid.load(Ordering::Relaxed) | 1 << cursor.used);
        cursor.used += 1;
        cursor.page * PAGE + cursor.used - 1
    }

    /// Marks `entry` (of a slot of the holder whose `cursor` this is, that just died, or
    /// moved) invalid, freeing its page when no valid entry is left and the holder no longer
    /// appends to it. Returns the page and its valid entries if it is now sparse (a quarter or
    /// less valid), for [`compact_now`] to judge.
    pub fn invalidate(&self, cursor: &Cursor, entry: u32, grace: &Grace) -> Option<(u32, u32)> {
        let p = self.page(entry)?;
        let bit = 1 << (entry % PAGE);
        let left = p.valid.load(Ordering::Relaxed) & !bit;
        p.set_valid(left);
        let page = entry / PAGE;
        if cursor.page == page {
            return None;
        }
        if left == 0 {
            self.free(page, grace);
            return None;
        }
        (left.count_ones() <= PAGE / 4).then_some((page, left.count_ones()))
    }

    /// The valid entries of `page`, as `(entry, hash)`.
    pub fn valid_entries(&self, page: u32) -> Vec<(u32, u64)> {
        let Some(p) = self.page(page * PAGE) else { return Vec::new() };
        let mut valid = p.valid.load(Ordering::Acquire);
        let mut out = Vec::with_capacity(valid.count_ones() as usize);
        while valid != 0 {
            let k = valid.trailing_zeros();
            valid &= valid - 1;
            out.push((page * PAGE + k, p.hashes[k as usize].load(Ordering::Relaxed)));
        }
        out
    }

    /// Drops every page of the holders matching `drop` (their slots are gone). Caller holds
    /// those holders' locks (or otherwise excludes their writers) and removes their cursors.
    pub fn drop_pages(&self, drop: impl Fn(u64) -> bool, grace: &Grace) {
        let mut st = lock(&self.state);
        let mut dropped = Vec::new();
        for page in 0..st.fresh {
            let p = self.page(page * PAGE).expect("allocated");
            if owner(p.stamp.load(Ordering::Relaxed)).is_some_and(&drop) {
                p.valid.store(0, Ordering::Release);
                Self::disown(p);
                dropped.push(page);
            }
        }
        let ticket = grace.ticket();
        st.retired.extend(dropped.into_iter().map(|page| (page, ticket)));
    }

    /// Marks a page free in its stamp (its entries are all invalid by now). Caller holds the
    /// pool's lock.
    fn disown(p: &Page) {
        let stamp = p.stamp.load(Ordering::Relaxed);
        p.stamp.store(stamp & !(OWNED | STAMP_HOLDER), Ordering::Release);
    }

    fn free_if_empty(&self, page: u32, grace: &Grace) {
        if self.page(page * PAGE).is_some_and(|p| p.valid.load(Ordering::Acquire) == 0) {
            self.free(page, grace);
        }
    }

    fn free(&self, page: u32, grace: &Grace) {
        let mut st = lock(&self.state);
        let p = self.page(page * PAGE).expect("a freed page exists");
        if p.stamp.load(Ordering::Relaxed) & OWNED != 0 {
            Self::disown(p);
            st.retired.push_back((page, grace.ticket()));
        }
    }

    /// A page for `holder`: a free one, else a fresh one. Freed pages become free once their
    /// grace ticket has passed (every lookup that could still read them is over); writers
    /// never wait for it, they move the grace periods on and check at each allocation.
    fn alloc(&self, holder: u64, grace: &Grace) -> Option<u32> {
        let mut st = lock(&self.state);
        if !st.retired.is_empty() {
            grace.advance();
            let ended = grace.periods_ended();
            while st.retired.front().is_some_and(|&(_, ticket)| ended > ticket) {
                let (page, _) = st.retired.pop_front().expect("a retired page");
                st.free.push(page);
            }
        }
        let page = match st.free.pop() {
            Some(page) => page,
            None => {
                let page = st.fresh;
                let chunk = self.chunks.get(page as usize / CHUNK)?;
                chunk.get_or_init(|| (0..CHUNK).map(|_| Page::new()).collect());
                st.fresh += 1;
                page
            }
        };
        let p = self.page(page * PAGE).expect("allocated");
        // A new tenure: entries and links reset, then the stamp (a new epoch), then a fence, so
        // that a lookup that reads anything this tenure writes also reads its stamp.
        p.valid.store(0, Ordering::Relaxed);
        for l in &p.links {
            l.store(0, Ordering::Relaxed);
        }
        let epoch = (p.stamp.load(Ordering::Relaxed) >> 32).wrapping_add(1) << 32;
        p.stamp.store(epoch | OWNED | (holder >> HOLDER_SHIFT), Ordering::Release);
        fence(Ordering::Release);
        Some(page)
    }

    /// Pages owned by holders, and free ones (reusable now or after a grace period).
    pub fn pages(&self) -> (usize, usize) {
        let st = lock(&self.state);
        let free = st.free.len() + st.retired.len();
        (st.fresh as usize - free, free)
    }

    /// [`Runs::bytes`] by use: `(entries, slack, headers, free, pool)`: the valid entries
    /// of pages in use (a hash each), their other entries, their headers (valid word, stamp
    /// and links), the pages not in use (free, waiting for a grace period, or never handed
    /// out in an allocated chunk), and the pool's directory and bookkeeping.
    pub fn bytes_by_use(&self) -> (usize, usize, usize, usize, usize) {
        let (mut owned, mut valid) = (0, 0);
        let fresh = lock(&self.state).fresh;
        for page in 0..fresh {
            let p = self.page(page * PAGE).expect("allocated");
            if owner(p.stamp.load(Ordering::Relaxed)).is_some() {
                owned += 1;
                valid += p.valid.load(Ordering::Relaxed).count_ones() as usize;
            }
        }
        let entry = std::mem::size_of::<AtomicU64>();
        let page = std::mem::size_of::<Page>();
        let chunks = self.chunks.iter().filter(|c| c.get().is_some()).count();
        let free = (chunks * CHUNK - owned) * page;
        let (entries, slack) = (valid * entry, (owned * PAGE as usize - valid) * entry);
        let headers = owned * (page - PAGE as usize * entry);
        (entries, slack, headers, free, self.bytes() - entries - slack - headers - free)
    }

    /// Heap bytes: allocated chunks, the directory and the bookkeeping.
    ///
    /// Never holds the pool's lock while it takes a holder's: writers take them in that order
    /// (a holder's, then the pool's to allocate a page), so holding both here the other way
    /// round deadlocked a writer and this reader (`/metrics` beside a stream).
    pub fn bytes(&self) -> usize {
        let chunks = self.chunks.iter().filter(|c| c.get().is_some()).count();
        let pool = {
            let st = lock(&self.state);
            st.free.capacity() * 4 + st.retired.capacity() * 16
        };
        let cursors: usize = self.cursors.iter().map(|c| lock(c).capacity() * (8 + 8 + 8)).sum();
        chunks * CHUNK * std::mem::size_of::<Page>()
            + self.chunks.len() * std::mem::size_of::<OnceLock<Box<[Page]>>>()
            + pool
            + cursors
            + STRIPES * std::mem::size_of::<Mutex<Cursors>>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    #[test]
    fn bytes_holds_no_lock_a_writer_with_a_holders_lock_waits_for() {
        let runs = std::sync::Arc::new(Runs::default());
        // A writer holds a holder's lock (as around every change of its slots)...
        let held = runs.lock(7 << 34);
        // ...while a reader counts the bytes: it waits for that lock.
        let reader = {
            let runs = runs.clone();
            std::thread::spawn(move || runs.bytes())
        };
        std::thread::sleep(Duration::from_millis(100));
        // The writer then allocates a page: it takes the pool's lock, which the reader must not
        // be holding while it waits.
        let (tx, rx) = mpsc::channel();
        {
            let runs = runs.clone();
            std::thread::spawn(move || {
                let grace = Grace::default();
                let _ = tx.send(runs.alloc(7 << 34, &grace));
            });
        }
        let page = rx.recv_timeout(Duration::from_secs(10)).expect("the pool's lock is free while bytes() waits");
        assert_eq!(page, Some(0));
        drop(held);
        reader.join().expect("the reader ends once the holder's lock is free");
    }
}
