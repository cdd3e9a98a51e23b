//! What routing buys, on a simulated fleet: a Mooncake trace replayed with its arrival times (at
//! `--speed` times its rate) through `kv-router`'s OpenAI front to W mock engines, each behind
//! its relay, every engine with the face's cost model (`kv_relay_testkit::face::CostModel`: a
//! batch of at most 8 with a queue, one prefill at a time per uncached token, decode per output
//! token; its KV usage, as vLLM reports it, the running requests' tokens over the cache's
//! capacity) and an LRU prefix cache publishing its real KV events. Each policy gets a fresh fleet,
//! in one run. Per request: the router's prediction (the `x-kv-router-matched-blocks` header
//! times the block size) against the engine's `cached_tokens`, and against the oracle (the best
//! cached prefix any engine held when the request was sent); the time to its first streamed
//! chunk (TTFT). Scores: hit rate against the oracle, predicted = actual, TTFT p50 / p99,
//! goodput (requests a second within `--ttft-limit-ms`), balance (the largest worker's share).
//!
//! ```text
//! cargo bench --locked -p kv-router --bench serve                       # 8 and 32 workers, full cache and KV pressure
//! cargo bench --locked -p kv-router --bench serve -- --workers 8 --requests 2000
//! cargo test --locked -p kv-router --bench serve -- --quick              # seconds (CI)
//! ```
//! Options: `--trace FILE` (testdata's conversation trace), `--requests N` (1,000: the trace's
//! first N), `--speed X` (3), `--workers 8,32`, `--policies cache_aware,round_robin,least_load`,
//! `--caches full,pressure` (pressure: each engine holds 7% of the replayed working set),
//! `--max-output N` (16 tokens), `--ttft-limit-ms` (2,000), and the `cache_aware` knobs as an
//! operator sets them for these engines: `--prefill-us-per-block` (10,240: 512 tokens x 20 us),
//! `--queue-us-per-request` (20,000).

mod engines;

use engines::header;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kv_relay_proto::hash::{EngineHashConfig, VllmHashAlgo};
use kv_relay_testkit::client::start_engine_on_free_ports;
use kv_relay_testkit::daemon::Daemon;
use kv_relay_testkit::engine::{EngineConfig, MockEngine};
use kv_relay_testkit::face::CostModel;
use kv_relay_testkit::metrics::dechunk;
use kv_relay_testkit::traffic::mooncake_block_tokens;
use kv_relay_testkit::wire::{Engine, WireVersion};
use kv_router::front::{FrontConfig, MATCHED_HEADER, WORKER_HEADER};
use kv_router::policy::PolicyKind;
use kv_router::{http, Router, RouterConfig};

/// Tokens per Mooncake block (its traces' `hash_ids` are 512-token blocks).
const BLOCK: usize = 512;

const COST: CostModel = CostModel {
    max_batch: 8,
    prefill_per_token: Duration::from_micros(20),
    decode_per_token: Duration::from_millis(5),
    // Set per fleet: the engine's KV capacity is its cache's blocks.
    kv_tokens: 0,
};

struct Opts {
    trace: std::path::PathBuf,
    requests: usize,
    speed: f64,
    workers: Vec<usize>,
    policies: Vec<PolicyKind>,
    caches: Vec<String>,
    max_output: u64,
    ttft_limit: Duration,
    /// The `cache_aware` knobs, as an operator sets them for the fleet's engines.
    prefill_us_per_block: f64,
    queue_us_per_request: f64,
    quick: bool,
}

impl Opts {
    fn parse() -> Opts {
        let args: Vec<String> = std::env::args().skip(1).collect();
        let quick = args.iter().any(|a| a == "--quick");
        let get = |k: &str| args.iter().position(|a| a == k).and_then(|i| args.get(i + 1)).cloned();
        let list = |k: &str, d: &str| -> Vec<String> {
            get(k).unwrap_or_else(|| d.to_string()).split(',').map(str::to_string).collect()
        };
        let num = |k: &str, d: f64| get(k).map_or(d, |v| v.parse().unwrap_or_else(|_| panic!("{k} takes a number")));
        let (requests, speed, workers, policies, caches) = if quick {
            (60.0, 40.0, "4", "cache_aware,round_robin", "full")
        } else {
            (1000.0, 3.0, "8,32", "cache_aware,round_robin,least_load", "full,pressure")
        };
        Opts {
            trace: get("--trace").map_or_else(|| kv_relay_testdata::mooncake("conversation_trace.jsonl"), Into::into),
            requests: num("--requests", requests) as usize,
            speed: num("--speed", speed),
            workers: list("--workers", workers).iter().map(|w| w.parse().expect("--workers 8,32")).collect(),
            policies: list("--policies", policies)
                .iter()
                .map(|p| p.parse().unwrap_or_else(|e| panic!("--policies: {e}")))
                .collect(),
            caches: list("--caches", caches),
            max_output: num("--max-output", 16.0) as u64,
            ttft_limit: Duration::from_millis(num("--ttft-limit-ms", 2000.0) as u64),
            // A block's prefill on these engines (512 tokens x 20 us).
            prefill_us_per_block: num(
                "--prefill-us-per-block",
                COST.prefill_per_token.as_secs_f64() * 1e6 * BLOCK as f64,
            ),
            queue_us_per_request: num("--queue-us-per-request", 20_000.0),
            quick,
        }
    }
}

/// One request of the trace.
#[derive(Clone)]
struct TraceRequest {
    at: Duration,
    tokens: Vec<u64>,
    output: u64,
}

fn load_trace(o: &Opts) -> (Vec<TraceRequest>, usize) {
    let text = std::fs::read_to_string(&o.trace).unwrap_or_else(|e| panic!("{}: {e}", o.trace.display()));
    let mut out = Vec::new();
    let mut blocks = BTreeSet::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()).take(o.requests) {
        let v: serde_json::Value = serde_json::from_str(line).expect("a trace line");
        let ids: Vec<u64> = v["hash_ids"].as_array().expect("hash_ids").iter().filter_map(|x| x.as_u64()).collect();
        blocks.extend(ids.iter().copied());
        let len = v["input_length"].as_u64().unwrap_or(0) as usize;
        let mut tokens: Vec<u64> = ids.iter().flat_map(|&id| mooncake_block_tokens(id, BLOCK as u32)).collect();
        tokens.truncate(len.clamp(1, tokens.len().max(1)));
        let at = Duration::from_secs_f64(v["timestamp"].as_f64().unwrap_or(0.0) / 1000.0 / o.speed);
        out.push(TraceRequest { at, tokens, output: v["output_length"].as_u64().unwrap_or(1).clamp(1, o.max_output) });
    }
    (out, blocks.len())
}

/// What one request saw.
#[derive(Clone, Debug, Default)]
struct Outcome {
    ok: bool,
    ttft: Duration,
    oracle: u64,
    predicted: u64,
    actual: u64,
    worker: String,
}

/// Streams one completion through the front: its status, headers, TTFT and body.
fn stream(front: SocketAddr, body: &str) -> std::io::Result<(u16, String, Duration, String)> {
    let t0 = Instant::now();
    let mut s = TcpStream::connect(front)?;
    s.set_read_timeout(Some(Duration::from_secs(120)))?;
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: {front}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut raw = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    let mut ttft = None;
    loop {
        let n = s.read(&mut buf)?;
        if n == 0 {
            break;
        }
        raw.extend_from_slice(&buf[..n]);
        if ttft.is_none() && raw.windows(5).any(|w| w == b"data:") {
            ttft = Some(t0.elapsed());
        }
    }
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let chunked = head.to_ascii_lowercase().contains("transfer-encoding: chunked");
    let body = if chunked { dechunk(rest) } else { rest.to_string() };
    Ok((status, head.to_string(), ttft.unwrap_or_else(|| t0.elapsed()), body))
}

/// The fleet of one run: engines with their relays, the router and its front.
struct Fleet {
    engines: Vec<Arc<MockEngine>>,
    relays: Vec<Daemon>,
    router: Arc<Router>,
    front: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

fn hash() -> EngineHashConfig {
    EngineHashConfig::vllm("0.32".parse().expect("version"), VllmHashAlgo::Sha256Cbor, None, BLOCK).expect("hash")
}

fn fleet(rt: &tokio::runtime::Runtime, workers: usize, cache_blocks: usize, policy: PolicyKind, o: &Opts) -> Fleet {
    let engines: Vec<Arc<MockEngine>> = (0..workers)
        .map(|_| {
            let mut cfg = EngineConfig::new(WireVersion::parse(Engine::Vllm, "0.32").expect("wire"));
            cfg.topic = "kv".into();
            cfg.block_size = BLOCK as u32;
            cfg.cache_blocks = cache_blocks;
            cfg.metrics_listen = Some("127.0.0.1:0".parse().expect("addr"));
            let e = Arc::new(start_engine_on_free_ports(cfg, true));
            e.serve_completions();
            e.face().expect("face").set_cost(Some(CostModel { kv_tokens: (cache_blocks * BLOCK) as u64, ..COST }));
            e
        })
        .collect();
    let (relays, follower) = engines::follow(rt, &engines);
    let _in_rt = rt.enter();
    let mut cfg = RouterConfig { policy, ..RouterConfig::default() };
    cfg.cache_aware.prefill_us_per_block = o.prefill_us_per_block;
    cfg.cache_aware.queue_us_per_request = o.queue_us_per_request;
    let router = Arc::new(Router::new(follower, cfg));
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).expect("bind");
    let front = listener.local_addr().expect("addr");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let cfg = FrontConfig { hash: Some(hash()), ..FrontConfig::default() };
    rt.spawn(http::serve_with(listener, router.clone(), cfg, async {
        let _ = stopped.await;
    }));
    engines::wait_routable(&router, workers, Duration::from_secs(60));
    Fleet { engines, relays, router, front, stop: Some(stop) }
}

impl Fleet {
    fn stop(mut self, rt: &tokio::runtime::Runtime) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        for r in self.relays.drain(..) {
            rt.block_on(r.stop());
        }
        drop(self.router);
        drop(self.engines);
    }
}

/// Replays `trace` through the fleet: every request's outcome, and the run's length.
fn replay(f: &Fleet, trace: &[TraceRequest], o: &Opts) -> (Vec<Outcome>, Duration) {
    let out = Arc::new(Mutex::new(vec![Outcome::default(); trace.len()]));
    let t0 = Instant::now();
    let mut threads = Vec::new();
    let step = (trace.len() / 10).max(1);
    for (i, r) in trace.iter().enumerate() {
        if let Some(wait) = r.at.checked_sub(t0.elapsed()) {
            std::thread::sleep(wait);
        }
        if i % step == 0 && !o.quick {
            eprintln!("    sent {i} of {} at {:.1} s", trace.len(), t0.elapsed().as_secs_f64());
        }
        let oracle = f.engines.iter().map(|e| e.cached_blocks(0, &r.tokens).unwrap_or(0)).max().unwrap_or(0) * BLOCK;
        let body =
            serde_json::json!({"model": "m", "prompt": r.tokens, "max_tokens": r.output, "stream": true}).to_string();
        let (front, out) = (f.front, out.clone());
        threads.push(std::thread::spawn(move || {
            let mut res = Outcome { oracle: oracle as u64, ..Outcome::default() };
            if let Ok((200, head, ttft, body)) = stream(front, &body) {
                res.ttft = ttft;
                res.worker = header(&head, WORKER_HEADER).unwrap_or("").to_string();
                res.predicted =
                    header(&head, MATCHED_HEADER).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0) * BLOCK as u64;
                let usage = kv_router::front::usage(body.as_bytes());
                res.actual = usage.cached_tokens.unwrap_or(0);
                res.ok = usage.prompt_tokens > 0;
            }
            out.lock().expect("outcomes")[i] = res;
        }));
    }
    for t in threads {
        let _ = t.join();
    }
    let took = t0.elapsed();
    let out = out.lock().expect("outcomes").clone();
    (out, took)
}

/// One run's scores.
struct Scores {
    ok: usize,
    hit_over_oracle: f64,
    equal: usize,
    under: usize,
    over: usize,
    ttft_p50_ms: f64,
    ttft_p99_ms: f64,
    goodput: f64,
    top_share: f64,
}

fn score(out: &[Outcome], took: Duration, o: &Opts) -> Scores {
    let ok: Vec<&Outcome> = out.iter().filter(|r| r.ok).collect();
    let actual: u64 = ok.iter().map(|r| r.actual).sum();
    let oracle: u64 = ok.iter().map(|r| r.oracle).sum();
    let mut ttft: Vec<f64> = ok.iter().map(|r| r.ttft.as_secs_f64() * 1000.0).collect();
    ttft.sort_by(f64::total_cmp);
    let pct =
        |p: f64| ttft.get(((ttft.len() as f64 * p) as usize).min(ttft.len().saturating_sub(1))).copied().unwrap_or(0.0);
    let mut per: BTreeMap<&str, usize> = BTreeMap::new();
    for r in &ok {
        *per.entry(r.worker.as_str()).or_default() += 1;
    }
    Scores {
        ok: ok.len(),
        hit_over_oracle: if oracle == 0 { 1.0 } else { actual as f64 / oracle as f64 },
        equal: ok.iter().filter(|r| r.predicted == r.actual).count(),
        under: ok.iter().filter(|r| r.predicted < r.actual).count(),
        over: ok.iter().filter(|r| r.predicted > r.actual).count(),
        ttft_p50_ms: pct(0.5),
        ttft_p99_ms: pct(0.99),
        goodput: ok.iter().filter(|r| r.ttft <= o.ttft_limit).count() as f64 / took.as_secs_f64(),
        top_share: per.values().max().copied().unwrap_or(0) as f64 / ok.len().max(1) as f64,
    }
}

fn main() {
    let o = Opts::parse();
    let (trace, working_set) = load_trace(&o);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let span = trace.last().map_or(0.0, |r| r.at.as_secs_f64());
    println!(
        "kv-router on a simulated fleet: {} requests of {} ({} blocks of {BLOCK} tokens in their working set), \
         {}x their rate ({span:.0} s); cost: batch {}, prefill {} us/token, decode {} ms/token, output <= {} tokens; \
         cache_aware: {} us a block's prefill, {} us a queued request",
        trace.len(),
        o.trace.file_name().map(|f| f.to_string_lossy()).unwrap_or_default(),
        working_set,
        o.speed,
        COST.max_batch,
        COST.prefill_per_token.as_micros(),
        COST.decode_per_token.as_millis(),
        o.max_output,
        o.prefill_us_per_block,
        o.queue_us_per_request,
    );
    for &workers in &o.workers {
        for cache in &o.caches {
            let blocks = match cache.as_str() {
                "full" => working_set + 1024,
                "pressure" => (working_set * 7 / 100).max(64),
                other => panic!("--caches takes full and pressure, not {other:?}"),
            };
            println!("\n{workers} workers, {cache} cache ({blocks} blocks each)");
            println!(
                "  {:<12} {:>5} {:>11} {:>24} {:>10} {:>10} {:>13} {:>10}",
                "policy",
                "ok",
                "hit/oracle",
                "predicted=actual (<, >)",
                "TTFT p50",
                "TTFT p99",
                "goodput/s",
                "top share"
            );
            for &policy in &o.policies {
                let f = fleet(&rt, workers, blocks, policy, &o);
                let (out, took) = replay(&f, &trace, &o);
                let s = score(&out, took, &o);
                println!(
                    "  {:<12} {:>5} {:>11.3} {:>16} ({}, {}) {:>7.1} ms {:>7.1} ms {:>13.2} {:>10.3}",
                    policy.to_string(),
                    s.ok,
                    s.hit_over_oracle,
                    format!("{}/{}", s.equal, s.ok),
                    s.under,
                    s.over,
                    s.ttft_p50_ms,
                    s.ttft_p99_ms,
                    s.goodput,
                    s.top_share
                );
                if o.quick {
                    // Every request answered, and with the whole working set cached nothing is
                    // evicted: the router never predicts more than the engine had.
                    assert_eq!(s.ok, trace.len(), "requests failed");
                    assert_eq!(s.over, 0, "predicted above the engine's cached tokens");
                }
                f.stop(&rt);
            }
        }
    }
}
