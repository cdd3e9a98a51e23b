//! router_process

use super::*;
pub(crate) use kv_relay_testkit::kit::{cpu_ticks, percentile, poll_until, thread_ticks};

/// `/proc/PID/status` field in KiB (0 when the process is gone).
pub(crate) fn proc_kib(pid: u32, field: &str) -> u64 {
    kv_relay_testkit::kit::proc_status(pid, field).unwrap_or(0)
}

/// A keep-alive HTTP/1.1 connection to the router.
pub(crate) struct Http {
    pub(crate) addr: SocketAddr,
    pub(crate) conn: Option<BufReader<TcpStream>>,
}

impl Http {
    pub(crate) fn new(addr: SocketAddr) -> Http {
        Http { addr, conn: None }
    }

    pub(crate) fn call(&mut self, method: &str, path: &str, body: &[u8]) -> std::io::Result<Vec<u8>> {
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

    pub(crate) fn try_call(&mut self, method: &str, path: &str, body: &[u8]) -> std::io::Result<Vec<u8>> {
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

    pub(crate) fn json(&mut self, path: &str) -> Value {
        serde_json::from_slice(&self.call("GET", path, b"").expect(path)).expect("json")
    }

    pub(crate) fn metrics(&mut self) -> String {
        String::from_utf8_lossy(&self.call("GET", "/metrics", b"").expect("/metrics")).into_owned()
    }
}

pub(crate) struct Router {
    pub(crate) child: Child,
    pub(crate) addr: SocketAddr,
    /// Its standard output, kept open (it would die writing to a closed pipe).
    pub(crate) _out: BufReader<std::process::ChildStdout>,
}

/// Sets this thread's niceness (Linux keeps one per thread; lowering it needs CAP_SYS_NICE);
/// says so when it cannot.
pub(crate) fn renice_this_thread(nice: i32) {
    if let Err(e) = rustix::process::setpriority_process(Some(rustix::thread::gettid()), nice) {
        eprintln!("could not set the /match caller's niceness to {nice} ({e}): its figures include its waits behind the fleet");
    }
}

/// A thread sending `/match` requests for 512 live blocks of one relay, one at a time at `rate`
/// a second, from when `go` is set until `stop` is; their latencies (ms) go to `latencies`.
pub(crate) fn spawn_matcher(
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
    pub(crate) fn start(relays_file: &Path, malloc_env: bool) -> Router {
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

    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Router {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Per relay URL: (epoch, cursor, syncing), and the workers' states by relay.
pub(crate) struct Seen {
    pub(crate) relays: BTreeMap<String, (u64, u64, bool)>,
    pub(crate) states: BTreeMap<String, String>,
}

pub(crate) fn seen(http: &mut Http) -> Seen {
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

/// For each relay, the first of 512 blocks in the middle of its live set (live for the longest).
pub(crate) fn windows(fleet: &Fleet) -> Vec<u64> {
    fleet.relays.iter().map(|r| r.live()).map(|l| l.start + (l.end - l.start).saturating_sub(512) / 2).collect()
}

pub(crate) fn pct(sorted: &[f64], p: f64) -> f64 {
    percentile(sorted, p).unwrap_or(0.0)
}

/// A matcher's latencies, taken and sorted.
pub(crate) fn take_sorted(latencies: &Mutex<Vec<f64>>) -> Vec<f64> {
    let mut l = std::mem::take(&mut *latencies.lock().expect("latencies"));
    l.sort_by(f64::total_cmp);
    l
}

/// `p50 / p99 / max ms` of sorted latencies.
pub(crate) fn spread(sorted: &[f64]) -> String {
    format!("{:.3} / {:.3} / {:.3} ms", pct(sorted, 0.5), pct(sorted, 0.99), pct(sorted, 1.0))
}
