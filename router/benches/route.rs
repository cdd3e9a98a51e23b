//! What a routing decision costs: `Router::route` (the index lookup, the gating of every
//! worker, the policy) and its `report`, at 128 and 1,024 workers, paced at `--rate` decisions a
//! second on one thread, beside a stream of batches that republishes every worker's load; its
//! peer in the same run is `Follower::matches` alone (the lookup and the workers' views the
//! decision reads). Then `POST /route` + `POST /route/report` over keep-alive HTTP against the
//! router's API on a thread of its own, beside the same stream, with `POST /match` of the same
//! request as its peer; and 1,000 misses over idle workers, to show how they spread.
//!
//! ```text
//! cargo bench --locked -p kv-router --bench route                   # 16 x 8 and 128 x 8 relays x ranks
//! cargo test --locked -p kv-router --bench route -- --quick          # seconds (CI)
//! ```
//! Options: `--rate R` decisions a second (10,000), `--seconds S` per measurement (5),
//! `--shapes 16x8,128x8` (relays x ranks).

mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_relay_testkit::pace::Pace;
use kv_router::{Outcome, Router, RouterConfig, Tokens};
use kv_router_client::MatchOptions;
use support::{loadavg, own, shared, thread_cpu, Followed, Relay};

struct Opts {
    rate: f64,
    seconds: f64,
    shapes: Vec<(usize, usize)>,
    quick: bool,
}

impl Opts {
    fn parse() -> Opts {
        let args: Vec<String> = std::env::args().skip(1).collect();
        let quick = args.iter().any(|a| a == "--quick");
        let get = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
        let num = |name: &str, full: f64, q: f64| {
            get(name).map(|v| v.parse().expect(name)).unwrap_or(if quick { q } else { full })
        };
        let shapes = get("--shapes").unwrap_or_else(|| if quick { "4x2".into() } else { "16x8,128x8".into() });
        let shapes = shapes
            .split(',')
            .map(|s| {
                let (a, b) = s.split_once('x').expect("--shapes RELAYSxRANKS");
                (a.parse().expect("relays"), b.parse().expect("ranks"))
            })
            .collect();
        Opts { rate: num("--rate", 10_000.0, 2_000.0), seconds: num("--seconds", 5.0, 0.5), shapes, quick }
    }
}

/// Sorted microseconds: p50, p99, max.
fn spread(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    let q = |p: f64| v[((v.len() - 1) as f64 * p).round() as usize];
    (q(0.5), q(0.99), v[v.len() - 1])
}

/// `n` paced calls of `f` at `rate` a second: each call's wall time (µs) and the thread's CPU.
fn paced(rate: f64, n: usize, mut f: impl FnMut(usize)) -> (Vec<f64>, Duration) {
    let pace = Pace::new(rate);
    let c = thread_cpu();
    let mut wall = Vec::with_capacity(n);
    for k in 0..n {
        pace.wait(k as u64);
        let t = Instant::now();
        f(k);
        wall.push(t.elapsed().as_secs_f64() * 1e6);
    }
    (wall, thread_cpu() - c)
}

/// A keep-alive HTTP/1.1 client: one POST at a time, its status and body.
struct Http {
    r: BufReader<TcpStream>,
    addr: SocketAddr,
}

impl Http {
    fn new(addr: SocketAddr) -> Http {
        let s = TcpStream::connect(addr).expect("connect to the router");
        s.set_nodelay(true).expect("nodelay");
        Http { r: BufReader::new(s), addr }
    }

    fn post(&mut self, path: &str, body: &str) -> (u16, String) {
        let req = format!(
            "POST {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            self.addr,
            body.len()
        );
        self.r.get_mut().write_all(req.as_bytes()).expect("send");
        let mut line = String::new();
        self.r.read_line(&mut line).expect("status line");
        let status = line.split_whitespace().nth(1).and_then(|c| c.parse().ok()).expect("status");
        let mut len = 0;
        loop {
            line.clear();
            self.r.read_line(&mut line).expect("header");
            if line == "\r\n" {
                break;
            }
            if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                len = v.trim().parse().expect("length");
            }
        }
        let mut buf = vec![0; len];
        self.r.read_exact(&mut buf).expect("body");
        (status, String::from_utf8(buf).expect("utf-8"))
    }
}

fn request_id(body: &str) -> u64 {
    let v: serde_json::Value = serde_json::from_str(body).expect("json");
    v["request_id"].as_u64().unwrap_or_else(|| panic!("no request_id in {body}"))
}

fn main() {
    let opts = Opts::parse();
    println!(
        "kv-router decision bench: {} decisions/s, {} s a measurement (load {})",
        opts.rate,
        opts.seconds,
        loadavg()
    );
    for &(n_relays, ranks) in &opts.shapes {
        shape(&opts, n_relays, ranks);
    }
}

fn shape(opts: &Opts, n_relays: usize, ranks: usize) {
    let workers = n_relays * ranks;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().expect("runtime");
    let relays: Vec<Relay> = (0..n_relays).map(|i| Relay::new(i, ranks)).collect();
    let followed = Followed::start(&rt, &relays, workers);
    let f = &followed.follower;
    let router = Arc::new(Router::new(f.clone(), RouterConfig { seed: Some(1), ..RouterConfig::default() }));
    println!(
        "\n{n_relays} relays x {ranks} ranks = {workers} workers, followed in {:.2} s",
        followed.took.as_secs_f64()
    );

    // The stream: an empty batch with a new load to each worker in turn, once a second each.
    let stop = Arc::new(AtomicBool::new(false));
    let stream = {
        let (stop, mut relays, rate) = (stop.clone(), relays, workers as f64);
        std::thread::spawn(move || {
            let pace = Pace::new(rate);
            let mut k = 0u64;
            while !stop.load(Ordering::Relaxed) {
                pace.wait(k);
                let g = k as usize % workers;
                relays[g / ranks].commit(g % ranks, Vec::new(), (k % 4) as f64);
                k += 1;
            }
            relays
        })
    };

    // A worker's own 512 blocks (one worker holds them: cached_prefix) and the shared chain
    // (a tenth hold 256 in the host tier).
    let kinds = [("own 512 blocks", own(7)), ("shared 512-block chain", shared())];
    let n = (opts.rate * opts.seconds) as usize;
    for (kind, hashes) in &kinds {
        let chosen = router.route(hashes).expect("a route");
        router.report(chosen.request_id, Outcome::Done, Tokens::default()).expect("report");
        // Interleaved halves: the peer, the decision, the peer, the decision.
        let (mut dec, mut peer) = (Vec::new(), Vec::new());
        let (mut dec_cpu, mut peer_cpu) = (Duration::ZERO, Duration::ZERO);
        for _ in 0..2 {
            let (w, c) = paced(opts.rate, n / 2, |_| {
                std::hint::black_box(f.matches(hashes, MatchOptions::default()));
            });
            peer.extend(w);
            peer_cpu += c;
            let (w, c) = paced(opts.rate, n / 2, |_| {
                let r = router.route(hashes).expect("a route");
                router.report(r.request_id, Outcome::Done, Tokens::default()).expect("report");
            });
            dec.extend(w);
            dec_cpu += c;
        }
        let (d50, d99, dmax) = spread(dec);
        let (p50, p99, pmax) = spread(peer);
        println!(
            "  {kind}: route + report p50 {d50:.2} us p99 {d99:.2} us max {dmax:.0} us, CPU {:.2} us each | \
             matches alone p50 {p50:.2} us p99 {p99:.2} us max {pmax:.0} us, CPU {:.2} us | p99 ratio {:.2}",
            dec_cpu.as_secs_f64() * 1e6 / (n / 2 * 2) as f64,
            peer_cpu.as_secs_f64() * 1e6 / (n / 2 * 2) as f64,
            d99 / p99
        );
        println!(
            "    chosen: {} rank {} ({:?}, {} of {} blocks)",
            chosen.relay, chosen.dp_rank, chosen.reason, chosen.matched_blocks, chosen.blocks
        );
    }

    // Over HTTP, on a thread of its own as kv-router runs it.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.set_nonblocking(true).expect("nonblocking");
    let addr = listener.local_addr().expect("address");
    let (stop_http, stopped) = tokio::sync::oneshot::channel::<()>();
    let http_thread = {
        let router = router.clone();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
                kv_router::http::serve(listener, router, async move {
                    let _ = stopped.await;
                })
                .await
                .expect("serve");
            });
        })
    };
    let body = format!("{{\"block_hashes\": {}}}", serde_json::to_string(&kinds[1].1).expect("json"));
    let mut http = Http::new(addr);
    let http_rate = if opts.quick { 500.0 } else { 1_000.0 };
    let m = (http_rate * opts.seconds) as usize;
    let (mut route, mut matched) = (Vec::new(), Vec::new());
    for _ in 0..2 {
        let (w, _) = paced(http_rate, m / 2, |_| {
            let (status, text) = http.post("/match", &body);
            assert_eq!(status, 200, "{text}");
        });
        matched.extend(w);
        let (w, _) = paced(http_rate, m / 2, |_| {
            let (status, text) = http.post("/route", &body);
            assert_eq!(status, 200, "{text}");
            let report = format!("{{\"request_id\": {}, \"outcome\": \"done\"}}", request_id(&text));
            let (status, text) = http.post("/route/report", &report);
            assert_eq!(status, 200, "{text}");
        });
        route.extend(w);
    }
    let (r50, r99, rmax) = spread(route);
    let (m50, m99, mmax) = spread(matched);
    println!(
        "  HTTP, shared chain, {http_rate}/s: POST /route + /route/report p50 {:.3} ms p99 {:.3} ms max {:.3} ms | \
         POST /match p50 {:.3} ms p99 {:.3} ms max {:.3} ms",
        r50 / 1e3,
        r99 / 1e3,
        rmax / 1e3,
        m50 / 1e3,
        m99 / 1e3,
        mmax / 1e3
    );

    // 1,000 misses over the idle workers, none reported until the end.
    let miss: Vec<u64> = (0..16).map(|n| 0xdead_0000_0000 | n).collect();
    let mut got = vec![0u32; workers];
    let ids: Vec<(u64, usize)> = (0..1000)
        .map(|_| {
            let r = router.route(&miss).expect("a route");
            let w =
                followed.urls.iter().position(|u| **u == *r.relay).expect("a known relay") * ranks + r.dp_rank as usize;
            got[w] += 1;
            (r.request_id, w)
        })
        .collect();
    for (id, _) in ids {
        router.report(id, Outcome::Done, Tokens::default()).expect("report");
    }
    let mean = 1000.0 / workers as f64;
    let (least, most) = (got.iter().min().copied().unwrap_or(0), got.iter().max().copied().unwrap_or(0));
    println!(
        "  1,000 misses over {workers} idle workers: fewest {least}, most {most} (mean {mean:.2}; most/mean {:.2}); every worker some: {}",
        f64::from(most) / mean,
        least > 0
    );
    // The goal is stated for 128 workers; over more, 1,000 misses are about one per worker.
    if workers <= 128 {
        assert!(least > 0 && f64::from(most) <= 3.0 * mean, "misses spread unevenly: {got:?}");
    }

    stop.store(true, Ordering::Relaxed);
    let relays = stream.join().expect("stream");
    let _ = stop_http.send(());
    http_thread.join().expect("http thread");
    followed.stop(&rt);
    drop(relays);
    println!("load after: {}", loadavg());
}
