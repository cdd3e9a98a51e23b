//! parts

use super::*;

pub(crate) fn part_router(opts: &Opts, rt: &tokio::runtime::Runtime, rows: &mut Vec<String>) {
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
pub(crate) struct Answers(pub(crate) Mutex<Vec<std::net::IpAddr>>);

impl Resolver for Answers {
    fn lookup<'a>(&'a self, _: &'a str) -> Lookup<'a> {
        let now = self.0.lock().expect("answers").clone();
        Box::pin(async move { Ok(now) })
    }
}

pub(crate) fn part_dns(opts: &Opts, rt: &tokio::runtime::Runtime, rows: &mut Vec<String>) {
    let (interval, grace) = if opts.quick {
        (Duration::from_millis(200), Duration::from_millis(500))
    } else {
        (Duration::from_secs(1), Duration::from_secs(3))
    };
    pub(crate) const RELAYS: usize = 4;
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

pub(crate) fn part_storm(opts: &Opts, rt: &tokio::runtime::Runtime, rows: &mut Vec<String>) {
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
pub(crate) fn serve(opts: &Opts, rt: &tokio::runtime::Runtime) {
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
