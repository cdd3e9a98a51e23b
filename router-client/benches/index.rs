//! Prefix index benchmark on the Mooncake traces: sustained block operations per second, lookup
//! latency at that load, and memory per indexed block, for `kv-router-client`'s index and, in
//! the same run, its peers: with `--features dynamo-bench`, NVIDIA Dynamo's
//! `ConcurrentRadixTreeCompressed` (behind its `ThreadPoolIndexer`, Dynamo's default) and its
//! `RadixTree` (`dynamo-kv-router` 1.6.1); without the feature, the naive reference index.
//!
//! ```text
//! cargo bench -p kv-router-client --bench index --features dynamo-bench            # full, docs
//! cargo test -p kv-router-client --bench index -- --blocks 20000 --lookups 2000    # CI: seconds
//! ```
//!
//! Options: `--workers 8,128`, `--runs N` (3; medians are printed), `--threads N` (writer
//! threads, 1), `--capacity N` (blocks per worker, 4096), `--copies N` (trace copies; default
//! workers / 2, at least 4), `--blocks N` (stop the workload after N stored blocks; 0 = the
//! whole trace), `--lookups N` (distinct lookup requests, 20,000), `--trace FILE` (default
//! `$KV_ROUTER_MOONCAKE`, else the repository's `testdata/mooncake/conversation_trace.jsonl`; a
//! synthetic trace of the same shape when the file cannot be read), `--placement cost,uniform`
//! (how requests are placed on workers, see Workload; `cost` by default; a list runs each),
//! `--half-rate` (also time lookups beside a writer paced at half the peer's own block ops/s
//! of the same run's back-to-back part; not `RadixTree`, which cannot be read concurrently),
//! `--lookup-rate N` (the lookup thread beside the
//! writers does N lookups a second instead of back to back; `RadixTree` keeps one lookup every
//! 8 events), `--reference` (add the reference with Dynamo on),
//! `--only NAME`, `--analyze` (instead of the comparison: the index alone on one thread, the
//! stream applied `--runs` times with its rate and no lookups, then lookups over the final
//! index `--lookup-runs` times (default `--runs`), with percentiles by match depth and by how
//! many workers matched past block 0; for profiling; with `--resync`, also every worker's
//! final state swapped into new indexes by `replace_worker`, without and with the blocks'
//! parents, and the lookups over both; with `--hot`, the lookup's own CPU: one request looked
//! up again and again, everything in cache, for three requests of each kind).
//!
//! **Workload.** The trace's requests (block ids of 512-token blocks, chained: an id stands
//! for its whole prefix) are duplicated into `copies` disjoint id spaces (copy `c` of request
//! `i` follows copy `c - 1`), each id mapped to a uniform 64-bit hash. With `--placement cost`
//! (the default) a KV-aware router places
//! each request on the worker with the lowest cost = blocks to prefill (the request's blocks
//! minus the worker's cached prefix) + the blocks of the worker's requests among the last
//! `2 x workers` placed (its running load), ties broken round-robin: Dynamo's default cost
//! with overlap weight 1; requests sharing a prefix mostly meet on one worker. With
//! `--placement uniform` each request goes to the worker a hash of its blocks picks, with no
//! affinity (a router balancing load, or just started): every worker then holds every trace
//! copy's first block, and a conversation's prefix is held by the workers of its turns.
//! Each worker is an LRU cache of `capacity` blocks: a request touches
//! its blocks, the blocks it lacks (a suffix: the cache stays prefix-closed) are one `stored`
//! event (parent = the last cached block), and the least-recently-used blocks beyond capacity
//! (deepest first among equals, as engines evict leaves first) are one `removed` event.
//!
//! **Measures.** Sustained block ops/s: the whole event stream applied as fast as possible
//! by `--threads` writer threads (events of a worker stay on one thread, in order) while one
//! more thread looks up trace requests back to back, timing each: lookup p50 / p99 are at that
//! load. With `--half-rate`, each peer's part is followed by a second one in which the writers
//! (Dynamo's: the bench thread enqueueing) apply the same stream paced at half the rate the
//! first part measured (each event waits for its due time: its block ops so far over that
//! rate), and lookups are timed back to back beside them: the latency a router sees at a
//! steady load the index keeps up with. Each sample also holds what the timer itself takes (`timer_cost`, read on the same
//! thread right after the run and printed with it, about 25-30 ns here); the latency ratios
//! are printed as measured and net of it (both peers' percentiles less their own run's
//! reading), since a constant added to both pulls a ratio toward 1. Dynamo's thread-pool
//! indexer gets the same number of apply threads (its own); the bench thread only enqueues
//! prebuilt events (with a flush every 4,096, so queues stay short).
//! Dynamo's `RadixTree` is single-threaded (`Rc` nodes, no concurrent reads): its one thread
//! applies the events and does one lookup every 8 events; ops/s counts only the apply time.
//! Memory: the allocator's live bytes after the stream, minus before the peer was built
//! (events a peer consumes are freed by then); for `ConcurrentRadixTreeCompressed` also after
//! the sweep of worker-less nodes it runs at most every 5 minutes (longer than a run), which
//! the bench runs (`swept`; the ratios are given against both); for the index, also where its
//! bytes are, by structure (`PrefixIndex::memory_breakdown`). Per distinct block (live hashes
//! held by any worker) and per (worker, block) pair, both from the simulation's final state. Each peer's
//! part of a run starts with a reading of the core (`Cores`: this machine's vCPUs are slowed
//! from outside at times), printed with its row; the ratios are also given over the runs
//! where both parts read an undisturbed core.

use std::alloc::System;
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::hint::black_box;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use cap::Cap;
use kv_router_client::index::reference::ReferenceIndex;
use kv_router_client::index::{
    IndexConfig, LookupResult, MemoryBreakdown, PrefixIndex, StagedSnapshot, TierId, WorkerId,
};

#[global_allocator]
static ALLOCATOR: Cap<System> = Cap::new(System, usize::MAX);

/// One KV event of one worker.
#[derive(Clone, Debug)]
enum Op {
    Store {
        worker: u32,
        /// The block before the first stored one (Dynamo's trees link to it, and so do the
        /// index's runs).
        parent: Option<u64>,
        hashes: Vec<u64>,
    },
    Remove {
        worker: u32,
        hashes: Vec<u64>,
    },
}

impl Op {
    fn worker(&self) -> u32 {
        match self {
            Op::Store { worker, .. } | Op::Remove { worker, .. } => *worker,
        }
    }
}

/// The events of one simulated fleet, and what is indexed at the end.
struct Workload {
    workers: u32,
    requests: usize,
    ops: Vec<Op>,
    /// Block operations before each event (`ops[i]` is due at `due[i] / rate` when paced).
    due: Vec<u64>,
    block_ops: usize,
    stores: usize,
    hits: usize,
    lookups: Vec<Vec<u64>>,
    /// Live hashes held by at least one worker at the end.
    distinct: usize,
    /// Live (worker, hash) pairs at the end.
    pairs: usize,
    /// Each worker's blocks at the end, sorted by hash (as a store keyed by hash lists them).
    held: Vec<Vec<u64>>,
    /// The block each stored block was stored after.
    parents: HashMap<u64, u64>,
}

fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Reads the trace's `hash_ids`, or makes a synthetic trace of the same shape (every request
/// starts with a shared block; conversations grow turn by turn) when the file is absent.
fn read_trace(path: Option<&PathBuf>, max_blocks: usize) -> (String, Vec<Vec<u64>>) {
    if let Some(text) = path.and_then(|p| std::fs::read_to_string(p).ok()) {
        let mut out = Vec::new();
        let mut n = 0;
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let v: serde_json::Value = serde_json::from_str(line).expect("a Mooncake trace line is JSON");
            let ids: Vec<u64> =
                v["hash_ids"].as_array().map(|a| a.iter().filter_map(|x| x.as_u64()).collect()).unwrap_or_default();
            n += ids.len();
            out.push(ids);
            if max_blocks > 0 && n >= max_blocks {
                break;
            }
        }
        return (path.expect("read").display().to_string(), out);
    }
    let mut out: Vec<Vec<u64>> = Vec::new();
    let mut next_id = 1u64;
    let mut s = 7u64;
    let mut n = 0;
    while n < max_blocks.max(1) && out.len() < 12_000 {
        s = splitmix(s);
        let ids = if out.len() > 10 && s.is_multiple_of(3) {
            // A later turn of an earlier conversation: its prompt plus a few new blocks.
            let mut ids = out[out.len() - 1 - (s >> 8) as usize % 10.min(out.len())].clone();
            ids.extend((0..1 + (s >> 20) % 4).map(|_| {
                next_id += 1;
                next_id
            }));
            ids
        } else {
            std::iter::once(0)
                .chain((0..3 + (s >> 8) % 40).map(|_| {
                    next_id += 1;
                    next_id
                }))
                .collect()
        };
        n += ids.len();
        out.push(ids);
    }
    ("synthetic (trace file not found)".into(), out)
}

/// One worker's LRU cache of blocks.
#[derive(Default)]
struct Lru {
    /// hash -> (last use, depth)
    at: HashMap<u64, (u64, u32)>,
    /// (last use, deepest first, hash)
    order: BTreeSet<(u64, std::cmp::Reverse<u32>, u64)>,
}

impl Lru {
    fn touch(&mut self, hash: u64, now: u64, depth: u32) -> bool {
        let hit = match self.at.insert(hash, (now, depth)) {
            Some((t, d)) => {
                self.order.remove(&(t, std::cmp::Reverse(d), hash));
                true
            }
            None => false,
        };
        self.order.insert((now, std::cmp::Reverse(depth), hash));
        hit
    }
    fn evict(&mut self) -> u64 {
        let (_, _, h) = self.order.pop_first().expect("evict from a non-empty cache");
        self.at.remove(&h);
        h
    }
}

/// How requests are placed on workers (`--placement`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Placement {
    /// The lowest cost: blocks to prefill plus running load (Dynamo's default).
    Cost,
    /// A hash of the request's blocks: no affinity.
    Uniform,
}

impl Placement {
    fn parse(name: &str) -> Placement {
        match name.trim() {
            "cost" => Placement::Cost,
            "uniform" => Placement::Uniform,
            other => panic!("--placement takes cost or uniform, not {other:?}"),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Placement::Cost => "cost",
            Placement::Uniform => "uniform",
        }
    }
}

fn simulate(
    trace: &[Vec<u64>],
    placement: Placement,
    workers: u32,
    copies: u32,
    capacity: usize,
    max_blocks: usize,
    lookups: usize,
) -> Workload {
    assert!((1..=128).contains(&workers), "the simulation tracks holders in a u128");
    let hash = |copy: u32, id: u64| splitmix(id ^ ((copy as u64) << 44) ^ 0x5eed);
    let mut caches: Vec<Lru> = (0..workers).map(|_| Lru::default()).collect();
    let mut holders: HashMap<u64, u128> = HashMap::new();
    let mut recent: VecDeque<(u32, usize)> = VecDeque::new();
    let mut active = vec![0usize; workers as usize];
    let mut w = Workload {
        workers,
        requests: 0,
        ops: Vec::new(),
        due: Vec::new(),
        block_ops: 0,
        stores: 0,
        hits: 0,
        lookups: Vec::new(),
        distinct: 0,
        pairs: 0,
        held: Vec::new(),
        parents: HashMap::new(),
    };
    let mut matched = vec![0usize; workers as usize];
    let all: u128 = if workers == 128 { u128::MAX } else { (1u128 << workers) - 1 };
    'outer: for ids in trace {
        for copy in 0..copies {
            let blocks: Vec<u64> = ids.iter().take(capacity).map(|&id| hash(copy, id)).collect();
            let now = w.requests as u64;
            // Route: each worker's cached prefix, from the holder bitmaps (for the cost).
            matched.iter_mut().for_each(|m| *m = 0);
            let mut mask = if placement == Placement::Cost { all } else { 0 };
            for h in &blocks {
                mask &= holders.get(h).copied().unwrap_or(0);
                if mask == 0 {
                    break;
                }
                let mut m = mask;
                while m != 0 {
                    matched[m.trailing_zeros() as usize] += 1;
                    m &= m - 1;
                }
            }
            let chosen = match placement {
                Placement::Cost => {
                    let start = (now % workers as u64) as usize;
                    let cost = |k: usize| blocks.len() - matched[k] + active[k];
                    let chosen = (0..workers as usize).map(|j| (start + j) % workers as usize).min_by_key(|&k| cost(k));
                    chosen.expect("at least one worker")
                }
                Placement::Uniform => {
                    (blocks.iter().fold(0x0c0f_fee5, |a, &h| splitmix(a ^ h)) % workers as u64) as usize
                }
            };
            recent.push_back((chosen as u32, blocks.len()));
            active[chosen] += blocks.len();
            if recent.len() > 2 * workers as usize {
                let (k, n) = recent.pop_front().expect("non-empty");
                active[k as usize] -= n;
            }
            // Serve: touch every block; the missing suffix is stored.
            let cache = &mut caches[chosen];
            let bit = 1u128 << chosen;
            let mut first_missing = blocks.len();
            for (d, &h) in blocks.iter().enumerate() {
                if cache.touch(h, now, d as u32) {
                    w.hits += 1;
                    debug_assert!(first_missing == blocks.len(), "caches stay prefix-closed");
                } else {
                    first_missing = first_missing.min(d);
                    *holders.entry(h).or_insert(0) |= bit;
                }
            }
            if first_missing < blocks.len() {
                let stored = blocks[first_missing..].to_vec();
                let parent = first_missing.checked_sub(1).map(|i| blocks[i]);
                for d in first_missing.max(1)..blocks.len() {
                    w.parents.insert(blocks[d], blocks[d - 1]);
                }
                w.due.push(w.block_ops as u64);
                w.stores += stored.len();
                w.block_ops += stored.len();
                w.ops.push(Op::Store { worker: chosen as u32, parent, hashes: stored });
            }
            let mut evicted = Vec::new();
            while cache.at.len() > capacity {
                let h = cache.evict();
                let e = holders.get_mut(&h).expect("a cached block has holders");
                *e &= !bit;
                if *e == 0 {
                    holders.remove(&h);
                }
                evicted.push(h);
            }
            if !evicted.is_empty() {
                w.due.push(w.block_ops as u64);
                w.block_ops += evicted.len();
                w.ops.push(Op::Remove { worker: chosen as u32, hashes: evicted });
            }
            w.requests += 1;
            if max_blocks > 0 && w.stores >= max_blocks {
                break 'outer;
            }
        }
    }
    w.distinct = holders.len();
    w.pairs = caches.iter().map(|c| c.at.len()).sum();
    w.held = caches
        .iter()
        .map(|c| {
            let mut v: Vec<u64> = c.at.keys().copied().collect();
            v.sort_unstable();
            v
        })
        .collect();
    // Lookups: trace requests (any copy), spread over the trace.
    let served = (w.requests / copies as usize).max(1);
    w.lookups = (0..lookups as u64)
        .map(|i| {
            let r = splitmix(i ^ 0x100c) as usize % served.min(trace.len());
            let copy = (splitmix(i ^ 0xc0b1) % copies as u64) as u32;
            trace[r].iter().take(capacity).map(|&id| hash(copy, id)).collect()
        })
        .collect();
    w
}

/// One measured run of one peer.
#[derive(Clone, Copy, Debug, Default)]
struct Row {
    ops_per_s: f64,
    p50: Duration,
    p99: Duration,
    lookups: usize,
    bytes: f64,
    /// The compressed tree's `bytes` after its sweep of worker-less nodes (`dynamo::crtc`);
    /// `bytes` for the others.
    swept: f64,
    /// What the timer adds to each latency sample, read on the lookup thread right after its
    /// run (`timer_cost`).
    timer: Duration,
    /// Ours: where its bytes are (`PrefixIndex::memory_breakdown`), after the stream.
    parts: Option<MemoryBreakdown>,
}

impl Row {
    /// A latency percentile net of the timer's own cost.
    fn net(&self, raw: Duration) -> Duration {
        raw.saturating_sub(self.timer)
    }
}

fn pct(sorted: &[u64], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    Duration::from_nanos(sorted[((sorted.len() - 1) as f64 * p) as usize])
}

/// What timing a lookup adds to its sample: the median of 100,000 empty intervals timed the
/// way each lookup is (`Instant::now`, then `elapsed`), on the calling thread. A sample is the
/// lookup's time plus about this much (the end of one clock read and the start of the next):
/// 25 ns here, against a p50 of 180-750 ns, so the raw ratios are pulled toward 1.
fn timer_cost() -> Duration {
    let mut empty: Vec<u64> = (0..100_000)
        .map(|_| {
            let t0 = Instant::now();
            black_box(());
            t0.elapsed().as_nanos() as u64
        })
        .collect();
    empty.sort_unstable();
    pct(&empty, 0.5)
}

/// `--lookup-rate`: lookups per second of the lookup thread beside the writers (0: back to back).
static LOOKUP_RATE: AtomicU64 = AtomicU64::new(0);

/// Runs `lookup` on this thread until `done`, back to back or at `--lookup-rate` (the i-th
/// lookup starts at the i-th tick of the rate, or at once if late), returning the sorted
/// latencies (ns, each lookup's own time) and the timer's cost read after them.
fn lookup_loop(w: &Workload, done: &AtomicBool, mut lookup: impl FnMut(&[u64]) -> u64) -> (Vec<u64>, Duration) {
    let mut lat = Vec::with_capacity(1 << 20);
    let mut sink = 0u64;
    let mut i = 0;
    let rate = LOOKUP_RATE.load(Ordering::Relaxed);
    let start = Instant::now();
    while !done.load(Ordering::Relaxed) {
        if rate > 0 {
            let due = start + Duration::from_secs_f64(i as f64 / rate as f64);
            while Instant::now() < due && !done.load(Ordering::Relaxed) {
                std::hint::spin_loop();
            }
        }
        let q = &w.lookups[i % w.lookups.len()];
        let t0 = Instant::now();
        sink = sink.wrapping_add(lookup(q));
        lat.push(t0.elapsed().as_nanos() as u64);
        i += 1;
    }
    black_box(sink);
    lat.sort_unstable();
    (lat, timer_cost())
}

/// The row of a run: `lat` (sorted) is dropped before the allocator is read, so that it is not
/// counted as the peer's memory.
fn row(ops: usize, elapsed: Duration, (lat, timer): (Vec<u64>, Duration), before: usize) -> Row {
    let (p50, p99, lookups) = (pct(&lat, 0.5), pct(&lat, 0.99), lat.len());
    drop(lat);
    let bytes = ALLOCATOR.allocated().saturating_sub(before) as f64;
    Row { ops_per_s: ops as f64 / elapsed.as_secs_f64(), p50, p99, lookups, bytes, swept: bytes, timer, parts: None }
}

/// An index applied directly by writer threads (ours, and the reference behind a mutex).
trait Direct: Send + Sync {
    fn apply(&self, op: &Op);
    fn lookup(&self, hashes: &[u64]) -> u64;
    /// Where the index's bytes are, if it can tell.
    fn parts(&self) -> Option<MemoryBreakdown> {
        None
    }
}

fn wid(raw: u32) -> WorkerId {
    WorkerId::new(raw).expect("small worker id")
}

impl Direct for PrefixIndex {
    fn apply(&self, op: &Op) {
        match op {
            Op::Store { worker, parent, hashes } => self.store_after(wid(*worker), TierId::DEVICE, *parent, hashes),
            Op::Remove { worker, hashes } => {
                self.remove(wid(*worker), TierId::DEVICE, hashes);
            }
        }
    }
    fn lookup(&self, hashes: &[u64]) -> u64 {
        thread_local!(static OUT: std::cell::RefCell<LookupResult> = Default::default());
        OUT.with(|out| {
            let mut out = out.borrow_mut();
            self.lookup_into(hashes, &mut out);
            out.iter().map(|m| m.blocks as u64).sum()
        })
    }
    fn parts(&self) -> Option<MemoryBreakdown> {
        Some(self.memory_breakdown())
    }
}

impl Direct for Mutex<ReferenceIndex> {
    fn apply(&self, op: &Op) {
        let mut r = self.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        match op {
            Op::Store { worker, hashes, .. } => r.store(wid(*worker), TierId::DEVICE, hashes),
            Op::Remove { worker, hashes } => {
                r.remove(wid(*worker), TierId::DEVICE, hashes);
            }
        }
    }
    fn lookup(&self, hashes: &[u64]) -> u64 {
        let r = self.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        r.lookup(hashes).iter().map(|m| m.blocks as u64).sum()
    }
}

/// Waits until event `i` of `w` is due when the stream is paced at `pace` block ops a second
/// from `t0` (at once when not paced). Yields the core meanwhile: the lookup thread and
/// another writer may need it.
fn wait_due(w: &Workload, i: usize, t0: Instant, pace: Option<f64>) {
    let Some(rate) = pace else {
        return;
    };
    let due = t0 + Duration::from_secs_f64(w.due[i] as f64 / rate);
    while Instant::now() < due {
        std::thread::yield_now();
    }
}

/// One part of a run: the stream applied by `threads` writers while lookups run beside them,
/// as fast as they can or paced at `pace` block ops a second.
fn run_direct<I: Direct>(w: &Workload, threads: usize, pace: Option<f64>, make: impl FnOnce() -> I) -> Row {
    let before = ALLOCATOR.allocated();
    let index = make();
    let done = AtomicBool::new(false);
    let (elapsed, lat) = std::thread::scope(|s| {
        let reader = s.spawn(|| lookup_loop(w, &done, |q| index.lookup(q)));
        let t0 = Instant::now();
        let writers: Vec<_> = (0..threads)
            .map(|t| {
                let index = &index;
                s.spawn(move || {
                    for (i, op) in w.ops.iter().enumerate().filter(|(_, op)| op.worker() as usize % threads == t) {
                        wait_due(w, i, t0, pace);
                        index.apply(op);
                    }
                })
            })
            .collect();
        writers.into_iter().for_each(|h| h.join().expect("writer"));
        let elapsed = t0.elapsed();
        done.store(true, Ordering::Relaxed);
        (elapsed, reader.join().expect("reader"))
    });
    let r = Row { parts: index.parts(), ..row(w.block_ops, elapsed, lat, before) };
    drop(index);
    r
}

#[cfg(feature = "dynamo-bench")]
mod dynamo {
    //! NVIDIA Dynamo's indexes (`dynamo-kv-router` 1.6.1), driven as its router drives them.

    use super::*;
    use dynamo_kv_router::indexer::{SyncIndexer, ThreadPoolIndexer};
    use dynamo_kv_router::protocols::{
        ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
        KvCacheStoredBlockData, LocalBlockHash, RouterEvent,
    };
    use dynamo_kv_router::{ConcurrentRadixTreeCompressed, RadixTree};

    /// A KV event as Dynamo's router receives it: worker id, DP rank 0, device tier; each block
    /// with its sequence hash and (the trace's hashes being chained already) the same value as
    /// its local hash, which is what Dynamo's trees match requests by.
    fn event(id: u64, op: &Op) -> RouterEvent {
        let data = match op {
            Op::Store { parent, hashes, .. } => KvCacheEventData::Stored(KvCacheStoreData {
                parent_hash: parent.map(ExternalSequenceBlockHash),
                start_position: None,
                blocks: hashes
                    .iter()
                    .map(|&h| KvCacheStoredBlockData {
                        block_hash: ExternalSequenceBlockHash(h),
                        tokens_hash: LocalBlockHash(h),
                        mm_extra_info: None,
                    })
                    .collect(),
            }),
            Op::Remove { hashes, .. } => KvCacheEventData::Removed(KvCacheRemoveData {
                block_hashes: hashes.iter().map(|&h| ExternalSequenceBlockHash(h)).collect(),
            }),
        };
        RouterEvent::new(op.worker() as u64, KvCacheEvent { event_id: id, data, dp_rank: 0 })
    }

    fn query(hashes: &[u64]) -> Vec<LocalBlockHash> {
        hashes.iter().map(|&h| LocalBlockHash(h)).collect()
    }

    /// `ConcurrentRadixTreeCompressed` behind `ThreadPoolIndexer` with `threads` apply threads,
    /// its events enqueued as fast as it takes them or paced at `pace` block ops a second;
    /// lookups inline on the reader thread (as `find_matches` does).
    pub fn crtc(w: &Workload, threads: usize, pace: Option<f64>) -> Row {
        let queries: Vec<Vec<LocalBlockHash>> = w.lookups.iter().map(|q| query(q)).collect();
        let rt = tokio::runtime::Builder::new_current_thread().build().expect("tokio runtime");
        let before = ALLOCATOR.allocated();
        let events: Vec<RouterEvent> = w.ops.iter().enumerate().map(|(i, op)| event(i as u64, op)).collect();
        let pool = ThreadPoolIndexer::new(ConcurrentRadixTreeCompressed::new(), threads, 512);
        let done = AtomicBool::new(false);
        let (elapsed, lat) = std::thread::scope(|s| {
            let reader = s.spawn(|| {
                let mut k = 0usize;
                lookup_loop(w, &done, |_| {
                    k += 1;
                    let q = &queries[(k - 1) % queries.len()];
                    pool.backend().find_matches(q, false).scores.values().map(|&v| v as u64).sum()
                })
            });
            let t0 = Instant::now();
            for (i, ev) in events.into_iter().enumerate() {
                wait_due(w, i, t0, pace);
                pool.enqueue_event(ev).expect("enqueue");
                if i % 4096 == 4095 {
                    rt.block_on(pool.flush_and_wait()).expect("flush");
                }
            }
            rt.block_on(pool.flush_and_wait()).expect("flush");
            let elapsed = t0.elapsed();
            done.store(true, Ordering::Relaxed);
            (elapsed, reader.join().expect("reader"))
        });
        let mut r = row(w.block_ops, elapsed, lat, before);
        // The tree keeps nodes whose workers all left until a sweep it runs at most every 5
        // minutes (`dynamo_kv_router::cleanup`), longer than a run: its memory is also read
        // after that sweep, run here.
        pool.backend().run_cleanup_task();
        r.swept = ALLOCATOR.allocated().saturating_sub(before) as f64;
        drop(pool);
        r
    }

    /// `RadixTree`: one thread applies the events and looks up once every 8 events.
    pub fn radix(w: &Workload) -> Row {
        let queries: Vec<Vec<LocalBlockHash>> = w.lookups.iter().map(|q| query(q)).collect();
        let before = ALLOCATOR.allocated();
        let events: Vec<RouterEvent> = w.ops.iter().enumerate().map(|(i, op)| event(i as u64, op)).collect();
        let mut tree = RadixTree::new();
        let mut lat = Vec::with_capacity(events.len() / 8 + 1);
        let mut apply = Duration::ZERO;
        let mut sink = 0u64;
        for (i, ev) in events.into_iter().enumerate() {
            let t0 = Instant::now();
            tree.apply_event(ev).expect("a well-formed event");
            apply += t0.elapsed();
            if i % 8 == 7 {
                let q = queries[(i / 8) % queries.len()].clone();
                let t0 = Instant::now();
                sink = sink.wrapping_add(tree.find_matches(q, false).scores.values().map(|&v| v as u64).sum());
                lat.push(t0.elapsed().as_nanos() as u64);
            }
        }
        black_box(sink);
        lat.sort_unstable();
        let r = row(w.block_ops, apply, (lat, timer_cost()), before);
        drop(tree);
        r
    }
}

struct Opts {
    workers: Vec<u32>,
    runs: usize,
    threads: usize,
    capacity: usize,
    copies: Option<u32>,
    blocks: usize,
    lookups: usize,
    trace: Option<PathBuf>,
    reference: bool,
    only: Option<String>,
    lookup_runs: Option<usize>,
    lookup_rate: u64,
    placements: Vec<Placement>,
    half_rate: bool,
}

impl Opts {
    fn parse() -> Opts {
        let args: Vec<String> = std::env::args().collect();
        let val = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
        let num = |name: &str, d: usize| val(name).and_then(|v| v.parse().ok()).unwrap_or(d);
        let blocks = num("--blocks", 0);
        Opts {
            workers: val("--workers")
                .map(|v| v.split(',').filter_map(|x| x.trim().parse().ok()).collect())
                .unwrap_or_else(|| vec![8, 128]),
            runs: num("--runs", if blocks > 0 { 1 } else { 3 }).max(1),
            threads: num("--threads", 1).max(1),
            capacity: num("--capacity", 4096).max(1),
            copies: val("--copies").and_then(|v| v.parse().ok()),
            blocks,
            lookups: num("--lookups", 20_000).max(1),
            trace: val("--trace")
                .map(PathBuf::from)
                .or_else(|| std::env::var_os("KV_ROUTER_MOONCAKE").map(PathBuf::from))
                .or_else(|| Some(kv_relay_testdata::mooncake("conversation_trace.jsonl"))),
            reference: args.iter().any(|a| a == "--reference") || !cfg!(feature = "dynamo-bench"),
            only: val("--only"),
            lookup_runs: val("--lookup-runs").and_then(|v| v.parse().ok()),
            lookup_rate: num("--lookup-rate", 0) as u64,
            placements: val("--placement")
                .map(|v| v.split(',').map(Placement::parse).collect())
                .unwrap_or_else(|| vec![Placement::Cost]),
            half_rate: args.iter().any(|a| a == "--half-rate"),
        }
    }
}

/// A peer: its name, whether its writers can be paced beside concurrent lookups
/// (`--half-rate`), and its part of a run (the stream, unpaced or paced at a block ops rate).
type Runner<'a> = (&'static str, bool, Box<dyn Fn(&Workload, Option<f64>) -> Row + 'a>);

/// A reading of this machine's cores, taken before each peer's part of a run: how long a fixed
/// ALU loop takes alone (`alone`, seconds, best of 3), and how much a second thread running it
/// beside slows it (`beside`, a ratio). This machine's two cores are virtual: the host may run
/// them on the two hardware threads of one physical core, or another tenant's work on the other
/// hardware thread of ours, for some runs and not others. A writer whose work is in cache then
/// slows by up to a third (the same binary, 7M against 11M block ops/s here), and the peers do
/// not all slow alike, so the runs where both parts read an undisturbed core are also compared
/// on their own.
#[derive(Clone, Copy)]
struct Cores {
    alone: f64,
    beside: f64,
}

impl Cores {
    fn read() -> Cores {
        // Eight independent chains: enough work in flight to keep a core's ALU ports busy, so
        // that a hardware thread beside it has to share them (one dependent chain would not
        // notice).
        fn spin(iters: u64) -> u64 {
            let mut x: [u64; 8] = std::array::from_fn(|i| 0x9e37_79b9_7f4a_7c15u64.wrapping_mul(i as u64 + 1));
            for _ in 0..iters {
                for v in &mut x {
                    *v ^= *v << 13;
                    *v ^= *v >> 7;
                    *v ^= *v << 17;
                }
            }
            black_box(x.iter().fold(0, |a, b| a ^ b))
        }
        let time = || {
            (0..3)
                .map(|_| {
                    let t0 = Instant::now();
                    spin(400_000);
                    t0.elapsed().as_secs_f64()
                })
                .fold(f64::INFINITY, f64::min)
        };
        let alone = time();
        let stop = AtomicBool::new(false);
        let beside = std::thread::scope(|s| {
            s.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    spin(2_000);
                }
            });
            let t = time();
            stop.store(true, Ordering::Relaxed);
            t
        });
        Cores { alone, beside: beside / alone }
    }

    /// Undisturbed: within a tenth of the fastest reading of the run (`best`, seconds alone),
    /// and not sharing a physical core with the other thread.
    fn undisturbed(&self, best: f64) -> bool {
        best / self.alone >= 0.9 && self.beside < 1.25
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// `--analyze`: the index alone, on one thread. The whole stream is applied `reps` times (each
/// into a new index, timed: the apply rate with no lookups), then the lookups run
/// `lookup_reps` times over the last index, with no writer beside them: latency percentiles
/// (each with the lookup's length, deepest match, workers matched and (worker, block) pairs
/// matched), mean latency by depth of the deepest match, and by how many workers matched past
/// block 0 (how many runs the lookup followed) with the share of them at or over the p99. For
/// profiling.
fn analyze(w: &Workload, reps: usize, lookup_reps: usize) {
    // The stream applied `reps` times, each into a new index (the last one is looked up).
    let mut rates = Vec::new();
    let mut index = PrefixIndex::new(IndexConfig::default());
    for rep in 0..reps {
        if rep > 0 {
            index = PrefixIndex::new(IndexConfig::default());
        }
        let t0 = Instant::now();
        for op in &w.ops {
            index.apply(op);
        }
        let secs = t0.elapsed().as_secs_f64();
        rates.push(w.block_ops as f64 / secs);
        println!(
            "  applied {} block ops in {secs:.3} s on one thread, no lookups: {:.0} ops/s",
            w.block_ops,
            w.block_ops as f64 / secs
        );
    }
    println!("  apply median of {reps}: {:.0} ops/s", median(rates));
    // (ns, request length, deepest match, workers, matched (worker, block) pairs, workers
    // matching more than block 0)
    let mut rows: Vec<(u64, usize, u32, usize, u64, usize)> = Vec::new();
    let mut r = LookupResult::default();
    for _ in 0..lookup_reps {
        for q in &w.lookups {
            let t0 = Instant::now();
            index.lookup_into(q, &mut r);
            let ns = t0.elapsed().as_nanos() as u64;
            let pairs: u64 = r.iter().map(|m| m.blocks as u64).sum();
            let depth = r.iter().map(|m| m.blocks).max().unwrap_or(0);
            let past_first = r.iter().filter(|m| m.blocks > 1).count();
            rows.push((ns, q.len(), depth, r.len(), pairs, past_first));
        }
    }
    rows.sort_unstable();
    let n = rows.len();
    let total: u64 = rows.iter().map(|r| r.0).sum();
    match n {
        0 => println!("  no lookups (--lookup-runs 0)"),
        _ => println!("  {n} lookups, mean {} ns", total / n as u64),
    }
    // The row at percentile `p` (rows are sorted by time).
    let at = |p: f64| rows[((n - 1) as f64 * p) as usize];
    for p in [0.5, 0.9, 0.99, 0.999].into_iter().filter(|_| n > 0) {
        let (ns, len, depth, workers, pairs, _) = at(p);
        println!("  p{p}: {ns} ns (length {len}, depth {depth}, {workers} workers, {pairs} matched pairs)");
    }
    let mut by_depth = std::collections::BTreeMap::new();
    for &(ns, _, depth, _, _, _) in &rows {
        let e = by_depth.entry(depth / 25 * 25).or_insert((0usize, 0u64));
        e.0 += 1;
        e.1 += ns;
    }
    for (d, (c, ns)) in by_depth {
        println!("  depth {d:>4}..{:<4} {c:>8} lookups, mean {} ns", d + 24, ns / c as u64);
    }
    // By how many workers' runs the lookup followed past block 0: how many lookups, their
    // mean, and how many of them are at or over the p99.
    if n > 0 {
        let p99 = at(0.99).0;
        let mut by_followed = std::collections::BTreeMap::new();
        for &(ns, _, _, _, _, past_first) in &rows {
            let e = by_followed.entry(past_first.min(3)).or_insert((0usize, 0u64, 0usize));
            e.0 += 1;
            e.1 += ns;
            e.2 += (ns >= p99) as usize;
        }
        for (k, (c, ns, slow)) in by_followed {
            let label = if k == 3 { "3 or more".to_string() } else { k.to_string() };
            println!(
                "  workers matching past block 0: {label:>9}: {c:>8} lookups, mean {} ns, {slow} at or over the p99 ({:.1}% of them)",
                ns / c as u64,
                100.0 * slow as f64 / c as f64
            );
        }
    }
    println!("  {:?}, {} B: {:?}", index.stats(), index.memory_bytes(), index.memory_breakdown().parts());
    if std::env::args().any(|a| a == "--hot") {
        hot(&index, w);
    }
    if std::env::args().any(|a| a == "--resync") {
        resync(w, lookup_reps);
    }
}

/// `--analyze --hot`: the CPU a lookup costs with everything in cache (one request looked up
/// 200,000 times in a row), for the first three lookup requests of each kind: every worker
/// matching only the first block (kept first-block candidates with no holder of block 1, the
/// path of most of the 8-worker bench's lookups), 3 to 24 blocks deep, and 25 or more. Three
/// rounds, to see the machine's spread.
fn hot(index: &PrefixIndex, w: &Workload) {
    const REPS: u32 = 200_000;
    let mut r = LookupResult::default();
    let mut picked: Vec<(&str, &[u64])> = Vec::new();
    for q in &w.lookups {
        index.lookup_into(q, &mut r);
        let depth = r.iter().map(|m| m.blocks).max().unwrap_or(0);
        let kind = match depth {
            1 if r.len() == w.workers as usize => "first block only",
            3..=24 => "3-24 blocks",
            25.. => "25+ blocks",
            _ => continue,
        };
        if picked.iter().filter(|(k, _)| *k == kind).count() < 3 {
            picked.push((kind, q));
        }
    }
    picked.sort_by_key(|(kind, _)| *kind);
    for round in 0..3 {
        let mut line = format!("  in cache, round {round}:");
        for (kind, q) in &picked {
            let t0 = Instant::now();
            for _ in 0..REPS {
                index.lookup_into(q, &mut r);
                black_box(&r);
            }
            let ns = t0.elapsed().as_nanos() as f64 / REPS as f64;
            line += &format!(" [{kind}, length {}] {ns:.0} ns", q.len());
        }
        println!("{line}");
    }
}

/// `--analyze --resync`: every worker's final state swapped into a new index by
/// `replace_worker`, as a router resynced from relays' snapshots would hold it (blocks in hash
/// order), once without the blocks' parents and once with them; then the same lookups over
/// both, alternating passes, in this process.
fn resync(w: &Workload, reps: usize) {
    let snapshots = |with_parents: bool| -> Vec<StagedSnapshot> {
        w.held
            .iter()
            .map(|held| {
                let mut snap = StagedSnapshot::new();
                for &h in held {
                    let parent = if with_parents { w.parents.get(&h).copied() } else { None };
                    snap.push_after(TierId::DEVICE, h, 1, parent);
                }
                snap
            })
            .collect()
    };
    let (without, with) = (snapshots(false), snapshots(true));
    let build = |with_parents: bool| {
        let index = PrefixIndex::new(IndexConfig::default());
        let t0 = Instant::now();
        for (k, snap) in if with_parents { &with } else { &without }.iter().enumerate() {
            index.replace_worker(wid(k as u32), snap);
        }
        (index, t0.elapsed())
    };
    let (_, t0) = build(false);
    let (_, t1) = build(true);
    println!("  resync warm-up: {t0:.2?} without parents, {t1:.2?} with");
    let (plain, t_plain) = build(false);
    let (laid, t_laid) = build(true);
    println!(
        "  resync: {} workers' snapshots replaced in {t_plain:.2?} without parents, {t_laid:.2?} with",
        w.held.len()
    );
    let mut lat: [Vec<u64>; 2] = [Vec::new(), Vec::new()];
    let mut r = LookupResult::default();
    for _ in 0..reps {
        for (k, index) in [&plain, &laid].into_iter().enumerate() {
            for q in &w.lookups {
                let t0 = Instant::now();
                index.lookup_into(q, &mut r);
                lat[k].push(t0.elapsed().as_nanos() as u64);
            }
        }
    }
    for (k, name) in ["without parents", "with parents"].into_iter().enumerate() {
        let v = &mut lat[k];
        v.sort_unstable();
        let mean = v.iter().sum::<u64>() / v.len().max(1) as u64;
        println!(
            "  resynced index, {name}: {} lookups, mean {mean} ns, p50 {:?}, p99 {:?}",
            v.len(),
            pct(v, 0.5),
            pct(v, 0.99)
        );
    }
}

fn main() {
    let o = Opts::parse();
    LOOKUP_RATE.store(o.lookup_rate, Ordering::Relaxed);
    let threads = o.threads;
    let mut runners: Vec<Runner> = vec![(
        "index",
        true,
        Box::new(move |w: &Workload, pace| run_direct(w, threads, pace, || PrefixIndex::new(IndexConfig::default()))),
    )];
    #[cfg(feature = "dynamo-bench")]
    {
        runners.push(("dynamo-crtc", true, Box::new(move |w: &Workload, pace| dynamo::crtc(w, threads, pace))));
        runners.push(("dynamo-radix", false, Box::new(|w: &Workload, _| dynamo::radix(w))));
    }
    if o.reference {
        runners.push((
            "reference",
            true,
            Box::new(move |w: &Workload, pace| run_direct(w, threads, pace, || Mutex::new(ReferenceIndex::new()))),
        ));
    }
    runners.retain(|(name, _, _)| name == &"index" || o.only.as_deref().is_none_or(|n| n == *name));
    let (source, trace) = read_trace(o.trace.as_ref(), o.blocks);
    println!(
        "prefix index bench: trace {source} ({} requests); {} writer thread(s) + 1 lookup thread ({}); {} run(s); load average {}",
        trace.len(),
        threads,
        if o.lookup_rate > 0 { format!("{} lookups/s", o.lookup_rate) } else { "back to back".into() },
        o.runs,
        std::fs::read_to_string("/proc/loadavg").map(|s| s.split(' ').take(3).collect::<Vec<_>>().join(" ")).unwrap_or_default()
    );
    for &placement in &o.placements {
        for &workers in &o.workers {
            let copies = o.copies.unwrap_or((workers / 2).max(4));
            let w = simulate(&trace, placement, workers, copies, o.capacity, o.blocks, o.lookups);
            if std::env::args().any(|a| a == "--analyze") {
                println!(
                    "{workers} workers, {copies} copies, {} placement: the index alone, one thread, {} run(s)",
                    placement.name(),
                    o.runs
                );
                analyze(&w, o.runs, o.lookup_runs.unwrap_or(o.runs));
            } else {
                compare(&o, &runners, placement, copies, &w);
            }
        }
    }
}

/// The peers' runs on one workload, and their same-run ratios.
fn compare(o: &Opts, runners: &[Runner], placement: Placement, copies: u32, w: &Workload) {
    println!(
        "\n{} workers x {} blocks LRU, {} placement, {} trace copies: {} requests, {} events, {} block ops ({} stored, {} cache hits), \
         at the end {} distinct blocks, {} (worker, block) pairs",
        w.workers,
        o.capacity,
        placement.name(),
        copies,
        w.requests,
        w.ops.len(),
        w.block_ops,
        w.stores,
        w.hits,
        w.distinct,
        w.pairs
    );
    let mut rows: Vec<Vec<Row>> = vec![Vec::new(); runners.len()];
    // `--half-rate`: per peer that can be paced, its paced part of each run.
    let mut half: Vec<Vec<Row>> = vec![Vec::new(); runners.len()];
    // Per run, the cores as read before each peer's part (see `Cores`).
    let mut cores: Vec<Vec<Cores>> = Vec::new();
    let mut best = f64::INFINITY;
    for run in 0..o.runs {
        let mut readings = Vec::new();
        for (k, (name, paced, f)) in runners.iter().enumerate() {
            let c = Cores::read();
            best = best.min(c.alone);
            readings.push(c);
            let r = f(w, None);
            println!(
                "  run {run} {name:<13} {:>12.0} ops/s  lookup p50 {:>9.2?} p99 {:>9.2?} ({} lookups, timer {} ns)  {:>6.1} B/distinct {:>6.1} B/pair ({:.1} swept)  core {:.0} µs, x{:.2} beside",
                r.ops_per_s,
                r.p50,
                r.p99,
                r.lookups,
                r.timer.as_nanos(),
                r.bytes / w.distinct.max(1) as f64,
                r.bytes / w.pairs.max(1) as f64,
                r.swept / w.pairs.max(1) as f64,
                c.alone * 1e6,
                c.beside,
            );
            if let Some(parts) = r.parts {
                let per = |b: usize| b as f64 / w.pairs.max(1) as f64;
                let list: Vec<String> =
                    parts.parts().iter().map(|&(what, b)| format!("{what} {:.1}", per(b))).collect();
                println!("      B/pair by structure: {:.1}: {}", per(parts.total()), list.join(", "));
            }
            if o.half_rate && *paced {
                let h = f(w, Some(r.ops_per_s / 2.0));
                println!(
                    "  run {run} {name:<13} {:>12.0} ops/s  lookup p50 {:>9.2?} p99 {:>9.2?} ({} lookups, timer {} ns)  writer paced at half",
                    h.ops_per_s,
                    h.p50,
                    h.p99,
                    h.lookups,
                    h.timer.as_nanos(),
                );
                half[k].push(h);
            }
            rows[k].push(r);
        }
        cores.push(readings);
    }
    println!(
        "  medians of {} run(s)   {:>12} {:>10} {:>10} {:>12} {:>10} {:>14} {:>14}",
        o.runs, "ops/s", "p50", "p99", "B/distinct", "B/pair", "half-rate p50", "half-rate p99"
    );
    let med = |rows: &[Row], f: &dyn Fn(&Row) -> f64| median(rows.iter().map(f).collect());
    let micros = |d: Duration| d.as_secs_f64() * 1e6;
    for (k, (name, _, _)) in runners.iter().enumerate() {
        let halves = match half[k].as_slice() {
            [] => String::new(),
            h => format!(" {:>12.2}µs {:>12.2}µs", med(h, &|r| micros(r.p50)), med(h, &|r| micros(r.p99))),
        };
        println!(
            "  {name:<22} {:>12.0} {:>8.2}µs {:>8.2}µs {:>12.1} {:>10.1}{halves}",
            med(&rows[k], &|r| r.ops_per_s),
            med(&rows[k], &|r| micros(r.p50)),
            med(&rows[k], &|r| micros(r.p99)),
            med(&rows[k], &|r| r.bytes / w.distinct.max(1) as f64),
            med(&rows[k], &|r| r.bytes / w.pairs.max(1) as f64),
        );
    }
    for (k, (name, _, _)) in runners.iter().enumerate().skip(1) {
        // Same-run ratios, median over the runs given.
        let ratio = |rows: &[Vec<Row>], runs: &[usize], f: &dyn Fn(&Row) -> f64| {
            median(runs.iter().map(|&i| f(&rows[0][i]) / f(&rows[k][i])).collect())
        };
        let all: Vec<usize> = (0..o.runs).collect();
        println!(
            "  index / {name}: ops/s x{:.2}, lookup p50 x{:.3}, p99 x{:.3}, memory x{:.3} (x{:.3} swept); net of the timer: p50 x{:.3}, p99 x{:.3}",
            ratio(&rows, &all, &|r| r.ops_per_s),
            ratio(&rows, &all, &|r| r.p50.as_secs_f64()),
            ratio(&rows, &all, &|r| r.p99.as_secs_f64()),
            ratio(&rows, &all, &|r| r.bytes),
            ratio(&rows, &all, &|r| r.swept),
            ratio(&rows, &all, &|r| r.net(r.p50).as_secs_f64()),
            ratio(&rows, &all, &|r| r.net(r.p99).as_secs_f64()),
        );
        if !half[0].is_empty() && !half[k].is_empty() {
            println!(
                "  index / {name}, writers at half their own rate: lookup p50 x{:.3}, p99 x{:.3}; net of the timer: p50 x{:.3}, p99 x{:.3}",
                ratio(&half, &all, &|r| r.p50.as_secs_f64()),
                ratio(&half, &all, &|r| r.p99.as_secs_f64()),
                ratio(&half, &all, &|r| r.net(r.p50).as_secs_f64()),
                ratio(&half, &all, &|r| r.net(r.p99).as_secs_f64()),
            );
        }
        // The same over the runs where both parts read an undisturbed core.
        let calm: Vec<usize> =
            all.into_iter().filter(|&run| cores[run][0].undisturbed(best) && cores[run][k].undisturbed(best)).collect();
        if !calm.is_empty() {
            println!(
                "  index / {name}, the {} of {} run(s) with both parts on an undisturbed core: ops/s x{:.2}, lookup p99 x{:.3}",
                calm.len(),
                o.runs,
                ratio(&rows, &calm, &|r| r.ops_per_s),
                ratio(&rows, &calm, &|r| r.p99.as_secs_f64()),
            );
        }
    }
}
