//! The drills' pieces: a mock engine on free loopback ports, steady traffic that can be held
//! still for a comparison, `kv-relay` as a separate process (SIGKILL, restart on the same state
//! directory and ports), its Status / History / metrics / RSS, and the "equal" check.

use super::router::{truth_held, Router, RouterState};
use crate::client::free_ports;
use crate::engine::{EngineConfig, MockEngine};
use crate::traffic::{RandomSource, RequestSource};
use crate::truth::Truth;
use crate::wire::{Engine, WireVersion};
use kv_relay::ctl::{self, Target};
use kv_relay::live::LiveKey;
use kv_relay::model::Tier;
use kv_relay_proto::pb;
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// glibc malloc settings the systemd unit and the Kubernetes manifest give the relay
/// (`docs/operations.md`): two arenas, and a fixed mmap threshold (128 KiB, with the heap's top
/// trimmed past 4 MiB), so that large blocks are mapped and returned when freed instead of
/// staying in the heap as the threshold climbs. A test keeps the two files in step with this.
pub const SHIPPED_ENV: [(&str, &str); 2] = [
    ("MALLOC_ARENA_MAX", "2"),
    ("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=131072:glibc.malloc.trim_threshold=4194304"),
];

/// Where the relay binary is: `KV_RELAY_BIN`, else `target/debug/kv-relay` beside this crate
/// (`cargo build -p kv-relay --bins` builds it; `.ci/run` builds every binary first).
pub fn relay_bin() -> PathBuf {
    workspace_bin("kv-relay", "KV_RELAY_BIN")
}

/// A binary of the workspace: the path in `env` when set, else `target/debug/<name>` beside this
/// crate (`cargo build --workspace --bins` builds them all).
pub fn workspace_bin(name: &str, env: &str) -> PathBuf {
    if let Ok(p) = std::env::var(env) {
        return PathBuf::from(p);
    }
    let target = std::env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"));
    target.join("debug").join(name)
}

/// A mock engine (vLLM 0.32 wire, GPU and host tiers, replay socket, `/metrics`) with `dp` ranks on free ports.
pub fn engine(dp: u32, buffer_steps: usize) -> Arc<MockEngine> {
    engine_on(WireVersion::parse(Engine::Vllm, "0.32").expect("wire"), dp, buffer_steps)
}

/// [`engine`] with another wire (e.g. SGLang's latest layout).
pub fn engine_on(wire: WireVersion, dp: u32, buffer_steps: usize) -> Arc<MockEngine> {
    engine_with(wire, dp, buffer_steps, |_| {})
}

/// [`engine_on`] with the configuration changed by `adjust` before the engine starts.
pub fn engine_with(
    wire: WireVersion,
    dp: u32,
    buffer_steps: usize,
    adjust: impl Fn(&mut EngineConfig),
) -> Arc<MockEngine> {
    for _ in 0..20 {
        let base = free_ports(2 * dp as u16);
        let mut cfg = EngineConfig::new(wire);
        cfg.dp_size = dp;
        cfg.endpoint = format!("tcp://127.0.0.1:{base}");
        cfg.replay_endpoint = Some(format!("tcp://127.0.0.1:{}", base + dp as u16));
        cfg.topic = "kv".into();
        cfg.buffer_steps = buffer_steps;
        cfg.block_size = 4;
        cfg.cache_blocks = 64;
        // GPU evictions offload to a host tier: "equal" is checked tier for tier.
        cfg.host_tier_blocks = 32;
        cfg.metrics_listen = Some("127.0.0.1:0".parse().expect("addr"));
        adjust(&mut cfg);
        if let Ok(e) = MockEngine::start(cfg) {
            return Arc::new(e);
        }
    }
    panic!("no free loopback ports for the mock engine");
}

/// Steady generated traffic over every running rank; [`Traffic::hold`] stops it for a moment.
pub struct Traffic {
    stop: Arc<AtomicBool>,
    gate: Arc<Mutex<()>>,
    pub served: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Traffic {
    /// `rate` requests per second in all, spread round-robin over the ranks.
    pub fn start(e: &Arc<MockEngine>, rate: u32, seed: u64) -> Traffic {
        let stop = Arc::new(AtomicBool::new(false));
        let gate = Arc::new(Mutex::new(()));
        let served = Arc::new(AtomicU64::new(0));
        let thread = {
            let (e, stop, gate, served) = (e.clone(), stop.clone(), gate.clone(), served.clone());
            std::thread::spawn(move || {
                let mut src = RandomSource::new(seed, 4, 24);
                let dp = e.dp_size();
                let pace = crate::pace::Pace::new(f64::from(rate.max(1)));
                let mut n = 0u64;
                while !stop.load(Ordering::SeqCst) {
                    let due = pace.due(n);
                    let now = Instant::now();
                    if due > now {
                        std::thread::sleep((due - now).min(Duration::from_millis(50)));
                        continue;
                    }
                    let _g = gate.lock().expect("gate");
                    let rank = (n % u64::from(dp)) as u32;
                    n += 1;
                    if !e.is_running(rank).unwrap_or(false) {
                        continue;
                    }
                    if let Some(req) = src.next_request() {
                        if e.serve_request(rank, &req, false).is_ok() {
                            served.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            })
        };
        Traffic { stop, gate, served, thread: Some(thread) }
    }

    /// Runs `f` with the traffic held still.
    pub fn hold<T>(&self, f: impl FnOnce() -> T) -> T {
        let _g = self.gate.lock().expect("gate");
        f()
    }
}

impl Drop for Traffic {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Live blocks with copy counts, per (rank, tier, group).
pub type Blocks = BTreeMap<LiveKey, BTreeMap<u64, u32>>;

/// The truth keyed as the relay keys it (tier from medium, group 0 when absent), empty sets out.
pub fn truth_as_live(t: &Truth) -> BTreeMap<LiveKey, BTreeMap<u64, u32>> {
    let mut out: BTreeMap<LiveKey, BTreeMap<u64, u32>> = BTreeMap::new();
    for (k, set) in &t.blocks {
        let key =
            LiveKey { dp_rank: k.rank, tier: Tier::from_medium(k.medium.as_deref()), group: k.group.unwrap_or(0) };
        let into = out.entry(key).or_default();
        for (h, c) in set {
            *into.entry(*h).or_default() += c;
        }
    }
    out.retain(|_, s| !s.is_empty());
    out
}

/// Live blocks summed over keys: (keys, blocks, copies), for reports.
pub fn size_of(b: &BTreeMap<LiveKey, BTreeMap<u64, u32>>) -> (usize, usize, u64) {
    (b.len(), b.values().map(BTreeMap::len).sum(), b.values().flat_map(|s| s.values()).map(|&c| u64::from(c)).sum())
}

/// Holds the traffic, flushes the engine and waits up to `within` for every router's index to
/// equal the truth (every worker, tier, hash and copy count, both ways). Returns whether it did.
pub fn equal_now(e: &MockEngine, traffic: Option<&Traffic>, routers: &[&Router], within: Duration) -> bool {
    let check = || {
        let _ = e.flush();
        let want = truth_held(&e.truth());
        let deadline = Instant::now() + within;
        loop {
            if routers.iter().all(|r| r.held() == want) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    match traffic {
        Some(t) => t.hold(check),
        None => check(),
    }
}

/// Polls [`equal_now`] (each try holds the traffic at most 300 ms) until it holds or `limit`
/// passes; returns the time from `since` to the first success.
pub fn time_to_equal(
    e: &MockEngine,
    traffic: Option<&Traffic>,
    routers: &[&Router],
    since: Instant,
    limit: Duration,
) -> Option<Duration> {
    loop {
        if equal_now(e, traffic, routers, Duration::from_millis(300)) {
            return Some(since.elapsed());
        }
        if since.elapsed() > limit {
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A difference report for a failed comparison.
pub fn diff(e: &MockEngine, s: &RouterState) -> String {
    let want = truth_held(&e.truth());
    let got = &s.held;
    let mut out = Vec::new();
    for k in want.keys().chain(got.keys()).collect::<std::collections::BTreeSet<_>>() {
        let (w, g) = (want.get(k), got.get(k));
        if w != g {
            let wn = w.map_or(0, BTreeMap::len);
            let gn = g.map_or(0, BTreeMap::len);
            out.push(format!("rank {} {}: truth {wn} blocks, router {gn}", k.0, k.1));
        }
    }
    format!(
        "cursor {} snapshots {:?} counters {:?} last error {:?}; {}",
        s.cursor(),
        s.snapshots,
        s.counters,
        s.last_error,
        out.join("; ")
    )
}

/// What a relay needs to follow an engine: rank 0's endpoints (rank r: port + r), the topic,
/// and its metrics URL (the health endpoint and the engine's URL derive from it).
#[derive(Debug, Clone)]
pub struct EngineSpec {
    pub endpoint: String,
    pub replay_endpoint: String,
    pub dp_size: u32,
    pub topic: String,
    pub metrics_url: Option<String>,
}

/// The address a server announces on its first line of output (`... http://ADDR ...`, as
/// `kv-router` prints it).
pub fn announced_addr(out: &mut impl std::io::BufRead, what: &str) -> SocketAddr {
    let mut line = String::new();
    out.read_line(&mut line).unwrap_or_else(|e| panic!("{what}'s first line: {e}"));
    line.split("http://")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("{what} said {line:?}"))
}

/// A `kv-relay` process on fixed loopback ports, restartable on the same state directory.
pub struct RelayProc {
    pub args: Vec<String>,
    pub listen: SocketAddr,
    pub metrics: SocketAddr,
    pub state_dir: PathBuf,
    pub log: PathBuf,
    child: Option<Child>,
}

impl RelayProc {
    /// Starts a relay following `e`, with extra flags (e.g. `--history-batches 50`), and waits
    /// until it answers Status.
    pub fn start(e: &MockEngine, state_dir: &Path, log: &Path, extra: &[&str]) -> RelayProc {
        let c = e.config();
        let spec = EngineSpec {
            endpoint: c.endpoint.clone(),
            replay_endpoint: c.replay_endpoint.clone().expect("replay endpoint"),
            dp_size: c.dp_size,
            topic: c.topic.clone(),
            metrics_url: e.metrics_addr().map(|m| format!("http://{m}/metrics")),
        };
        RelayProc::start_for(&spec, state_dir, log, extra)
    }

    /// [`RelayProc::start`] for an engine known by its endpoints (e.g. a `mock-engine` process).
    pub fn start_for(spec: &EngineSpec, state_dir: &Path, log: &Path, extra: &[&str]) -> RelayProc {
        let ports = free_ports(2);
        let listen: SocketAddr = format!("127.0.0.1:{ports}").parse().expect("addr");
        let metrics: SocketAddr = format!("127.0.0.1:{}", ports + 1).parse().expect("addr");
        let mut args: Vec<String> = vec![
            "--endpoint".into(),
            spec.endpoint.clone(),
            "--replay-endpoint".into(),
            spec.replay_endpoint.clone(),
            "--dp-size".into(),
            spec.dp_size.to_string(),
            "--topic".into(),
            spec.topic.clone(),
            "--state-dir".into(),
            state_dir.display().to_string(),
            "--listen".into(),
            listen.to_string(),
            "--metrics-listen".into(),
            metrics.to_string(),
            "--tail-probe-ms".into(),
            "300".into(),
        ];
        if let Some(m) = &spec.metrics_url {
            args.push("--engine-metrics-url".into());
            args.push(m.clone());
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut r = RelayProc {
            args,
            listen,
            metrics,
            state_dir: state_dir.to_path_buf(),
            log: log.to_path_buf(),
            child: None,
        };
        r.spawn();
        r
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.listen)
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Starts the process (again) with the same flags; does not wait.
    pub fn spawn_only(&mut self) {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log).expect("relay log");
        let mut command = Command::new(relay_bin());
        command.args(&self.args).env("RUST_LOG", "warn");
        // As the systemd unit and the Kubernetes manifest run it (docs/operations.md): the
        // drills' RSS rules and the relay bench judge the relay as shipped, not glibc's default
        // of up to eight arenas per core (docs/drills.md, Open) and its moving mmap threshold. A
        // value in the environment wins, so that a comparison with other settings can still be
        // run.
        for (name, value) in SHIPPED_ENV {
            if std::env::var_os(name).is_none() {
                command.env(name, value);
            }
        }
        let child =
            command.stdin(Stdio::null()).stdout(log.try_clone().expect("log")).stderr(log).spawn().unwrap_or_else(
                |e| panic!("starting {}: {e} (build it: cargo build -p kv-relay --bins)", relay_bin().display()),
            );
        self.child = Some(child);
    }

    /// Starts the process and waits until Status answers.
    pub fn spawn(&mut self) {
        self.spawn_only();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if status(&self.url()).is_ok() {
                return;
            }
            if let Some(Ok(Some(st))) = self.child.as_mut().map(Child::try_wait) {
                panic!("kv-relay exited at start ({st}); log {}:\n{}", self.log.display(), self.log_tail());
            }
            assert!(Instant::now() < deadline, "kv-relay never answered Status; log:\n{}", self.log_tail());
            std::thread::sleep(Duration::from_millis(25));
        }
    }

    /// Whether the process has exited, and how.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.as_mut().and_then(|c| c.try_wait().ok().flatten())
    }

    /// SIGTERM (with `kill`, as systemd stops the unit; panics if `kill` fails), then up to
    /// `within` for the process to exit: how long it took, or `None` (it is then killed).
    pub fn terminate(&mut self, within: Duration) -> Option<Duration> {
        let mut c = self.child.take()?;
        let t0 = Instant::now();
        let sent = Command::new("kill").args(["-TERM", &c.id().to_string()]).status().is_ok_and(|st| st.success());
        assert!(sent, "kill -TERM {} failed", c.id());
        loop {
            if let Ok(Some(_)) = c.try_wait() {
                return Some(t0.elapsed());
            }
            if t0.elapsed() >= within {
                let _ = c.kill();
                let _ = c.wait();
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGKILL (std's `Child::kill` on Unix) and reap.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The process's resident set, in KiB (`/proc/PID/status` VmRSS).
    pub fn rss_kib(&self) -> Option<u64> {
        self.proc_status("VmRSS")
    }

    /// A number from `/proc/PID/status` (`VmRSS`, `Threads`, ...).
    pub fn proc_status(&self, field: &str) -> Option<u64> {
        crate::kit::proc_status(self.pid()?, field)
    }

    /// The Prometheus text from `--metrics-listen`.
    pub fn metrics_text(&self) -> String {
        http_get(self.metrics, "/metrics").unwrap_or_default()
    }

    pub fn log_tail(&self) -> String {
        let s = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = s.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }
}

impl Drop for RelayProc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A plain HTTP/1.0 GET on loopback; the body.
pub fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<String> {
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    Ok(out.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or(out))
}

/// Sum of a metric's samples whose line contains every one of `labels` (e.g. `rank="1"`).
pub fn metric(text: &str, name: &str, labels: &[&str]) -> Option<f64> {
    let mut found = None;
    for l in text.lines() {
        if l.starts_with('#') {
            continue;
        }
        let Some(rest) = l.strip_prefix(name) else { continue };
        if !(rest.starts_with('{') || rest.starts_with(' ')) || !labels.iter().all(|x| l.contains(x)) {
            continue;
        }
        if let Some(v) = l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) {
            *found.get_or_insert(0.0) += v;
        }
    }
    found
}

/// A current-thread runtime for one blocking RPC.
fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime").block_on(f)
}

/// The relay's Status.
pub fn status(url: &str) -> Result<pb::StatusResponse, String> {
    block_on(async {
        let mut c =
            ctl::connect(&Target { url: url.to_string(), ..Default::default() }).await.map_err(|e| e.to_string())?;
        c.status(pb::StatusRequest {}).await.map(|r| r.into_inner()).map_err(|e| e.to_string())
    })
}

/// Every history record from `from` on (up to `limit`), as (cursor, record).
pub fn history(url: &str, from: u64, limit: u32) -> Result<Vec<pb::HistoryResponse>, String> {
    block_on(async {
        let mut c =
            ctl::connect(&Target { url: url.to_string(), ..Default::default() }).await.map_err(|e| e.to_string())?;
        let mut s = c
            .history(pb::HistoryRequest { from_cursor: from, to_cursor: 0, limit, ranks: vec![], epoch: 0 })
            .await
            .map_err(|e| e.to_string())?
            .into_inner();
        let mut out = Vec::new();
        while let Some(m) = s.message().await.map_err(|e| e.to_string())? {
            out.push(m);
        }
        Ok(out)
    })
}

/// The cursor of a history record.
pub fn record_cursor(r: &pb::HistoryResponse) -> u64 {
    match &r.record {
        Some(pb::history_response::Record::Batch(b)) => b.cursor,
        Some(pb::history_response::Record::Control(c)) => c.cursor,
        None => 0,
    }
}

/// Ranks whose Status state is not OK, with the state's name.
pub fn not_ok_ranks(s: &pb::StatusResponse) -> Vec<(u32, String)> {
    s.ranks
        .iter()
        .filter(|r| r.state != pb::RankState::Ok as i32)
        .map(|r| (r.dp_rank, pb::RankState::try_from(r.state).map(|x| x.as_str_name().to_string()).unwrap_or_default()))
        .collect()
}

/// Waits up to `limit` for `f`, asking every 20 ms; returns the time it took.
pub fn wait_until(limit: Duration, f: impl FnMut() -> bool) -> Option<Duration> {
    crate::kit::poll_until(limit, Duration::from_millis(20), f)
}

/// The relay's live blocks (Snapshot RPC) keyed like the truth, and the cursor they are at.
pub fn snapshot(url: &str) -> Result<(u64, Blocks), String> {
    use kv_relay::server::convert::snapshot_block_from_pb;
    use pb::snapshot_response::Message as S;
    block_on(async {
        let mut c =
            ctl::connect(&Target { url: url.to_string(), ..Default::default() }).await.map_err(|e| e.to_string())?;
        let mut s = c
            .snapshot(pb::SnapshotRequest { ranks: vec![], tiers: vec![], include_token_ids: false })
            .await
            .map_err(|e| e.to_string())?
            .into_inner();
        let (mut cursor, mut out) = (0, BTreeMap::<LiveKey, BTreeMap<u64, u32>>::new());
        while let Some(m) = s.message().await.map_err(|e| e.to_string())? {
            match m.message {
                Some(S::Begin(b)) => cursor = b.cursor,
                Some(S::Chunk(ch)) => {
                    for b in &ch.blocks {
                        let sb = snapshot_block_from_pb(b).map_err(|e| e.to_string())?;
                        out.entry(LiveKey { dp_rank: sb.dp_rank, tier: sb.tier, group: sb.group })
                            .or_default()
                            .insert(sb.hash, sb.copies);
                    }
                }
                _ => {}
            }
        }
        out.retain(|_, s: &mut BTreeMap<u64, u32>| !s.is_empty());
        Ok((cursor, out))
    })
}

#[cfg(test)]
mod tests {
    use super::SHIPPED_ENV;

    /// The drills and the relay bench run the relay with the environment it is shipped with.
    #[test]
    fn the_unit_and_the_manifest_give_the_relay_the_harness_allocator_settings() {
        let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
        let unit = std::fs::read_to_string(format!("{root}/systemd/kv-relay@.service")).expect("unit");
        let manifest =
            std::fs::read_to_string(format!("{root}/deploy/kubernetes/vllm-with-kv-relay.yaml")).expect("manifest");
        let manifest: Vec<&str> = manifest.lines().map(str::trim).collect();
        for (name, value) in SHIPPED_ENV {
            assert!(unit.lines().any(|l| l == format!("Environment={name}={value}")), "unit: {name}={value}");
            let at = manifest.iter().position(|l| *l == format!("- name: {name}")).expect(name);
            assert_eq!(manifest[at + 1], format!("value: \"{value}\""), "manifest: {name}");
        }
    }
}
