//! The routing drills: four mock engines, each with its HTTP face (`/health`, `/metrics`,
//! `/v1/completions` served through its prefix cache) and its `kv-relay` process; the
//! `kv-router` binary follows the relays (through a [`Proxy`] each, to cut a host off) and serves
//! its OpenAI front; clients post completions through it all along. Each drill injects one fault
//! into one worker and reads, from the router's own `GET /workers`, when the worker left routing,
//! whether anything was routed to it while out, and when it came back.

use super::harness::{announced_addr, engine_with, wait_until, workspace_bin, EngineSpec, RelayProc};
use super::proxy::Proxy;
use super::{ms, Report, Scale};
use crate::engine::MockEngine;
use crate::face::Fault;
use crate::metrics::http_post;
use crate::wire::{Engine, WireVersion};
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

/// Tokens per block of every engine (and of the router's hashing).
const BLOCK: usize = 4;
/// How the router hashes the clients' token-id prompts: as the mock engines do.
const HASH: &str = r#"{"engine": "vllm", "version": "0.32", "algo": "sha256_cbor", "block_size": 4}"#;
/// The relays' default wedge bound (`--engine-wedge-secs`).
const WEDGE: Duration = Duration::from_secs(3);
/// The bound for a dead, cut-off or frozen worker to leave routing, and for a killed
/// one to come back.
const OUT_WITHIN: Duration = Duration::from_millis(2500);

/// One worker's engine: in this process (faults on its face), or a `mock-engine` process (to
/// be stopped with SIGSTOP).
enum EngineKind {
    InProcess(Arc<MockEngine>),
    Process { child: Child, _stdin: ChildStdin },
}

struct Member {
    engine: EngineKind,
    /// The engine's base URL, as its relay reports it and the router's `/workers` shows it.
    url: String,
    relay: RelayProc,
    proxy: Proxy,
}

impl Member {
    fn engine(&self) -> &Arc<MockEngine> {
        match &self.engine {
            EngineKind::InProcess(e) => e,
            EngineKind::Process { .. } => panic!("a process engine has no in-process handle"),
        }
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        if let EngineKind::Process { child, .. } = &mut self.engine {
            let _ = signal(child.id(), "CONT");
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// `kill -<sig> pid`.
fn signal(pid: u32, sig: &str) -> std::io::Result<()> {
    let st = Command::new("kill").args([format!("-{sig}"), pid.to_string()]).status()?;
    if st.success() {
        Ok(())
    } else {
        Err(std::io::Error::other(format!("kill -{sig} {pid}: {st}")))
    }
}

/// A `mock-engine` process (one rank, its face on a free port), once it has printed its
/// endpoints.
fn engine_process(log: &std::path::Path) -> (EngineKind, EngineSpec, String) {
    let bin = workspace_bin("mock-engine", "MOCK_ENGINE_BIN");
    let log = std::fs::File::create(log).expect("engine log");
    let mut child = Command::new(&bin)
        .args(["--endpoint", "tcp://127.0.0.1:0", "--replay-endpoint", "tcp://127.0.0.1:0", "--topic", "kv"])
        .args(["--block-size", &BLOCK.to_string(), "--cache-blocks", "256", "--http-listen", "127.0.0.1:0"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(log)
        .spawn()
        .unwrap_or_else(|e| panic!("starting {}: {e} (cargo build --workspace --bins)", bin.display()));
    let mut out = BufReader::new(child.stdout.take().expect("stdout"));
    let ready = loop {
        let mut line = String::new();
        assert!(out.read_line(&mut line).expect("mock-engine's output") > 0, "mock-engine exited at start");
        if let Some(j) = line.strip_prefix("ready ") {
            break serde_json::from_str::<Value>(j).expect("ready JSON");
        }
    };
    // Its later output (command answers) is not read: drain it so that it never blocks.
    std::thread::spawn(move || for _ in out.lines() {});
    let rank = &ready["ranks"][0];
    let spec = EngineSpec {
        endpoint: rank["publisher"].as_str().expect("publisher").to_string(),
        replay_endpoint: rank["replay"].as_str().expect("replay").to_string(),
        dp_size: 1,
        topic: "kv".into(),
        metrics_url: ready["metrics"].as_str().map(str::to_string),
    };
    let url = ready["url"].as_str().expect("url").to_string();
    let stdin = child.stdin.take().expect("stdin");
    (EngineKind::Process { child, _stdin: stdin }, spec, url)
}

/// The `kv-router` binary following the members' proxies, its front on `listen`.
struct RouterProc {
    child: Child,
    addr: SocketAddr,
}

impl RouterProc {
    fn start(relays: &[String], listen: SocketAddr, log: &std::path::Path) -> RouterProc {
        let bin = workspace_bin("kv-router", "KV_ROUTER_BIN");
        let log = std::fs::OpenOptions::new().create(true).append(true).open(log).expect("router log");
        let mut cmd = Command::new(&bin);
        for r in relays {
            cmd.args(["--relay", r]);
        }
        let mut child = cmd
            .args(["--listen", &listen.to_string(), "--start-jitter-ms", "0", "--engine-hash", HASH])
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e} (cargo build --workspace --bins)", bin.display()));
        let mut out = BufReader::new(child.stdout.take().expect("stdout"));
        let addr = announced_addr(&mut out, "kv-router");
        std::thread::spawn(move || for _ in out.lines() {});
        RouterProc { child, addr }
    }

    fn rss_kib(&self) -> u64 {
        crate::kit::proc_status(self.child.id(), "VmRSS").unwrap_or(0)
    }
}

impl Drop for RouterProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A worker as the router's `/workers` shows it.
#[derive(Debug, Clone, Default)]
struct View {
    /// `routable`, `probing` or `out`.
    routing: String,
    cause: Option<String>,
    routed: u64,
    held_blocks: u64,
}

impl View {
    fn routable(&self) -> bool {
        self.routing == "routable"
    }

    /// Not out: routable, or taking its probe.
    fn back(&self) -> bool {
        self.routing != "out"
    }
}

/// What the clients saw.
#[derive(Debug, Default)]
struct ClientStats {
    ok: AtomicU64,
    failed: AtomicU64,
}

/// Clients posting token-id completions through the router's front: most share one of 24
/// four-block prefixes (so the cache decides where they go), the rest are misses.
struct Clients {
    stop: Arc<AtomicBool>,
    /// Each request holds it for reading; [`Clients::hold`] takes it for writing.
    gate: Arc<RwLock<()>>,
    stats: Arc<ClientStats>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

/// Client threads, and the pause between each one's requests (40 requests a second in all).
const CLIENT_THREADS: u64 = 8;
const CLIENT_PAUSE: Duration = Duration::from_millis(200);

impl Clients {
    fn start(front: SocketAddr) -> Clients {
        let stop = Arc::new(AtomicBool::new(false));
        let gate = Arc::new(RwLock::new(()));
        let stats = Arc::new(ClientStats::default());
        let threads = (0..CLIENT_THREADS)
            .map(|t| {
                let (stop, gate, stats) = (stop.clone(), gate.clone(), stats.clone());
                std::thread::spawn(move || {
                    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (t + 1);
                    let mut next = move || {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        x
                    };
                    while !stop.load(Ordering::SeqCst) {
                        let r = next();
                        let mut prompt: Vec<u64> = if r % 10 < 7 {
                            let doc = (r >> 8) % 24;
                            (0..4 * BLOCK as u64).map(|i| 1 + doc * 100 + i).collect()
                        } else {
                            Vec::new()
                        };
                        let unique = if prompt.is_empty() { 3 * BLOCK } else { BLOCK };
                        prompt.extend((0..unique).map(|_| 10_000 + next() % 1_000_000));
                        let body = serde_json::json!({"model": "m", "prompt": prompt, "max_tokens": 4}).to_string();
                        let ok = {
                            let _g = gate.read().expect("gate");
                            matches!(http_post(front, "/v1/completions", &[], &body), Ok((200, _)))
                        };
                        let c = if ok { &stats.ok } else { &stats.failed };
                        c.fetch_add(1, Ordering::Relaxed);
                        std::thread::sleep(CLIENT_PAUSE);
                    }
                })
            })
            .collect();
        Clients { stop, gate, stats, threads }
    }

    /// Runs `f` with no client request in flight and none starting.
    fn hold<T>(&self, f: impl FnOnce() -> T) -> T {
        let _g = self.gate.write().expect("gate");
        f()
    }

    fn counts(&self) -> (u64, u64) {
        (self.stats.ok.load(Ordering::Relaxed), self.stats.failed.load(Ordering::Relaxed))
    }
}

impl Drop for Clients {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// The fleet: members, the router, the clients.
struct Fleet {
    // Dropped in this order: clients, router, members (relays, proxies, engines), runtime, dir.
    clients: Option<Clients>,
    router: Option<RouterProc>,
    members: Vec<Member>,
    /// The proxies' runtime.
    _rt: tokio::runtime::Runtime,
    dir: tempfile::TempDir,
}

impl Fleet {
    /// `in_process` engines in this process and `processes` `mock-engine` processes, each with
    /// its relay and proxy; the router; the clients; every worker routed to at least once.
    fn start(in_process: usize, processes: usize) -> Result<Fleet, String> {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
        let dir = tempfile::tempdir().expect("temp dir");
        let mut members = Vec::new();
        for i in 0..in_process + processes {
            let log = dir.path().join(format!("relay-{i}.log"));
            let state = dir.path().join(format!("state-{i}"));
            let (engine, relay, url) = if i < in_process {
                let wire = WireVersion::parse(Engine::Vllm, "0.32").expect("wire");
                let e = engine_with(wire, 1, 10_000, |c| {
                    c.cache_blocks = 256;
                    c.host_tier_blocks = 0;
                });
                e.serve_completions();
                let relay = RelayProc::start(&e, &state, &log, &[]);
                let url = e.url().expect("the face's URL");
                (EngineKind::InProcess(e), relay, url)
            } else {
                let (engine, spec, url) = engine_process(&dir.path().join(format!("engine-{i}.log")));
                (engine, RelayProc::start_for(&spec, &state, &log, &[]), url)
            };
            let proxy = Proxy::start(rt.handle(), relay.listen);
            members.push(Member { engine, url, relay, proxy });
        }
        let mut f = Fleet { clients: None, router: None, members, _rt: rt, dir };
        f.start_router("127.0.0.1:0".parse().expect("addr"));
        f.clients = Some(Clients::start(f.front()));
        let all_routed = wait_until(Duration::from_secs(20), || {
            let v = f.views();
            v.len() == f.members.len() && v.iter().all(|w| w.as_ref().is_some_and(|w| w.routable() && w.routed >= 3))
        });
        if all_routed.is_none() {
            return Err(format!("the fleet never routed to every worker: {:?}", f.views()));
        }
        Ok(f)
    }

    fn start_router(&mut self, listen: SocketAddr) {
        let relays: Vec<String> = self.members.iter().map(|m| m.proxy.url()).collect();
        self.router = Some(RouterProc::start(&relays, listen, &self.dir.path().join("router.log")));
    }

    fn router(&self) -> &RouterProc {
        self.router.as_ref().expect("a router")
    }

    fn front(&self) -> SocketAddr {
        self.router().addr
    }

    fn clients(&self) -> &Clients {
        self.clients.as_ref().expect("clients")
    }

    /// Each member's worker as `/workers` shows it now (`None`: not listed, or no answer).
    fn views(&self) -> Vec<Option<View>> {
        let body = super::harness::http_get(self.front(), "/workers").unwrap_or_default();
        let workers = serde_json::from_str::<Value>(&body).ok().map(|v| v["workers"].clone()).unwrap_or_default();
        let workers = workers.as_array().cloned().unwrap_or_default();
        self.members
            .iter()
            .map(|m| {
                let w = workers.iter().find(|w| w["engine_url"].as_str() == Some(m.url.as_str()))?;
                let r = &w["routing"];
                Some(View {
                    routing: r["routing"].as_str()?.to_string(),
                    cause: r["cause"].as_str().map(str::to_string),
                    routed: r["routed"].as_u64()?,
                    held_blocks: w["held_blocks"].as_u64()?,
                })
            })
            .collect()
    }

    fn view(&self, member: usize) -> View {
        self.views().swap_remove(member).unwrap_or_default()
    }

    /// How long until `member`'s view satisfies `pred` (polled every 10 ms), within `limit`.
    fn wait_view(&self, member: usize, limit: Duration, pred: impl Fn(&View) -> bool) -> Option<Duration> {
        wait_until(limit, || pred(&self.view(member)))
    }

    /// The router's log, for a failure's report.
    fn router_log(&self) -> String {
        let s = std::fs::read_to_string(self.dir.path().join("router.log")).unwrap_or_default();
        s.lines().rev().take(20).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n")
    }
}

/// The out-and-back drills' common steps: `fault` is injected into member `m` at `t0`; the
/// worker must leave routing within `out_within`; nothing is routed to it for `hold_out`
/// while the fault lasts; `heal` ends it; it must be back within `back_within`.
struct OutAndBack {
    member: usize,
    out_within: Duration,
    hold_out: Duration,
    back_within: Duration,
    /// Back means routable (`true`), or not out (taking its probe counts).
    back_routable: bool,
}

impl OutAndBack {
    fn run(&self, rep: &mut Report, f: &Fleet, fault: impl FnOnce(), heal: impl FnOnce()) {
        let m = self.member;
        let (ok0, failed0) = f.clients().counts();
        fault();
        let Some(out) = f.wait_view(m, self.out_within + Duration::from_secs(10), |v| !v.back()) else {
            let relay = f.members[m].relay.log_tail();
            rep.check(
                false,
                format!("never out of routing: {:?}\nrouter: {}\nrelay: {relay}", f.view(m), f.router_log()),
            );
            heal();
            return;
        };
        let v = f.view(m);
        rep.measure(format!("out of routing after {} (cause {})", ms(out), v.cause.as_deref().unwrap_or("-")));
        rep.check(out <= self.out_within, format!("out after {} > {}", ms(out), ms(self.out_within)));
        let routed_at_out = v.routed;
        std::thread::sleep(self.hold_out);
        let v = f.view(m);
        rep.measure(format!("routed to it in the {} out: {}", ms(self.hold_out), v.routed - routed_at_out));
        rep.check(v.routed == routed_at_out, format!("{} routed to it while out", v.routed - routed_at_out));
        rep.check(!v.back(), format!("back before the fault ended: {v:?}"));
        heal();
        let pred = |v: &View| if self.back_routable { v.routable() } else { v.back() };
        match f.wait_view(m, self.back_within + Duration::from_secs(10), pred) {
            Some(back) => {
                rep.measure(format!("back after {} ({})", ms(back), f.view(m).routing));
                rep.check(back <= self.back_within, format!("back after {} > {}", ms(back), ms(self.back_within)));
            }
            None => {
                let relay = f.members[m].relay.log_tail();
                rep.check(false, format!("never back: {:?}\nrouter: {}\nrelay: {relay}", f.view(m), f.router_log()));
            }
        }
        // Served again: a request reaches it.
        let routed = f.view(m).routed;
        let served = f.wait_view(m, Duration::from_secs(10), |v| v.routed > routed && v.routable());
        rep.check(served.is_some(), format!("never routed to after its return: {:?}", f.view(m)));
        let (ok, failed) = f.clients().counts();
        rep.measure(format!("client requests during the drill: {} served, {} failed", ok - ok0, failed - failed0));
    }
}

fn fleet_or_fail(rep: &mut Report, in_process: usize, processes: usize) -> Option<Fleet> {
    match Fleet::start(in_process, processes) {
        Ok(f) => Some(f),
        Err(e) => {
            rep.check(false, e);
            None
        }
    }
}

/// The engine is killed (its listener and its publisher gone).
pub fn engine_killed(_scale: Scale) -> Report {
    let mut rep = Report::new(
        "engine_killed",
        "out of routing <= 2.5 s; nothing routed to it after; back <= 2.5 s after it serves again",
    );
    let Some(f) = fleet_or_fail(&mut rep, 4, 0) else { return rep };
    let e = f.members[0].engine().clone();
    let drill = OutAndBack {
        member: 0,
        out_within: OUT_WITHIN,
        hold_out: Duration::from_millis(1500),
        back_within: OUT_WITHIN,
        back_routable: true,
    };
    drill.run(
        &mut rep,
        &f,
        || {
            e.face().expect("face").set_fault(Fault::ListenerGone).expect("fault");
            e.stop(0).expect("stop");
        },
        || {
            e.start_rank(0).expect("start");
            e.face().expect("face").set_fault(Fault::None).expect("fault");
        },
    );
    rep
}

/// The relay's host is cut off: its stream through the proxy goes silent (nothing forwarded,
/// connections held open, as a partition drops packets).
pub fn host_partitioned(_scale: Scale) -> Report {
    let mut rep = Report::new("host_partitioned", "out <= 2.5 s (the stream silent for 2 s); back after the heal");
    let Some(f) = fleet_or_fail(&mut rep, 4, 0) else { return rep };
    let proxy = &f.members[1].proxy;
    let drill = OutAndBack {
        member: 1,
        out_within: OUT_WITHIN,
        hold_out: Duration::from_secs(1),
        back_within: Duration::from_secs(5),
        back_routable: false,
    };
    drill.run(&mut rep, &f, || proxy.set_paused(true), || proxy.set_paused(false));
    rep
}

/// The engine's health answers but it makes no progress: its completions hang.
pub fn engine_wedged(_scale: Scale) -> Report {
    let mut rep = Report::new("engine_wedged", "out <= wedge secs (3) + 1 s; routable <= 1 s after it progresses");
    let Some(f) = fleet_or_fail(&mut rep, 4, 0) else { return rep };
    let face = f.members[2].engine().face().expect("face");
    let drill = OutAndBack {
        member: 2,
        out_within: WEDGE + Duration::from_secs(1),
        hold_out: Duration::from_secs(1),
        back_within: Duration::from_secs(1),
        back_routable: false,
    };
    drill.run(
        &mut rep,
        &f,
        || face.set_fault(Fault::Wedged).expect("fault"),
        || face.set_fault(Fault::None).expect("fault"),
    );
    rep
}

/// The engine's process is stopped with SIGSTOP (its health probe times out), then continued.
pub fn engine_frozen(_scale: Scale) -> Report {
    let mut rep = Report::new("engine_frozen", "out <= 2.5 s; back <= 1 s after SIGCONT");
    let Some(f) = fleet_or_fail(&mut rep, 3, 1) else { return rep };
    let EngineKind::Process { child, .. } = &f.members[3].engine else { unreachable!("member 3 is a process") };
    let pid = child.id();
    let drill = OutAndBack {
        member: 3,
        out_within: OUT_WITHIN,
        hold_out: Duration::from_secs(1),
        back_within: Duration::from_secs(1),
        back_routable: false,
    };
    drill.run(&mut rep, &f, || signal(pid, "STOP").expect("SIGSTOP"), || signal(pid, "CONT").expect("SIGCONT"));
    rep
}

/// The engine restarts with an empty cache: its worker is re-admitted, takes a share of the
/// misses while it is cold, and its index regrows to equal its cache.
pub fn engine_restarted_empty(_scale: Scale) -> Report {
    let mut rep = Report::new(
        "engine_restarted_empty",
        "re-admitted; receives a slice of misses; its index regrows (equal to its engine's cache)",
    );
    let Some(f) = fleet_or_fail(&mut rep, 4, 0) else { return rep };
    // Every engine warm first: a quarter of the traffic each, a few seconds.
    std::thread::sleep(Duration::from_secs(3));
    let e = f.members[3].engine().clone();
    let before = f.view(3);
    let face = e.face().expect("face");
    face.set_fault(Fault::ListenerGone).expect("fault");
    std::thread::sleep(Duration::from_millis(500));
    e.restart(0).expect("restart");
    face.set_fault(Fault::None).expect("fault");
    let t0 = Instant::now();
    let emptied = f.wait_view(3, Duration::from_secs(5), |v| v.held_blocks < before.held_blocks);
    rep.check(emptied.is_some(), format!("its index never emptied: {:?} (before {before:?})", f.view(3)));
    let back = f.wait_view(3, Duration::from_secs(10), View::routable);
    match back {
        Some(_) => rep.measure(format!("re-admitted {} after the restart", ms(t0.elapsed()))),
        None => {
            rep.check(false, format!("never re-admitted: {:?}", f.view(3)));
            return rep;
        }
    }
    let routed0 = f.view(3).routed;
    std::thread::sleep(Duration::from_secs(3));
    let v = f.view(3);
    let share = v.routed - routed0;
    rep.measure(format!(
        "in the 3 s after: {share} requests routed to it; it holds {} blocks (held {} before the restart)",
        v.held_blocks, before.held_blocks
    ));
    rep.check(share >= 5, format!("only {share} requests in 3 s went to the restarted worker"));
    rep.check(v.held_blocks >= 4 * BLOCK as u64, format!("its index did not regrow: {v:?}"));
    // Its index equals its cache, with the clients held still.
    let equal = f.clients().hold(|| {
        wait_until(Duration::from_secs(3), || {
            f.view(3).held_blocks == e.cache_hashes(0).map(|s| s.len() as u64).unwrap_or(u64::MAX)
        })
    });
    rep.check(
        equal.is_some(),
        format!("held {} blocks, the engine caches {:?}", f.view(3).held_blocks, e.cache_hashes(0).map(|s| s.len())),
    );
    rep
}

/// The router is killed under load and started again on the same address.
pub fn router_restarted(_scale: Scale) -> Report {
    let mut rep = Report::new(
        "router_restarted",
        "serving <= 2 s after its start; every worker's index equal (block count) to its engine's cache",
    );
    let Some(mut f) = fleet_or_fail(&mut rep, 4, 0) else { return rep };
    let listen = f.front();
    f.router = None; // SIGKILL
    std::thread::sleep(Duration::from_millis(300));
    let t0 = Instant::now();
    f.start_router(listen);
    let body = serde_json::json!({"model": "m", "prompt": [1, 2, 3, 4, 5], "max_tokens": 1}).to_string();
    let serving = wait_until(Duration::from_secs(10), || {
        matches!(http_post(listen, "/v1/completions", &[], &body), Ok((200, _)))
            && f.views().iter().all(|v| v.as_ref().is_some_and(View::routable))
    });
    match serving {
        Some(_) => {
            let took = t0.elapsed();
            rep.measure(format!("serving, every worker routable, {} after the start", ms(took)));
            rep.check(took <= Duration::from_secs(2), format!("serving after {} > 2000 ms", ms(took)));
        }
        None => {
            rep.check(false, format!("never serving: {:?}\n{}", f.views(), f.router_log()));
            return rep;
        }
    }
    let cached = |m: &Member| m.engine().cache_hashes(0).map(|s| s.len() as u64).unwrap_or(u64::MAX);
    let equal = f.clients().hold(|| {
        wait_until(Duration::from_secs(3), || {
            f.views().iter().zip(&f.members).all(|(v, m)| v.as_ref().is_some_and(|v| v.held_blocks == cached(m)))
        })
    });
    let held: Vec<String> = f
        .views()
        .iter()
        .zip(&f.members)
        .map(|(v, m)| format!("{}/{}", v.as_ref().map_or(0, |v| v.held_blocks), cached(m)))
        .collect();
    rep.measure(format!("held/cached blocks per worker: {}", held.join(" ")));
    rep.check(equal.is_some(), format!("an index differs from its engine's cache: {}", held.join(" ")));
    rep
}

/// 512 `POST /route` (each then reported) at once against the router, four times.
pub fn route_storm(_scale: Scale) -> Report {
    const CALLS: usize = 512;
    const ROUNDS: usize = 4;
    let mut rep = Report::new(
        "route_storm",
        "512 concurrent POST /route: every call answered (none hung past 10 s); RSS growth after the first round <= 8 MiB",
    );
    let Some(f) = fleet_or_fail(&mut rep, 4, 0) else { return rep };
    let front = f.front();
    let rss0 = f.router().rss_kib();
    let mut rss = Vec::new();
    for round in 0..ROUNDS {
        let start = Arc::new(std::sync::Barrier::new(CALLS));
        let t0 = Instant::now();
        let calls: Vec<_> = (0..CALLS)
            .map(|i| {
                let start = start.clone();
                std::thread::spawn(move || {
                    let tokens: Vec<u64> = (0..4 * BLOCK as u64).map(|k| 1 + (i as u64 % 24) * 100 + k).collect();
                    let hash: Value = serde_json::from_str(HASH).expect("hash JSON");
                    let body = serde_json::json!({"token_ids": tokens, "hash": hash}).to_string();
                    start.wait();
                    let (status, text) = http_post(front, "/route", &[], &body).map_err(|e| e.to_string())?;
                    if status != 200 {
                        return Err(format!("/route {status}: {text}"));
                    }
                    let id = serde_json::from_str::<Value>(&text).map_err(|e| e.to_string())?["request_id"]
                        .as_u64()
                        .ok_or("no request_id")?;
                    let report = serde_json::json!({"request_id": id, "outcome": "done"}).to_string();
                    match http_post(front, "/route/report", &[], &report) {
                        Ok((200, _)) => Ok(()),
                        other => Err(format!("/route/report: {other:?}")),
                    }
                })
            })
            .collect();
        let failed: Vec<String> = calls.into_iter().filter_map(|c| c.join().expect("a call's thread").err()).collect();
        let took = t0.elapsed();
        rss.push(f.router().rss_kib());
        rep.measure(format!(
            "round {}: {CALLS} calls in {}, {} failed; router RSS {} KiB",
            round + 1,
            ms(took),
            failed.len(),
            rss[round]
        ));
        rep.check(
            failed.is_empty(),
            format!("round {}: {} calls failed, e.g. {:?}", round + 1, failed.len(), failed.first()),
        );
    }
    let growth = rss[ROUNDS - 1].saturating_sub(rss[0]);
    rep.measure(format!(
        "router RSS {rss0} KiB before, {} KiB after round 1, {} KiB after the last",
        rss[0],
        rss[ROUNDS - 1]
    ));
    rep.check(growth <= 8 * 1024, format!("RSS grew {growth} KiB after the first round"));
    let in_flight = wait_until(Duration::from_secs(5), || {
        let text = super::harness::http_get(front, "/metrics").unwrap_or_default();
        super::harness::metric(&text, "kv_router_in_flight", &[]).is_some_and(|v| v <= CLIENT_THREADS as f64)
    });
    rep.check(in_flight.is_some(), "routed requests left unreported after the storm");
    rep
}
