//! The prefix index: which worker holds which KV blocks, in which tier, and how many leading
//! blocks of a request each worker holds.
//!
//! # Semantics
//!
//! A key is `(worker, tier, block hash)`; each key has a copy count. [`PrefixIndex::store`]
//! adds one copy per hash (the same hash stored twice is two copies), [`PrefixIndex::remove`]
//! takes one (a hash with no copies is a counted no-op, never an underflow),
//! [`PrefixIndex::clear`] drops a worker's blocks (all, or one tier),
//! [`PrefixIndex::remove_worker`] drops a worker, and [`PrefixIndex::replace_worker`] swaps in
//! a worker's complete new state ([`StagedSnapshot`]) atomically.
//!
//! [`PrefixIndex::lookup`] takes a request's chained block hashes `[h0, h1, ..]` and returns,
//! for every worker holding `h0` in some tier, the number of leading blocks it holds in any
//! tier (block `i` counts if some tier holds `h_i`, and all earlier blocks counted), and per
//! tier the leading run within that tier alone. Workers holding none of `h0` (0 matched blocks)
//! are omitted, as are tiers with a run of 0. After any sequence of operations every lookup
//! equals [`reference::ReferenceIndex::lookup`] exactly. [`PrefixIndex::blocks`] lists one
//! worker's whole state (every tier, hash and copy count), for audits and end-to-end checks.
//!
//! ```
//! use kv_router_client::index::{PrefixIndex, StagedSnapshot, TierId};
//!
//! let index = PrefixIndex::default();
//! let w = index.worker("http://relay-a:50051", 0)?;
//! index.store(w, TierId::DEVICE, &[11, 12, 13]);
//! index.store(w, TierId::HOST, &[11]);
//! let found = index.lookup(&[11, 12, 99]);
//! let m = found.get(w).unwrap();
//! assert_eq!((m.blocks, m.tier(TierId::DEVICE), m.tier(TierId::HOST)), (2, 2, 1));
//!
//! // A resync: the worker's whole state, swapped in atomically.
//! let mut snapshot = StagedSnapshot::new();
//! snapshot.extend_blocks(TierId::DISK, &[11, 12, 99]);
//! index.replace_worker(w, &snapshot);
//! assert_eq!(index.lookup(&[11, 12, 99]).get(w).unwrap().tier(TierId::DISK), 3);
//! # Ok::<(), kv_router_client::index::IndexError>(())
//! ```
//!
//! # Design
//!
//! How the index is built (storage, runs, crowded first blocks, crowd records, lock-free
//! lookups, the atomic snapshot replace, writers) and its trade-offs: `docs/prefix-index.md`.

mod crowd;
mod grace;
mod ids;
mod prefetch;
pub mod reference;
mod result;
mod runs;
mod snapshot;
mod table;

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::hash::BuildHasherDefault;
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError, RwLock};

use arc_swap::ArcSwap;

pub use ids::{IndexError, TierId, TierInterner, WorkerId, WorkerInterner};
pub use result::{LookupResult, TierRun, WorkerMatch};
pub use snapshot::StagedSnapshot;

use crowd::Crowd;
use grace::{Grace, ReadGuard};
use prefetch::prefetch;
use runs::{Cursor, Runs, WordHasher, PAGE};
use table::{Added, Overflow, Probe, Subbed, Table};

/// Construction parameters of a [`PrefixIndex`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexConfig {
    /// Number of shards (rounded up to a power of two). More shards let more writer threads
    /// run at once and make each rebuild smaller.
    pub shards: usize,
    /// Blocks to size the tables for up front (they grow as needed).
    pub initial_capacity: usize,
}

impl Default for IndexConfig {
    fn default() -> Self {
        Self { shards: 16, initial_capacity: 0 }
    }
}

/// What a [`PrefixIndex::remove`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RemoveOutcome {
    /// Copies taken.
    pub removed: usize,
    /// Hashes that had no copy to take (counted no-ops).
    pub missing: usize,
}

/// Counters and sizes of a [`PrefixIndex`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IndexStats {
    /// `(worker, tier, hash)` keys with copies > 0.
    pub blocks: usize,
    /// Dead slots (reused after a grace period, freed in place by a sweep, or dropped by a
    /// rebuild).
    pub tombstones: usize,
    /// Slots allocated over all shards.
    pub slots: usize,
    /// Removals of blocks that had no copy.
    pub missing_removes: u64,
    /// Stores that hit the `u32::MAX` copy limit.
    pub saturated_stores: u64,
    /// Completed [`PrefixIndex::replace_worker`] calls (including clears and removals).
    pub replaces: u64,
    /// Shard tables rebuilt (grown when full, or shrunk after a worker-level removal).
    pub rebuilds: u64,
    /// Full shard tables that freed their dead slots in place instead of being rebuilt.
    pub sweeps: u64,
    /// Pages of the holders' runs: in use, and free (reusable now or after a grace period).
    pub run_pages: (usize, usize),
}

/// Where [`PrefixIndex::memory_bytes`] is, by structure (bytes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryBreakdown {
    /// Table slots holding a live `(worker, tier, hash)` key, each with its share of its
    /// group's control word.
    pub live_slots: usize,
    /// Dead slots (waiting for a grace period, a sweep or a rebuild).
    pub dead_slots: usize,
    /// Slots never used, or freed: the tables' load-factor room.
    pub empty_slots: usize,
    /// The tables' version counters and headers.
    pub versions: usize,
    /// Crowd records.
    pub crowds: usize,
    /// Run pages in use: their valid entries (a hash each).
    pub run_entries: usize,
    /// Run pages in use: their entries not valid (not written yet, or dead).
    pub run_slack: usize,
    /// Run pages in use: valid words, stamps and links.
    pub run_headers: usize,
    /// Run pages not in use (free, waiting for a grace period, or not handed out yet in an
    /// allocated chunk).
    pub run_free: usize,
    /// The page pool's directory, free lists and holder cursors.
    pub run_pool: usize,
    /// Generation words, locks, the overflow map of copy counts, and the index itself.
    pub other: usize,
}

impl MemoryBreakdown {
    /// The parts, named, in field order.
    pub fn parts(&self) -> [(&'static str, usize); 11] {
        [
            ("live slots", self.live_slots),
            ("dead slots", self.dead_slots),
            ("empty slots", self.empty_slots),
            ("versions", self.versions),
            ("crowd records", self.crowds),
            ("run entries", self.run_entries),
            ("run slack", self.run_slack),
            ("run headers", self.run_headers),
            ("free pages", self.run_free),
            ("page pool", self.run_pool),
            ("other", self.other),
        ]
    }

    /// The sum of the parts: [`PrefixIndex::memory_bytes`].
    pub fn total(&self) -> usize {
        self.parts().iter().map(|&(_, b)| b).sum()
    }
}

/// One shard's writer lock, holding the shard's current table (the one also published in
/// `tables`) so writers need no `ArcSwap` load. Alone on its cache lines so writers of
/// different shards do not contend. Lookups never take it.
///
/// A spin lock whose waiters yield their thread, not `std::sync::Mutex`: a writer takes it
/// once per block, and std's mutex releases with a locked swap (to see whether anyone sleeps
/// on it), which on x86 waits until the writer's pending stores have left for the cache. The
/// writer's stores to lines a lookup has just read wait for those lines, so each release held
/// the writer until the block's misses were over. This one releases with a plain store and the
/// next block's work overlaps them, which is what a writer beside lookups is bound by. Writers rarely
/// meet on one shard; one that does yields until the holder, who never sleeps or waits under
/// it, is done. A panic under it releases it on unwinding, as std's does (nothing here reads
/// the poison flag either).
type ShardLock = Padded<spin::mutex::SpinMutex<Arc<Table>, spin::relax::Yield>>;

/// A value alone on its two cache lines (the adjacent-line prefetcher fetches lines in pairs):
/// for words writers change often, kept away from the words every lookup reads. A write to a
/// line a lookup reads costs that lookup a miss, and the first one of a lookup sits before
/// its grace section's swap, which waits for it.
#[repr(align(128))]
#[derive(Default)]
struct Padded<T>(T);

impl<T> std::ops::Deref for Padded<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

/// The shards' tables, published together so a lookup loads them with one `ArcSwap` load.
type Tables = Box<[Arc<Table>]>;

/// Per-worker generation words: `swap_seq << 1 | tag`. Chunked (chunk `k` covers
/// `1024 << k` workers) so that readers index it without a lock while writers add chunks.
struct Generations {
    chunks: [OnceLock<Box<[AtomicU64]>>; 14],
}

impl Generations {
    fn locate(worker: WorkerId) -> (usize, usize) {
        let x = worker.get() as u64 + 1024;
        let k = (63 - x.leading_zeros() - 10) as usize;
        (k, (x - (1024 << k)) as usize)
    }

    fn load(&self, worker: WorkerId) -> u64 {
        let (k, i) = Self::locate(worker);
        self.chunks[k].get().map_or(0, |c| c[i].load(Ordering::SeqCst))
    }

    fn store(&self, worker: WorkerId, word: u64) {
        let (k, i) = Self::locate(worker);
        let chunk = self.chunks[k].get_or_init(|| (0..1024 << k).map(|_| AtomicU64::new(0)).collect());
        chunk[i].store(word, Ordering::SeqCst);
    }

    fn bytes(&self) -> usize {
        std::mem::size_of::<Self>() + self.chunks.iter().filter_map(|c| c.get()).map(|c| c.len() * 8).sum::<usize>()
    }
}

const WORKER_STRIPES: usize = 64;

/// The concurrent prefix index. See the [module docs](self) for semantics and design.
pub struct PrefixIndex {
    tables: ArcSwap<Tables>,
    /// The set `tables` holds, for read-side sections ([`PrefixIndex::section_tables`]).
    section_tables: AtomicPtr<Tables>,
    /// Sets swapped out of `tables`, each with the grace ticket taken after it: kept until
    /// every read-side section that may have loaded its pointer has left.
    retired_sets: Mutex<Vec<(u64, Arc<Tables>)>>,
    /// Serialises publishing a rebuilt table into `tables` (writers of different shards may
    /// rebuild at once).
    publish: Mutex<()>,
    shard_locks: Box<[ShardLock]>,
    shard_mask: usize,
    gens: Generations,
    /// Number of completed tag flips; stamped into the flipped worker's generation word.
    swap_seq: AtomicU64,
    grace: Grace,
    /// Each holder's blocks in store order, for lookups that walk a matched run.
    runs: Runs,
    /// Copy counts too large for their slot.
    overflow: Overflow,
    /// Serialises replaces (tag flips and grace periods).
    swap: Mutex<()>,
    /// Read by incremental writers of a worker, written by that worker's replace.
    worker_locks: Box<[RwLock<()>]>,
    workers: WorkerInterner,
    tiers: TierInterner,
    missing_removes: AtomicU64,
    saturated_stores: AtomicU64,
    replaces: AtomicU64,
    rebuilds: AtomicU64,
    sweeps: AtomicU64,
}

impl Default for PrefixIndex {
    fn default() -> Self {
        Self::new(IndexConfig::default())
    }
}

impl std::fmt::Debug for PrefixIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixIndex")
            .field("shards", &self.shard_locks.len())
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

#[derive(Clone, Copy)]
struct Candidate {
    worker: u32,
    /// The tag this lookup counts for the worker.
    tag: u64,
    /// Tiers whose leading run is still going; once `done`, the tiers whose run ended at
    /// `blocks` (so that ending a candidate writes nothing else).
    alive: u64,
    /// Tiers holding block `seen_at` (stale, so 0, when `seen_at` is another block).
    seen: u64,
    seen_at: u32,
    /// Leading blocks in any tier, once the run ended.
    blocks: u32,
    done: bool,
    /// Runs of tiers that ended before the candidate did: the head of a list in
    /// `Scratch::runs` (`NO_RUN` if none).
    ended: u32,
}

impl Candidate {
    /// A worker holding block 0 in `tiers` under `tag`, before any later block.
    fn new(worker: u32, tag: u64, tiers: u64) -> Self {
        Candidate { worker, tag, alive: tiers, seen: 0, seen_at: 0, blocks: 0, done: false, ended: NO_RUN }
    }
}

/// Not a candidate (see `Memo::by_worker`).
const NO_CANDIDATE: u32 = u32::MAX;

/// The end of a candidate's list of ended runs.
const NO_RUN: u32 = u32::MAX;

#[derive(Default)]
struct Scratch {
    /// Holders of the blocks of the current window; block `k`'s end at `ends[k]`.
    holders: Vec<u64>,
    ends: [usize; WINDOW],
    /// Block `k` of the current window by its crowd record, when it has one and its holders
    /// were not listed (`PrefixIndex::gather`).
    crowds: [Option<Crowd>; WINDOW],
    candidates: Vec<Candidate>,
    /// Indexes of the candidates whose run goes on (a block costs O(its holders + these),
    /// not O(all candidates): after a popular first block most candidates drop out at once).
    alive: Vec<u32>,
    /// For every alive (candidate, tier): the entry of its slot of the last block matched.
    pairs: Vec<u32>,
    /// Alive candidates with no alive tier (their run goes on in tiers that did not hold
    /// block 0): only a probe tells whether they hold the next block.
    orphans: usize,
    /// The last block probed ended no run: the pairs left are likely to go on together.
    settled: bool,
    /// `(tier, run, next)`: per candidate, a list of the tier runs that ended before it did.
    runs: Vec<(u8, u32, u32)>,
    /// Scratch for sorting block 0's holders by worker.
    sorted: Vec<u64>,
    buckets: Vec<u32>,
    /// One candidate's tier runs, while `emit` sorts them.
    tier_runs: Vec<TierRun>,
    /// Block 0's candidates of crowded keys, as this thread last computed them.
    memo: HashMap<u64, Memo, BuildHasherDefault<WordHasher>>,
    /// The lookup started from kept candidates: the result already lists every candidate as
    /// ending at block 1, and `candidates` are only those that may go on.
    patch: bool,
    /// Kept candidates brought up to date by a key's last change instead of read again
    /// (`PrefixIndex::catch_up`), in this thread.
    caught_up: u64,
}

/// Block 0's candidates as a lookup computed them (before any later block), valid while the
/// key's table, the key's version and the swap sequence are the same: a crowded key's version
/// rises before and after any change of its holders, a rebuilt table has a new id, and the
/// tags a lookup counts depend only on the swap sequence it read. Not the pairs' entries:
/// those move (a page's compaction), and a lookup with kept candidates takes them from block
/// 1's probe.
#[derive(Default)]
struct Memo {
    at: (u64, u64, u64),
    /// Live slots of the key (every worker, tag and tier): at least [`MEMO_HOLDERS`].
    slots: usize,
    candidates: Vec<Candidate>,
    /// By worker id: the worker's index in `candidates` (`NO_CANDIDATE` if none); empty when
    /// the ids are sparse (then a binary search of `candidates` finds them). A lookup finds
    /// each holder of block 1 among block 0's candidates: with hundreds of candidates, binary
    /// searches were a fifth of a deep lookup's instructions.
    by_worker: Vec<u32>,
    /// The result if every candidate's match ends at block 1: a lookup copies it, then writes
    /// over the few candidates that go on (each tier that holds block 0 has a run of at least
    /// 1, so their entries keep their size).
    result: LookupResult,
}

impl Memo {
    fn is(&self, table: u64, version: u64, seq: u64) -> bool {
        self.at == (table, version, seq)
    }

    /// Builds `by_worker` and `result` from `candidates`.
    fn index(&mut self) {
        self.by_worker.clear();
        // Only when the workers' ids are dense enough to cost at most 16 bytes per candidate
        // (ids are interned in order, so the holders of a popular block usually are).
        let top = self.candidates.last().map_or(0, |c| c.worker as usize + 1);
        if top <= 4 * self.candidates.len() {
            self.by_worker.resize(top, NO_CANDIDATE);
            for (k, c) in self.candidates.iter().enumerate() {
                self.by_worker[c.worker as usize] = k as u32;
            }
        }
        self.result.clear();
        for c in &self.candidates {
            let worker = WorkerId::new(c.worker).expect("packed worker ids are valid");
            self.result.push(worker, 1, tier_runs(c.alive, 1));
        }
    }

    /// Applies one change of the key's slots (`holder`'s slot born or dead) to the candidates,
    /// `visible` giving the tag the lookups of this memo count for a worker. False if the
    /// candidates cannot be kept: fewer than [`MEMO_HOLDERS`] slots would be left, or the
    /// change does not fit them (never, while the versions are right).
    fn apply(&mut self, holder: u64, born: bool, visible: impl FnOnce(u32) -> u64) -> bool {
        self.slots = if born { self.slots + 1 } else { self.slots.saturating_sub(1) };
        if self.slots < MEMO_HOLDERS {
            return false;
        }
        let (worker, tag, bit) = (table::worker_of(holder), table::tag_of(holder), 1u64 << table::tier_of(holder));
        match self.candidates.binary_search_by_key(&worker, |c| c.worker) {
            Ok(k) => {
                let c = &mut self.candidates[k];
                if c.tag != tag {
                    return true;
                }
                if (c.alive & bit != 0) == born {
                    return false;
                }
                c.alive ^= bit;
                if c.alive == 0 {
                    self.candidates.remove(k);
                }
            }
            Err(k) => {
                if visible(worker) != tag {
                    return true;
                }
                if !born {
                    return false;
                }
                self.candidates.insert(k, Candidate::new(worker, tag, bit));
            }
        }
        self.index();
        true
    }
}

impl Scratch {
    /// Keeps block 0's candidates (just computed, from holders read between two reads of
    /// `at`'s version that gave the same even value) for `hash`.
    fn remember(&mut self, hash: u64, at: (u64, u64, u64)) {
        if self.memo.len() >= MEMO_KEYS && !self.memo.contains_key(&hash) {
            self.memo.clear();
        }
        let m = self.memo.entry(hash).or_default();
        m.at = at;
        m.slots = self.ends[0];
        m.candidates.clear();
        m.candidates.extend_from_slice(&self.candidates);
        m.index();
    }
}

/// Holders of block 0 from which a lookup keeps its candidates for the next lookups of the
/// same first block. At least eight: a key with more holders than its home group's seven
/// slots has one outside it, so every change of it raises its version.
const MEMO_HOLDERS: usize = 8;
/// First blocks whose candidates a thread keeps (all dropped when a new one would exceed it).
const MEMO_KEYS: usize = 64;

/// Blocks whose first cache lines a lookup asks for before using any (see `Table::prefetch`).
const WINDOW: usize = 8;
/// How many blocks ahead of the block it works on a writer asks for a block's lines (see
/// [`Ahead`]). 4, 8, 12 and 16 gave the same rate in the 128-worker bench.
const AHEAD: usize = 8;
/// Blocks a replace writes under one taking of their holder's lock (a stripe: other holders'
/// writers wait for it meanwhile).
const HELD: usize = 1024;
/// Most alive (candidate, tier) pairs a lookup follows through their runs; with more, it
/// probes (one probe serves every holder of a block).
const FOLLOW: usize = 8;

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Sorts packed values by worker id, keeping the order of equal ones. Block 0 of a popular
/// prefix has a holder per worker (hundreds), and a comparison sort of them cost a third of
/// such a lookup; an LSD radix sort over the bits the largest worker id needs is one pass of
/// at most 1,024 buckets for up to 1,024 workers.
fn sort_by_worker(v: &mut [u64], tmp: &mut Vec<u64>, buckets: &mut Vec<u32>) {
    const DIGIT: u32 = 10;
    if v.len() <= 32 {
        v.sort_by_key(|&x| table::worker_of(x));
        return;
    }
    let max = v.iter().map(|&x| table::worker_of(x)).max().unwrap_or(0);
    let bits = u32::BITS - max.leading_zeros();
    tmp.clear();
    tmp.resize(v.len(), 0);
    let mut shift = 0;
    let mut in_tmp = false;
    while shift < bits {
        let width = (bits - shift).min(DIGIT);
        let digit = |x: u64| ((table::worker_of(x) >> shift) & ((1 << width) - 1)) as usize;
        let (src, dst): (&[u64], &mut [u64]) = if in_tmp { (tmp, v) } else { (v, tmp) };
        buckets.clear();
        buckets.resize(1 << width, 0);
        for &x in src.iter() {
            buckets[digit(x)] += 1;
        }
        let mut at = 0;
        for b in buckets.iter_mut() {
            let n = *b;
            *b = at;
            at += n;
        }
        for &x in src.iter() {
            let b = &mut buckets[digit(x)];
            dst[*b as usize] = x;
            *b += 1;
        }
        in_tmp = !in_tmp;
        shift += width;
    }
    if in_tmp {
        v.copy_from_slice(tmp);
    }
}

/// One run of `blocks` for each tier whose bit `tiers` sets, in tier order.
fn tier_runs(mut tiers: u64, blocks: u32) -> impl Iterator<Item = TierRun> {
    std::iter::from_fn(move || {
        let t = (tiers != 0).then(|| tiers.trailing_zeros() as u8)?;
        tiers &= tiers - 1;
        Some(TierRun { tier: TierId::new(t).expect("packed tier ids are valid"), blocks })
    })
}

thread_local! {
    /// This thread's removals that took a copy, to pace [`Grace::advance`] (any index).
    static REMOVALS: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// The probes of a writer's blocks, in order, each block's first lines asked for [`AHEAD`]
/// blocks before it is yielded: the misses of the next blocks overlap the work on this one.
/// Plain loads could not do that: the shard lock a writer takes per block waits for every
/// load before it, so they overlapped only within a window, and each window paid a whole miss
/// (`prefetch.rs`).
struct Ahead<'a> {
    /// The tables the hints are for. A table rebuilt meanwhile only makes a hint useless.
    tables: arc_swap::Guard<Arc<Tables>>,
    mask: usize,
    hashes: &'a [u64],
    /// Block `i`'s probe is at `i % AHEAD` from the time its lines are asked for.
    ring: [Probe; AHEAD],
    next: usize,
}

impl<'a> Ahead<'a> {
    fn new(index: &PrefixIndex, hashes: &'a [u64]) -> Self {
        let mut ahead = Self {
            tables: index.tables.load(),
            mask: index.shard_mask,
            hashes,
            ring: [Probe::default(); AHEAD],
            next: 0,
        };
        for i in 0..hashes.len().min(AHEAD) {
            ahead.ask(i);
        }
        ahead
    }

    /// The table of `p`'s shard, of the set the hints are for.
    fn table(&self, p: &Probe) -> &Table {
        &self.tables[p.shard(self.mask)]
    }

    fn ask(&mut self, i: usize) {
        let p = Probe::new(self.hashes[i]);
        self.table(&p).prefetch_write(&p);
        self.ring[i % AHEAD] = p;
    }
}

impl Iterator for Ahead<'_> {
    type Item = Probe;

    fn next(&mut self) -> Option<Probe> {
        let i = self.next;
        if i == self.hashes.len() {
            return None;
        }
        let p = self.ring[i % AHEAD];
        if i + AHEAD < self.hashes.len() {
            self.ask(i + AHEAD);
        }
        self.next = i + 1;
        Some(p)
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl PrefixIndex {
    /// An empty index.
    pub fn new(config: IndexConfig) -> Self {
        let n = config.shards.max(1).next_power_of_two();
        let per_shard = config.initial_capacity / n;
        let tables: Arc<Tables> = Arc::new((0..n).map(|_| Arc::new(Table::for_entries(per_shard))).collect());
        Self {
            shard_locks: tables.iter().map(|t| Padded(spin::mutex::SpinMutex::new(t.clone()))).collect(),
            section_tables: AtomicPtr::new(Arc::as_ptr(&tables).cast_mut()),
            retired_sets: Mutex::default(),
            tables: ArcSwap::new(tables),
            publish: Mutex::new(()),
            shard_mask: n - 1,
            gens: Generations { chunks: [const { OnceLock::new() }; 14] },
            swap_seq: AtomicU64::new(0),
            grace: Grace::default(),
            runs: Runs::default(),
            overflow: Overflow::default(),
            swap: Mutex::new(()),
            worker_locks: (0..WORKER_STRIPES).map(|_| RwLock::new(())).collect(),
            workers: WorkerInterner::default(),
            tiers: TierInterner::default(),
            missing_removes: AtomicU64::new(0),
            saturated_stores: AtomicU64::new(0),
            replaces: AtomicU64::new(0),
            rebuilds: AtomicU64::new(0),
            sweeps: AtomicU64::new(0),
        }
    }

    /// The worker interner: `(relay_url, dp_rank) -> WorkerId`.
    pub fn workers(&self) -> &WorkerInterner {
        &self.workers
    }

    /// The tier interner: tier name -> `TierId`.
    pub fn tiers(&self) -> &TierInterner {
        &self.tiers
    }

    /// Shorthand for `self.workers().intern(relay_url, dp_rank)`.
    pub fn worker(&self, relay_url: &str, dp_rank: u32) -> Result<WorkerId, IndexError> {
        self.workers.intern(relay_url, dp_rank)
    }

    /// Shorthand for `self.tiers().intern(name)`.
    pub fn tier(&self, name: &str) -> Result<TierId, IndexError> {
        self.tiers.intern(name)
    }

    /// Replaces shard `s`'s table: `current` is the guard of shard `s`'s lock.
    fn publish(&self, s: usize, current: &mut Arc<Table>, table: Table) {
        self.rebuilds.fetch_add(1, Ordering::Relaxed);
        let table = Arc::new(table);
        *current = table.clone();
        let _p = lock(&self.publish);
        let mut next: Vec<Arc<Table>> = self.tables.load().iter().cloned().collect();
        next[s] = table;
        let next: Arc<Tables> = Arc::new(next.into_boxed_slice());
        self.section_tables.store(Arc::as_ptr(&next).cast_mut(), Ordering::SeqCst);
        let old = self.tables.swap(next);
        // Read-side sections that may still use the old set entered before the store above:
        // it is kept until they have left (a writer never waits for lookups). The periods are
        // moved on here too: an index that only grows (no removals, which move them on) kept
        // every set it swapped out, and with them every table ever replaced, as many bytes
        // again as its tables (the index bench's CI run: 99 bytes a pair by the allocator where
        // the index held 49, `docs/benchmarks.md`).
        let ticket = self.grace.ticket();
        lock(&self.retired_sets).push((ticket, old));
        self.move_periods_on(1);
    }

    /// Takes `steps` steps of the numbered grace periods ([`Grace::advance`]), then frees
    /// the table sets they let go.
    fn move_periods_on(&self, steps: usize) {
        for _ in 0..steps {
            self.grace.advance();
        }
        self.free_retired_sets();
    }

    /// Drops the table sets whose grace ticket has passed (they are freed unless a writer's
    /// guard still holds them).
    fn free_retired_sets(&self) {
        if let Ok(mut sets) = self.retired_sets.try_lock() {
            if !sets.is_empty() {
                let ended = self.grace.periods_ended();
                sets.retain(|&(ticket, _)| ended <= ticket);
            }
        }
    }

    /// The shards' table set, for as long as the read-side section `_in` lasts. Lookups read
    /// it with one plain load, where an `ArcSwap` load costs two locked instructions.
    fn section_tables<'a>(&'a self, _in: &'a ReadGuard<'a>) -> &'a Tables {
        // SAFETY: the pointer is always that of the set `tables` holds, set before that set is
        // swapped in (`new`, `publish`). A set swapped out is kept in `retired_sets` until the
        // grace ticket taken after the newer pointer was stored has passed: every read-side
        // section that entered before that store has left by then, and a section that entered
        // after it loads the newer pointer (`SeqCst`, grace.rs). The caller's section `_in`
        // outlives the reference, so the set stays allocated while it is used. Nothing writes
        // through it.
        #[allow(unsafe_code)]
        unsafe {
            &*self.section_tables.load(Ordering::SeqCst)
        }
    }

    /// Asks for the first lines of several probes, so that their cache misses overlap.
    fn prefetch(tables: &Tables, mask: usize, probes: &[Probe]) {
        for p in probes {
            tables[p.shard(mask)].prefetch(p);
        }
    }

    /// Probes for up to [`WINDOW`] hashes (the rest of the array is not meant to be used).
    fn probes(hashes: &[u64]) -> [Probe; WINDOW] {
        let mut probes = [Probe::default(); WINDOW];
        for (p, &h) in probes.iter_mut().zip(hashes) {
            *p = Probe::new(h);
        }
        probes
    }

    fn worker_lock(&self, worker: WorkerId) -> &RwLock<()> {
        &self.worker_locks[worker.get() as usize % WORKER_STRIPES]
    }

    /// Adds copies under the shard's lock, rebuilding the shard's table when it is full. A
    /// new slot gets the holder's next run entry. `cursor` is the holder's (caller holds its
    /// lock). Returns the slot's entry (`NO_ENTRY` if none).
    fn add(&self, p: &Probe, holder: u64, copies: u32, cursor: &mut Cursor) -> u32 {
        let s = p.shard(self.shard_mask);
        let mut table = self.shard_locks[s].0.lock();
        let mut entry = || self.runs.append(cursor, holder, p.hash, &self.grace);
        let ended = self.grace.periods_ended();
        let mut added = table.add(p, holder, copies, &mut entry, &self.overflow, ended);
        // A table full of dead slots frees those whose grace has passed in place, if that
        // gives it enough room. The grace periods are moved on first (a period is a start, a
        // flip and an end; none of it waits): a rebuild costs far more, and with little room
        // for dead slots (a small table, many removals) their tickets would not pass in time.
        if added == Added::Full && table.sweep_first() {
            self.move_periods_on(3);
            let ended = self.grace.periods_ended();
            if table.sweep(ended) >= table.sweep_enough() {
                self.sweeps.fetch_add(1, Ordering::Relaxed);
                added = table.add(p, holder, copies, &mut entry, &self.overflow, ended);
            }
        }
        let (saturated, entry) = match added {
            Added::Done { saturated, entry } => (saturated, entry),
            Added::Full => {
                // Live slots past 3/4: the table grows by half; else a sweep freed too few
                // of its dead slots, and it is rebuilt without them for its live slots.
                let bigger = if table.sweep_first() { table.rebuilt(1) } else { table.grown() };
                let Added::Done { saturated, entry } = bigger.add(p, holder, copies, &mut entry, &self.overflow, ended)
                else {
                    unreachable!("a table rebuilt with room for one more entry is not full");
                };
                self.publish(s, &mut table, bigger);
                (saturated, entry)
            }
        };
        if saturated {
            self.saturated_stores.fetch_add(1, Ordering::Relaxed);
        }
        entry
    }

    /// Makes room for new slots of `hashes` (a replace's staged blocks) in every shard before
    /// they are written: a shard's table that they would fill is rebuilt once, for its live
    /// slots and them (at least half as many again as it holds, as a table grows), instead of
    /// growing by half again and again while they are written (a resync of a million blocks
    /// into a new index rebuilt each of its 16 tables about 20 times).
    fn reserve(&self, hashes: impl Iterator<Item = u64>) {
        let mut extra = vec![0usize; self.shard_locks.len()];
        for h in hashes {
            extra[Probe::new(h).shard(self.shard_mask)] += 1;
        }
        for (s, &n) in extra.iter().enumerate() {
            let mut table = self.shard_locks[s].0.lock();
            if n > 0 && !table.has_room(n) {
                let bigger = table.rebuilt(n.max(table.live() / 2));
                self.publish(s, &mut table, bigger);
            }
        }
    }

    /// Kills the entries matching `drop` in every shard, compacting shards left sparse.
    fn remove_where(&self, drop: impl Fn(u64) -> bool) {
        for (s, shard_lock) in self.shard_locks.iter().enumerate() {
            let mut table = shard_lock.0.lock();
            if table.remove_where(&drop, &self.overflow, &self.grace) > 0 && table.wants_compaction() {
                let smaller = table.rebuilt(0);
                self.publish(s, &mut table, smaller);
            }
        }
        self.move_periods_on(1);
    }

    /// Adds one copy of each hash to `(worker, tier)`.
    pub fn store(&self, worker: WorkerId, tier: TierId, hashes: &[u64]) {
        self.store_after(worker, tier, None, hashes);
    }

    /// [`store`](Self::store) of a stored event whose blocks continue `parent` (the hash the
    /// engine stored them after): lookups then follow the worker's blocks from the parent's
    /// into these without a probe (module docs, Links). The parent only guides that layout:
    /// absent, wrong, not held, or held by other workers, the index holds and answers exactly
    /// what [`store`](Self::store) would.
    pub fn store_after(&self, worker: WorkerId, tier: TierId, parent: Option<u64>, hashes: &[u64]) {
        let _w = self.worker_lock(worker).read().unwrap_or_else(PoisonError::into_inner);
        let tag = self.gens.load(worker) & 1;
        let holder = table::holder(worker.get(), tag, tier.get());
        let mut cursors = self.runs.lock(holder);
        let cursor = cursors.entry(holder).or_insert(Cursor::NEW);
        let blocks = Ahead::new(self, hashes);
        // The entry before the next block's: the parent's, then each block's. The parent's is
        // read without the shard's lock (its miss overlaps the blocks' hints): only this
        // holder's writers change its slots, and we hold its lock.
        let mut prev = parent
            .filter(|_| !hashes.is_empty())
            .map(Probe::new)
            .and_then(|pp| blocks.table(&pp).entry(&pp, holder))
            .unwrap_or(table::NO_ENTRY);
        for p in blocks {
            let entry = self.add(&p, holder, 1, cursor);
            self.runs.join(prev, entry);
            prev = entry;
        }
    }

    /// Takes one copy of each hash from `(worker, tier)`. A hash with no copy is a no-op,
    /// counted in the outcome and in [`IndexStats::missing_removes`].
    pub fn remove(&self, worker: WorkerId, tier: TierId, hashes: &[u64]) -> RemoveOutcome {
        let _w = self.worker_lock(worker).read().unwrap_or_else(PoisonError::into_inner);
        let tag = self.gens.load(worker) & 1;
        let holder = table::holder(worker.get(), tag, tier.get());
        let mut out = RemoveOutcome::default();
        let mut cursors = self.runs.lock(holder);
        // A holder without a cursor has no entries (none stored, or all dropped with it): a
        // fresh one stands in, so that a removal adds nothing to the map.
        let mut fresh = Cursor::NEW;
        let cursor = cursors.get_mut(&holder).unwrap_or(&mut fresh);
        for p in Ahead::new(self, hashes) {
            let subbed =
                self.shard_locks[p.shard(self.shard_mask)].0.lock().sub(&p, holder, &self.overflow, &self.grace);
            match subbed {
                Subbed::Taken => out.removed += 1,
                Subbed::Died { entry } => {
                    out.removed += 1;
                    if let Some((sparse, left)) = self.runs.invalidate(cursor, entry, &self.grace) {
                        if runs::compact_now(left, || self.pages_half_empty()) {
                            self.compact(cursor, holder, sparse);
                        }
                    }
                }
                Subbed::Missing => out.missing += 1,
            }
        }
        if out.missing > 0 {
            self.missing_removes.fetch_add(out.missing as u64, Ordering::Relaxed);
        }
        // Dead slots are reused once a grace period passes: move the periods on, every 16th
        // removal of this thread (each step reads every reader's slot line).
        if out.removed > 0 && REMOVALS.with(|n| n.replace(n.get().wrapping_add(1)) % 16 == 0) {
            self.move_periods_on(1);
        }
        out
    }

    /// True when the pages in use hold fewer live entries than half their room (live slots
    /// stand for their entries): then sparse pages are worth compacting.
    fn pages_half_empty(&self) -> bool {
        let live: usize = self.tables.load().iter().map(|t| t.live()).sum();
        live * 2 < self.runs.pages().0 * PAGE as usize
    }

    /// Moves the valid entries of `holder`'s sparse `page` to its current page (in order, so
    /// runs stay runs), so that the page is freed instead of holding a few live entries.
    /// `cursor` is the holder's (caller holds its lock). The moved entries keep their links,
    /// and entries that were adjacent stay joined (by a link where the current page ends
    /// between them); links of other pages into the moved entries go stale (lookups then
    /// probe).
    fn compact(&self, cursor: &mut Cursor, holder: u64, page: u32) {
        let entries = self.runs.valid_entries(page);
        let links: Vec<Option<u32>> = entries.iter().map(|&(old, _)| self.runs.link_of(old)).collect();
        let mut moved: Vec<(u32, u32)> = Vec::with_capacity(entries.len());
        for (old, hash) in entries {
            let p = Probe::new(hash);
            let table = self.shard_locks[p.shard(self.shard_mask)].0.lock();
            let entry = self.runs.append(cursor, holder, hash, &self.grace);
            // Both entries are valid while the slot moves: either proves the block is held.
            let ok = table.move_entry(&p, holder, old, entry);
            drop(table);
            let stale = if ok { old } else { entry };
            debug_assert!(ok, "a valid entry is its slot's entry");
            self.runs.invalidate(cursor, stale, &self.grace);
            // Entries adjacent in the old page stay joined.
            if let Some(&(_, prev)) = moved.last().filter(|&&(before, _)| old == before + 1) {
                self.runs.join(prev, entry);
            }
            moved.push((old, entry));
        }
        // Links out of the moved entries, to targets that moved too or not.
        for (&(_, entry), link) in moved.iter().zip(links) {
            if let Some(to) = link {
                let to = match moved.binary_search_by_key(&to, |&(old, _)| old) {
                    Ok(k) => moved[k].1,
                    Err(_) if to / PAGE == page => continue,
                    Err(_) => to,
                };
                self.runs.link(entry, to);
            }
        }
    }

    /// Drops all of a worker's blocks (`tier: None`, atomically, like an empty
    /// [`replace_worker`](Self::replace_worker)) or those of one tier (block by block: a
    /// concurrent lookup may see the tier partly cleared).
    pub fn clear(&self, worker: WorkerId, tier: Option<TierId>) {
        let Some(tier) = tier else {
            self.replace_worker(worker, &StagedSnapshot::new());
            return;
        };
        let _w = self.worker_lock(worker).read().unwrap_or_else(PoisonError::into_inner);
        let tag = self.gens.load(worker) & 1;
        let holder = table::holder(worker.get(), tag, tier.get());
        let mut cursors = self.runs.lock(holder);
        self.remove_where(|v| v & table::HOLDER == holder);
        self.runs.drop_pages(|h| h == holder, &self.grace);
        cursors.remove(&holder);
    }

    /// Drops every block of a worker, atomically. Its id stays interned.
    pub fn remove_worker(&self, worker: WorkerId) {
        self.replace_worker(worker, &StagedSnapshot::new());
    }

    /// Replaces a worker's whole state with `snapshot`, atomically: a concurrent lookup sees
    /// the worker's whole old state or its whole new state, never a mix.
    ///
    /// Cost: O(snapshot) to stage, one grace period (waits for in-flight lookups), and a scan
    /// of every shard to delete the old state.
    pub fn replace_worker(&self, worker: WorkerId, snapshot: &StagedSnapshot) {
        let _swap = lock(&self.swap);
        let _w = self.worker_lock(worker).write().unwrap_or_else(PoisonError::into_inner);
        let old_tag = self.gens.load(worker) & 1;
        let new_tag = old_tag ^ 1;
        // 1. Stage under the new tag: lookups ignore it until the flip. Each staged chain in
        // order, a block after its parent, so that the worker's blocks form runs as its
        // events would have (joined by links where they do not follow in a page).
        let entries = snapshot.entries();
        self.reserve(entries.iter().filter(|&&(_, _, copies)| copies > 0).map(|&(_, h, _)| h));
        let laid = snapshot.laid();
        // Each entry's run entry, by its position in `laid`.
        let mut written = vec![table::NO_ENTRY; entries.len()];
        // The lock of the holder being written, kept while its blocks follow one another, up
        // to `HELD` blocks (it is a stripe, shared with other holders' writers).
        let mut held: Option<(u64, MutexGuard<'_, runs::Cursors>)> = None;
        let mut under_lock = 0;
        for (k, (&(tier, copies, parent), p)) in laid.blocks.iter().zip(Ahead::new(self, &laid.hashes)).enumerate() {
            if copies == 0 {
                continue;
            }
            let holder = table::holder(worker.get(), new_tag, tier.get());
            if held.as_ref().is_none_or(|&(h, _)| h != holder) || under_lock == HELD {
                drop(held.take());
                held = Some((holder, self.runs.lock(holder)));
                under_lock = 0;
            }
            under_lock += 1;
            let (_, cursors) = held.as_mut().expect("the holder's lock was just taken");
            let entry = self.add(&p, holder, copies, cursors.entry(holder).or_insert(Cursor::NEW));
            if parent != snapshot::NONE {
                self.runs.join(written[parent as usize], entry);
            }
            written[k] = entry;
        }
        drop(held);
        // 2. Flip. Lookups that read `swap_seq` before this store keep the old tag.
        let seq = self.swap_seq.load(Ordering::SeqCst) + 1;
        self.gens.store(worker, (seq << 1) | new_tag);
        self.swap_seq.store(seq, Ordering::SeqCst);
        // 3. Wait for lookups that may still count the old tag.
        self.grace.synchronize();
        // 4. Delete the old state, and its runs (no lookup reads them any more).
        let old = ((worker.get() as u64) << 1) | old_tag;
        self.remove_where(|v| v >> 40 == old);
        self.runs.drop_pages(|h| h >> 40 == old, &self.grace);
        for tier in 0..64 {
            let holder = table::holder(worker.get(), old_tag, tier);
            self.runs.lock(holder).remove(&holder);
        }
        self.replaces.fetch_add(1, Ordering::Relaxed);
    }

    /// For every worker holding `hashes[0]`: leading blocks held in any tier, and per tier.
    /// Never blocks on writers.
    pub fn lookup(&self, hashes: &[u64]) -> LookupResult {
        let mut out = LookupResult::default();
        self.lookup_into(hashes, &mut out);
        out
    }

    /// [`lookup`](Self::lookup) into a reused result.
    pub fn lookup_into(&self, hashes: &[u64], out: &mut LookupResult) {
        out.clear();
        if hashes.is_empty() {
            return;
        }
        let reading = self.grace.read();
        // Read before any slot: decides which side of each concurrent replace this lookup is on.
        let seq0 = self.swap_seq.load(Ordering::SeqCst);
        let tables = self.section_tables(&reading);
        SCRATCH.with(|s| {
            let s = &mut *s.borrow_mut();
            s.candidates.clear();
            s.runs.clear();
            s.alive.clear();
            s.pairs.clear();
            s.orphans = 0;
            s.settled = false;
            // Block 0 decides the candidates: from this thread's memo when its holders are many
            // and unchanged, else from the table. Block 1 is probed with it (their misses
            // overlap): unless one pair holds block 0, block 1 is where most candidates drop out.
            let n = hashes.len();
            // The first lines asked for: block 1's home group (every lookup of more than one
            // block probes it), then the request's lines, so that the probe's misses do not
            // queue behind those of a long request.
            if n > 1 {
                Self::prefetch(tables, self.shard_mask, &[Probe::new(hashes[1])]);
            }
            Self::prefetch_request(hashes);
            let first = Probe::new(hashes[0]);
            let table = &tables[first.shard(self.shard_mask)];
            // Read before block 0's holders, and again after (see `table`'s docs, Versions of
            // crowded keys).
            let version = table.version(&first);
            let Scratch { memo, patch, caught_up, .. } = &mut *s;
            let kept = match memo.get_mut(&hashes[0]) {
                Some(m) if m.is(table.id(), version, seq0) => true,
                Some(m) => {
                    let up = self.catch_up(m, table, &first, version, seq0);
                    *caught_up += up as u64;
                    up
                }
                None => false,
            };
            *patch = kept;
            let block1 = if kept {
                // Every candidate ends at block 1 but those holding block 1 (probed now: it
                // also gives the pairs' entries); only those are walked. `holders` is block 1's
                // holders (none for a request of one block).
                self.gather(tables, &hashes[1..n.min(2)], true, s);
                let Scratch { memo, holders, candidates, .. } = &mut *s;
                let m = &memo[&hashes[0]];
                out.clone_from(&m.result);
                for &v in holders.iter() {
                    let worker = table::worker_of(v);
                    let k = if m.by_worker.is_empty() {
                        m.candidates.binary_search_by_key(&worker, |c| c.worker).ok()
                    } else {
                        m.by_worker.get(worker as usize).filter(|&&k| k != NO_CANDIDATE).map(|&k| k as usize)
                    };
                    if let Some(k) = k {
                        candidates.push(m.candidates[k]);
                    }
                }
                candidates.sort_unstable_by_key(|c| c.worker);
                candidates.dedup_by_key(|c| c.worker);
                0..holders.len()
            } else {
                self.gather(tables, &hashes[..n.min(2)], true, s);
                self.first_block(seq0, s);
                // Kept only if no change of the key was under way or came while its holders
                // were read: the version was even and is still the same.
                if s.ends[0] >= MEMO_HOLDERS && version.is_multiple_of(2) && table.version(&first) == version {
                    s.remember(hashes[0], (table.id(), version, seq0));
                }
                s.ends[0]..s.ends[1]
            };
            if s.candidates.is_empty() {
                return;
            }
            s.alive.extend(0..s.candidates.len() as u32);
            let mut i = 1;
            if n > 1 && (s.patch || s.pairs.len() > 1) {
                if !Self::step(1, block1, s) {
                    Self::emit(n as u32, s, out);
                    return;
                }
                i = 2;
            }
            while i < n {
                let pairs = s.pairs.len();
                if s.orphans == 0 && (pairs == 1 || (s.settled && pairs <= FOLLOW)) {
                    // Few holders left, and going on together: follow their runs while every
                    // one goes on, then probe the block where one stops (or its page ends).
                    i += self.follow(&hashes[i..], &mut s.pairs);
                    if i == n {
                        break;
                    }
                    self.gather(tables, &hashes[i..=i], false, s);
                    if !Self::step_at(i, 0, 0..s.ends[0], s) {
                        Self::emit(n as u32, s, out);
                        return;
                    }
                    i += 1;
                    continue;
                }
                // Many holders: probe windows of WINDOW blocks whose cache misses overlap; one
                // block while they are dropping out (block 1 after a popular block 0), as
                // the next block may end them all.
                let window = &hashes[i..n.min(i + if s.settled { WINDOW } else { 1 })];
                self.gather(tables, window, false, s);
                let mut from = 0;
                for k in 0..window.len() {
                    let to = s.ends[k];
                    if !Self::step_at(i + k, k, from..to, s) {
                        Self::emit(n as u32, s, out);
                        return;
                    }
                    from = to;
                }
                i += window.len();
            }
            Self::emit(n as u32, s, out);
        });
    }

    /// Brings kept candidates `m` of `p`'s key up to `version` (even, just read) when one
    /// crowded change of the key's counter came since they were kept: that change, read from
    /// the counter, is applied to them instead of reading the key's slots again (a crowded
    /// first block changes holders often, and reading a hundred holders cost ten times a
    /// lookup that kept them). Exact for the same reason kept candidates are (`table.rs`,
    /// Versions of crowded keys): with at least [`MEMO_HOLDERS`] slots after the change, one is
    /// outside the home group, so the next change raises the version too. False if they cannot
    /// be brought up (then the lookup reads the slots).
    fn catch_up(&self, m: &mut Memo, table: &Table, p: &Probe, version: u64, seq0: u64) -> bool {
        if version < 2 || !version.is_multiple_of(2) || m.at != (table.id(), version - 2, seq0) {
            return false;
        }
        let Some(change) = table.last_change(p, version) else {
            return false;
        };
        if change.hash == p.hash && !m.apply(change.holder, change.born, |worker| self.visible_tag(worker, seq0)) {
            // Not kept: the next lookup reads the slots, and keeps them anew if it can.
            m.at = (table.id(), u64::MAX, seq0);
            return false;
        }
        m.at.1 = version;
        true
    }

    /// Asks for the cache lines of a request's hashes (past the first, which the lookup reads
    /// at once), so that when they are not in cache their misses overlap, instead of coming
    /// one after another as the lookup reaches them: a router may look up hashes it computed a
    /// while before.
    fn prefetch_request(hashes: &[u64]) {
        let mut i = 8;
        while i < hashes.len() {
            prefetch(&hashes[i]);
            i += 8;
        }
        prefetch(&hashes[hashes.len() - 1]);
    }

    /// Follows every alive (candidate, tier) through its holder's runs: the number of blocks
    /// of `hashes` that every one of them holds by its runs alone (each pair's entry moves to
    /// its last one). 0 when one of them cannot go on that way. A pair goes on in its page
    /// while the next entries are valid and equal the next hashes, and where they are not, at
    /// its entry's link if the link's target checks out (module docs, Links).
    fn follow(&self, hashes: &[u64], pairs: &mut [u32]) -> usize {
        if pairs.len() > 1 {
            // Ask for every page's first line before comparing any: their misses overlap.
            for &entry in pairs.iter() {
                if let Some(p) = self.runs.page(entry) {
                    p.prefetch(entry % PAGE + 1);
                }
            }
        }
        debug_assert!(pairs.len() <= FOLLOW);
        // Per pair: 0 while its page is one a live slot named (the grace period keeps it the
        // holder's during this lookup), else the stamp its page had when the pair linked to it.
        let mut stamps = [0u64; FOLLOW];
        let mut bases = [0u32; FOLLOW];
        let mut done = 0;
        while done < hashes.len() {
            let mut m = hashes.len() - done;
            for (k, &entry) in pairs.iter().enumerate() {
                let (base, n) = self.next_of(entry, &mut stamps[k], &hashes[done..done + m]);
                if n == 0 {
                    return done;
                }
                (bases[k], m) = (base, n);
            }
            for (entry, base) in pairs.iter_mut().zip(bases) {
                *entry = base.wrapping_add(m as u32);
            }
            done += m;
        }
        done
    }

    /// How many of `hashes` a pair whose last matched block is at `entry` holds next by its
    /// runs, and the entry just before the first of them (`entry`, or a link's target minus
    /// one). `stamp` is the pair's page stamp (see [`follow`](Self::follow)), updated on a link.
    #[inline]
    fn next_of(&self, entry: u32, stamp: &mut u64, hashes: &[u64]) -> (u32, usize) {
        let Some(page) = self.runs.page(entry) else {
            return (entry, 0);
        };
        let checked = *stamp != 0;
        if checked && page.stamp() != *stamp {
            return (entry, 0);
        }
        let n = page.matching(entry % PAGE + 1, hashes);
        if checked && !page.still(*stamp) {
            return (entry, 0);
        }
        if n > 0 {
            return (entry, n);
        }
        let Some(to) = page.link(entry % PAGE) else {
            return (entry, 0);
        };
        // The pair's holder: its page's owner (a page a live slot named is the holder's or,
        // once all its entries died, free).
        let owner = if checked { *stamp } else { page.stamp() };
        let (Some(holder), Some(target)) = (runs::owner(owner), self.runs.page(to)) else {
            return (entry, 0);
        };
        let at = target.stamp();
        if !runs::owned_by(at, holder) {
            return (entry, 0);
        }
        let n = target.matching(to % PAGE, hashes);
        if n == 0 || !target.still(at) {
            return (entry, 0);
        }
        *stamp = at;
        (to.wrapping_sub(1), n)
    }

    /// The tag a lookup that started at `seq0` counts for `worker`.
    fn visible_tag(&self, worker: u32, seq0: u64) -> u64 {
        let Some(w) = WorkerId::new(worker) else {
            return 0;
        };
        let word = self.gens.load(w);
        // A flip stamped after the lookup started has not happened for it; the old state
        // stays intact until the lookup ends (grace period).
        if word >> 1 > seq0 {
            (word & 1) ^ 1
        } else {
            word & 1
        }
    }

    /// Collects the holders of each block of `window` (at most [`WINDOW`]) into `holders`,
    /// block `k`'s ending at `ends[k]`. A block with a crowd record is read from it (one line
    /// instead of its slots): its holders are listed when `list` (the first two blocks, whose
    /// holders make the candidates), else it is left in `crowds[k]` for [`Self::step_at`].
    fn gather(&self, tables: &Tables, window: &[u64], list: bool, s: &mut Scratch) {
        let Scratch { holders, ends, crowds, .. } = s;
        let probes = Self::probes(window);
        let probes = &probes[..window.len()];
        // Even for one probe: its control word and slots are separate lines, loaded together.
        Self::prefetch(tables, self.shard_mask, probes);
        holders.clear();
        for (k, p) in probes.iter().enumerate() {
            crowds[k] = tables[p.shard(self.shard_mask)].holders(p, |v| holders.push(v));
            if list {
                if let Some(c) = crowds[k].take() {
                    c.for_each(|v| holders.push(v));
                }
            }
            ends[k] = holders.len();
        }
    }

    /// Candidates: workers holding block 0 (`s.holders[..s.ends[0]]`) under their visible tag,
    /// by worker, and the entries of their (worker, tier) pairs.
    fn first_block(&self, seq0: u64, s: &mut Scratch) {
        let first = &mut s.holders[..s.ends[0]];
        sort_by_worker(first, &mut s.sorted, &mut s.buckets);
        let mut i = 0;
        while i < first.len() {
            let worker = table::worker_of(first[i]);
            let tag = self.visible_tag(worker, seq0);
            let mut tiers = 0u64;
            while i < first.len() && table::worker_of(first[i]) == worker {
                if table::tag_of(first[i]) == tag {
                    tiers |= 1 << table::tier_of(first[i]);
                    s.pairs.push(table::entry_of(first[i]));
                }
                i += 1;
            }
            if tiers != 0 {
                s.candidates.push(Candidate::new(worker, tag, tiers));
            }
        }
    }

    /// Applies block `i`, the `k`-th of the window [`gather`](Self::gather) read, to the
    /// candidates still alive: by its crowd record if it left one, else by its holders
    /// `s.holders[holders]`. False once no candidate goes on.
    fn step_at(i: usize, k: usize, holders: std::ops::Range<usize>, s: &mut Scratch) -> bool {
        match s.crowds[k] {
            Some(c) => Self::step_crowd(i, &c, s),
            None => Self::step(i, holders, s),
        }
    }

    /// [`step`](Self::step) for a block read from its crowd record: each alive candidate's bit
    /// is tested (the cost of the candidates left, whatever the block's holders). The pairs
    /// that go on have no entry (a record has none), so the next block is probed.
    fn step_crowd(i: usize, c: &Crowd, s: &mut Scratch) -> bool {
        let Scratch { candidates, alive, pairs, .. } = &mut *s;
        let at = i as u32;
        pairs.clear();
        let bit = 1 << c.tier;
        for &k in alive.iter() {
            let cand = &mut candidates[k as usize];
            if cand.worker < crowd::WIDE && c.workers[cand.tag as usize] >> cand.worker & 1 != 0 {
                cand.seen_at = at;
                cand.seen = bit;
                if cand.alive & bit != 0 {
                    pairs.push(table::NO_ENTRY);
                }
            }
        }
        Self::settle(at, s)
    }

    /// Applies block `i`'s holders (`s.holders[holders]`) to the candidates still alive (dropping those whose run
    /// ended) and notes the entries of the (candidate, tier) pairs that go on; false once no
    /// candidate goes on.
    fn step(i: usize, holders: std::ops::Range<usize>, s: &mut Scratch) -> bool {
        let Scratch { holders: all, candidates, pairs, .. } = &mut *s;
        let holders = &all[holders];
        let at = i as u32;
        pairs.clear();
        for &v in holders {
            let worker = table::worker_of(v);
            let found = if candidates.len() <= 8 {
                candidates.iter().position(|c| c.worker == worker)
            } else {
                candidates.binary_search_by_key(&worker, |c| c.worker).ok()
            };
            if let Some(c) = found.map(|k| &mut candidates[k]) {
                if !c.done && table::tag_of(v) == c.tag {
                    let bit = 1 << table::tier_of(v);
                    if c.seen_at != at {
                        c.seen_at = at;
                        c.seen = 0;
                    }
                    c.seen |= bit;
                    if c.alive & bit != 0 {
                        pairs.push(table::entry_of(v));
                    }
                }
            }
        }
        Self::settle(i as u32, s)
    }

    /// Ends the alive candidates that did not hold block `at` (their `seen` says which tiers
    /// did), and the tier runs of those that hold it in fewer tiers; false once none is left.
    fn settle(at: u32, s: &mut Scratch) -> bool {
        let Scratch { candidates, alive, runs, orphans, settled, .. } = s;
        *orphans = 0;
        let ended = runs.len();
        let before = alive.len();
        alive.retain(|&k| {
            let c = &mut candidates[k as usize];
            let seen = if c.seen_at == at { c.seen } else { 0 };
            if seen == 0 {
                // Every tier still going ends here: `alive` keeps them, `blocks` says where.
                c.done = true;
                c.blocks = at;
                return false;
            }
            let mut gone = c.alive & !seen;
            while gone != 0 {
                runs.push((gone.trailing_zeros() as u8, at, c.ended));
                c.ended = runs.len() as u32 - 1;
                gone &= gone - 1;
            }
            c.alive &= seen;
            *orphans += (c.alive == 0) as usize;
            true
        });
        *settled = runs.len() == ended && alive.len() == before;
        !alive.is_empty()
    }

    /// Writes the candidates' matches into `out`: appended, or, when `out` already lists every
    /// candidate of kept first-block candidates (`s.patch`), over their entries there.
    fn emit(len: u32, s: &mut Scratch, out: &mut LookupResult) {
        let Scratch { candidates, runs, tier_runs: mine, patch, .. } = s;
        #[inline]
        fn put(
            out: &mut LookupResult,
            patch: bool,
            worker: WorkerId,
            blocks: u32,
            runs: impl Iterator<Item = TierRun>,
        ) {
            if patch {
                out.patch(worker, blocks, runs);
            } else {
                out.push(worker, blocks, runs);
            }
        }
        for c in candidates.iter() {
            let blocks = if c.done { c.blocks } else { len };
            let worker = WorkerId::new(c.worker).expect("packed worker ids are valid");
            if c.ended == NO_RUN {
                // The common case: no tier ended before the candidate did.
                put(out, *patch, worker, blocks, tier_runs(c.alive, blocks));
                continue;
            }
            mine.clear();
            mine.extend(tier_runs(c.alive, blocks));
            let mut r = c.ended;
            while r != NO_RUN {
                let (t, run, next) = runs[r as usize];
                mine.push(TierRun { tier: TierId::new(t).expect("packed tier ids are valid"), blocks: run });
                r = next;
            }
            mine.sort_unstable_by_key(|run| run.tier);
            put(out, *patch, worker, blocks, mine.iter().copied());
        }
    }

    /// Copies of one block the worker holds in `tier` (0 if none).
    pub fn copies(&self, worker: WorkerId, tier: TierId, hash: u64) -> u32 {
        let _reading = self.grace.read();
        let seq0 = self.swap_seq.load(Ordering::SeqCst);
        let holder = table::holder(worker.get(), self.visible_tag(worker.get(), seq0), tier.get());
        let p = Probe::new(hash);
        let find = || {
            let mut found = None;
            self.tables.load()[p.shard(self.shard_mask)].for_each(&p, |v| {
                if v & table::HOLDER == holder {
                    found = Some(v);
                }
            });
            found
        };
        match find() {
            None => 0,
            Some(v) if !Overflow::is_many(v) => self.overflow.copies(hash, v, None),
            Some(_) => {
                // A count in the overflow map: read the slot again with the map locked, so
                // the two agree.
                let many = self.overflow.lock();
                find().map_or(0, |v| self.overflow.copies(hash, v, Some(&many)))
            }
        }
    }

    /// Every block `worker` holds: per tier, each hash with its copy count (no entry has 0
    /// copies). The worker's whole state as a lookup would see it now: a concurrent
    /// [`replace_worker`](Self::replace_worker) is seen whole or not at all, concurrent
    /// incremental writes block by block. Equals [`reference::ReferenceIndex::blocks`] after
    /// the same operations.
    ///
    /// Cost: a scan of every shard (O(total slots), about a millisecond per million blocks):
    /// for audits, tests and debugging, not the request path.
    pub fn blocks(&self, worker: WorkerId) -> BTreeMap<TierId, BTreeMap<u64, u32>> {
        let _reading = self.grace.read();
        let seq0 = self.swap_seq.load(Ordering::SeqCst);
        let mine = ((worker.get() as u64) << 1) | self.visible_tag(worker.get(), seq0);
        let mut out: BTreeMap<TierId, BTreeMap<u64, u32>> = BTreeMap::new();
        // Held throughout, so that slots saying their count is in the map agree with it.
        let many = self.overflow.lock();
        for t in self.tables.load().iter() {
            t.for_each_entry(|hash, v| {
                if v >> 40 == mine {
                    let tier = TierId::new(table::tier_of(v)).expect("packed tier ids are valid");
                    out.entry(tier).or_default().insert(hash, self.overflow.copies(hash, v, Some(&many)));
                }
            });
        }
        out
    }

    /// Counters and sizes.
    pub fn stats(&self) -> IndexStats {
        let mut stats = IndexStats {
            missing_removes: self.missing_removes.load(Ordering::Relaxed),
            saturated_stores: self.saturated_stores.load(Ordering::Relaxed),
            replaces: self.replaces.load(Ordering::Relaxed),
            rebuilds: self.rebuilds.load(Ordering::Relaxed),
            sweeps: self.sweeps.load(Ordering::Relaxed),
            run_pages: self.runs.pages(),
            ..IndexStats::default()
        };
        for t in self.tables.load().iter() {
            stats.blocks += t.live();
            stats.tombstones += t.tombs();
            stats.slots += t.capacity();
        }
        stats
    }

    /// An estimate of the heap and inline bytes the index holds (tables, generation words,
    /// locks), not counting interned names. Transient copies during a rebuild are not counted.
    pub fn memory_bytes(&self) -> usize {
        // Per shard: its lock, its `Arc` (pointer and counts) and its table.
        let shards: usize = self
            .tables
            .load()
            .iter()
            .map(|t| {
                std::mem::size_of::<ShardLock>() + std::mem::size_of::<Arc<Table>>() + 16 + t.bytes() + t.crowd_bytes()
            })
            .sum();
        std::mem::size_of::<Self>()
            + shards
            + self.gens.bytes()
            + WORKER_STRIPES * std::mem::size_of::<RwLock<()>>()
            + self.runs.bytes()
            + self.overflow.bytes()
    }

    /// [`memory_bytes`](Self::memory_bytes) by structure. Not a snapshot: read while writers
    /// run, its parts may disagree by the slots and entries written meanwhile.
    pub fn memory_breakdown(&self) -> MemoryBreakdown {
        let mut m = MemoryBreakdown::default();
        for t in self.tables.load().iter() {
            let (live, dead, empty) = t.slot_bytes();
            m.live_slots += live;
            m.dead_slots += dead;
            m.empty_slots += empty;
            m.versions += t.versions_bytes();
            m.crowds += t.crowd_bytes();
        }
        (m.run_entries, m.run_slack, m.run_headers, m.run_free, m.run_pool) = self.runs.bytes_by_use();
        m.other = self.memory_bytes().saturating_sub(m.total());
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_index_that_only_grows_keeps_few_of_the_table_sets_it_swapped_out() {
        let index = PrefixIndex::new(IndexConfig { shards: 1, initial_capacity: 0 });
        let w = index.worker("http://relay-a:50051", 0).unwrap();
        index.store(w, TierId::DEVICE, &(0..20_000).collect::<Vec<u64>>());
        assert!(index.stats().rebuilds >= 10, "{:?}", index.stats());
        assert!(lock(&index.retired_sets).len() <= 2, "{} sets kept", lock(&index.retired_sets).len());
    }

    #[test]
    fn the_memory_breakdown_adds_up_to_memory_bytes_and_counts_live_and_dead_slots_and_entries() {
        let index = PrefixIndex::default();
        let w = index.worker("http://relay-a:50051", 0).unwrap();
        index.store(w, TierId::DEVICE, &(0..1000).collect::<Vec<u64>>());
        index.remove(w, TierId::DEVICE, &(0..100).collect::<Vec<u64>>());
        let m = index.memory_breakdown();
        assert_eq!(m.total(), index.memory_bytes());
        // A slot is 16 bytes and a seventh of its group's control word; rounded per shard.
        let slot = |n: usize| n * (16 * 7 + 8) / 7;
        assert!(m.live_slots.abs_diff(slot(900)) < 16, "{m:?}");
        assert!(m.dead_slots.abs_diff(slot(100)) < 16, "{m:?}");
        assert_eq!(m.run_entries, 900 * 8);
        assert!(m.empty_slots > 0 && m.versions > 0 && m.run_headers > 0, "{m:?}");
    }

    /// Lookups answer the same with any parent or none, so only the layout shows whether a
    /// store used its parent: the parent's entry links to the first stored block's.
    #[test]
    fn a_store_after_its_parent_links_the_parents_entry_to_its_first_block() {
        let index = PrefixIndex::default();
        let w = index.worker("http://relay:50051", 0).expect("worker");
        let holder = table::holder(w.get(), index.gens.load(w) & 1, TierId::DEVICE.get());
        let entry = |hash: u64| {
            let p = Probe::new(hash);
            index.tables.load()[p.shard(index.shard_mask)].entry(&p, holder).expect("held")
        };
        index.store(w, TierId::DEVICE, &[1, 2, 3]);
        // Another event's blocks come between the parent and the continuation.
        index.store(w, TierId::DEVICE, &[10, 11]);
        index.store_after(w, TierId::DEVICE, Some(3), &[4, 5]);
        assert_eq!((entry(3), entry(10), entry(4)), (2, 3, 5));
        assert_eq!(index.runs.link_of(entry(3)), Some(entry(4)));
        // Without a parent nothing links to the new blocks.
        index.store(w, TierId::DEVICE, &[20]);
        index.store(w, TierId::DEVICE, &[30]);
        index.store(w, TierId::DEVICE, &[6]);
        assert_eq!(index.runs.link_of(entry(20)), None);
        assert_eq!(index.runs.link_of(entry(5)), None);
        // A parent this worker does not hold links nothing either.
        index.store_after(w, TierId::DEVICE, Some(99), &[7]);
        assert_eq!(index.runs.link_of(entry(6)), None);
        assert_eq!(index.lookup(&[1, 2, 3, 4, 5]).get(w).map(|m| m.blocks), Some(5));
    }

    /// A replace writes the staged chains in order whatever the staging order: each block
    /// right after its parent, a fork's other children after the first's chain (linked from
    /// their parent's entry), duplicates into the first's slot, nothing for blocks without
    /// copies, and a cycle's entries last.
    #[test]
    fn a_replace_writes_each_staged_chain_in_order_and_links_forks() {
        let index = PrefixIndex::default();
        let w = index.worker("http://relay:50051", 0).expect("worker");
        // Old state, under the other tag: the replace writes the new one from entry 0 of pages
        // of its own.
        index.store(w, TierId::DEVICE, &[1, 2, 3, 50]);
        let d = TierId::DEVICE;
        let mut s = StagedSnapshot::new();
        s.push_after(d, 3, 1, Some(2)); // after 2
        s.push(d, 1, 1); // a first block
        s.push_after(d, 2, 1, Some(1)); // after 1
        s.push_after(d, 4, 1, Some(1)); // after 1 too: a fork
        s.push_after(d, 9, 1, Some(8)); // parent not staged: a first block
        s.push_after(d, 6, 1, Some(7)); // a cycle, 6 <-> 7
        s.push_after(d, 7, 1, Some(6));
        s.push_after(d, 2, 2, Some(1)); // 2 again
        s.push_after(d, 11, 0, Some(9)); // no copies: not written
        s.push_after(d, 12, 1, Some(11)); // after the block not written
        index.replace_worker(w, &s);
        let holder = table::holder(w.get(), index.gens.load(w) & 1, d.get());
        let entry = |hash: u64| {
            let p = Probe::new(hash);
            index.tables.load()[p.shard(index.shard_mask)].entry(&p, holder)
        };
        let base = entry(1).expect("held");
        assert_eq!(base % PAGE, 0, "a page of the new state's own");
        let entries: Vec<Option<u32>> =
            [1, 2, 3, 4, 9, 12, 6, 7, 11, 50].into_iter().map(|h| entry(h).map(|e| e - base)).collect();
        assert_eq!(entries, vec![Some(0), Some(1), Some(2), Some(3), Some(4), Some(5), Some(6), Some(7), None, None]);
        // The fork's second child is linked from the parent; the rest follow in their page.
        let links: Vec<Option<u32>> = (base..base + 8).map(|e| index.runs.link_of(e)).collect();
        assert_eq!(links, vec![Some(base + 3), None, None, None, None, None, None, None]);
        let blocks = |hashes: &[u64]| index.lookup(hashes).get(w).map(|m| m.blocks);
        assert_eq!(
            [blocks(&[1, 2, 3]), blocks(&[1, 4]), blocks(&[9, 11, 12]), blocks(&[6, 7]), blocks(&[50])],
            [Some(3), Some(2), Some(1), Some(2), None]
        );
    }

    /// An index and its reference, written together; `look` checks a lookup against the
    /// reference and returns how many times this thread's kept candidates were brought up to
    /// date by a change (`Scratch::caught_up`) during it.
    struct Both {
        index: PrefixIndex,
        reference: reference::ReferenceIndex,
    }

    impl Both {
        fn store(&mut self, worker: u32, tier: TierId, hashes: &[u64]) {
            let worker = WorkerId::new(worker).expect("small id");
            self.index.store(worker, tier, hashes);
            self.reference.store(worker, tier, hashes);
        }

        fn remove(&mut self, worker: u32, tier: TierId, hashes: &[u64]) {
            let worker = WorkerId::new(worker).expect("small id");
            assert_eq!(self.index.remove(worker, tier, hashes), self.reference.remove(worker, tier, hashes));
        }

        fn look(&self, hashes: &[u64]) -> u64 {
            let before = SCRATCH.with(|s| s.borrow().caught_up);
            assert_eq!(self.index.lookup(hashes), self.reference.lookup(hashes), "lookup of {hashes:?}");
            SCRATCH.with(|s| s.borrow().caught_up) - before
        }
    }

    /// The crowd record of `hash`'s key, as a lookup would read it.
    fn crowd_of(index: &PrefixIndex, hash: u64) -> Option<crowd::Crowd> {
        let p = Probe::new(hash);
        index.tables.load()[p.shard(index.shard_mask)].crowd(&p)
    }

    /// A popular block's record follows every change of its holders: taken at eight slots of
    /// workers below 128 in one tier, dropped below eight, with a second tier or a wide
    /// worker, kept through rebuilds, and both tags' holders while a replace is under way.
    /// Every lookup, from the record or from the slots, equals the reference's.
    #[test]
    fn a_popular_blocks_record_follows_every_change_of_its_holders() {
        let mut b = Both {
            index: PrefixIndex::new(IndexConfig { shards: 1, initial_capacity: 0 }),
            reference: reference::ReferenceIndex::new(),
        };
        let s = [0x61u64, 0x62, 0x63, 0x64];
        let record = |b: &Both| crowd_of(&b.index, s[0]).map(|c| (c.tier, c.workers));
        for k in 0..7 {
            b.store(k, TierId::DEVICE, &s[..1 + k as usize % 4]);
        }
        assert_eq!(record(&b), None, "seven holders");
        b.store(9, TierId::DEVICE, &s);
        assert_eq!(record(&b), Some((0, [0x27f, 0])));
        b.look(&s);
        let found = b.index.lookup(&s);
        let blocks: Vec<(u32, u32)> = found.iter().map(|m| (m.worker.get(), m.blocks)).collect();
        assert_eq!(blocks, [(0, 1), (1, 2), (2, 3), (3, 4), (4, 1), (5, 2), (6, 3), (9, 4)]);
        // A second tier: no record; back to one: the record again.
        b.store(4, TierId::HOST, &s[..2]);
        assert_eq!(record(&b), None);
        b.look(&s);
        b.remove(4, TierId::HOST, &s[..2]);
        assert_eq!(record(&b), Some((0, [0x27f, 0])));
        // A worker past the bitsets' 128: no record while it holds the block.
        b.store(128, TierId::DEVICE, &s[..3]);
        assert_eq!(record(&b), None);
        b.look(&s);
        b.remove(128, TierId::DEVICE, &s[..3]);
        b.store(127, TierId::DEVICE, &s[..3]);
        assert_eq!(record(&b), Some((0, [0x27f | 1 << 127, 0])));
        b.look(&s);
        // Copies are not holders.
        b.store(127, TierId::DEVICE, &s[..1]);
        b.remove(127, TierId::DEVICE, &s[..1]);
        assert_eq!(record(&b), Some((0, [0x27f | 1 << 127, 0])));
        // Many other blocks: the table is rebuilt several times, the record stays.
        let rebuilds = b.index.stats().rebuilds;
        for k in 0..2_000u64 {
            b.store(k as u32 % 16, TierId::DEVICE, &[0x1000 + k]);
        }
        assert!(b.index.stats().rebuilds > rebuilds);
        assert_eq!(record(&b), Some((0, [0x27f | 1 << 127, 0])));
        b.look(&s);
        // A replace of worker 2: the new state under the other tag, then the old one gone.
        let mut snap = StagedSnapshot::new();
        snap.extend_blocks(TierId::DEVICE, &s[..2]);
        b.index.replace_worker(WorkerId::new(2).expect("small id"), &snap);
        b.reference.replace_worker(WorkerId::new(2).expect("small id"), &snap);
        let tag2 = b.index.gens.load(WorkerId::new(2).expect("small id")) & 1;
        let mut want = [0x27b | 1 << 127, 0];
        want[tag2 as usize] |= 1 << 2;
        assert_eq!(record(&b), Some((0, want)));
        assert_eq!(b.index.lookup(&s).blocks(WorkerId::new(2).expect("small id")), 2);
        b.look(&s);
        // Below eight holders: dropped.
        b.remove(0, TierId::DEVICE, &s[..1]);
        want[0] &= !1;
        assert_eq!(record(&b), Some((0, want)));
        b.look(&s);
        b.remove(1, TierId::DEVICE, &s[..1]);
        assert_eq!(record(&b), None);
        b.look(&s);
    }

    /// Kept candidates of a crowded first block follow a single change of its holders (a slot
    /// born or dead, in any tier, under either tag) by applying it, not by reading the block's
    /// holders again; two changes, or a change leaving fewer than eight holders, make the
    /// lookup read them. Every answer equals the reference's.
    #[test]
    fn kept_candidates_take_a_single_change_of_their_block_without_reading_it_again() {
        let mut b = Both {
            index: PrefixIndex::new(IndexConfig { shards: 1, initial_capacity: 1 << 12 }),
            reference: reference::ReferenceIndex::new(),
        };
        let s = [0x51u64, 0x52, 0x53];
        for k in 0..12 {
            b.store(k, TierId::DEVICE, &s[..1 + k as usize % 3]);
        }
        // The first lookup keeps the candidates, the second uses them as they are.
        assert_eq!((b.look(&s), b.look(&s)), (0, 0));
        // A new holder, with an id between the others' and past them.
        b.store(40, TierId::DEVICE, &s);
        assert_eq!(b.look(&s), 1);
        b.store(7, TierId::HOST, &s[..2]);
        assert_eq!(b.look(&s), 1);
        // A holder's last copy of block 0 goes; then a tier of a holder with two.
        b.remove(4, TierId::DEVICE, &s[..1]);
        assert_eq!(b.look(&s), 1);
        b.remove(7, TierId::DEVICE, &s[..1]);
        assert_eq!(b.look(&s), 1);
        // Copies are not changes of the holders: nothing to bring up.
        b.store(5, TierId::DEVICE, &s[..1]);
        assert_eq!(b.look(&s), 0);
        b.remove(5, TierId::DEVICE, &s[..1]);
        assert_eq!(b.look(&s), 0);
        // The other tag (a replace under way writes under it) is not counted by lookups.
        let w3 = WorkerId::new(3).expect("small id");
        let other = table::holder(3, (b.index.gens.load(w3) & 1) ^ 1, TierId::DISK.get());
        let p = Probe::new(s[0]);
        {
            let table = b.index.shard_locks[p.shard(b.index.shard_mask)].lock();
            let added = table.add(&p, other, 1, &mut || table::NO_ENTRY, &b.index.overflow, 0);
            assert!(matches!(added, Added::Done { .. }));
        }
        assert_eq!(b.look(&s), 1);
        // Two changes since the last lookup: read again.
        b.store(41, TierId::DEVICE, &s[..1]);
        b.store(42, TierId::DEVICE, &s[..1]);
        assert_eq!(b.look(&s), 0);
        assert_eq!(b.look(&s), 0);
        // Down to eight slots (six workers' in the device tier, worker 7's in the host tier,
        // worker 3's under the other tag), one change at a time; then to seven, which cannot
        // be kept.
        for k in [0, 1, 2, 5, 6, 8, 9] {
            b.remove(k, TierId::DEVICE, &s[..1]);
            assert_eq!(b.look(&s), 1, "after worker {k} left");
        }
        b.remove(10, TierId::DEVICE, &s[..1]);
        assert_eq!(b.look(&s), 0);
        assert_eq!(b.look(&s), 0);
    }
}
