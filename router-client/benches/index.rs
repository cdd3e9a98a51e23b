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

#[path = "index/workload.rs"]
mod workload;
use workload::*;

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
    Duration::from_nanos(kv_relay_testkit::kit::percentile(sorted, p).unwrap_or(0))
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
#[path = "index/dynamo.rs"]
mod dynamo;

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

#[path = "index/analyze.rs"]
mod analyze;
use analyze::*;

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
