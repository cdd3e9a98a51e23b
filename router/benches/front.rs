//! What `kv-router`'s front adds to a request: the same 2k-token prompts sent to a mock engine
//! directly and through the front (which tokenizes them with the model's tokenizer, hashes their
//! blocks, routes them and passes the engine's answer back), one of each in turn, so both see
//! the same machine. Two mock engines with instant answers (no cost model), each behind its
//! relay; the front's tokenizer is the test corpus's BPE (`tests/data/tokenize/tiny`, with its
//! ChatML template); a second front on the same router asks the engines' `/tokenize` instead
//! (`--tokenize-via-engine`). Each request is a new connection (the mock engine closes every one, so the
//! front's connection to it is new too); the direct request carries the rank the front chose.
//!
//! ```text
//! cargo bench --locked -p kv-router --bench front                 # 2,000 pairs per form
//! cargo test --locked -p kv-router --bench front -- --quick       # seconds (CI)
//! ```
//! Options: `--pairs N`, `--tokens N` (each prompt's length in BPE tokens, 2,048).
//!
//! It prints, for text prompts and for chat messages: the direct and the front's p50 / p99, the
//! added latency (front - direct at p50 and at p99, and the p50 / p99 of each pair's
//! difference), and checks that every front answer is the engine's. The mock engine keys its
//! cache by the prompt's bytes, not by this tokenizer's ids, so the front's lookup finds no
//! prefix here; a 512-block lookup costs microseconds (the Routing bench), the tokenizing and
//! the proxying are what this measures.

mod engines;

use engines::header;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_relay_proto::hash::{EngineHashConfig, VllmHashAlgo};
use kv_relay_testkit::client::start_engine_on_free_ports;
use kv_relay_testkit::daemon::Daemon;
use kv_relay_testkit::engine::{EngineConfig, MockEngine};
use kv_relay_testkit::wire::{Engine, WireVersion};
use kv_router::front::{FrontConfig, WORKER_HEADER};
use kv_router::tokenize::{Prompt, Tokenizer};
use kv_router::{http, Router, RouterConfig};

const BLOCK: usize = 16;
const PROMPTS: usize = 8;

struct Opts {
    pairs: usize,
    tokens: usize,
    quick: bool,
}

fn opts() -> Opts {
    let mut o = Opts { pairs: 2000, tokens: 2048, quick: false };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut num = |what: &str| -> usize {
            args.next().and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("{what} needs a number"))
        };
        match a.as_str() {
            "--pairs" => o.pairs = num("--pairs"),
            "--tokens" => o.tokens = num("--tokens"),
            "--quick" => o.quick = true,
            // cargo's own arguments to a bench or test binary
            "--bench" | "--nocapture" | "--test-threads=1" => {}
            other if other.starts_with("--") => panic!("unknown option {other}"),
            _ => {}
        }
    }
    if o.quick {
        o.pairs = o.pairs.min(50);
    }
    o
}

/// One HTTP/1.1 request on a new connection, read to its end: status, head, body, time taken.
fn post(addr: SocketAddr, path: &str, headers: &str, body: &str) -> (u16, String, String, Duration) {
    let t0 = Instant::now();
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_nodelay(true).expect("nodelay");
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n{headers}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("write");
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read");
    let took = t0.elapsed();
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        kv_relay_testkit::metrics::dechunk(rest)
    } else {
        rest.to_string()
    };
    (status, head.to_string(), body, took)
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    kv_relay_testkit::kit::percentile(sorted, p).unwrap_or_default()
}

fn ms(d: Duration) -> String {
    format!("{:.3}", d.as_secs_f64() * 1e3)
}

fn signed_ms(x: f64) -> String {
    format!("{:+.3}", x * 1e3)
}

/// Prompts of `tokens` BPE tokens each, cut from the corpus (each from its own offset).
fn prompts(tok: &Tokenizer, tokens: usize) -> Vec<String> {
    let corpus = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tokenize/corpus.md"))
        .expect("the tokenizer corpus");
    let words: Vec<&str> = corpus.split_whitespace().collect();
    (0..PROMPTS)
        .map(|i| {
            let mut text = format!("Request {i}.");
            let mut w = i * 97;
            while tok.encode(&text, false).expect("encode").len() < tokens {
                // Whole sentences at a time, then words, to land on the length.
                let chunk = if tok.encode(&text, false).unwrap().len() + 64 < tokens { 32 } else { 1 };
                for _ in 0..chunk {
                    text.push(' ');
                    text.push_str(words[w % words.len()]);
                    w += 1;
                }
            }
            text
        })
        .collect()
}

struct Fleet {
    engines: Vec<Arc<MockEngine>>,
    relays: Vec<Daemon>,
    /// The front with the model's tokenizer, and one asking the engines' `/tokenize`.
    front: SocketAddr,
    front_via_engine: SocketAddr,
    stops: Vec<tokio::sync::oneshot::Sender<()>>,
    _router: Arc<Router>,
}

fn fleet(rt: &tokio::runtime::Runtime, tokenizer: Arc<Tokenizer>) -> Fleet {
    let engines: Vec<Arc<MockEngine>> = (0..2)
        .map(|_| {
            let mut cfg = EngineConfig::new(WireVersion::parse(Engine::Vllm, "0.32").expect("wire"));
            cfg.topic = "kv".into();
            cfg.block_size = BLOCK as u32;
            cfg.cache_blocks = 8192;
            cfg.metrics_listen = Some("127.0.0.1:0".parse().expect("addr"));
            let e = Arc::new(start_engine_on_free_ports(cfg, true));
            e.serve_completions();
            e
        })
        .collect();
    let (relays, follower) = engines::follow(rt, &engines);
    let _in_rt = rt.enter();
    let router = Arc::new(Router::new(follower, RouterConfig::default()));
    let hash =
        EngineHashConfig::vllm("0.32".parse().expect("version"), VllmHashAlgo::Sha256Cbor, None, BLOCK).expect("hash");
    let mut stops = Vec::new();
    let mut serve = |cfg: FrontConfig| {
        let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        rt.spawn(http::serve_with(listener, router.clone(), cfg, async {
            let _ = stopped.await;
        }));
        stops.push(stop);
        addr
    };
    let front = serve(FrontConfig { hash: Some(hash.clone()), tokenizer: Some(tokenizer), ..FrontConfig::default() });
    let front_via_engine = serve(FrontConfig { hash: Some(hash), tokenize_via_engine: true, ..FrontConfig::default() });
    engines::wait_routable(&router, 2, Duration::from_secs(30));
    Fleet { engines, relays, front, front_via_engine, stops, _router: router }
}

impl Fleet {
    fn stop(mut self, rt: &tokio::runtime::Runtime) {
        for s in self.stops.drain(..) {
            let _ = s.send(());
        }
        for r in self.relays.drain(..) {
            rt.block_on(r.stop());
        }
        drop(self.engines);
    }
}

/// One form's pairs: the direct and the front's times, in order.
fn measure(f: &Fleet, front: SocketAddr, path: &str, bodies: &[String], pairs: usize) -> [Vec<Duration>; 2] {
    // Each prompt once through the front: the direct requests go to the engine and rank it
    // chose.
    let mut route = Vec::new();
    for b in bodies {
        let (status, head, body, _) = post(front, path, "", b);
        assert_eq!(status, 200, "{body}");
        let worker = header(&head, WORKER_HEADER).expect("worker header").to_string();
        let (relay, rank) = worker.rsplit_once(' ').expect("relay rank");
        let rank: u32 = rank.parse().expect("rank");
        let engine = f
            .relays
            .iter()
            .position(|d| d.url == relay)
            .map(|i| f.engines[i].face().expect("face").addr())
            .expect("the worker's engine");
        route.push((engine, rank, body));
    }
    let (mut direct, mut through) = (Vec::with_capacity(pairs), Vec::with_capacity(pairs));
    for i in 0..pairs {
        let k = i % bodies.len();
        let (engine, rank, ref answer) = route[k];
        let rank_header = format!("X-data-parallel-rank: {rank}\r\n");
        let one = |through_front: bool| {
            let (status, _, body, took) = if through_front {
                post(front, path, "", &bodies[k])
            } else {
                post(engine, path, &rank_header, &bodies[k])
            };
            assert_eq!(status, 200, "{body}");
            // The mock engine answers every request alike but for its usage's cached tokens.
            assert_eq!(without_usage(&body), without_usage(answer), "the engine's answer, passed through");
            took
        };
        // Alternate which goes first, so neither always finds the other's connection warm.
        if i % 2 == 0 {
            direct.push(one(false));
            through.push(one(true));
        } else {
            through.push(one(true));
            direct.push(one(false));
        }
    }
    [direct, through]
}

fn without_usage(body: &str) -> serde_json::Value {
    let mut v: serde_json::Value = serde_json::from_str(body).expect("a JSON answer");
    v.as_object_mut().expect("an object").remove("usage");
    v
}

fn report(form: &str, [direct, front]: [Vec<Duration>; 2]) {
    let diff: Vec<f64> = direct.iter().zip(&front).map(|(d, f)| f.as_secs_f64() - d.as_secs_f64()).collect();
    let (mut d, mut f, mut x) = (direct.clone(), front.clone(), diff);
    d.sort();
    f.sort();
    x.sort_by(f64::total_cmp);
    let xp = |p: f64| x[((x.len() - 1) as f64 * p).round() as usize];
    println!(
        "{form:<26} {:>9} {:>9}   {:>9} {:>9}   {:>9} {:>9}   {:>9} {:>9}",
        ms(pct(&d, 0.5)),
        ms(pct(&d, 0.99)),
        ms(pct(&f, 0.5)),
        ms(pct(&f, 0.99)),
        signed_ms(pct(&f, 0.5).as_secs_f64() - pct(&d, 0.5).as_secs_f64()),
        signed_ms(pct(&f, 0.99).as_secs_f64() - pct(&d, 0.99).as_secs_f64()),
        signed_ms(xp(0.5)),
        signed_ms(xp(0.99)),
    );
}

fn main() {
    let o = opts();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tokenize/tiny");
    let tok = Arc::new(Tokenizer::from_dir(&dir).expect("the tiny tokenizer"));
    let texts = prompts(&tok, o.tokens);
    let f = fleet(&rt, tok.clone());
    let completions: Vec<String> =
        texts.iter().map(|t| serde_json::json!({"model": "m", "prompt": t, "max_tokens": 1}).to_string()).collect();
    let chats: Vec<String> = texts
        .iter()
        .map(|t| {
            serde_json::json!({"model": "m", "messages": [{"role": "user", "content": t}], "max_tokens": 1}).to_string()
        })
        .collect();
    let blocks = |path: &str, body: &str| -> usize {
        let p = Prompt::of(path, body.as_bytes()).expect("prompt");
        tok.tokens(&p).expect("tokens").len() / BLOCK
    };
    let lens: Vec<usize> = texts.iter().map(|t| tok.encode(t, false).unwrap().len()).collect();
    println!(
        "front's added latency: {} prompts of {}-{} BPE tokens ({} blocks of {BLOCK}), {} pairs per form, each a new connection",
        texts.len(),
        lens.iter().min().unwrap(),
        lens.iter().max().unwrap(),
        blocks("/v1/completions", &completions[0]),
        o.pairs
    );
    println!(
        "{:<26} {:>9} {:>9}   {:>9} {:>9}   {:>9} {:>9}   {:>9} {:>9}",
        "ms", "direct50", "direct99", "front50", "front99", "added50", "added99", "pair50", "pair99"
    );
    // The peer inside the front: tokenizing the same prompts alone, in this thread.
    for (path, bodies) in [("/v1/completions", &completions), ("/v1/chat/completions", &chats)] {
        let prompts: Vec<Prompt> = bodies.iter().map(|b| Prompt::of(path, b.as_bytes()).expect("prompt")).collect();
        let mut took: Vec<Duration> = (0..o.pairs)
            .map(|i| {
                let t = Instant::now();
                std::hint::black_box(tok.tokens(&prompts[i % prompts.len()]).expect("tokens"));
                t.elapsed()
            })
            .collect();
        took.sort();
        println!("{:<26} tokenizing alone: p50 {} ms, p99 {} ms", path, ms(pct(&took, 0.5)), ms(pct(&took, 0.99)));
    }
    let text = measure(&f, f.front, "/v1/completions", &completions, o.pairs);
    report("text prompt (completions)", text);
    let chat = measure(&f, f.front, "/v1/chat/completions", &chats, o.pairs);
    report("chat messages", chat);
    let via = measure(&f, f.front_via_engine, "/v1/completions", &completions, o.pairs);
    report("text, --tokenize-via-engine", via);
    // Token ids: nothing to tokenize; hashing, the lookup, the routing and the proxying alone.
    let ids: Vec<String> = texts
        .iter()
        .map(|t| {
            serde_json::json!({"model": "m", "prompt": tok.encode(t, true).expect("ids"), "max_tokens": 1}).to_string()
        })
        .collect();
    let hash =
        EngineHashConfig::vllm("0.32".parse().expect("version"), VllmHashAlgo::Sha256Cbor, None, BLOCK).expect("hash");
    let token_ids: Vec<Vec<u64>> = texts.iter().map(|t| tok.encode(t, true).expect("ids")).collect();
    let mut took: Vec<Duration> = (0..o.pairs)
        .map(|i| {
            let keys =
                kv_relay_proto::hash::RequestKeys { token_ids: &token_ids[i % token_ids.len()], ..Default::default() };
            let t = Instant::now();
            std::hint::black_box(kv_relay_proto::hash::block_event_hashes(&hash, &keys).expect("hashes"));
            t.elapsed()
        })
        .collect();
    took.sort();
    println!(
        "{:<26} hashing alone (sha256_cbor): p50 {} ms, p99 {} ms",
        "token ids",
        ms(pct(&took, 0.5)),
        ms(pct(&took, 0.99))
    );
    let by_ids = measure(&f, f.front, "/v1/completions", &ids, o.pairs);
    report("token ids (no tokenizing)", by_ids);
    f.stop(&rt);
}
