//! What a `/match` answer costs the router: `http::answer_match` and the JSON it is sent as, for
//! 512-block requests over many workers, against the path it replaced (every worker's
//! `WorkerInfo` under its relay's lock, a map of the lookup's matches, a map of tier names per
//! worker), in the same run, interleaved.
//!
//! The follower is the library's, in this process, following relays that are the relay's own
//! server code (`kv_relay_testkit::fleet::serve_store`) over stores of `--ranks` ranks each; a
//! thread commits an empty batch with a new load to every worker `--rate` times a second, so
//! each relay's workers are republished while matches read them. Each worker holds a chain of
//! 512 blocks of its own on the device; every tenth also the first 256 of a shared chain on the
//! host. Requests: a worker's own 512 blocks (one worker holds them, as in the fleet bench), and
//! the shared chain's 512 (a tenth of the workers hold 256). Per request kind and path: p50 and
//! p99 of the wall time, the CPU time of the measuring thread per request, and the answer's
//! bytes; every answer of the full path is checked to be the old path's, byte for byte.
//!
//! ```text
//! cargo bench --locked -p kv-router --bench match                  # 100 relays x 10 ranks
//! cargo bench --locked -p kv-router --bench match -- --relays 1000 --ranks 1
//! cargo test --locked -p kv-router --bench match -- --quick         # seconds (CI)
//! ```
//! Options: `--relays N` (100), `--ranks N` (10), `--requests N` per kind and path (2,000),
//! `--rate R` batches a second per worker (1).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod support;

use kv_relay_testkit::pace::Pace;
use kv_router::http::{answer_match, MatchRequest};
use kv_router_client::{Follower, Match, WorkerState};
use serde::Serialize;
use support::{loadavg, own, shared, thread_cpu, Followed, Relay};

struct Opts {
    relays: usize,
    ranks: usize,
    requests: usize,
    rate: f64,
}

impl Opts {
    fn parse() -> Opts {
        let args: Vec<String> = std::env::args().skip(1).collect();
        let quick = args.iter().any(|a| a == "--quick");
        let num = |name: &str, full: f64, quick_value: f64| {
            let v = args.iter().position(|a| a == name).and_then(|i| args.get(i + 1));
            v.map(|v| v.parse::<f64>().expect(name)).unwrap_or(if quick { quick_value } else { full })
        };
        Opts {
            relays: num("--relays", 100.0, 10.0) as usize,
            ranks: num("--ranks", 10.0, 2.0) as usize,
            requests: num("--requests", 2000.0, 50.0) as usize,
            rate: num("--rate", 1.0, 1.0),
        }
    }
}

/// The path `/match` took before: every worker's `WorkerInfo` (each relay's lock taken), a map
/// of the lookup's matches, a map of tier names (strings) per worker, then the JSON.
fn old_answer(f: &Follower, req: &MatchRequest) -> Vec<u8> {
    #[derive(Serialize)]
    struct Answer {
        blocks: usize,
        workers: Vec<Match>,
    }
    let hashes = req.block_hashes.clone().expect("block hashes");
    let mut workers = f.workers();
    workers.retain(|w| w.state != WorkerState::Syncing);
    let result = f.index().lookup(&hashes);
    let tiers = f.index().tiers();
    let found: HashMap<_, _> = result.iter().map(|m| (m.worker, m)).collect();
    let workers = workers
        .into_iter()
        .map(|w| {
            let m = found.get(&w.id);
            let by_tier: BTreeMap<String, u32> = m
                .map(|m| {
                    let name = |t: kv_router_client::index::TierId| {
                        tiers.name(t).map_or_else(|| t.get().to_string(), |n| n.to_string())
                    };
                    m.tiers.iter().map(|r| (name(r.tier), r.blocks)).collect()
                })
                .unwrap_or_default();
            Match {
                relay: w.relay,
                dp_rank: w.dp_rank,
                matched_blocks: m.map_or(0, |m| m.blocks),
                by_tier,
                load: w.load,
                state: w.state,
            }
        })
        .collect();
    serde_json::to_vec(&Answer { blocks: hashes.len(), workers }).expect("json")
}

fn new_answer(f: &Follower, req: &MatchRequest) -> Vec<u8> {
    serde_json::to_vec(&answer_match(f, req).expect("answer")).expect("json")
}

fn request(hashes: &[u64], options: &str) -> MatchRequest {
    let body = format!("{{\"block_hashes\": {}{options}}}", serde_json::to_string(hashes).expect("json"));
    serde_json::from_str(&body).expect("request")
}

/// A path's timings: each request's wall time, and the thread's CPU time over runs of requests.
#[derive(Default)]
struct Runs {
    wall: Vec<f64>,
    cpu: Duration,
    bytes: usize,
}

impl Runs {
    /// `n` requests in a row; the last answer.
    fn run(&mut self, n: usize, mut answer: impl FnMut() -> Vec<u8>) -> Vec<u8> {
        let c = thread_cpu();
        let mut out = Vec::new();
        for _ in 0..n {
            let t = Instant::now();
            out = answer();
            self.wall.push(t.elapsed().as_secs_f64() * 1e3);
        }
        self.cpu += thread_cpu() - c;
        self.bytes = out.len();
        out
    }

    /// Prints the figures; returns p50, p99 and CPU per request (ms).
    fn report(&mut self, name: &str) -> [f64; 3] {
        self.wall.sort_by(f64::total_cmp);
        let q = |p: f64| self.wall[((self.wall.len() - 1) as f64 * p).round() as usize];
        let cpu = self.cpu.as_secs_f64() * 1e3 / self.wall.len() as f64;
        let (p50, p99) = (q(0.5), q(0.99));
        println!("  {name:<34} p50 {p50:.3} ms  p99 {p99:.3} ms  CPU {cpu:.3} ms/request  {} bytes", self.bytes);
        [p50, p99, cpu]
    }
}

/// Equal but for loads (the stream may change one between two answers).
fn assert_same(a: &[u8], b: &[u8]) {
    if a == b {
        return;
    }
    let strip = |json: &[u8]| {
        let mut v: serde_json::Value = serde_json::from_slice(json).expect("json");
        for w in v["workers"].as_array_mut().expect("workers") {
            w["load"] = serde_json::Value::Null;
        }
        v
    };
    assert_eq!(strip(a), strip(b), "the old and new answers differ");
}

fn main() {
    let opts = Opts::parse();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().expect("runtime");
    let workers = opts.relays * opts.ranks;
    println!(
        "{} relays x {} ranks = {workers} workers, {} requests per kind and path, {} batches/s per worker (load {})",
        opts.relays,
        opts.ranks,
        opts.requests,
        opts.rate,
        loadavg()
    );
    let relays: Vec<Relay> = (0..opts.relays).map(|i| Relay::new(i, opts.ranks)).collect();
    let followed = Followed::start(&rt, &relays, workers);
    let f = &followed.follower;
    println!(
        "followed {} relays in {:.2} s, {} blocks indexed",
        followed.urls.len(),
        followed.took.as_secs_f64(),
        f.index().stats().blocks
    );

    // The stream: an empty batch with a new load to each worker in turn.
    let stop = Arc::new(AtomicBool::new(false));
    let stream = {
        let (stop, mut relays, rate) = (stop.clone(), relays, opts.rate * workers as f64);
        std::thread::spawn(move || {
            let pace = Pace::new(rate);
            let mut k = 0u64;
            while !stop.load(Ordering::Relaxed) {
                pace.wait(k);
                let g = k as usize % workers;
                let ranks = relays[0].seq.len();
                relays[g / ranks].commit(g % ranks, Vec::new(), (k % 64) as f64);
                k += 1;
            }
            relays
        })
    };

    let kinds = [("a worker's own 512 blocks", own(7)), ("a shared 512-block chain", shared())];
    for (kind, hashes) in kinds {
        println!("{kind}:");
        let full = request(&hashes, "");
        let matched = request(&hashes, ", \"matched_only\": true");
        let best = request(&hashes, ", \"limit\": 8");
        let (mut old, mut new, mut only, mut top) =
            (Runs::default(), Runs::default(), Runs::default(), Runs::default());
        // Warm caches first; then the paths take turns, runs of 50 requests.
        old.run(20, || old_answer(f, &full));
        new.run(20, || new_answer(f, &full));
        (old, new) = (Runs::default(), Runs::default());
        let run = 50.min(opts.requests);
        for _ in 0..opts.requests.div_ceil(run) {
            let a = old.run(run, || old_answer(f, &full));
            let b = new.run(run, || new_answer(f, &full));
            assert_same(&a, &b);
            only.run(run, || new_answer(f, &matched));
            top.run(run, || new_answer(f, &best));
        }
        let was = old.report("old path, every worker");
        let is = new.report("new path, every worker");
        only.report("new path, \"matched_only\": true");
        top.report("new path, \"limit\": 8");
        let [p50, p99, cpu] = [0, 1, 2].map(|i| is[i] / was[i]);
        println!("  full answer, new/old: p50 {p50:.3}  p99 {p99:.3}  CPU {cpu:.3}");
    }
    println!("load after: {}", loadavg());
    stop.store(true, Ordering::Relaxed);
    let relays = stream.join().expect("stream");
    followed.stop(&rt);
    drop(relays);
}
