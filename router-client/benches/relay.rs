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

#[path = "relay/workload.rs"]
mod workload;
use workload::*;
#[path = "relay/cycles.rs"]
mod cycles;
use cycles::*;
#[path = "relay/subscribers.rs"]
mod subscribers;
use subscribers::*;
#[path = "relay/setup.rs"]
mod setup;
use setup::*;
#[path = "relay/footprint.rs"]
mod footprint;
use footprint::*;

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
