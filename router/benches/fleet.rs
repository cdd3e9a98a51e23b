//! A router following a fleet of relays: the fleet goals, measured by hand, and a fleet that a
//! `kv-router` can be pointed at.
//!
//! The fleet is the test kit's (`kv_relay_testkit::fleet`): every relay is the relay's own server
//! code (`kv_relay::server::serve`, the real `kv_relay.v1` contract) over its own store, on its
//! own port of 127.0.0.1, in this process; a thread commits a steady stream of records into the
//! stores in turn. The router is the real `kv-router` binary in a process of its own, so its RSS
//! and CPU are its own; it is driven and read over its HTTP API (`/workers`, `/metrics`,
//! `/match`). Parts:
//! - `router`: start to every worker ready (every relay's cursor its newest, every worker
//!   `fresh`), the router's RSS and index bytes, then a stream of records for `--load-s`
//!   seconds: the rate the fleet achieved, the router's CPU (per thread name), each relay's lag
//!   (the store's newest cursor minus the router's), `/match` latency for 512-block requests
//!   (keep-alive HTTP, one request at a time at `--match-rate` a second, from a thread at the
//!   router's niceness, 0, as a caller on its own host), with the same requests for half of
//!   `--load-s` before the stream as its peer; then, under the same
//!   stream, a relay restarts with a new epoch: the time until the router holds the new epoch at
//!   the new store's cursor, and whether any other worker left `fresh` meanwhile.
//! - `dns`: discovery through the resolver seam (the code `--relays-dns` runs, in this process):
//!   relays on 127.0.0.2.. of one port; the time from an address appearing to its relay being
//!   followed, and from its disappearing to its relay being dropped.
//! - `storm`: one relay (a child process: this binary with `--serve`, so its RSS and CPU are its
//!   own) and `--routers` followers in this process starting at once against a history too short
//!   for them: every one takes a snapshot, at most the relay's `max_snapshots` (8) at once. The
//!   time until all equal the relay, the relay's RSS and CPU.
//!
//! ```text
//! cargo bench --locked -p kv-router --bench fleet                       # 1,000 relays x 10,000 blocks
//! cargo bench --locked -p kv-router --bench fleet -- --only storm,dns
//! cargo test --locked -p kv-router --bench fleet -- --quick              # seconds (CI)
//! cargo bench --locked -p kv-router --bench fleet -- --serve --relays-file F   # serve only
//! ```
//! Options: `--relays N` (1,000), `--blocks N` live blocks a relay (10,000), `--rate R` records
//! a second a relay (50), `--ops N` block operations a record (40: half stores, half removals of
//! the oldest), `--load-s S` (20), `--match-rate R` (200), `--match-limit K` (each `/match` asks for the `K` best workers;
//! default: every worker), `--routers N` (64), `--storm-blocks N`
//! (100,000), `--only router,dns,storm`, `--router-malloc default` (glibc's own settings instead
//! of the relay's shipped `MALLOC_ARENA_MAX` and `GLIBC_TUNABLES`). A thousand relays need about 4,000 file descriptors
//! (`ulimit -n`).
//!
//! `--serve` only serves the fleet: it writes the relays' URLs to `--relays-file` (one a line,
//! what `kv-router --relays-file` reads), streams records at `--rate`, and reads commands on
//! standard input until it closes: `restart I`, `disappear I`, `slow I BYTES_PER_S` (0 stalls),
//! `recover I`.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kv_relay::store::HistoryLimits;
use kv_relay_testkit::drills::harness::{announced_addr, metric, status, wait_until, SHIPPED_ENV};
use kv_relay_testkit::fleet::{serve_store, Fleet, FleetOptions, StreamConfig};
use kv_relay_testkit::pace::Pace;
use kv_router_client::discovery::{Discovery, Lookup, Resolver};
use kv_router_client::{FollowConfig, Follower};
use serde_json::Value;

struct Opts {
    quick: bool,
    serve: bool,
    relays: usize,
    blocks: usize,
    rate: f64,
    ops: usize,
    load: Duration,
    match_rate: f64,
    /// `"limit"` in each `/match` body (`--match-limit K`); none: every worker listed.
    match_limit: Option<u64>,
    routers: usize,
    storm_blocks: usize,
    relays_file: Option<PathBuf>,
    /// kv-router runs with the relay's shipped malloc settings.
    malloc_env: bool,
    only: Vec<String>,
}

impl Opts {
    fn parse() -> Opts {
        let args: Vec<String> = std::env::args().skip(1).collect();
        let quick = args.iter().any(|a| a == "--quick");
        let get = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
        let num = |name: &str, full: f64, quick_value: f64| {
            get(name).map(|v| v.parse::<f64>().expect(name)).unwrap_or(if quick { quick_value } else { full })
        };
        Opts {
            quick,
            serve: args.iter().any(|a| a == "--serve"),
            relays: num("--relays", 1000.0, 20.0) as usize,
            blocks: num("--blocks", 10_000.0, 400.0) as usize,
            rate: num("--rate", 50.0, 50.0),
            ops: num("--ops", 40.0, 40.0) as usize,
            load: Duration::from_secs_f64(num("--load-s", 20.0, 2.0)),
            match_rate: num("--match-rate", 200.0, 50.0),
            match_limit: get("--match-limit").map(|k| k.parse().expect("--match-limit: a whole number")),
            routers: num("--routers", 64.0, 8.0) as usize,
            storm_blocks: num("--storm-blocks", 100_000.0, 2_000.0) as usize,
            relays_file: get("--relays-file").map(PathBuf::from),
            malloc_env: get("--router-malloc").as_deref() != Some("default"),
            only: get("--only").map(|s| s.split(',').map(str::to_string).collect()).unwrap_or_default(),
        }
    }

    fn part(&self, name: &str) -> bool {
        self.only.is_empty() || self.only.iter().any(|o| o == name)
    }

    /// The fleet: records of `ops` stores each until `blocks` are live.
    fn fleet(&self, relays: usize, blocks: usize, history: HistoryLimits) -> FleetOptions {
        let per = self.ops.max(1);
        FleetOptions { history, ..FleetOptions::new(relays, blocks.div_ceil(per), per) }
    }

    fn stream(&self, relays: usize) -> StreamConfig {
        StreamConfig {
            records_per_second: self.rate * relays as f64,
            stores: self.ops / 2,
            removes: self.ops - self.ops / 2,
            limit: None,
        }
    }
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn th(v: f64) -> String {
    let s = format!("{:.0}", v);
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

// ---- the router process and its HTTP API ---------------------------------------------------------

/// A keep-alive HTTP/1.1 connection to the router.
struct Http {
    addr: SocketAddr,
    conn: Option<BufReader<TcpStream>>,
}

impl Http {
    fn new(addr: SocketAddr) -> Http {
        Http { addr, conn: None }
    }

    fn call(&mut self, method: &str, path: &str, body: &[u8]) -> std::io::Result<Vec<u8>> {
        let mut last = None;
        for _ in 0..2 {
            match self.try_call(method, path, body) {
                Ok(b) => return Ok(b),
                Err(e) => {
                    self.conn = None;
                    last = Some(e);
                }
            }
        }
        Err(last.expect("an error"))
    }

    fn try_call(&mut self, method: &str, path: &str, body: &[u8]) -> std::io::Result<Vec<u8>> {
        if self.conn.is_none() {
            let s = TcpStream::connect(self.addr)?;
            s.set_nodelay(true)?;
            s.set_read_timeout(Some(Duration::from_secs(30)))?;
            self.conn = Some(BufReader::new(s));
        }
        let c = self.conn.as_mut().expect("connected");
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            self.addr,
            body.len()
        );
        let s = c.get_mut();
        s.write_all(head.as_bytes())?;
        s.write_all(body)?;
        let mut line = String::new();
        let mut length = None;
        c.read_line(&mut line)?;
        if !line.starts_with("HTTP/1.1 200") {
            return Err(std::io::Error::other(format!("{path}: {}", line.trim())));
        }
        loop {
            line.clear();
            if c.read_line(&mut line)? == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            let l = line.trim();
            if l.is_empty() {
                break;
            }
            if let Some((k, v)) = l.split_once(':') {
                if k.eq_ignore_ascii_case("content-length") {
                    length = v.trim().parse::<usize>().ok();
                }
            }
        }
        let mut out = vec![0; length.ok_or_else(|| std::io::Error::other("no content-length"))?];
        c.read_exact(&mut out)?;
        Ok(out)
    }

    fn json(&mut self, path: &str) -> Value {
        serde_json::from_slice(&self.call("GET", path, b"").expect(path)).expect("json")
    }

    fn metrics(&mut self) -> String {
        String::from_utf8_lossy(&self.call("GET", "/metrics", b"").expect("/metrics")).into_owned()
    }
}

struct Router {
    child: Child,
    addr: SocketAddr,
    /// Its standard output, kept open (it would die writing to a closed pipe).
    _out: BufReader<std::process::ChildStdout>,
}

/// Sets this thread's niceness (Linux keeps one per thread; lowering it needs CAP_SYS_NICE);
/// says so when it cannot.
fn renice_this_thread(nice: i32) {
    if let Err(e) = rustix::process::setpriority_process(Some(rustix::thread::gettid()), nice) {
        eprintln!("could not set the /match caller's niceness to {nice} ({e}): its figures include its waits behind the fleet");
    }
}

/// A thread sending `/match` requests for 512 live blocks of one relay, one at a time at `rate`
/// a second, from when `go` is set until `stop` is; their latencies (ms) go to `latencies`.
fn spawn_matcher(
    addr: SocketAddr,
    (rate, limit): (f64, Option<u64>),
    windows: Arc<Mutex<Vec<u64>>>,
    (go, stop): (Arc<AtomicBool>, Arc<AtomicBool>),
    latencies: Arc<Mutex<Vec<f64>>>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        // The caller runs at the router's niceness, as a router's caller on its own host
        // would; at the fleet's, its own wait behind the fleet's threads was in the figures.
        renice_this_thread(0);
        let mut http = Http::new(addr);
        while !go.load(Ordering::Relaxed) && !stop.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(10));
        }
        let pace = Pace::new(rate);
        let mut k = 0u64;
        while !stop.load(Ordering::Relaxed) {
            pace.wait(k);
            // 512 live blocks of one relay.
            let (relay, first) = {
                let w = windows.lock().expect("windows");
                let relay = (k as usize * 7919) % w.len();
                (relay as u64, w[relay])
            };
            let hashes: Vec<u64> = (first..first + 512).map(|b| relay << 32 | b).collect();
            let mut body = serde_json::json!({ "block_hashes": hashes });
            if let Some(k) = limit {
                body["limit"] = k.into();
            }
            let body = serde_json::to_vec(&body).expect("json");
            let t = Instant::now();
            let resp = http.call("POST", "/match", &body).expect("/match");
            let took = t.elapsed().as_secs_f64() * 1e3;
            if k == 0 {
                let v: Value = serde_json::from_slice(&resp).expect("json");
                let best = v["workers"]
                    .as_array()
                    .map_or(0, |w| w.iter().filter_map(|m| m["matched_blocks"].as_u64()).max().unwrap_or(0));
                println!(
                    "/match: {} bytes, {} workers, best match {best} blocks",
                    resp.len(),
                    v["workers"].as_array().map_or(0, Vec::len)
                );
            }
            // The first few open the connection and warm it.
            if k >= 5 {
                latencies.lock().expect("latencies").push(took);
            }
            k += 1;
        }
    })
}

impl Router {
    /// kv-router on `relays_file`, at niceness 0 whatever this process's (run the bench under
    /// `nice` to give the fleet only what the router leaves), with the relay's shipped malloc
    /// settings when `malloc_env`.
    fn start(relays_file: &Path, malloc_env: bool) -> Router {
        let nice = std::fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|s| s.rsplit_once(')').and_then(|(_, f)| f.split_whitespace().nth(16)?.parse::<i32>().ok()))
            .unwrap_or(0);
        let mut cmd = Command::new("nice");
        cmd.args(["-n", &(-nice).to_string(), env!("CARGO_BIN_EXE_kv-router")])
            .args(["--relays-file", relays_file.to_str().expect("path"), "--listen", "127.0.0.1:0"])
            .env("RUST_LOG", "kv_router_client=warn");
        if malloc_env {
            cmd.envs(SHIPPED_ENV);
        }
        let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn().expect("spawn kv-router");
        let mut out = BufReader::new(child.stdout.take().expect("stdout"));
        let addr = announced_addr(&mut out, "kv-router");
        Router { child, addr, _out: out }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Router {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `/proc/PID/status` field in KiB.
fn proc_kib(pid: u32, field: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    s.lines()
        .find_map(|l| {
            l.strip_prefix(field).and_then(|r| r.trim_start_matches(':').split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(0)
}

/// utime + stime of a `/proc/.../stat` line, in clock ticks (100 a second), and the command.
fn stat_ticks(path: &str) -> Option<(String, u64)> {
    let s = std::fs::read_to_string(path).ok()?;
    let (head, after) = s.rsplit_once(')')?;
    let comm = head.split_once('(')?.1.to_string();
    let f: Vec<&str> = after.split_whitespace().collect();
    Some((comm, f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?))
}

fn cpu_ticks(pid: u32) -> u64 {
    stat_ticks(&format!("/proc/{pid}/stat")).map_or(0, |x| x.1)
}

/// Clock ticks per thread name (threads of one name summed).
fn thread_ticks(pid: u32) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    if let Ok(rd) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for e in rd.flatten() {
            if let Some((comm, t)) = stat_ticks(&format!("{}/stat", e.path().display())) {
                *out.entry(comm).or_insert(0) += t;
            }
        }
    }
    out
}

/// Per relay URL: (epoch, cursor, syncing), and the workers' states by relay.
struct Seen {
    relays: BTreeMap<String, (u64, u64, bool)>,
    states: BTreeMap<String, String>,
}

fn seen(http: &mut Http) -> Seen {
    let v = http.json("/workers");
    let mut relays = BTreeMap::new();
    for r in v["relays"].as_array().into_iter().flatten() {
        let n = |k: &str| r[k].as_u64().unwrap_or(0);
        relays.insert(
            r["url"].as_str().unwrap_or("").to_string(),
            (n("epoch"), n("cursor"), r["syncing"].as_bool() == Some(true)),
        );
    }
    let mut states = BTreeMap::new();
    for w in v["workers"].as_array().into_iter().flatten() {
        states.insert(w["relay"].as_str().unwrap_or("").to_string(), w["state"].as_str().unwrap_or("").to_string());
    }
    Seen { relays, states }
}

/// Polls `f` every `every` for up to `limit`; the time it took.
fn poll_until(limit: Duration, every: Duration, mut f: impl FnMut() -> bool) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if f() {
            return Some(start.elapsed());
        }
        std::thread::sleep(every);
    }
    None
}

/// For each relay, the first of 512 blocks in the middle of its live set (live for the longest).
fn windows(fleet: &Fleet) -> Vec<u64> {
    fleet.relays.iter().map(|r| r.live()).map(|l| l.start + (l.end - l.start).saturating_sub(512) / 2).collect()
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1]
}

/// A matcher's latencies, taken and sorted.
fn take_sorted(latencies: &Mutex<Vec<f64>>) -> Vec<f64> {
    let mut l = std::mem::take(&mut *latencies.lock().expect("latencies"));
    l.sort_by(f64::total_cmp);
    l
}

/// `p50 / p99 / max ms` of sorted latencies.
fn spread(sorted: &[f64]) -> String {
    format!("{:.3} / {:.3} / {:.3} ms", pct(sorted, 0.5), pct(sorted, 0.99), pct(sorted, 1.0))
}

// ---- parts ---------------------------------------------------------------------------------------

fn part_router(opts: &Opts, rt: &tokio::runtime::Runtime, rows: &mut Vec<String>) {
    let n = opts.relays;
    let t = Instant::now();
    let mut fleet = rt.block_on(Fleet::start_with(opts.fleet(n, opts.blocks, HistoryLimits::default())));
    let urls = fleet.urls();
    let live: usize = fleet.relays.iter().map(|r| (r.live().end - r.live().start) as usize).sum();
    println!(
        "fleet: {n} relays, {} live blocks, filled in {:.1} s (load {})",
        th(live as f64),
        t.elapsed().as_secs_f64(),
        loadavg()
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("relays.txt");
    std::fs::write(&file, urls.join("\n") + "\n").expect("relays file");
    let newest = |fleet: &Fleet| -> BTreeMap<String, (u64, u64)> {
        fleet.relays.iter().map(|r| (r.url(), (r.store().epoch(), r.store().newest_cursor()))).collect()
    };
    let want = newest(&fleet);

    // (a) Start to every worker ready.
    let start = Instant::now();
    let router = Router::start(&file, opts.malloc_env);
    let mut http = Http::new(router.addr);
    let mut peak_rss = 0;
    // Every 250 ms: a /workers of a thousand relays is 300 KB of JSON the router writes.
    let ready = poll_until(Duration::from_secs(600), Duration::from_millis(250), || {
        peak_rss = peak_rss.max(proc_kib(router.pid(), "VmRSS"));
        let s = seen(&mut http);
        s.relays.len() == n
            && s.states.len() == n
            && s.states.values().all(|st| st == "fresh")
            && want.iter().all(|(u, &(e, c))| s.relays.get(u).is_some_and(|&(re, rc, sy)| re == e && rc == c && !sy))
    })
    .map(|_| start.elapsed());
    let load_a = loadavg();
    let m = http.metrics();
    let rss = proc_kib(router.pid(), "VmRSS");
    let index_bytes = metric(&m, "kv_router_index_bytes", &[]).unwrap_or(0.0);
    let blocks = metric(&m, "kv_router_index_blocks", &[]).unwrap_or(0.0);
    let snapshots = metric(&m, "kv_router_snapshots_total", &[]).unwrap_or(0.0);
    let secs = ready.map_or(f64::NAN, |d| d.as_secs_f64());
    println!(
        "router malloc settings: {}",
        if opts.malloc_env { "the relay's shipped ones" } else { "glibc's defaults" }
    );
    println!(
        "ready: {secs:.2} s, {} blocks indexed, RSS {} MiB, index {:.1} MiB (load {load_a})",
        th(blocks),
        rss / 1024,
        index_bytes / 1048576.0
    );
    rows.push(format!(
        "| {n} relays x {} live blocks: start to every worker ready | {secs:.2} s ({} blocks, {snapshots} snapshots) | at most 30 s | {load_a} |",
        th(opts.blocks as f64),
        th(blocks)
    ));
    rows.push(format!(
        "| router RSS with those blocks (peak while starting) | {:.0} MiB ({:.0}); index {:.0} MiB, {:.1} bytes a block | at most 600 MiB | {load_a} |",
        rss as f64 / 1024.0,
        peak_rss as f64 / 1024.0,
        index_bytes / 1048576.0,
        index_bytes / blocks.max(1.0)
    ));

    // (c0) `/match` with no stream: the same-run peer of the figures beside it.
    let idle = {
        let (stop, lat) = (Arc::new(AtomicBool::new(false)), Arc::new(Mutex::new(Vec::new())));
        let m = spawn_matcher(
            router.addr,
            (opts.match_rate, opts.match_limit),
            Arc::new(Mutex::new(windows(&fleet))),
            (Arc::new(AtomicBool::new(true)), stop.clone()),
            lat.clone(),
        );
        std::thread::sleep(opts.load / 2);
        stop.store(true, Ordering::Relaxed);
        m.join().expect("matcher");
        take_sorted(&lat)
    };
    println!("/match with no stream: {} requests, p50 / p99 / max {} (load {})", idle.len(), spread(&idle), loadavg());

    // (c, d) A stream of records; CPU, lag, /match.
    let stream = fleet.stream(opts.stream(n));
    let (cpu0, threads0, t0) = (cpu_ticks(router.pid()), thread_ticks(router.pid()), Instant::now());
    let (stop, go) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
    let latencies = Arc::new(Mutex::new(Vec::new()));
    // Updated at each lag sample: the stream removes the oldest blocks.
    let windows = Arc::new(Mutex::new(windows(&fleet)));
    let matcher = spawn_matcher(
        router.addr,
        (opts.match_rate, opts.match_limit),
        windows.clone(),
        (go.clone(), stop.clone()),
        latencies.clone(),
    );
    // The first half: the stream alone (CPU, lag); the second: /match requests beside it.
    let mut lags: Vec<u64> = Vec::new();
    let mut max_lag = 0u64;
    let mut cpu_mid = None;
    while t0.elapsed() < opts.load {
        std::thread::sleep(Duration::from_millis(if opts.quick { 300 } else { 2000 }));
        if cpu_mid.is_none() && t0.elapsed() >= opts.load / 2 {
            cpu_mid = Some((
                cpu_ticks(router.pid()),
                thread_ticks(router.pid()),
                t0.elapsed().as_secs_f64(),
                stream.records(),
            ));
            go.store(true, Ordering::Relaxed);
        }
        let s = seen(&mut http);
        *windows.lock().expect("windows") = self::windows(&fleet);
        for r in &fleet.relays {
            let lag = r.store().newest_cursor().saturating_sub(s.relays.get(&r.url()).map_or(0, |x| x.1));
            max_lag = max_lag.max(lag);
            lags.push(lag);
        }
    }
    let (cpu2, elapsed2) = (cpu_ticks(router.pid()), t0.elapsed().as_secs_f64());
    stop.store(true, Ordering::Relaxed);
    matcher.join().expect("matcher");
    let (cpu1, threads1, elapsed, records1) = cpu_mid.expect("the load's first half");
    let offered = records1 as f64 / elapsed;
    let load_c = loadavg();
    let cores = (cpu1 - cpu0) as f64 / 100.0 / elapsed;
    let cores_match = (cpu2 - cpu1) as f64 / 100.0 / (elapsed2 - elapsed);
    let mut per_thread: Vec<(String, f64)> = threads1
        .iter()
        .map(|(k, v)| (k.clone(), (v - threads0.get(k).copied().unwrap_or(0)) as f64 / 100.0 / elapsed))
        .filter(|x| x.1 >= 0.005)
        .collect();
    per_thread.sort_by(|a, b| b.1.total_cmp(&a.1));
    let per_thread = per_thread.iter().map(|(k, v)| format!("{k} {v:.2}")).collect::<Vec<_>>().join(", ");
    lags.sort_unstable();
    let p99_lag = lags.get((lags.len() * 99 / 100).min(lags.len().saturating_sub(1))).copied().unwrap_or(0);
    let per_relay = offered / n as f64;
    println!(
        "load: {} records/s offered ({} block ops/s), router {cores:.3} cores [{per_thread}], with /match {cores_match:.3}; lag p99 {p99_lag} max {max_lag} records (load {load_c})",
        th(offered),
        th(offered * opts.ops as f64)
    );
    rows.push(format!(
        "| router CPU, each relay sending {} records/s of {} block ops (goal's rate: {} ops/s) | {cores:.2} cores at {} records/s, {} block ops/s achieved ({per_thread}); {cores_match:.2} with the /match requests | at most 1 core | {load_c} |",
        opts.rate,
        opts.ops,
        th(opts.rate * n as f64 * opts.ops as f64),
        th(offered),
        th(offered * opts.ops as f64)
    ));
    rows.push(format!(
        "| relay lag under that stream (newest cursor - router's, every relay, every {} s) | p99 {p99_lag}, max {max_lag} records ({:.2} s at {per_relay:.1} records/s a relay) | no relay falls behind | {load_c} |",
        if opts.quick { 0.3 } else { 2.0 },
        max_lag as f64 / per_relay.max(1e-9)
    ));
    let lat = take_sorted(&latencies);
    println!("/match: {} requests, p50 / p99 / max {}", lat.len(), spread(&lat));
    rows.push(format!(
        "| `/match` of 512 blocks under that stream, p50 / p99 / max ({} requests, keep-alive{}) | {}; with no stream, same run ({} requests): {} | p99 at most 1 ms | {load_c} |",
        lat.len(),
        opts.match_limit.map_or(String::new(), |k| format!(", \"limit\": {k}")),
        spread(&lat),
        idle.len(),
        spread(&idle)
    ));

    // (e) A relay restarts with a new epoch, the stream still on.
    let victim = n / 2;
    let others: Vec<String> = urls.iter().enumerate().filter(|&(i, _)| i != victim).map(|(_, u)| u.clone()).collect();
    let before = seen(&mut http);
    let m0 = http.metrics();
    let t = Instant::now();
    rt.block_on(fleet.restart_new_epoch(victim, opts.blocks.div_ceil(opts.ops.max(1))));
    let down_and_refilled = t.elapsed();
    let back = Instant::now();
    let (epoch, cursor) = (fleet.relays[victim].store().epoch(), fleet.relays[victim].store().newest_cursor());
    let vurl = fleet.relays[victim].url();
    let mut disturbed = 0;
    let resynced = poll_until(Duration::from_secs(60), Duration::from_millis(50), || {
        let s = seen(&mut http);
        disturbed += others
            .iter()
            .filter(|u| {
                s.states.get(*u).is_none_or(|st| st != "fresh")
                    || s.relays.get(*u).map(|r| r.0) != before.relays.get(*u).map(|r| r.0)
            })
            .count();
        s.relays.get(&vurl).is_some_and(|&(e, c, sy)| e == epoch && c >= cursor && !sy)
    })
    .map_or(f64::NAN, |_| back.elapsed().as_secs_f64());
    let m1 = http.metrics();
    let delta = |name: &str| metric(&m1, name, &[]).unwrap_or(0.0) - metric(&m0, name, &[]).unwrap_or(0.0);
    let load_e = loadavg();
    println!(
        "restart: relay {victim} down and refilled in {:.2} s; resynced {resynced:.3} s after serving; snapshots +{}, epoch changes +{}; others not fresh or moved epoch: {disturbed} samples",
        down_and_refilled.as_secs_f64(),
        delta("kv_router_snapshots_total"),
        delta("kv_router_epoch_changes_total")
    );
    rows.push(format!(
        "| a relay restarts with a new epoch ({} blocks) under the stream: resynced and equal, from its serving again | {resynced:.3} s; snapshots +{}, epoch changes +{}; other workers not `fresh` or on another epoch: {disturbed} samples | within 2 s, no other disturbed | {load_e} |",
        th(opts.blocks as f64),
        delta("kv_router_snapshots_total"),
        delta("kv_router_epoch_changes_total")
    ));
    let report = stream.stop();
    println!("stream: {} records in {:.1} s", th(report.records as f64), report.elapsed.as_secs_f64());
    drop(router);
    rt.block_on(fleet.stop());
}

/// Addresses the test sets: a name's answer.
#[derive(Default)]
struct Answers(Mutex<Vec<std::net::IpAddr>>);

impl Resolver for Answers {
    fn lookup<'a>(&'a self, _: &'a str) -> Lookup<'a> {
        let now = self.0.lock().expect("answers").clone();
        Box::pin(async move { Ok(now) })
    }
}

fn part_dns(opts: &Opts, rt: &tokio::runtime::Runtime, rows: &mut Vec<String>) {
    let (interval, grace) = if opts.quick {
        (Duration::from_millis(200), Duration::from_millis(500))
    } else {
        (Duration::from_secs(1), Duration::from_secs(3))
    };
    const RELAYS: usize = 4;
    let dirs: Vec<_> = (0..RELAYS).map(|_| tempfile::tempdir().expect("tempdir")).collect();
    let (servers, port) = rt.block_on(async {
        let mut servers = Vec::new();
        let mut port = 0;
        for (i, d) in dirs.iter().enumerate() {
            let mut cfg = kv_relay::store::StoreConfig::new(d.path());
            cfg.cache_bytes = 1 << 20;
            let store = kv_relay::store::Store::open(cfg).expect("store");
            let addr: SocketAddr = format!("127.0.0.{}:{port}", i + 2).parse().expect("addr");
            let (addr, stop, task) = serve_store(&store, addr).await;
            port = addr.port();
            servers.push((store, stop, task));
        }
        (servers, port)
    });
    let answers = Arc::new(Answers::default());
    let follower =
        rt.block_on(async { Follower::new(FollowConfig { start_jitter: Duration::ZERO, ..FollowConfig::default() }) });
    let mut discovery = Discovery::new(follower.clone(), answers.clone()).with_grace(grace);
    discovery.add_name(format!("relays.fleet.test:{port}").parse().expect("name"));
    let stop = Arc::new(tokio::sync::Notify::new());
    let s = stop.clone();
    let task = rt.spawn(async move { discovery.run(interval, async move { s.notified().await }).await });
    let url = |i: usize| format!("http://127.0.0.{}:{port}", i + 2);
    let (mut added, mut dropped) = (Vec::new(), Vec::new());
    for i in 0..RELAYS {
        let ip: std::net::IpAddr = format!("127.0.0.{}", i + 2).parse().expect("ip");
        answers.0.lock().expect("answers").push(ip);
        let followed =
            wait_until(Duration::from_secs(30), || follower.relays().iter().any(|r| *r.url == url(i) && r.connected));
        added.push(followed.map_or(f64::NAN, |d| d.as_secs_f64()));
    }
    for i in 0..RELAYS {
        answers.0.lock().expect("answers").retain(|a| a.to_string() != format!("127.0.0.{}", i + 2));
        let gone = wait_until(Duration::from_secs(30), || follower.relays().iter().all(|r| *r.url != url(i)));
        dropped.push(gone.map_or(f64::NAN, |d| d.as_secs_f64()));
    }
    stop.notify_one();
    let _ = rt.block_on(task);
    rt.block_on(async {
        for (_, stop, task) in servers {
            let _ = stop.send(());
            let _ = task.await;
        }
    });
    let fmt = |v: &[f64]| v.iter().map(|x| format!("{x:.2}")).collect::<Vec<_>>().join(", ");
    let load = loadavg();
    println!(
        "dns: interval {interval:?}, grace {grace:?}: added after {} s; dropped after {} s (load {load})",
        fmt(&added),
        fmt(&dropped)
    );
    rows.push(format!(
        "| DNS (resolver seam, interval {:.1} s, grace {:.1} s): an address added, followed after / removed, dropped after | {} s / {} s | within interval + 1 s / after the grace | {load} |",
        interval.as_secs_f64(),
        grace.as_secs_f64(),
        fmt(&added),
        fmt(&dropped)
    ));
}

fn part_storm(opts: &Opts, rt: &tokio::runtime::Runtime, rows: &mut Vec<String>) {
    let exe = std::env::current_exe().expect("this binary");
    let mut child = Command::new(exe)
        .args(["--serve", "--relays", "1", "--rate", "0", "--history", "10"])
        .args(["--blocks", &opts.storm_blocks.to_string(), "--ops", &opts.ops.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn the relay");
    let mut out = BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = String::new();
    out.read_line(&mut line).expect("the relay's URL");
    let url = line.trim().to_string();
    assert!(url.starts_with("http://"), "the relay said {url:?}");
    let st = status(&url).expect("status");
    let pid = child.id();
    let (rss0, cpu0) = (proc_kib(pid, "VmRSS"), cpu_ticks(pid));
    let t = Instant::now();
    let followers: Vec<Follower> = rt.block_on(async {
        (0..opts.routers)
            .map(|_| {
                let f = Follower::new(FollowConfig { start_jitter: Duration::ZERO, ..FollowConfig::default() });
                f.add_relay(&url).expect("add");
                f
            })
            .collect()
    });
    let mut peak = rss0;
    let equal = wait_until(Duration::from_secs(600), || {
        peak = peak.max(proc_kib(pid, "VmRSS"));
        followers.iter().all(|f| {
            f.relays().first().is_some_and(|r| r.epoch == st.epoch && r.cursor == st.newest_cursor && !r.syncing)
        })
    });
    let secs = equal.map_or(f64::NAN, |_| t.elapsed().as_secs_f64());
    let cpu = (cpu_ticks(pid) - cpu0) as f64 / 100.0;
    let blocks: Vec<usize> = followers.iter().map(|f| f.index().stats().blocks).collect();
    let snapshots: u64 = followers.iter().map(|f| f.counters().snapshots).sum();
    assert!(blocks.iter().all(|&b| b == opts.storm_blocks.div_ceil(opts.ops) * opts.ops), "{blocks:?}");
    let hwm = proc_kib(pid, "VmHWM");
    rt.block_on(async {
        for f in followers {
            f.shutdown().await;
        }
    });
    drop(child.stdin.take());
    let _ = child.wait();
    let load = loadavg();
    println!(
        "storm: {} routers, {} blocks: all equal after {secs:.2} s, {snapshots} snapshots; relay RSS {} -> peak {} MiB (VmHWM {}), CPU {cpu:.2} s ({:.2} cores) (load {load})",
        opts.routers,
        th(opts.storm_blocks as f64),
        rss0 / 1024,
        peak / 1024,
        hwm / 1024,
        cpu / secs
    );
    rows.push(format!(
        "| one relay of {} live blocks, {} routers starting at once (max_snapshots 8): all equal after | {secs:.2} s ({snapshots} snapshots); relay RSS {:.0} MiB before, peak {:.0}; relay CPU {cpu:.2} s ({:.2} cores) | none set | {load} |",
        th(opts.storm_blocks as f64),
        opts.routers,
        rss0 as f64 / 1024.0,
        hwm as f64 / 1024.0,
        cpu / secs
    ));
}

/// `--serve`: the fleet alone, until standard input closes.
fn serve(opts: &Opts, rt: &tokio::runtime::Runtime) {
    let args: Vec<String> = std::env::args().collect();
    let history = args.iter().position(|a| a == "--history").and_then(|i| args.get(i + 1)).map_or(
        HistoryLimits::default(),
        |h| HistoryLimits { max_batches: h.parse().expect("--history"), ..HistoryLimits::default() },
    );
    let mut fleet = rt.block_on(Fleet::start_with(opts.fleet(opts.relays, opts.blocks, history)));
    let urls = fleet.urls();
    match &opts.relays_file {
        Some(f) => {
            std::fs::write(f, urls.join("\n") + "\n").expect("relays file");
            eprintln!("{} relays in {}", urls.len(), f.display());
        }
        None => {
            for u in &urls {
                println!("{u}");
            }
        }
    }
    let _ = std::io::stdout().flush();
    let stream = (opts.rate > 0.0).then(|| fleet.stream(opts.stream(opts.relays)));
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let w: Vec<&str> = line.split_whitespace().collect();
        let i = |k: usize| w.get(k).and_then(|v| v.parse::<usize>().ok()).filter(|&i| i < fleet.relays.len());
        match (w.first().copied(), i(1)) {
            (Some("restart"), Some(i)) => {
                rt.block_on(fleet.restart_new_epoch(i, opts.blocks.div_ceil(opts.ops.max(1))))
            }
            (Some("disappear"), Some(i)) => rt.block_on(fleet.disappear(i)),
            (Some("slow"), Some(i)) => rt.block_on(fleet.slow(i, w.get(2).and_then(|v| v.parse().ok()).unwrap_or(0))),
            (Some("recover"), Some(i)) => fleet.recover(i),
            _ => eprintln!("commands: restart I, disappear I, slow I BYTES_PER_S, recover I"),
        }
    }
    if let Some(s) = stream {
        let r = s.stop();
        eprintln!("{} records, {:.0} a second", r.records, r.rate());
    }
    rt.block_on(fleet.stop());
}

fn main() {
    let opts = Opts::parse();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    if opts.serve {
        serve(&opts, &rt);
        return;
    }
    println!(
        "router fleet ({} mode): {} relays x {} blocks, {} records/s a relay of {} ops; load {}",
        if opts.quick { "quick" } else { "full" },
        opts.relays,
        opts.blocks,
        opts.rate,
        opts.ops,
        loadavg()
    );
    let mut rows = Vec::new();
    if opts.part("dns") {
        part_dns(&opts, &rt, &mut rows);
    }
    if opts.part("storm") {
        part_storm(&opts, &rt, &mut rows);
    }
    if opts.part("router") {
        part_router(&opts, &rt, &mut rows);
    }
    println!("\n| measure | figure | goal | load |\n|---|---|---|---|");
    for r in rows {
        println!("{r}");
    }
}
