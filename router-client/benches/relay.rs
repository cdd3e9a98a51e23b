//! The relay end to end: sustained ingest, added latency, footprint, resync and recovery, printed
//! as one markdown table with the relay's goals and a same-run peer where one exists.
//!
//! Two engine sides. The drills' mock engine (vLLM 0.32 wire, 2 DP ranks, replay sockets)
//! publishes a realistic mix: the Mooncake conversation trace served by each rank's prefix-cache
//! simulator (stores of the uncached suffix, one removal per evicted block once the cache is
//! full), about 40 block operations a batch and at most about 6,500 batches a second. For the
//! rates the relay's ingest goals name, a [`Cycle`] of payloads encoded once with the test kit's wire
//! encoder goes out through the same mock engine (its seq, PUB socket and replay buffer; not its
//! truth), in two shapes ([`Shape`]): a prefill-heavy vLLM step and SGLang with page size 1. What
//! that publisher offers with nobody relaying is measured first (the peer of those rows).
//!
//! `kv-relay` runs as a separate process (so its RSS and CPU are its own), and subscribers in this
//! process follow it with `kv-router-client`'s admission and prefix index (the calls the follower
//! makes for each message). A direct ZeroMQ subscriber decodes and normalizes the same stream in
//! the same run: the peer for the latency ratio.
//!
//! Run (release; build the relay binary first):
//! ```text
//! cargo build --release --locked -p kv-relay --bins
//! cargo bench --locked -p kv-router-client --bench relay                 # full, ~25 min here
//! KV_RELAY_BENCH_QUICK=1 cargo test --locked -p kv-router-client --bench relay   # CI: about a minute
//! ```
//! Environment: `KV_RELAY_BIN` (the relay binary; default `target/release/kv-relay`, or
//! `target/debug/kv-relay` in quick mode), `KV_RELAY_BENCH_DIR` (where state directories go),
//! `KV_RELAY_BENCH_RUNS` (repetitions of each latency window and resync, default 3),
//! `KV_RELAY_BENCH_WINDOW_MS` (one latency window, default 5,000; longer to profile the relay),
//! `KV_RELAY_BENCH_RATES` (the latency windows' batches/s, comma-separated, instead of the goals'
//! and the searched ones),
//! `KV_RELAY_BENCH_SHAPE` (`prefill` or `page1`: one shape's rows only) and `KV_RELAY_BENCH_SUBS`
//! (`1` or `8`: those rows only), to look at one shape row,
//! `KV_RELAY_BENCH_STEP_MS` (length of one ingest step), `KV_RELAY_MOONCAKE` (the trace; default
//! `testdata/mooncake/conversation_trace.jsonl`),
//! `KV_RELAY_BENCH_ONLY` (comma list of parts: `ingest` the Mooncake ingest search; `publisher`
//! what the pre-encoded publisher offers alone; `shapes` that and the ingest search on both
//! shapes; `latency`; `footprint` the catch-up, the fill to a million live blocks, RSS, bytes on
//! disk, snapshot resync and the commit pause; `recovery` the fill and restarts after SIGKILL and
//! SIGTERM; `floor` the relay beside the transport alone, at the goals' light-load rates).
//!
//! The transport alone (`relay/forwarder.rs`, the `floor` part's peer) is this binary run again
//! as a process of its own: the relay's reading, decoding, normalizing, encoding and serving of
//! each batch with the relay's code and libraries, and no store. Both follow the engine at once,
//! each with an indexing subscriber, so the difference is what the store costs and the
//! transport's own figures are what any relay built this way pays.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kv_relay::normalize::Normalizer;
use kv_relay::wire;
use kv_relay_proto::pb;
use kv_relay_proto::pb::relay_client::RelayClient;
use kv_relay_testkit::client::Sub as ZmqSub;
use kv_relay_testkit::drills::harness::{self, metric, status, RelayProc};
use kv_relay_testkit::engine::MockEngine;
use kv_relay_testkit::traffic::{mooncake_block_tokens, CacheSim, RandomSource, RequestSource};
use kv_relay_testkit::wire::{
    encode_batch, Batch, BlockHash, Engine, EngineEvent, Removed, Stored, TokenIds, WireVersion,
};
use kv_router_client::admission::{ClientEvent, RelayAdmission};
use kv_router_client::index::{IndexConfig, PrefixIndex};

#[path = "relay/forwarder.rs"]
mod forwarder;

#[global_allocator]
static ALLOC: forwarder::BenchAllocator = forwarder::BenchAllocator;

const BLOCK_SIZE: u32 = 16;
const DP: u32 = 2;

struct Opts {
    quick: bool,
    runs: usize,
    step: Duration,
    /// GPU cache capacity per rank, in blocks.
    cache_blocks: usize,
    /// Live blocks for the footprint and snapshot-resync measurements.
    fill_blocks: u64,
    /// History batches for the catch-up measurement, and the relay's history bound there.
    catchup_batches: u64,
    history_batches: u64,
    /// Batches per second offered in the latency measurement.
    latency_rate: f64,
    latency_window: Duration,
    /// The latency windows' rates instead of the goals' and the searched ones (no search).
    rates: Option<Vec<f64>>,
    /// Only this shape's rows (`KV_RELAY_BENCH_SHAPE`).
    shape: Option<String>,
    /// Only the rows with this many subscribers (`KV_RELAY_BENCH_SUBS`).
    subs: Option<usize>,
    dir: PathBuf,
    trace: PathBuf,
    only: Vec<String>,
}

impl Opts {
    fn from_env() -> Opts {
        let quick = std::env::var("KV_RELAY_BENCH_QUICK").is_ok_and(|v| !v.is_empty() && v != "0");
        let env_u = |k: &str, d: u64| std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d);
        let trace = std::env::var("KV_RELAY_MOONCAKE")
            .map(PathBuf::from)
            .unwrap_or_else(|_| kv_relay_testdata::mooncake("conversation_trace.jsonl"));
        Opts {
            quick,
            runs: env_u("KV_RELAY_BENCH_RUNS", if quick { 1 } else { 3 }) as usize,
            step: Duration::from_millis(env_u("KV_RELAY_BENCH_STEP_MS", if quick { 800 } else { 6000 })),
            cache_blocks: if quick { 512 } else { 8192 },
            fill_blocks: if quick { 20_000 } else { 1_000_000 },
            catchup_batches: if quick { 250 } else { 10_000 },
            // A margin above the catch-up: a subscriber leaves a few records before the burst.
            history_batches: if quick { 300 } else { 10_050 },
            latency_rate: if quick { 200.0 } else { 10_000.0 },
            latency_window: Duration::from_millis(env_u("KV_RELAY_BENCH_WINDOW_MS", if quick { 800 } else { 5000 })),
            rates: std::env::var("KV_RELAY_BENCH_RATES").ok().map(|s| {
                s.split(',')
                    .map(|r| r.trim().parse().expect("KV_RELAY_BENCH_RATES: batches/s, comma-separated"))
                    .collect()
            }),
            shape: std::env::var("KV_RELAY_BENCH_SHAPE").ok(),
            subs: std::env::var("KV_RELAY_BENCH_SUBS").ok().map(|v| v.parse().expect("KV_RELAY_BENCH_SUBS: 1 or 8")),
            dir: std::env::var("KV_RELAY_BENCH_DIR").map(PathBuf::from).unwrap_or_else(|_| std::env::temp_dir()),
            trace,
            only: std::env::var("KV_RELAY_BENCH_ONLY")
                .map(|s| s.split(',').map(|x| x.trim().to_string()).collect())
                .unwrap_or_default(),
        }
    }

    fn part(&self, name: &str) -> bool {
        self.only.is_empty() || self.only.iter().any(|o| o == name)
    }
}

fn relay_binary(quick: bool) -> PathBuf {
    if let Ok(p) = std::env::var("KV_RELAY_BIN") {
        return PathBuf::from(p);
    }
    let target = std::env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"));
    target.join(if quick { "debug/kv-relay" } else { "release/kv-relay" })
}

fn wall() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

// ---------------------------------------------------------------------------------------------
// The workload: the Mooncake trace (looped with fresh ids each pass) through per-rank caches.

struct Workload {
    trace: Vec<Vec<u64>>,
    random: Option<RandomSource>,
    next: usize,
    pass: u64,
    sims: Vec<CacheSim>,
    turn: u32,
}

impl Workload {
    fn new(opts: &Opts) -> Workload {
        let trace = std::fs::read_to_string(&opts.trace)
            .ok()
            .map(|text| {
                text.lines()
                    .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                    .map(|v| {
                        v["hash_ids"]
                            .as_array()
                            .map(|a| a.iter().filter_map(|x| x.as_u64()).collect())
                            .unwrap_or_default()
                    })
                    .filter(|ids: &Vec<u64>| !ids.is_empty())
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default();
        let random = trace.is_empty().then(|| RandomSource::new(7, BLOCK_SIZE, 64));
        let sims = (0..DP).map(|_| CacheSim::new(Engine::Vllm, BLOCK_SIZE, opts.cache_blocks)).collect();
        Workload { trace, random, next: 0, pass: 0, sims, turn: 0 }
    }

    fn source(&self) -> &'static str {
        if self.random.is_some() {
            "random prompts (no Mooncake trace found)"
        } else {
            "Mooncake conversation trace"
        }
    }

    fn request(&mut self) -> Vec<Vec<u64>> {
        if let Some(r) = &mut self.random {
            return r.next_request().unwrap_or_default();
        }
        if self.next == self.trace.len() {
            self.next = 0;
            self.pass += 1;
        }
        let ids = &self.trace[self.next];
        self.next += 1;
        let off = self.pass << 40;
        ids.iter().map(|&id| mooncake_block_tokens(id + off, BLOCK_SIZE)).collect()
    }

    /// The next batch: (rank, events, block operations).
    fn batch(&mut self) -> (u32, Vec<EngineEvent>, u64) {
        loop {
            let rank = self.turn % DP;
            self.turn += 1;
            let blocks = self.request();
            let events = self.sims[rank as usize].serve(&blocks);
            if !events.is_empty() {
                let ops = events.iter().map(block_ops).sum();
                return (rank, events, ops);
            }
        }
    }
}

fn block_ops(e: &EngineEvent) -> u64 {
    match e {
        EngineEvent::Stored(s) => s.hashes.len() as u64,
        EngineEvent::Removed(r) => r.hashes.len() as u64,
        EngineEvent::Cleared => 0,
    }
}

/// A publisher thread at an adjustable rate, fed by a generator thread (the Mooncake workload)
/// or by a [`Cycle`] of pre-encoded payloads.
struct Publisher {
    /// Offered batches per second (0: paused; infinite: as fast as it can).
    rate: Arc<Mutex<f64>>,
    published: Arc<AtomicU64>,
    ops: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

type Item = (u32, Vec<EngineEvent>, u64);

/// Where the publisher's batches come from.
enum Feed {
    /// Events from the generator thread, encoded (and applied to the engine's truth) per batch.
    Events(std::sync::mpsc::Receiver<Item>),
    /// Pre-encoded payloads, published without the truth.
    Cycle(Cycle),
}

impl Publisher {
    fn start(engine: Arc<MockEngine>, mut work: Workload) -> Publisher {
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = std::sync::mpsc::sync_channel::<Item>(4096);
        let gen = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if tx.send(work.batch()).is_err() {
                        return;
                    }
                }
            })
        };
        let mut p = Publisher::pace(engine, Feed::Events(rx), stop);
        p.threads.push(gen);
        p
    }

    fn cycle(engine: Arc<MockEngine>, cycle: Cycle) -> Publisher {
        Publisher::pace(engine, Feed::Cycle(cycle), Arc::new(AtomicBool::new(false)))
    }

    fn pace(engine: Arc<MockEngine>, mut feed: Feed, stop: Arc<AtomicBool>) -> Publisher {
        let rate = Arc::new(Mutex::new(0.0f64));
        let published = Arc::new(AtomicU64::new(0));
        let ops = Arc::new(AtomicU64::new(0));
        let publ = {
            let (rate, published, ops, stop) = (rate.clone(), published.clone(), ops.clone(), stop.clone());
            std::thread::spawn(move || {
                let (mut cur, mut since, mut n) = (0.0f64, Instant::now(), 0u64);
                while !stop.load(Ordering::Relaxed) {
                    let r = *rate.lock().expect("rate");
                    if r != cur {
                        (cur, since, n) = (r, Instant::now(), 0);
                    }
                    if cur <= 0.0 {
                        std::thread::sleep(Duration::from_millis(2));
                        continue;
                    }
                    let due = since + Duration::from_secs_f64(n as f64 / cur);
                    let now = Instant::now();
                    if due > now {
                        std::thread::sleep((due - now).min(Duration::from_millis(5)));
                        continue;
                    }
                    let k = match &mut feed {
                        Feed::Events(rx) => {
                            let Ok((rank, events, k)) = rx.recv() else { return };
                            engine.publish(rank, events).expect("publish");
                            k
                        }
                        Feed::Cycle(c) => {
                            let (rank, payload, k) = c.next();
                            engine.publish_untracked(rank, payload).expect("publish");
                            k
                        }
                    };
                    n += 1;
                    published.fetch_add(1, Ordering::Relaxed);
                    ops.fetch_add(k, Ordering::Relaxed);
                }
            })
        };
        Publisher { rate, published, ops, stop, threads: vec![publ] }
    }

    fn set_rate(&self, r: f64) {
        *self.rate.lock().expect("rate") = r;
    }

    fn published(&self) -> u64 {
        self.published.load(Ordering::Relaxed)
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // The pacer first: the generator may be blocked on a full channel until the pacer's exit
        // drops the receiver.
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Pre-encoded cycles: the engine side that offers millions of block operations a second.

/// The batch shapes of the ingest goals' rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shape {
    /// A prefill-heavy vLLM step (0.32 wire): one `BlockStored` of 64-128 blocks of 16 token ids
    /// (chained in the event, no parent) and one `BlockRemoved` of as many hashes.
    Prefill,
    /// SGLang with page size 1 (latest wire): 128 one-block `BlockStored` of one token each, each
    /// the child of the one before, and 128 one-block `BlockRemoved`.
    Page1,
}

impl Shape {
    const ALL: [Shape; 2] = [Shape::Prefill, Shape::Page1];

    fn name(self) -> &'static str {
        match self {
            Shape::Prefill => "vLLM prefill (1 store of 64-128 blocks + 1 removal of as many)",
            Shape::Page1 => "SGLang page size 1 (128 one-block stores + 128 one-block removals)",
        }
    }

    /// The name in the table.
    fn short(self) -> &'static str {
        match self {
            Shape::Prefill => "vLLM prefill, 64-128-block store + removal a batch",
            Shape::Page1 => "SGLang page size 1, 128 + 128 one-block events a batch",
        }
    }

    /// Its name for `KV_RELAY_BENCH_SHAPE`.
    fn key(self) -> &'static str {
        match self {
            Shape::Prefill => "prefill",
            Shape::Page1 => "page1",
        }
    }

    fn wire(self) -> WireVersion {
        match self {
            Shape::Prefill => WireVersion::parse(Engine::Vllm, "0.32").expect("wire"),
            Shape::Page1 => WireVersion::latest(Engine::Sglang),
        }
    }

    /// Blocks stored by batch `i` of the cycle.
    fn stores(self, i: usize) -> usize {
        match self {
            Shape::Prefill => 64 + (i * 29) % 65,
            Shape::Page1 => 128,
        }
    }
}

/// Batches in one pass of a cycle per rank (L), and how many batches later a batch's blocks are
/// removed (D): about 6,200 live blocks a rank for the prefill shape, 8,192 for page size 1.
fn cycle_geometry(opts: &Opts) -> (usize, usize) {
    if opts.quick {
        (32, 8)
    } else {
        (256, 64)
    }
}

/// A vLLM store of a fresh prefix (no parent) of `BLOCK_SIZE`-token blocks on the GPU.
fn vllm_prefix(hashes: Vec<BlockHash>, tokens: Vec<u64>) -> EngineEvent {
    EngineEvent::Stored(Stored {
        hashes,
        parent: None,
        token_ids: TokenIds::Single(tokens),
        block_size: BLOCK_SIZE,
        medium: Some("GPU".into()),
        group_idx: Some(0),
        kind: Some("full_attention".into()),
        ..Default::default()
    })
}

fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// A state-consistent loop of pre-encoded batches per rank, encoded once with the test kit's wire
/// encoder: batch i of a pass stores `shape.stores(i)` fresh hashes and removes (tail first) the
/// hashes batch i - D stored (mod L), so the live set stays about K*D blocks a rank and every
/// removal hits a live block. The first pass's first D batches are store-only variants (nothing
/// to remove yet); SGLang's first batch carries `AllBlocksCleared` in front, as the engine's does.
/// Each send copies the payload and writes the current time into its `ts` (a float64 at bytes
/// 2..10); the seq frame is the rank publisher's, which also keeps the batch for replay.
struct Cycle {
    ranks: u32,
    shape: Shape,
    lag: usize,
    len: usize,
    /// Per rank: the first pass's first D batches, then the L batches of every pass; (payload,
    /// block operations).
    prelude: Vec<Vec<(Vec<u8>, u64)>>,
    pass: Vec<Vec<(Vec<u8>, u64)>>,
    sent: Vec<usize>,
    turn: u32,
}

impl Cycle {
    fn new(shape: Shape, ranks: u32, (len, lag): (usize, usize)) -> Cycle {
        assert!(lag < len, "a batch's blocks are removed within the pass");
        let wire = shape.wire();
        let hash = |rank: u32, i: usize, j: usize| splitmix64((u64::from(rank) << 48) ^ ((i as u64) << 16) ^ j as u64);
        let block_hash = |h: u64| match shape {
            Shape::Prefill => BlockHash::U64(h),
            Shape::Page1 => BlockHash::I64(h as i64),
        };
        let (mut prelude, mut pass) = (Vec::new(), Vec::new());
        for rank in 0..ranks {
            let (mut pre, mut cyc) = (Vec::new(), Vec::new());
            for i in 0..len {
                let stored: Vec<u64> = (0..shape.stores(i)).map(|j| hash(rank, i, j)).collect();
                let gone = (i + len - lag) % len;
                // Leaves first, as the engines evict: the chain's tail to its head.
                let removed: Vec<u64> = (0..shape.stores(gone)).rev().map(|j| hash(rank, gone, j)).collect();
                let (stores, removals) = match shape {
                    Shape::Prefill => {
                        let tokens = stored
                            .iter()
                            .flat_map(|&h| (0..u64::from(BLOCK_SIZE)).map(move |t| 1 + splitmix64(h ^ t) % 32_000))
                            .collect();
                        let store = vllm_prefix(stored.iter().map(|&h| block_hash(h)).collect(), tokens);
                        let removal = EngineEvent::Removed(Removed {
                            hashes: removed.iter().map(|&h| block_hash(h)).collect(),
                            medium: Some("GPU".into()),
                            group_idx: Some(0),
                            ..Default::default()
                        });
                        (vec![store], vec![removal])
                    }
                    Shape::Page1 => {
                        let stores = stored
                            .iter()
                            .enumerate()
                            .map(|(j, &h)| {
                                EngineEvent::Stored(Stored {
                                    hashes: vec![block_hash(h)],
                                    parent: j.checked_sub(1).map(|p| block_hash(stored[p])),
                                    token_ids: TokenIds::Single(vec![1 + splitmix64(h) % 32_000]),
                                    block_size: 1,
                                    medium: Some("GPU".into()),
                                    ..Default::default()
                                })
                            })
                            .collect();
                        let removals = removed
                            .iter()
                            .map(|&h| {
                                EngineEvent::Removed(Removed {
                                    hashes: vec![block_hash(h)],
                                    medium: Some("GPU".into()),
                                    ..Default::default()
                                })
                            })
                            .collect();
                        (stores, removals)
                    }
                };
                let clear = (i == 0 && wire.clears_on_start()).then_some(EngineEvent::Cleared);
                let encode = |events: Vec<EngineEvent>| {
                    let p = encode_batch(&wire, &Batch { ts: 0.0, events, dp_rank: Some(rank) });
                    assert_eq!(p[1], 0xcb, "a batch starts with its ts as a float64");
                    p
                };
                if i < lag {
                    let events: Vec<EngineEvent> = clear.into_iter().chain(stores.iter().cloned()).collect();
                    pre.push((encode(events), stored.len() as u64));
                }
                let events: Vec<EngineEvent> = removals.into_iter().chain(stores).collect();
                cyc.push((encode(events), (stored.len() + removed.len()) as u64));
            }
            prelude.push(pre);
            pass.push(cyc);
        }
        Cycle { ranks, shape, lag, len, prelude, pass, sent: vec![0; ranks as usize], turn: 0 }
    }

    /// Live blocks on every rank once the prelude is out.
    fn live_blocks(&self) -> u64 {
        let per_rank: usize = (self.len - self.lag..self.len).map(|i| self.shape.stores(i)).sum();
        per_rank as u64 * u64::from(self.ranks)
    }

    fn ops_per_batch(&self) -> f64 {
        let (n, ops) = self.pass.iter().flatten().fold((0u64, 0u64), |(n, o), (_, k)| (n + 1, o + k));
        ops as f64 / n as f64
    }

    fn bytes_per_batch(&self) -> f64 {
        let (n, b) = self.pass.iter().flatten().fold((0usize, 0usize), |(n, b), (p, _)| (n + 1, b + p.len()));
        b as f64 / n as f64
    }

    /// The next batch: (rank, payload stamped with the current time, block operations).
    fn next(&mut self) -> (u32, Vec<u8>, u64) {
        let rank = self.turn % self.ranks;
        self.turn = self.turn.wrapping_add(1);
        let n = self.sent[rank as usize];
        self.sent[rank as usize] += 1;
        let (p, ops) =
            if n < self.lag { &self.prelude[rank as usize][n] } else { &self.pass[rank as usize][n % self.len] };
        let mut out = p.clone();
        out[2..10].copy_from_slice(&wall().to_be_bytes());
        (rank, out, *ops)
    }
}

// ---------------------------------------------------------------------------------------------
// Subscribers: the router client's admission and prefix index, fed by a Subscribe stream.

#[derive(Default)]
struct SubShared {
    cursor: AtomicU64,
    batches: AtomicU64,
    snapshots: AtomicU64,
    /// Subscribe streams opened.
    sessions: AtomicU64,
    record: AtomicBool,
    /// Engine publish → applied, ms.
    latencies: Mutex<Vec<f32>>,
    errors: Mutex<Vec<String>>,
}

struct SubState {
    admission: RelayAdmission,
    index: PrefixIndex,
}

struct Sub {
    shared: Arc<SubShared>,
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<SubState>,
}

impl Sub {
    fn start(rt: &tokio::runtime::Handle, url: &str, state: Option<SubState>) -> Sub {
        let shared = Arc::new(SubShared::default());
        let state = state.unwrap_or_else(|| SubState {
            admission: RelayAdmission::new(url.to_string()),
            index: PrefixIndex::new(IndexConfig::default()),
        });
        shared.cursor.store(state.admission.position().cursor, Ordering::Relaxed);
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let task = rt.spawn(follow(url.to_string(), state, shared.clone(), stopped));
        Sub { shared, stop, task }
    }

    /// A subscriber that only reads its stream and counts batches: the relay does the same work
    /// for it as for an indexing one, this process much less (the extra subscribers of the shape
    /// rows, where eight indexes would bound the bench, not the relay). It decodes each message
    /// as [`ThinResponse`]: the batch's cursor, every other field skipped unread.
    fn start_counting(rt: &tokio::runtime::Handle, url: &str) -> Sub {
        let shared = Arc::new(SubShared::default());
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let task = rt.spawn(count(url.to_string(), shared.clone(), stopped));
        Sub { shared, stop, task }
    }

    fn cursor(&self) -> u64 {
        self.shared.cursor.load(Ordering::Relaxed)
    }

    fn finish(self, rt: &tokio::runtime::Runtime) -> SubState {
        let _ = self.stop.send(true);
        rt.block_on(self.task).expect("subscriber task")
    }
}

async fn follow(
    url: String,
    mut st: SubState,
    sh: Arc<SubShared>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> SubState {
    loop {
        if *stop.borrow() {
            return st;
        }
        if let Err(e) = session(&url, &mut st, &sh, &mut stop).await {
            sh.errors.lock().expect("errors").push(e);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// The largest message a subscriber of this bench decodes.
const MAX_MESSAGE: usize = 64 << 20;

async fn channel(url: &str) -> Result<tonic::transport::Channel, String> {
    tonic::transport::Endpoint::from_shared(url.to_string())
        .map_err(|e| e.to_string())?
        .connect()
        .await
        .map_err(|e| e.to_string())
}

async fn connect(url: &str) -> Result<RelayClient<tonic::transport::Channel>, String> {
    Ok(RelayClient::new(channel(url).await?).max_decoding_message_size(MAX_MESSAGE))
}

async fn session(
    url: &str,
    st: &mut SubState,
    sh: &SubShared,
    stop: &mut tokio::sync::watch::Receiver<bool>,
) -> Result<(), String> {
    let mut client = connect(url).await?;
    let s = client.status(pb::StatusRequest {}).await.map_err(|e| e.to_string())?;
    st.admission.apply_status(s.get_ref(), &st.index);
    let req = st.admission.subscribe_request(true);
    let mut stream = client.subscribe(req).await.map_err(|e| e.to_string())?.into_inner();
    sh.sessions.fetch_add(1, Ordering::Relaxed);
    let mut events: Vec<ClientEvent> = Vec::new();
    loop {
        let msg = tokio::select! {
            biased;
            _ = stop.changed() => return Ok(()),
            m = stream.message() => m.map_err(|e| e.to_string())?.ok_or("stream ended")?,
        };
        let ts = match &msg.message {
            Some(pb::subscribe_response::Message::Batch(b)) => Some(b.engine_ts),
            _ => None,
        };
        let before = st.admission.position().cursor;
        let verdict = st.admission.apply(msg, &st.index, tokio::time::Instant::now(), &mut events);
        if let Some(ts) = ts {
            if sh.record.load(Ordering::Relaxed) {
                let ms = ((wall() - ts) * 1000.0) as f32;
                sh.latencies.lock().expect("latencies").push(ms);
            }
            sh.batches.fetch_add(1, Ordering::Relaxed);
        }
        for e in events.drain(..) {
            if let ClientEvent::SnapshotApplied { cursor, .. } = e {
                sh.snapshots.fetch_add(1, Ordering::Relaxed);
                // The records the snapshot stands for count as applied: the relay's records here
                // are batches (a control record, if any, would count as one too), so a subscriber
                // that was told to resync can drain again and the next steps are measured.
                sh.batches.fetch_add(cursor.saturating_sub(before), Ordering::Relaxed);
            }
        }
        sh.cursor.store(st.admission.position().cursor, Ordering::Relaxed);
        if let kv_router_client::Verdict::Resume(why) = verdict {
            return Err(why);
        }
    }
}

async fn count(url: String, sh: Arc<SubShared>, mut stop: tokio::sync::watch::Receiver<bool>) -> SubState {
    let mut after = 0u64;
    while !*stop.borrow() {
        if let Err(e) = count_session(&url, &sh, &mut stop, &mut after).await {
            sh.errors.lock().expect("errors").push(e);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    SubState { admission: RelayAdmission::new(url), index: PrefixIndex::new(IndexConfig::default()) }
}

/// A `SubscribeResponse` as a counting subscriber reads it: a batch's cursor (the contract's
/// tags: `batch = 1` in the response, `cursor = 1` in the batch) and a snapshot end's; prost
/// skips the rest.
#[derive(Clone, PartialEq, prost::Message)]
struct ThinResponse {
    #[prost(message, optional, tag = "1")]
    batch: Option<ThinBatch>,
    /// A snapshot's end (`snapshot_end = 6`, its `cursor = 1`), after a resync.
    #[prost(message, optional, tag = "6")]
    snapshot_end: Option<ThinBatch>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct ThinBatch {
    #[prost(uint64, tag = "1")]
    cursor: u64,
}

async fn count_session(
    url: &str,
    sh: &SubShared,
    stop: &mut tokio::sync::watch::Receiver<bool>,
    after: &mut u64,
) -> Result<(), String> {
    let mut grpc = tonic::client::Grpc::new(channel(url).await?).max_decoding_message_size(MAX_MESSAGE);
    grpc.ready().await.map_err(|e| e.to_string())?;
    let req = pb::SubscribeRequest { after_cursor: *after, allow_snapshot: true, ..Default::default() };
    let codec = tonic_prost::ProstCodec::<pb::SubscribeRequest, ThinResponse>::default();
    let path = tonic::codegen::http::uri::PathAndQuery::from_static("/kv_relay.v1.Relay/Subscribe");
    let mut stream =
        grpc.server_streaming(tonic::Request::new(req), path, codec).await.map_err(|e| e.to_string())?.into_inner();
    sh.sessions.fetch_add(1, Ordering::Relaxed);
    loop {
        let msg = tokio::select! {
            biased;
            _ = stop.changed() => return Ok(()),
            m = stream.message() => m.map_err(|e| e.to_string())?.ok_or("stream ended")?,
        };
        if let Some(b) = &msg.batch {
            *after = b.cursor;
            sh.cursor.store(b.cursor, Ordering::Relaxed);
            sh.batches.fetch_add(1, Ordering::Relaxed);
        } else if let Some(e) = &msg.snapshot_end {
            // After a resync: the records the snapshot stands for count as received, as for an
            // indexing subscriber.
            sh.batches.fetch_add(e.cursor.saturating_sub(*after), Ordering::Relaxed);
            *after = e.cursor;
            sh.cursor.store(e.cursor, Ordering::Relaxed);
        }
    }
}

/// The peer: a ZeroMQ SUB on every rank that decodes and normalizes each batch.
struct Direct {
    record: Arc<AtomicBool>,
    latencies: Arc<Mutex<Vec<f32>>>,
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Direct {
    fn start(engine: &MockEngine) -> Direct {
        let record = Arc::new(AtomicBool::new(false));
        let latencies = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        for ep in engine.endpoints() {
            let sock = ZmqSub::connect(engine.context(), &ep.publisher).expect("SUB");
            let (record, latencies, stop) = (record.clone(), latencies.clone(), stop.clone());
            threads.push(std::thread::spawn(move || {
                let mut norm = Normalizer::new();
                while !stop.load(Ordering::Relaxed) {
                    let Some(m) = sock.recv_raw(Duration::from_millis(50)) else { continue };
                    let refs: Vec<&[u8]> = m.frames.iter().map(Vec::as_slice).collect();
                    let Ok(f) = wire::split_pub(&refs) else { continue };
                    let seq = f.seq;
                    let Ok(raw) = wire::decode_batch(f.payload) else { continue };
                    let ts = raw.ts;
                    let n = norm.normalize(raw.dp_rank.unwrap_or(ep.rank), seq, raw);
                    std::hint::black_box(&n);
                    if record.load(Ordering::Relaxed) {
                        latencies.lock().expect("latencies").push(((wall() - ts) * 1000.0) as f32);
                    }
                }
            }));
        }
        Direct { record, latencies, stop, threads }
    }
}

impl Drop for Direct {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The relay process, the engine, measurements.

struct Setup {
    engine: Arc<MockEngine>,
    relay: RelayProc,
    _dir: tempfile::TempDir,
}

fn setup(opts: &Opts, cores: Option<&str>, extra: &[&str]) -> Setup {
    setup_on(opts, Shape::Prefill.wire(), cores, extra)
}

fn setup_on(opts: &Opts, wire: WireVersion, cores: Option<&str>, extra: &[&str]) -> Setup {
    // vLLM 0.32 wire (or `wire`), replay sockets, `/metrics` scraped by the relay; 10,000 batches
    // buffered.
    let engine = harness::engine_on(wire, DP, 10_000);
    let dir = tempfile::Builder::new().prefix("kv-relay-bench").tempdir_in(&opts.dir).expect("state dir");
    let state = dir.path().join("state");
    let log = dir.path().join("relay.log");
    let mut args = vec!["--server-rate-per-second", "1000", "--server-rate-burst", "1000"];
    args.extend_from_slice(extra);
    let relay = RelayProc::start(&engine, &state, &log, &args);
    if let Some(c) = cores {
        pin(relay.pid().expect("pid"), c);
    }
    Setup { engine, relay, _dir: dir }
}

/// Sets the CPU affinity of every thread of `pid` (`taskset -a -p -c`).
fn pin(pid: u32, cores: &str) {
    let ok = std::process::Command::new("taskset")
        .args(["-a", "-p", "-c", cores, &pid.to_string()])
        .stdout(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "taskset -a -p -c {cores} {pid} failed");
}

/// utime + stime of a process, in seconds.
fn cpu_seconds(pid: u32) -> f64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = s.rsplit_once(')').map(|x| x.1).unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // After the command: state is field 0, utime 11, stime 12. Clock ticks are 100 per second on Linux.
    (ticks(11) + ticks(12)) / 100.0
}

fn dir_bytes(p: &Path) -> u64 {
    let mut n = 0;
    if let Ok(rd) = std::fs::read_dir(p) {
        for e in rd.flatten() {
            let Ok(m) = e.metadata() else { continue };
            n += if m.is_dir() { dir_bytes(&e.path()) } else { m.len() };
        }
    }
    n
}

/// `1234567.8` as `1,234,568`.
fn th(x: f64) -> String {
    if !x.is_finite() {
        return format!("{x}");
    }
    let digits = format!("{:.0}", x.abs());
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    if x < -0.5 {
        out.insert(0, '-');
    }
    out
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn pct(v: &mut [f32], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f32::total_cmp);
    f64::from(v[((v.len() as f64 * p) as usize).min(v.len() - 1)])
}

/// The relay's newest cursor and the engine's last seq per rank it has committed.
fn relay_position(url: &str) -> (u64, Vec<u64>) {
    match status(url) {
        Ok(s) => (s.newest_cursor, s.ranks.iter().map(|r| r.last_engine_seq).collect()),
        Err(_) => (0, vec![]),
    }
}

/// Waits until every subscriber has applied everything published; the time it took, or None.
fn drain(pubr: &Publisher, subs: &[Sub], limit: Duration) -> Option<Duration> {
    let target = pubr.published();
    let t = Instant::now();
    loop {
        if subs.iter().all(|s| s.shared.batches.load(Ordering::Relaxed) >= target) {
            return Some(t.elapsed());
        }
        if t.elapsed() > limit {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn min_applied(subs: &[Sub]) -> u64 {
    subs.iter().map(|s| s.shared.batches.load(Ordering::Relaxed)).min().unwrap_or(0)
}

struct Step {
    offered: f64,
    batches_s: f64,
    ops_s: f64,
    backlog_mid: u64,
    backlog_end: u64,
    drain: Option<Duration>,
    relay_cpu: f64,
    /// This process's CPU (engine, publisher, subscribers), in cores.
    bench_cpu: f64,
    /// Streams the subscribers opened again during the step (resyncs).
    resynced: u64,
    stable: bool,
}

fn run_step(s: &Setup, pubr: &Publisher, subs: &[Sub], rate: f64, len: Duration) -> Step {
    let (pid, me) = (s.relay.pid().expect("pid"), std::process::id());
    let sessions = || subs.iter().map(|s| s.shared.sessions.load(Ordering::Relaxed)).sum::<u64>();
    let sessions0 = sessions();
    let (p0, o0, c0, b0, t0) =
        (pubr.published(), pubr.ops.load(Ordering::Relaxed), cpu_seconds(pid), cpu_seconds(me), Instant::now());
    pubr.set_rate(rate);
    std::thread::sleep(len / 2);
    let backlog_mid = pubr.published().saturating_sub(min_applied(subs));
    std::thread::sleep(len / 2);
    let (p1, o1, c1, b1, el) =
        (pubr.published(), pubr.ops.load(Ordering::Relaxed), cpu_seconds(pid), cpu_seconds(me), t0.elapsed());
    let backlog_end = p1.saturating_sub(min_applied(subs));
    pubr.set_rate(0.0);
    let d = drain(pubr, subs, Duration::from_secs(60));
    let secs = el.as_secs_f64();
    let batches_s = (p1 - p0) as f64 / secs;
    // Stable: the engine published what was offered, the backlog did not grow from the middle of
    // the step to its end (beyond a quarter second of batches), it drained within a second, and
    // no subscriber had to open a new stream (a resync after falling behind the history).
    let resynced = sessions() - sessions0;
    let stable = batches_s >= 0.93 * rate
        && backlog_end <= backlog_mid + (rate / 4.0) as u64
        && d.is_some_and(|d| d < Duration::from_secs(1))
        && resynced == 0;
    Step {
        offered: rate,
        batches_s,
        ops_s: (o1 - o0) as f64 / secs,
        backlog_mid,
        backlog_end,
        drain: d,
        relay_cpu: (c1 - c0) / secs,
        bench_cpu: (b1 - b0) / secs,
        resynced,
        stable,
    }
}

fn print_step(st: &Step) {
    println!(
        "  offered {:>7.0} b/s  published {:>7.0} b/s  {:>8.0} ops/s  backlog mid {:>6} end {:>6}  drain {:>8}  relay cpu {:>4.2}  cpu/1k b/s {:>5.3}  bench cpu {:>4.2}  {}",
        st.offered,
        st.batches_s,
        st.ops_s,
        st.backlog_mid,
        st.backlog_end,
        st.drain.map_or("none".to_string(), |d| format!("{:.0}ms", d.as_secs_f64() * 1000.0)),
        st.relay_cpu,
        st.relay_cpu / (st.batches_s / 1000.0),
        st.bench_cpu,
        if st.stable {
            "stable".to_string()
        } else if st.resynced > 0 {
            format!("LAG GROWS ({} resynced)", st.resynced)
        } else {
            "LAG GROWS".to_string()
        }
    );
}

/// How [`search`] steps the offered rate.
struct Ramp {
    start: f64,
    factor: f64,
    max_steps: usize,
    /// Geometric midpoints tried between the last stable and the first unstable rate.
    refine: usize,
    /// Steps down (by `factor`) from an unstable first step, looking for a stable one.
    down: usize,
}

impl Ramp {
    /// The Mooncake rows': x1.4 from 200 batches/s, one midpoint.
    fn mooncake(opts: &Opts) -> Ramp {
        Ramp {
            start: if opts.quick { 100.0 } else { 200.0 },
            factor: 1.4,
            max_steps: if opts.quick { 2 } else { 14 },
            refine: 1,
            down: 0,
        }
    }
}

/// Steps the offered rate up until lag grows (or down from an unstable start until it holds),
/// then tries midpoints between the last stable and the first unstable rate. Returns the highest
/// stable step.
fn search(opts: &Opts, s: &Setup, pubr: &Publisher, subs: &[Sub], ramp: &Ramp) -> Option<Step> {
    let mut best: Option<Step> = None;
    let mut rate = ramp.start;
    let mut failed: Option<f64> = None;
    let mut down = 0;
    for _ in 0..ramp.max_steps {
        let st = run_step(s, pubr, subs, rate, opts.step);
        print_step(&st);
        if !st.stable {
            failed = Some(failed.map_or(rate, |f| f.min(rate)));
            if best.is_none() && down < ramp.down {
                down += 1;
                rate /= ramp.factor;
                continue;
            }
            break;
        }
        best = Some(st);
        if failed.is_some() {
            break; // stable below the first unstable start
        }
        rate *= ramp.factor;
    }
    for _ in 0..ramp.refine {
        let (Some(hi), Some(lo)) = (failed, best.as_ref().map(|b| b.offered)) else { break };
        let mid = (hi * lo).sqrt();
        let st = run_step(s, pubr, subs, mid, opts.step);
        print_step(&st);
        if st.stable {
            best = Some(st);
        } else {
            failed = Some(mid);
        }
    }
    best
}

fn ingest(opts: &Opts, rt: &tokio::runtime::Runtime, cores: Option<&str>, nsubs: usize) -> Option<Step> {
    let s = setup(opts, cores, &[]);
    if cores.is_some() {
        // This process (engine, subscribers) on the other core.
        pin(std::process::id(), "1");
    }
    let url = s.relay.url();
    let subs: Vec<Sub> = (0..nsubs).map(|_| Sub::start(rt.handle(), &url, None)).collect();
    let pubr = Publisher::start(s.engine.clone(), Workload::new(opts));
    // Warm up: fill the caches so removals flow too.
    let warm = if opts.quick { 400.0 } else { 2.0 * opts.cache_blocks as f64 * f64::from(DP) / 8.0 };
    pubr.set_rate(if opts.quick { 400.0 } else { 600.0 });
    while (pubr.published() as f64) < warm {
        std::thread::sleep(Duration::from_millis(20));
    }
    pubr.set_rate(0.0);
    drain(&pubr, &subs, Duration::from_secs(60));
    println!(
        "ingest: relay on {}, {} subscriber(s), load average {}",
        cores.map_or("both cores".to_string(), |c| format!("core {c}, this process on core 1")),
        nsubs,
        loadavg()
    );
    let best = search(opts, &s, &pubr, &subs, &Ramp::mooncake(opts));
    commit_breakdown(&s);
    if cores.is_some() {
        pin(std::process::id(), "0,1");
    }
    drop(pubr);
    for sub in subs {
        sub.finish(rt);
    }
    best
}

/// What the pre-encoded publisher offers with nobody relaying: this process on core 1 (the side
/// the relay's ingest search leaves it), as fast as it can for a while, a counting SUB per rank
/// on core 0 (where the relay would be). In quick mode, unpinned and briefly.
struct Offer {
    batches_s: f64,
    ops_s: f64,
    /// Batches the sinks received, per batch published (PUB drops past its high-water mark).
    received: f64,
    bench_cpu: f64,
}

fn publisher_alone(opts: &Opts, shape: Shape) -> Offer {
    let engine = harness::engine_on(shape.wire(), DP, 10_000);
    if !opts.quick {
        pin(std::process::id(), "1");
    }
    let stop = Arc::new(AtomicBool::new(false));
    let received = Arc::new(AtomicU64::new(0));
    let ready = Arc::new(AtomicU64::new(0));
    let sinks: Vec<_> = engine
        .endpoints()
        .into_iter()
        .map(|ep| {
            let (stop, received, ready, pin_it) = (stop.clone(), received.clone(), ready.clone(), !opts.quick);
            let ctx_like = engine.context().clone();
            std::thread::spawn(move || {
                if pin_it {
                    pin_this_thread("0");
                }
                // A zmq context of its own (the engine's type, made anew) whose I/O thread starts
                // on this thread's core, with the socket.
                let ctx = fresh(&ctx_like);
                let sock = ZmqSub::connect(&ctx, &ep.publisher).expect("SUB");
                ready.fetch_add(1, Ordering::Relaxed);
                while !stop.load(Ordering::Relaxed) {
                    if sock.recv_raw(Duration::from_millis(50)).is_some() {
                        received.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    while ready.load(Ordering::Relaxed) < u64::from(DP) {
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(300)); // the subscriptions reach the PUBs
    let pubr = Publisher::cycle(engine.clone(), Cycle::new(shape, DP, cycle_geometry(opts)));
    let window = if opts.quick { Duration::from_millis(500) } else { Duration::from_secs(3) };
    let me = std::process::id();
    let (b0, t0) = (cpu_seconds(me), Instant::now());
    pubr.set_rate(f64::INFINITY);
    std::thread::sleep(window);
    let (p, o, b1, el) = (pubr.published(), pubr.ops.load(Ordering::Relaxed), cpu_seconds(me), t0.elapsed());
    pubr.set_rate(0.0);
    let all = pubr.published(); // the window's and the few after it
    drop(pubr);
    engine.flush().expect("flush");
    std::thread::sleep(Duration::from_millis(200));
    stop.store(true, Ordering::Relaxed);
    for t in sinks {
        let _ = t.join();
    }
    if !opts.quick {
        pin(me, "0,1");
    }
    let secs = el.as_secs_f64();
    Offer {
        batches_s: p as f64 / secs,
        ops_s: o as f64 / secs,
        received: received.load(Ordering::Relaxed) as f64 / all.max(1) as f64,
        bench_cpu: (b1 - b0) / secs,
    }
}

/// A new value of `T`'s type (a zmq context without naming the crate).
fn fresh<T: Default>(_: &T) -> T {
    T::default()
}

/// Pins the calling thread (`taskset -p -c` on its thread id); threads it starts inherit it.
fn pin_this_thread(cores: &str) {
    let link = std::fs::read_link("/proc/thread-self").expect("/proc/thread-self");
    let tid: u32 = link
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.parse().ok())
        .expect("a thread id in /proc/thread-self");
    pin(tid, cores);
}

/// The ingest search on a pre-encoded shape. The first subscriber applies the stream to an index
/// as the Mooncake rows' do; the others only count (see [`Sub::start_counting`]).
fn ingest_shape(
    opts: &Opts,
    rt: &tokio::runtime::Runtime,
    shape: Shape,
    cores: Option<&str>,
    nsubs: usize,
) -> Option<Step> {
    let s = setup_on(opts, shape.wire(), cores, &[]);
    if cores.is_some() {
        pin(std::process::id(), "1");
    }
    let url = s.relay.url();
    let subs: Vec<Sub> = (0..nsubs)
        .map(|i| if i == 0 { Sub::start(rt.handle(), &url, None) } else { Sub::start_counting(rt.handle(), &url) })
        .collect();
    let cycle = Cycle::new(shape, DP, cycle_geometry(opts));
    let (per_batch, live) = (cycle.ops_per_batch(), cycle.live_blocks());
    let pubr = Publisher::cycle(s.engine.clone(), cycle);
    // Warm up: one whole pass and its prelude on every rank, so that removals flow and the live
    // set is at its size.
    let warm = ((cycle_geometry(opts).0 + cycle_geometry(opts).1) as u64) * u64::from(DP);
    pubr.set_rate(if opts.quick { 1000.0 } else { 500.0 });
    while pubr.published() < warm {
        std::thread::sleep(Duration::from_millis(20));
    }
    pubr.set_rate(0.0);
    drain(&pubr, &subs, Duration::from_secs(120));
    let relay_live = status(&url).ok().and_then(|st| st.counters.get("live_blocks").copied()).unwrap_or(0);
    println!(
        "ingest, {}: relay on {}, {nsubs} subscriber(s) (1 indexing), {per_batch:.1} block ops a batch, live blocks {relay_live} (cycle's {live}), load average {}",
        shape.name(),
        cores.map_or("both cores".to_string(), |c| format!("core {c}, this process on core 1")),
        loadavg()
    );
    // From about 30,000 block operations a second (5,000 in quick mode), x1.6 a step.
    let ramp = Ramp {
        start: (if opts.quick { 5_000.0 } else { 30_000.0 } / per_batch).max(10.0),
        factor: 1.6,
        max_steps: if opts.quick { 2 } else { 16 },
        refine: if opts.quick { 0 } else { 2 },
        down: if opts.quick { 0 } else { 3 },
    };
    let best = search(opts, &s, &pubr, &subs, &ramp);
    commit_breakdown(&s);
    if cores.is_some() {
        pin(std::process::id(), "0,1");
    }
    drop(pubr);
    finish_all(subs, rt);
    best
}

/// Stops the subscribers, printing the errors their streams ended with.
fn finish_all(subs: impl IntoIterator<Item = Sub>, rt: &tokio::runtime::Runtime) {
    for sub in subs {
        let errors = sub.shared.errors.lock().expect("errors").clone();
        if !errors.is_empty() {
            println!("  subscriber errors: {errors:?}");
        }
        sub.finish(rt);
    }
}

/// Where the relay's time went: its commit histograms against its CPU time so far.
fn commit_breakdown(s: &Setup) {
    let m = s.relay.metrics_text();
    let get = |n: &str| metric(&m, n, &[]).unwrap_or(f64::NAN);
    let (secs, n, records) = (
        get("kv_relay_commit_seconds_sum"),
        get("kv_relay_commit_seconds_count"),
        get("kv_relay_commit_group_records_sum"),
    );
    let cpu = cpu_seconds(s.relay.pid().expect("pid"));
    println!(
        "  relay so far: {n:.0} commits of {:.1} records on average, {:.2} ms each ({:.3} ms per record); {secs:.1} s in commits, {cpu:.1} s of CPU",
        records / n,
        secs / n * 1000.0,
        secs / records * 1000.0,
    );
}

// ---------------------------------------------------------------------------------------------

fn main() {
    if let Ok(spec) = std::env::var(forwarder::ENV) {
        forwarder::main(&spec);
        return;
    }
    // `cargo test --bench relay` passes libtest flags; there is nothing to filter.
    let opts = Opts::from_env();
    let bin = relay_binary(opts.quick);
    assert!(bin.exists(), "{} not found: build it (cargo build --release --locked -p kv-relay --bins)", bin.display());
    std::env::set_var("KV_RELAY_BIN", &bin);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    println!(
        "kv-relay end to end ({} mode): relay {}, workload {}, load average {}",
        if opts.quick { "quick" } else { "full" },
        bin.display(),
        Workload::new(&opts).source(),
        loadavg()
    );

    let mut table = Table::default();
    if opts.part("ingest") {
        let configs: &[(Option<&str>, usize)] =
            if opts.quick { &[(None, 1), (None, 8)] } else { &[(None, 1), (None, 8), (Some("0"), 1), (Some("0"), 8)] };
        for &(cores, nsubs) in configs {
            let label = format!("{}, {} subscriber(s)", cores.map_or("2 cores", |_| "1 core"), nsubs);
            let value = match ingest(&opts, &rt, cores, nsubs) {
                Some(b) => {
                    println!("  => highest stable: {:.0} batches/s, {:.0} block ops/s", b.batches_s, b.ops_s);
                    format!(
                        "{} block ops/s ({} batches/s, {:.1} ops/batch), relay CPU {:.2} cores",
                        th(b.ops_s),
                        th(b.batches_s),
                        b.ops_s / b.batches_s,
                        b.relay_cpu
                    )
                }
                None => "no stable step".into(),
            };
            table.row(format!("sustained ingest, Mooncake, {label}"), value, "", "(goals: the shape rows)");
        }
    }
    if opts.part("shapes") || opts.part("publisher") {
        shapes(&opts, &rt, &mut table);
    }
    if opts.part("latency") || opts.part("footprint") || opts.part("recovery") {
        footprint_latency_resync(&opts, &rt, &mut table);
    }
    if opts.part("floor") {
        floor(&opts, &rt, &mut table);
    }
    println!(
        "\nsummary ({} mode, relay {}, load average {}):\n",
        if opts.quick { "quick" } else { "full" },
        bin.display(),
        loadavg()
    );
    table.print();
}

/// The results as one markdown table: each measure with its same-run peer and its goal.
#[derive(Default)]
struct Table(Vec<[String; 4]>);

impl Table {
    fn row(&mut self, measure: impl Into<String>, value: impl Into<String>, peer: impl Into<String>, goal: &str) {
        self.0.push([measure.into(), value.into(), peer.into(), goal.to_string()]);
    }

    fn print(&self) {
        println!("| measure | this run | same-run peer | goal |");
        println!("|---|---|---|---|");
        for r in &self.0 {
            let cell = |s: &str| if s.is_empty() { "-".to_string() } else { s.replace('|', "/") };
            println!("| {} | {} | {} | {} |", cell(&r[0]), cell(&r[1]), cell(&r[2]), cell(&r[3]));
        }
    }
}

/// What the pre-encoded publisher offers alone, then the ingest search on each shape with 1 and 8
/// subscribers (the relay on core 0, this process on core 1; unpinned in quick mode).
fn shapes(opts: &Opts, rt: &tokio::runtime::Runtime, table: &mut Table) {
    for shape in Shape::ALL.into_iter().filter(|s| opts.shape.as_deref().is_none_or(|k| k == s.key())) {
        let c = Cycle::new(shape, DP, cycle_geometry(opts));
        println!(
            "shape {}: {:.1} block ops and {:.0} bytes a batch, {} live blocks (2 ranks)",
            shape.name(),
            c.ops_per_batch(),
            c.bytes_per_batch(),
            c.live_blocks()
        );
        let offer = publisher_alone(opts, shape);
        println!(
            "publisher alone, {}: {:.0} batches/s, {:.0} block ops/s, sinks received {:.3} of them, this process {:.2} cores (load average {})",
            shape.name(),
            offer.batches_s,
            offer.ops_s,
            offer.received,
            offer.bench_cpu,
            loadavg()
        );
        let offered = format!("publisher alone: {} block ops/s", th(offer.ops_s));
        table.row(
            format!("publisher alone (no relay), {}", shape.short()),
            format!(
                "{} block ops/s offered ({} batches/s, {:.2} cores of this process); a counting SUB per rank on the other core took {:.0}% of it ({} block ops/s)",
                th(offer.ops_s),
                th(offer.batches_s),
                offer.bench_cpu,
                offer.received.min(1.0) * 100.0,
                th(offer.ops_s * offer.received.min(1.0))
            ),
            "",
            "at least the goal rates",
        );
        if !opts.part("shapes") {
            continue;
        }
        let cores = if opts.quick { None } else { Some("0") };
        for nsubs in [1usize, 8].into_iter().filter(|n| opts.subs.is_none_or(|k| k == *n)) {
            let label = format!(
                "sustained ingest, {}, {}, {}",
                shape.short(),
                cores.map_or("2 cores", |_| "1 core"),
                if nsubs == 1 { "1 subscriber".to_string() } else { format!("{nsubs} subscribers (1 indexing)") }
            );
            let goal = if nsubs == 1 { "at least 1,000,000 block ops/s" } else { "at least 800,000 block ops/s" };
            let value = match ingest_shape(opts, rt, shape, cores, nsubs) {
                Some(b) => {
                    println!("  => highest stable: {:.0} batches/s, {:.0} block ops/s", b.batches_s, b.ops_s);
                    format!(
                        "{} block ops/s ({} batches/s), relay CPU {:.2} cores, this process {:.2} cores{}",
                        th(b.ops_s),
                        th(b.batches_s),
                        b.relay_cpu,
                        b.bench_cpu,
                        if b.bench_cpu > 0.9 { " (this process near a core: the edge may be the bench's)" } else { "" }
                    )
                }
                None => "no stable step".into(),
            };
            table.row(label, value, offered.clone(), goal);
        }
    }
}

/// What one latency window recorded: each subscriber's latencies (ms) and the direct SUB's, each
/// process's CPU (cores), the batches published a second, and whether the subscribers drained.
struct Window {
    subs: Vec<Vec<f32>>,
    direct: Vec<f32>,
    cpu: Vec<f64>,
    published: f64,
    drained: bool,
}

/// Offers `rate` for 300 ms, then records latencies for `window`, then stops and drains.
fn measure_window(
    pubr: &Publisher,
    subs: &[Sub],
    direct: &Direct,
    pids: &[u32],
    rate: f64,
    window: Duration,
) -> Window {
    for sub in subs {
        sub.shared.latencies.lock().expect("l").clear();
    }
    direct.latencies.lock().expect("l").clear();
    let cpu = || pids.iter().map(|&p| cpu_seconds(p)).collect::<Vec<_>>();
    let (p0, c0, t0) = (pubr.published(), cpu(), Instant::now());
    pubr.set_rate(rate);
    std::thread::sleep(Duration::from_millis(300));
    let record = |on: bool| {
        subs.iter().for_each(|s| s.shared.record.store(on, Ordering::Relaxed));
        direct.record.store(on, Ordering::Relaxed);
    };
    record(true);
    std::thread::sleep(window);
    record(false);
    let (p1, c1, el) = (pubr.published(), cpu(), t0.elapsed().as_secs_f64());
    pubr.set_rate(0.0);
    let drained = drain(pubr, subs, Duration::from_secs(120)).is_some();
    Window {
        subs: subs.iter().map(|s| std::mem::take(&mut *s.shared.latencies.lock().expect("l"))).collect(),
        direct: std::mem::take(&mut *direct.latencies.lock().expect("l")),
        cpu: c0.iter().zip(&c1).map(|(a, b)| (b - a) / el).collect(),
        published: (p1 - p0) as f64 / el,
        drained,
    }
}

fn latency_window(s: &Setup, pubr: &Publisher, sub: &Sub, direct: &Direct, rate: f64, window: Duration) -> [f64; 8] {
    let pid = s.relay.pid().expect("pid");
    let mut w = measure_window(pubr, std::slice::from_ref(sub), direct, &[pid], rate, window);
    let (r, d) = (&mut w.subs[0], &mut w.direct);
    [pct(r, 0.5), pct(r, 0.99), pct(r, 0.999), pct(d, 0.5), pct(d, 0.99), pct(d, 0.999), w.published, w.cpu[0]]
}

/// One path's figures in a `floor` window: p50, p99, p99.9 (ms) and its process's CPU (cores).
struct PathFigures {
    p50: f64,
    p99: f64,
    p999: f64,
    cpu: f64,
}

/// One `floor` window: the relay's and the transport's figures, the direct SUB's p50, p99 and
/// p99.9 (ms), and the batches published a second.
struct FloorRun {
    paths: [PathFigures; 2],
    direct: [f64; 3],
    published: f64,
}

/// The relay beside the transport alone ([`forwarder`]: the relay's ZeroMQ reading, decoding,
/// normalizing, encoding and gRPC serving, without its store), both following the same engine at
/// once, each with an indexing subscriber, and the direct SUB: how much of the relay's latency and
/// CPU at light load its store costs, and how much any relay on these libraries pays.
fn floor(opts: &Opts, rt: &tokio::runtime::Runtime, table: &mut Table) {
    let s = setup(opts, None, &[]);
    let endpoints: Vec<(u32, String)> = s.engine.endpoints().into_iter().map(|e| (e.rank, e.publisher)).collect();
    let fwd = forwarder::ForwarderProc::start(&endpoints);
    let direct = Direct::start(&s.engine);
    let subs = [Sub::start(rt.handle(), &s.relay.url(), None), Sub::start(rt.handle(), fwd.url(), None)];
    // Both have joined the engine's PUB sockets before the first batch (a SUB joins asynchronously).
    std::thread::sleep(Duration::from_secs(1));
    let pubr = Publisher::start(s.engine.clone(), Workload::new(opts));
    pubr.set_rate(300.0);
    std::thread::sleep(Duration::from_secs(if opts.quick { 1 } else { 4 }));
    pubr.set_rate(0.0);
    assert!(
        drain(&pubr, &subs, Duration::from_secs(60)).is_some(),
        "floor: a subscriber did not receive every batch published (relay {}, forwarder {}, published {})",
        subs[0].shared.batches.load(Ordering::Relaxed),
        subs[1].shared.batches.load(Ordering::Relaxed),
        pubr.published()
    );
    let pids = [s.relay.pid().expect("pid"), fwd.pid()];
    let rates = opts.rates.clone().unwrap_or_else(|| if opts.quick { vec![250.0] } else { vec![250.0, 750.0, 1000.0] });
    for rate in rates {
        let mut runs: Vec<FloorRun> = Vec::new();
        for _ in 0..opts.runs {
            let mut w = measure_window(&pubr, &subs, &direct, &pids, rate, opts.latency_window);
            assert!(w.drained, "floor: a subscriber fell behind");
            let paths = [0, 1].map(|i| {
                let l = &mut w.subs[i];
                PathFigures { p50: pct(l, 0.5), p99: pct(l, 0.99), p999: pct(l, 0.999), cpu: w.cpu[i] }
            });
            let d = &mut w.direct;
            let w = FloorRun { paths, direct: [pct(d, 0.5), pct(d, 0.99), pct(d, 0.999)], published: w.published };
            println!(
                "floor at {rate:.0} b/s ({:.0} published): relay p50 {:.2} p99 {:.2} ms, {:.3} cores; transport alone p50 {:.2} p99 {:.2} ms, {:.3} cores; direct p50 {:.2} p99 {:.2} ms (load average {})",
                w.published, w.paths[0].p50, w.paths[0].p99, w.paths[0].cpu, w.paths[1].p50, w.paths[1].p99, w.paths[1].cpu, w.direct[0], w.direct[1], loadavg()
            );
            runs.push(w);
        }
        let m = |f: &dyn Fn(&FloorRun) -> f64| median(&mut runs.iter().map(f).collect::<Vec<_>>());
        let path = |i: usize| {
            format!(
                "p50 {:.2} / p99 {:.2} / p99.9 {:.2} ms, {:.3} cores",
                m(&|r| r.paths[i].p50),
                m(&|r| r.paths[i].p99),
                m(&|r| r.paths[i].p999),
                m(&|r| r.paths[i].cpu)
            )
        };
        table.row(
            format!("relay beside the transport alone (no store), {rate:.0} batches/s offered ({:.0} published), Mooncake, median of {}", m(&|r| r.published), opts.runs),
            format!("relay {}", path(0)),
            format!(
                "transport alone {}; direct SUB p50 {:.2} / p99 {:.2} / p99.9 {:.2} ms",
                path(1),
                m(&|r| r.direct[0]),
                m(&|r| r.direct[1]),
                m(&|r| r.direct[2])
            ),
            match rate as u64 {
                250 => "relay p50 under 0.5 ms",
                1000 => "relay at most 0.1 core",
                _ => "",
            },
        );
    }
    drop(pubr);
    finish_all(subs, rt);
}

fn footprint_latency_resync(opts: &Opts, rt: &tokio::runtime::Runtime, table: &mut Table) {
    // The history holds the catch-up and no more, so that a new subscriber takes the snapshot path.
    let history = opts.history_batches.to_string();
    let mut s = setup(opts, None, &["--history-batches", &history]);
    let url = s.relay.url();
    std::thread::sleep(Duration::from_millis(500));
    let rss_idle = s.relay.rss_kib().unwrap_or(0);
    println!("footprint: relay RSS idle {:.1} MiB (load average {})", rss_idle as f64 / 1024.0, loadavg());
    table.row("RSS idle", format!("{:.1} MiB", rss_idle as f64 / 1024.0), "", "");

    let direct = Direct::start(&s.engine);
    let sub = Sub::start(rt.handle(), &url, None);
    let pubr = Publisher::start(s.engine.clone(), Workload::new(opts));
    std::thread::sleep(Duration::from_millis(300));

    let mut catchup_rate = if opts.quick { 500.0 } else { 300.0 };
    if opts.part("latency") {
        // Warm the caches, then find the highest stable rate with one subscriber (short steps).
        pubr.set_rate(300.0);
        std::thread::sleep(Duration::from_secs(if opts.quick { 1 } else { 4 }));
        pubr.set_rate(0.0);
        drain(&pubr, std::slice::from_ref(&sub), Duration::from_secs(60));
        // Issue 28's rates (p50 at 250, p99 at 750, CPU at 1,000 batches/s), then the overload
        // rate and the sustainable rate and half of it.
        let mut rates =
            if opts.quick { vec![250.0, opts.latency_rate] } else { vec![250.0, 750.0, 1000.0, opts.latency_rate] };
        if let Some(r) = &opts.rates {
            rates.clone_from(r);
        }
        let sustainable = if opts.quick || opts.rates.is_some() {
            None
        } else {
            search(opts, &s, &pubr, std::slice::from_ref(&sub), &Ramp::mooncake(opts))
                .map(|b| (b.batches_s / 50.0).floor() * 50.0)
        };
        if let Some(r) = sustainable {
            catchup_rate = (0.8 * r).max(100.0);
            if r < opts.latency_rate {
                rates.push(r);
                rates.push((r / 2.0).max(50.0));
            }
        }
        for rate in rates {
            // Above the sustainable rate the backlog grows all along: a shorter window.
            let window =
                if sustainable.is_some_and(|r| rate > r) { Duration::from_secs(2) } else { opts.latency_window };
            let mut rows: Vec<[f64; 8]> = Vec::new();
            for _ in 0..opts.runs {
                let w = latency_window(&s, &pubr, &sub, &direct, rate, window);
                println!(
                    "latency at {rate:.0} b/s offered ({:.0} published): relay p50 {:.2} p99 {:.2} p99.9 {:.2} ms; direct p50 {:.3} p99 {:.3} p99.9 {:.3} ms; relay cpu {:.2}",
                    w[6], w[0], w[1], w[2], w[3], w[4], w[5], w[7]
                );
                rows.push(w);
            }
            let m = |i: usize| median(&mut rows.iter().map(|r| r[i]).collect::<Vec<_>>());
            let ratio = |a: usize, b: usize| median(&mut rows.iter().map(|r| r[a] / r[b]).collect::<Vec<_>>());
            let what =
                format!("{rate:.0} batches/s offered ({:.0} published), Mooncake, median of {}", m(6), opts.runs);
            table.row(
                format!("latency through gRPC at {what}"),
                format!(
                    "relay path p50 {:.2} / p99 {:.2} / p99.9 {:.2} ms; ratio {:.0}x / {:.0}x / {:.0}x",
                    m(0),
                    m(1),
                    m(2),
                    ratio(0, 3),
                    ratio(1, 4),
                    ratio(2, 5),
                ),
                format!("direct SUB p50 {:.3} / p99 {:.3} / p99.9 {:.3} ms", m(3), m(4), m(5)),
                match rate as u64 {
                    250 => "relay p50 under 0.5 ms",
                    750 => "relay p99 at most direct p99 + 1 ms",
                    _ => "",
                },
            );
            table.row(
                format!("relay CPU at {what}"),
                format!("{:.3} cores ({:.3} per 1,000 batches/s)", m(7), m(7) / (m(6) / 1000.0)),
                "",
                if rate as u64 == 1000 { "at most 0.1 core" } else { "" },
            );
        }
    }

    if opts.part("footprint") {
        // Catch-up: a subscriber leaves, the history grows by N batches, it comes back.
        let sub_state = sub.finish(rt);
        let mut catchups = Vec::new();
        let mut held = Some(sub_state);
        let mut sub_again = None;
        for run in 0..opts.runs {
            let target = pubr.published() + opts.catchup_batches;
            pubr.set_rate(catchup_rate);
            while pubr.published() < target {
                std::thread::sleep(Duration::from_millis(10));
            }
            pubr.set_rate(0.0);
            // Wait until the relay has committed them all.
            let want: u64 = target;
            let ok = harness_wait(Duration::from_secs(300), || {
                let (_, seqs) = relay_position(&url);
                seqs.iter().map(|s| s + 1).sum::<u64>() >= want
            });
            assert!(ok, "the relay never committed the catch-up batches");
            let (newest, _) = relay_position(&url);
            let st = match (held.take(), sub_again.take()) {
                (Some(st), _) => st,
                (None, Some(s)) => Sub::finish(s, rt),
                _ => unreachable!(),
            };
            let from = st.admission.position().cursor;
            let t = Instant::now();
            let sub2 = Sub::start(rt.handle(), &url, Some(st));
            let ok = harness_wait(Duration::from_secs(300), || sub2.cursor() >= newest);
            assert!(ok, "the subscriber never caught up to {newest}: {:?}", sub2.shared.errors.lock().expect("e"));
            let took = t.elapsed();
            println!(
                "catch-up {}: {} records of history (cursor {from} -> {newest}) in {:.0} ms, snapshots {}",
                run + 1,
                newest - from,
                took.as_secs_f64() * 1000.0,
                sub2.shared.snapshots.load(Ordering::Relaxed)
            );
            catchups.push(took.as_secs_f64() * 1000.0);
            // Leave it stopped for the next run.
            held = Some(sub2.finish(rt));
        }
        let (hist_rss, hist) =
            (s.relay.rss_kib().unwrap_or(0), status(&url).map(|x| (x.history_records, x.history_bytes)));
        let live_cache = metric(&s.relay.metrics_text(), "kv_relay_live_blocks", &[]).unwrap_or(0.0);
        println!(
            "history: {:?} (records, bytes), live blocks {live_cache}, RSS {:.1} MiB",
            hist,
            hist_rss as f64 / 1024.0
        );
        table.row(
            format!("catch-up of {} batches of history (median of {})", opts.catchup_batches, opts.runs),
            format!("{:.0} ms", median(&mut catchups)),
            "",
            "",
        );
        table.row(
            "RSS with a full history",
            format!(
                "{:.1} MiB ({} records, {:.1} MiB of history, {live_cache:.0} live blocks)",
                hist_rss as f64 / 1024.0,
                hist.as_ref().map_or(0, |h| h.0),
                hist.as_ref().map_or(0, |h| h.1) as f64 / (1 << 20) as f64
            ),
            "",
            "",
        );
    } else {
        sub.finish(rt);
    }
    drop(pubr);
    if !opts.part("footprint") && !opts.part("recovery") {
        return;
    }

    // Fill: fresh chained prefixes of 128 blocks, alternating ranks, until fill_blocks are live.
    let pid = s.relay.pid().expect("pid");
    let t = Instant::now();
    let c0 = cpu_seconds(pid);
    let per = 128u64;
    let total = opts.fill_blocks;
    let mut next_hash = 1u64 << 62;
    let mut sent = 0u64;
    let mut published = 0u64;
    let base_seq: u64 = (0..DP).map(|r| s.engine.stats(r).map(|x| x.next_seq).unwrap_or(0)).sum();
    while sent < total {
        let rank = (published % u64::from(DP)) as u32;
        let n = per.min(total - sent);
        let hashes: Vec<BlockHash> = (0..n).map(|i| BlockHash::U64(next_hash + i)).collect();
        next_hash += n;
        let tokens: Vec<u64> = (0..n * u64::from(BLOCK_SIZE)).map(|i| 1 + (next_hash ^ i) % 32_000).collect();
        s.engine.publish(rank, vec![vllm_prefix(hashes, tokens)]).expect("publish");
        sent += n;
        published += 1;
        // Keep at most ~400 batches ahead of the relay.
        if published.is_multiple_of(100) {
            harness_wait(Duration::from_secs(120), || {
                let (_, seqs) = relay_position(&url);
                seqs.iter().map(|s| s + 1).sum::<u64>() + 400 >= base_seq + published
            });
        }
    }
    harness_wait(Duration::from_secs(300), || {
        let (_, seqs) = relay_position(&url);
        seqs.iter().map(|s| s + 1).sum::<u64>() >= base_seq + published
    });
    let fill_secs = t.elapsed().as_secs_f64();
    let fill_cpu = cpu_seconds(pid) - c0;
    std::thread::sleep(Duration::from_secs(2)); // sled's background flush, the live gauges
    let rss_full = s.relay.rss_kib().unwrap_or(0);
    let live = live_blocks(&url) as f64;
    let disk = dir_bytes(&s.relay.state_dir);
    println!(
        "fill: {published} batches of {per} stores in {fill_secs:.1} s ({:.0} block ops/s, relay CPU {:.2} cores); live blocks {live}, RSS {:.1} MiB, state directory {:.1} MiB ({:.0} B per live block); load average {}",
        total as f64 / fill_secs,
        fill_cpu / fill_secs,
        rss_full as f64 / 1024.0,
        disk as f64 / (1 << 20) as f64,
        disk as f64 / live.max(1.0),
        loadavg()
    );
    table.row(
        format!("RSS at {} live blocks of {BLOCK_SIZE} tokens, full history", th(live)),
        format!("{:.1} MiB", rss_full as f64 / 1024.0),
        format!("RSS idle {:.1} MiB", rss_idle as f64 / 1024.0),
        "at most 200 MiB",
    );
    table.row(
        "bytes on disk per live block (state directory: log, history and checkpoint)",
        format!("{:.0} ({:.1} MiB)", disk as f64 / live.max(1.0), disk as f64 / (1 << 20) as f64),
        "",
        "at most 150",
    );
    table.row(
        format!("fill, {per} stores per batch"),
        format!("{} block ops/s, relay CPU {:.2} cores", th(total as f64 / fill_secs), fill_cpu / fill_secs),
        "",
        "",
    );

    if opts.part("footprint") {
        resync_and_pause(opts, rt, &s, live, table);
    }
    if opts.part("recovery") {
        recovery(rt, &mut s, table);
    }
    drop(direct);
}

/// The relay's live blocks (Status's `live_blocks` counter).
fn live_blocks(url: &str) -> u64 {
    status(url).ok().and_then(|st| st.counters.get("live_blocks").copied()).unwrap_or(0)
}

/// A histogram's (sum, count) from the relay's metrics endpoint.
fn histogram(s: &Setup, name: &str) -> Option<(f64, f64)> {
    let m = s.relay.metrics_text();
    Some((metric(&m, &format!("{name}_sum"), &[])?, metric(&m, &format!("{name}_count"), &[])?))
}

/// A new subscriber rebuilds its index through the snapshot path, `runs` times; each snapshot's
/// commit pause is read from the relay's `kv_relay_store_snapshot_pause_seconds` (the growth of
/// its sum and count across the run), beside the mean commit of the same run as the peer.
fn resync_and_pause(opts: &Opts, rt: &tokio::runtime::Runtime, s: &Setup, live: f64, table: &mut Table) {
    const PAUSE: &str = "kv_relay_store_snapshot_pause_seconds";
    let url = s.relay.url();
    let (newest, _) = relay_position(&url);
    let mut resyncs = Vec::new();
    let mut pauses = Vec::new();
    for run in 0..opts.runs {
        let p0 = histogram(s, PAUSE);
        let t = Instant::now();
        let sub = Sub::start(rt.handle(), &url, None);
        let ok = harness_wait(Duration::from_secs(600), || sub.cursor() >= newest);
        assert!(ok, "the new subscriber never reached cursor {newest}: {:?}", sub.shared.errors.lock().expect("e"));
        let took = t.elapsed();
        let snaps = sub.shared.snapshots.load(Ordering::Relaxed);
        let st = sub.finish(rt);
        let blocks = st.index.stats().blocks;
        let pause = match (p0, histogram(s, PAUSE)) {
            (Some((s0, n0)), Some((s1, n1))) if n1 > n0 => Some((s1 - s0) / (n1 - n0) * 1000.0),
            (None, Some((s1, n1))) if n1 > 0.0 => Some(s1 / n1 * 1000.0),
            _ => None,
        };
        println!(
            "snapshot resync {}: {blocks} blocks indexed at cursor {} in {:.0} ms, snapshots {snaps}, commit pause {} (relay RSS {:.1} MiB)",
            run + 1,
            st.admission.position().cursor,
            took.as_secs_f64() * 1000.0,
            pause.map_or("not exported".to_string(), |p| format!("{p:.2} ms")),
            s.relay.rss_kib().unwrap_or(0) as f64 / 1024.0
        );
        resyncs.push(took.as_secs_f64() * 1000.0);
        pauses.extend(pause);
    }
    table.row(
        format!("snapshot resync of {} blocks into kv-router-client's index (median of {})", th(live), opts.runs),
        format!("{:.0} ms", median(&mut resyncs)),
        "",
        "at most 1 s",
    );
    let commit = histogram(s, "kv_relay_commit_seconds").map(|(sum, n)| sum / n * 1000.0);
    let max = pauses.iter().copied().fold(f64::NAN, f64::max);
    table.row(
        format!("commit pause while a snapshot of {} blocks is taken ({PAUSE}, median of {})", th(live), pauses.len()),
        if pauses.is_empty() {
            "not exported".to_string()
        } else {
            format!("{:.2} ms (max {max:.2} ms)", median(&mut pauses))
        },
        commit.map_or(String::new(), |c| format!("a commit takes {c:.2} ms on average")),
        "at most 5 ms",
    );
}

/// Recovery after SIGKILL at the fill's live blocks: the relay is killed (-9) with a subscriber
/// following, started again on the same state directory and ports, and timed until Status
/// answers, until its live blocks equal what it had, and until the subscriber is following again
/// at the newest cursor. The peer: the same after a clean stop (SIGTERM).
fn recovery(rt: &tokio::runtime::Runtime, s: &mut Setup, table: &mut Table) {
    let url = s.relay.url();
    let sub = Sub::start(rt.handle(), &url, None);
    let (newest, _) = relay_position(&url);
    let ok = harness_wait(Duration::from_secs(600), || sub.cursor() >= newest);
    assert!(ok, "the subscriber never reached cursor {newest}: {:?}", sub.shared.errors.lock().expect("e"));
    let live = live_blocks(&url);
    let mut times: Vec<[f64; 3]> = Vec::new();
    let mut resumed = Vec::new();
    for (how, signal) in [("SIGKILL", "KILL"), ("SIGTERM", "TERM")] {
        let sessions = sub.shared.sessions.load(Ordering::Relaxed);
        let snapshots = sub.shared.snapshots.load(Ordering::Relaxed);
        if signal == "KILL" {
            s.relay.kill();
        } else {
            let stopped = s.relay.terminate(Duration::from_secs(60));
            assert!(stopped.is_some(), "the relay did not exit within 60 s of SIGTERM");
        }
        let t = Instant::now();
        s.relay.spawn_only();
        let ok = harness_wait(Duration::from_secs(300), || status(&url).is_ok());
        assert!(ok, "the restarted relay never answered Status; log:\n{}", s.relay.log_tail());
        let serving = t.elapsed();
        let ok = harness_wait(Duration::from_secs(300), || live_blocks(&url) == live);
        assert!(ok, "the restarted relay's live blocks never came back to {live} ({} now)", live_blocks(&url));
        let equal = t.elapsed();
        let (newest, _) = relay_position(&url);
        let ok = harness_wait(Duration::from_secs(300), || {
            sub.shared.sessions.load(Ordering::Relaxed) > sessions && sub.cursor() >= newest
        });
        assert!(ok, "the subscriber never followed the restarted relay: {:?}", sub.shared.errors.lock().expect("e"));
        let resynced = t.elapsed();
        println!(
            "restart after {how} at {live} live blocks: Status answers in {:.0} ms, live blocks equal in {:.0} ms, subscriber following at cursor {newest} in {:.0} ms (snapshots so far {}; load average {})",
            serving.as_secs_f64() * 1000.0,
            equal.as_secs_f64() * 1000.0,
            resynced.as_secs_f64() * 1000.0,
            sub.shared.snapshots.load(Ordering::Relaxed),
            loadavg()
        );
        times.push([serving, equal, resynced].map(|d| d.as_secs_f64() * 1000.0));
        resumed.push(sub.shared.snapshots.load(Ordering::Relaxed) == snapshots);
    }
    sub.finish(rt);
    let [k, c] = [times[0], times[1]];
    table.row(
        format!("recovery after SIGKILL at {} live blocks, to serving", th(live as f64)),
        format!(
            "Status answers {:.0} ms, live blocks equal {:.0} ms, subscriber following {:.0} ms ({})",
            k[0],
            k[1],
            k[2],
            if resumed[0] { "resumed" } else { "through a snapshot" }
        ),
        format!(
            "after SIGTERM: {:.0} / {:.0} / {:.0} ms ({})",
            c[0],
            c[1],
            c[2],
            if resumed[1] { "resumed" } else { "through a snapshot" }
        ),
        "at most 3 s, log replay included",
    );
}

fn harness_wait(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let t = Instant::now();
    while t.elapsed() < limit {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    false
}
