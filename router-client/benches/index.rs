//! Prefix index benchmark: block ops/s, lookup latency and memory per block, for the index and
//! for the naive reference measured in the same run (printed as ratios).
//!
//! Run: `cargo bench -p kv-router-client --bench index` (release). Optional arguments:
//! `--blocks N` (default 1,000,000), `--lookups N` (default 20,000), and `--index-only` (for
//! profiling the index alone).
//!
//! Peers implement [`Peer`]. The reference is a `BTreeMap` behind a mutex. NVIDIA Dynamo's
//! radix tree (`dynamo-kv-router`) goes in as another `Peer` behind a cargo feature: see the
//! `// DYNAMO PEER` marker below.

use std::alloc::System;
use std::hint::black_box;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use cap::Cap;
use kv_router_client::index::reference::ReferenceIndex;
use kv_router_client::index::{IndexConfig, LookupResult, PrefixIndex, TierId, WorkerId};

#[global_allocator]
static ALLOCATOR: Cap<System> = Cap::new(System, usize::MAX);

/// What the benchmark needs from an index.
trait Peer: Send + Sync {
    fn name(&self) -> &'static str;
    fn store(&self, worker: u32, tier: TierId, hashes: &[u64]);
    fn remove(&self, worker: u32, tier: TierId, hashes: &[u64]);
    /// Returns something derived from the answer, so the lookup is not optimised away.
    fn lookup(&self, hashes: &[u64]) -> u64;
    /// Indexed `(worker, tier, hash)` blocks.
    fn blocks(&self) -> usize;
}

fn wid(raw: u32) -> WorkerId {
    WorkerId::new(raw).expect("small worker id")
}

struct Index(PrefixIndex);

impl Peer for Index {
    fn name(&self) -> &'static str {
        "index"
    }
    fn store(&self, worker: u32, tier: TierId, hashes: &[u64]) {
        self.0.store(wid(worker), tier, hashes);
    }
    fn remove(&self, worker: u32, tier: TierId, hashes: &[u64]) {
        self.0.remove(wid(worker), tier, hashes);
    }
    fn lookup(&self, hashes: &[u64]) -> u64 {
        thread_local!(static OUT: std::cell::RefCell<LookupResult> = Default::default());
        OUT.with(|out| {
            let mut out = out.borrow_mut();
            self.0.lookup_into(hashes, &mut out);
            out.iter().map(|m| m.blocks as u64).sum()
        })
    }
    fn blocks(&self) -> usize {
        self.0.stats().blocks
    }
}

struct Reference(Mutex<ReferenceIndex>);

impl Reference {
    fn get(&self) -> std::sync::MutexGuard<'_, ReferenceIndex> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Peer for Reference {
    fn name(&self) -> &'static str {
        "reference"
    }
    fn store(&self, worker: u32, tier: TierId, hashes: &[u64]) {
        self.get().store(wid(worker), tier, hashes);
    }
    fn remove(&self, worker: u32, tier: TierId, hashes: &[u64]) {
        self.get().remove(wid(worker), tier, hashes);
    }
    fn lookup(&self, hashes: &[u64]) -> u64 {
        self.get().lookup(hashes).iter().map(|m| m.blocks as u64).sum()
    }
    fn blocks(&self) -> usize {
        self.get().len()
    }
}

// DYNAMO PEER: add `dynamo-kv-router` as an optional dev-dependency behind a `dynamo-peer`
// feature, wrap its radix tree in a struct implementing `Peer` here (one worker per `u32`,
// DP rank 0; store/remove as KV events with one block per hash), and push it in `peers()`.

fn peers() -> Vec<Arc<dyn Peer>> {
    vec![
        Arc::new(Index(PrefixIndex::new(IndexConfig::default()))),
        Arc::new(Reference(Mutex::new(ReferenceIndex::new()))),
    ]
}

/// A deterministic generator (SplitMix64), so every peer sees the same workload.
struct Gen(u64);

impl Gen {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

const WORKERS: u32 = 16;
const SHARED_PREFIXES: u64 = 2_000;

/// A request: a shared prefix (system prompt, 8..40 blocks) and a unique suffix (8..56
/// blocks), as chained hashes; and the worker that served it.
fn request(g: &mut Gen) -> (u32, Vec<u64>) {
    let p = g.below(SHARED_PREFIXES);
    let plen = 8 + p % 32;
    let slen = 8 + g.below(48);
    let mut h = p.wrapping_mul(0x2545_f491_4f6c_dd1d) | 1;
    let mut blocks = Vec::with_capacity((plen + slen) as usize);
    for _ in 0..plen {
        h = h.rotate_left(17).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x51;
        blocks.push(h);
    }
    let salt = g.next();
    for _ in 0..slen {
        h = (h ^ salt).rotate_left(23).wrapping_mul(0xc2b2_ae3d_27d4_eb4f);
        blocks.push(h);
    }
    // Prefix-affine placement, as a KV-aware router would do: most requests of a prefix land
    // on the same few workers.
    let worker = ((p + g.below(3)) % WORKERS as u64) as u32;
    (worker, blocks)
}

fn workload(blocks: usize, seed: u64) -> Vec<(u32, Vec<u64>)> {
    let mut g = Gen(seed);
    let mut out = Vec::new();
    let mut n = 0;
    while n < blocks {
        let r = request(&mut g);
        n += r.1.len();
        out.push(r);
    }
    out
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p) as usize]
}

struct Row {
    name: &'static str,
    bytes_per_block: f64,
    store_ops: f64,
    churn_ops: [f64; 2],
    lookup: [Duration; 2],
    lookup_busy: [Duration; 2],
}

fn measure(peer: Arc<dyn Peer>, load: &[(u32, Vec<u64>)], churn: &[(u32, Vec<u64>)], lookups: usize) -> Row {
    // 1. Store everything (single thread): ops/s and allocator bytes per indexed block.
    let before = ALLOCATOR.allocated();
    let t0 = Instant::now();
    let mut ops = 0usize;
    for (worker, blocks) in load {
        peer.store(*worker, TierId::DEVICE, blocks);
        ops += blocks.len();
    }
    let store_ops = ops as f64 / t0.elapsed().as_secs_f64();
    let indexed = peer.blocks();
    let bytes_per_block = (ALLOCATOR.allocated() - before) as f64 / indexed as f64;

    // 2. Churn: each thread stores a request's blocks and removes them again (a cache
    //    admitting and evicting), on its own workers. Block ops/s at 1 and 2 threads.
    let mut churn_ops = [0.0; 2];
    for (k, threads) in [1usize, 2].into_iter().enumerate() {
        let t0 = Instant::now();
        let total: usize = std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads)
                .map(|th| {
                    let peer = peer.clone();
                    s.spawn(move || {
                        let mut ops = 0;
                        for (i, (worker, blocks)) in churn.iter().enumerate().skip(th).step_by(threads) {
                            let tier = if i % 4 == 0 { TierId::HOST } else { TierId::DEVICE };
                            peer.store(*worker, tier, blocks);
                            peer.remove(*worker, tier, blocks);
                            ops += 2 * blocks.len();
                        }
                        ops
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).sum()
        });
        churn_ops[k] = total as f64 / t0.elapsed().as_secs_f64();
    }

    // 3. Lookups of stored requests (deep matches), alone and with a writer churning.
    let run_lookups = |n: usize| {
        let mut lat = Vec::with_capacity(n);
        let mut sink = 0u64;
        for i in 0..n {
            let (_, blocks) = &load[(i * 7919) % load.len()];
            let t0 = Instant::now();
            sink = sink.wrapping_add(peer.lookup(blocks));
            lat.push(t0.elapsed());
        }
        black_box(sink);
        lat.sort_unstable();
        [pct(&lat, 0.5), pct(&lat, 0.99)]
    };
    let lookup = run_lookups(lookups);
    let stop = std::sync::atomic::AtomicBool::new(false);
    let lookup_busy = std::thread::scope(|s| {
        let writer = s.spawn(|| {
            let mut i = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let (worker, blocks) = &churn[i % churn.len()];
                peer.store(*worker, TierId::HOST, blocks);
                peer.remove(*worker, TierId::HOST, blocks);
                i += 1;
            }
        });
        let r = run_lookups(lookups);
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        writer.join().unwrap();
        r
    });
    Row { name: peer.name(), bytes_per_block, store_ops, churn_ops, lookup, lookup_busy }
}

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn main() {
    let blocks = arg("--blocks", 1_000_000);
    let lookups = arg("--lookups", 20_000);
    let load = workload(blocks, 1);
    let churn = workload(blocks / 10, 2);
    println!(
        "prefix index bench: {} requests, {} block stores, {WORKERS} workers; churn {} requests; {lookups} lookups",
        load.len(),
        load.iter().map(|r| r.1.len()).sum::<usize>(),
        churn.len()
    );
    let only_index = std::env::args().any(|a| a == "--index-only");
    let rows: Vec<Row> = peers()
        .into_iter()
        .filter(|p| !only_index || p.name() == "index")
        .map(|p| measure(p, &load, &churn, lookups))
        .collect();
    println!(
        "{:<10} {:>10} {:>12} {:>12} {:>12} {:>9} {:>9} {:>9} {:>9}",
        "peer", "B/block", "store/s", "churn/s 1t", "churn/s 2t", "p50", "p99", "p50 busy", "p99 busy"
    );
    for r in &rows {
        println!(
            "{:<10} {:>10.1} {:>12.0} {:>12.0} {:>12.0} {:>9.2?} {:>9.2?} {:>9.2?} {:>9.2?}",
            r.name,
            r.bytes_per_block,
            r.store_ops,
            r.churn_ops[0],
            r.churn_ops[1],
            r.lookup[0],
            r.lookup[1],
            r.lookup_busy[0],
            r.lookup_busy[1]
        );
    }
    let (ix, peers) = (&rows[0], &rows[1..]);
    for p in peers {
        let t = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64();
        println!(
            "index vs {}: memory/block x{:.3}, store ops/s x{:.2}, churn ops/s x{:.2} (1t) x{:.2} (2t), lookup p50 x{:.3} p99 x{:.3}, busy p50 x{:.3} p99 x{:.3}",
            p.name,
            ix.bytes_per_block / p.bytes_per_block,
            ix.store_ops / p.store_ops,
            ix.churn_ops[0] / p.churn_ops[0],
            ix.churn_ops[1] / p.churn_ops[1],
            t(ix.lookup[0], p.lookup[0]),
            t(ix.lookup[1], p.lookup[1]),
            t(ix.lookup_busy[0], p.lookup_busy[0]),
            t(ix.lookup_busy[1], p.lookup_busy[1]),
        );
    }
}
