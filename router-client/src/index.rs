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
mod lookup;
mod packed;
mod padded;
mod prefetch;
pub mod reference;
mod result;
mod runs;
mod snapshot;
mod table;
mod types;
mod write;

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::hash::BuildHasherDefault;
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError, RwLock};

use arc_swap::ArcSwap;

pub use ids::{IndexError, TierId, TierInterner, WorkerId, WorkerInterner};
pub use result::{LookupResult, TierRun, WorkerMatch};
pub use snapshot::StagedSnapshot;
pub use types::{IndexConfig, IndexStats, MemoryBreakdown, RemoveOutcome};

use crowd::Crowd;
use grace::{Grace, ReadGuard};
use packed::Overflow;
use padded::Padded;
use prefetch::prefetch;
use runs::{Cursor, Runs, WordHasher, PAGE};
use table::{Added, Probe, Subbed, Table};

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

    fn worker_lock(&self, worker: WorkerId) -> &RwLock<()> {
        &self.worker_locks[worker.get() as usize % WORKER_STRIPES]
    }

    /// Copies of one block the worker holds in `tier` (0 if none).
    pub fn copies(&self, worker: WorkerId, tier: TierId, hash: u64) -> u32 {
        let _reading = self.grace.read();
        let seq0 = self.swap_seq.load(Ordering::SeqCst);
        let holder = packed::holder(worker.get(), self.visible_tag(worker.get(), seq0), tier.get());
        let p = Probe::new(hash);
        let find = || {
            let mut found = None;
            self.tables.load()[p.shard(self.shard_mask)].for_each(&p, |v| {
                if v & packed::HOLDER == holder {
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
                    let tier = TierId::new(packed::tier_of(v)).expect("packed tier ids are valid");
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
mod tests;
