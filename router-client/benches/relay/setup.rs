//! The relay process, the engine, measurements.

use super::*;

pub(crate) struct Setup {
    pub(crate) engine: Arc<MockEngine>,
    pub(crate) relay: RelayProc,
    pub(crate) _dir: tempfile::TempDir,
}

pub(crate) fn setup(opts: &Opts, cores: Option<&str>, extra: &[&str]) -> Setup {
    setup_on(opts, Shape::Prefill.wire(), cores, extra)
}

pub(crate) fn setup_on(opts: &Opts, wire: WireVersion, cores: Option<&str>, extra: &[&str]) -> Setup {
    // vLLM 0.32 wire (or `wire`), replay sockets, `/metrics` scraped by the relay; 10,000 batches
    // buffered.
    let engine = harness::engine_on(wire, DP, 10_000);
    let dir = tempfile::Builder::new().prefix("kv-relay-bench").tempdir_in(&opts.dir).expect("state dir");
    let state = dir.path().join("state");
    let log = dir.path().join("relay.log");
    let mut args = vec!["--server-rate-per-second", "1000", "--server-rate-burst", "1000"];
    args.extend_from_slice(extra);
    let relay = RelayProc::start(&engine, &state, &log, &args);
    if let Some(c) = cores {
        pin(relay.pid().expect("pid"), c);
    }
    Setup { engine, relay, _dir: dir }
}

/// Sets the CPU affinity of every thread of `pid` (`taskset -a -p -c`).
pub(crate) fn pin(pid: u32, cores: &str) {
    let ok = std::process::Command::new("taskset")
        .args(["-a", "-p", "-c", cores, &pid.to_string()])
        .stdout(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "taskset -a -p -c {cores} {pid} failed");
}

/// utime + stime of a process, in seconds.
pub(crate) fn cpu_seconds(pid: u32) -> f64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = s.rsplit_once(')').map(|x| x.1).unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // After the command: state is field 0, utime 11, stime 12. Clock ticks are 100 per second on Linux.
    (ticks(11) + ticks(12)) / 100.0
}

pub(crate) fn dir_bytes(p: &Path) -> u64 {
    let mut n = 0;
    if let Ok(rd) = std::fs::read_dir(p) {
        for e in rd.flatten() {
            let Ok(m) = e.metadata() else { continue };
            n += if m.is_dir() { dir_bytes(&e.path()) } else { m.len() };
        }
    }
    n
}

/// `1234567.8` as `1,234,568`.
pub(crate) fn th(x: f64) -> String {
    if !x.is_finite() {
        return format!("{x}");
    }
    let digits = format!("{:.0}", x.abs());
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    if x < -0.5 {
        out.insert(0, '-');
    }
    out
}

pub(crate) fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

pub(crate) fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub(crate) fn pct(v: &mut [f32], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f32::total_cmp);
    f64::from(kv_relay_testkit::kit::percentile(v, p).expect("not empty"))
}

/// The relay's newest cursor and the engine's last seq per rank it has committed.
pub(crate) fn relay_position(url: &str) -> (u64, Vec<u64>) {
    match status(url) {
        Ok(s) => (s.newest_cursor, s.ranks.iter().map(|r| r.last_engine_seq).collect()),
        Err(_) => (0, vec![]),
    }
}

/// Waits until every subscriber has applied everything published; the time it took, or None.
pub(crate) fn drain(pubr: &Publisher, subs: &[Sub], limit: Duration) -> Option<Duration> {
    let target = pubr.published();
    let t = Instant::now();
    loop {
        if subs.iter().all(|s| s.shared.batches.load(Ordering::Relaxed) >= target) {
            return Some(t.elapsed());
        }
        if t.elapsed() > limit {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

pub(crate) fn min_applied(subs: &[Sub]) -> u64 {
    subs.iter().map(|s| s.shared.batches.load(Ordering::Relaxed)).min().unwrap_or(0)
}

pub(crate) struct Step {
    pub(crate) offered: f64,
    pub(crate) batches_s: f64,
    pub(crate) ops_s: f64,
    pub(crate) backlog_mid: u64,
    pub(crate) backlog_end: u64,
    pub(crate) drain: Option<Duration>,
    pub(crate) relay_cpu: f64,
    /// This process's CPU (engine, publisher, subscribers), in cores.
    pub(crate) bench_cpu: f64,
    /// Streams the subscribers opened again during the step (resyncs).
    pub(crate) resynced: u64,
    pub(crate) stable: bool,
}

pub(crate) fn run_step(s: &Setup, pubr: &Publisher, subs: &[Sub], rate: f64, len: Duration) -> Step {
    let (pid, me) = (s.relay.pid().expect("pid"), std::process::id());
    let sessions = || subs.iter().map(|s| s.shared.sessions.load(Ordering::Relaxed)).sum::<u64>();
    let sessions0 = sessions();
    let (p0, o0, c0, b0, t0) =
        (pubr.published(), pubr.ops.load(Ordering::Relaxed), cpu_seconds(pid), cpu_seconds(me), Instant::now());
    pubr.set_rate(rate);
    std::thread::sleep(len / 2);
    let backlog_mid = pubr.published().saturating_sub(min_applied(subs));
    std::thread::sleep(len / 2);
    let (p1, o1, c1, b1, el) =
        (pubr.published(), pubr.ops.load(Ordering::Relaxed), cpu_seconds(pid), cpu_seconds(me), t0.elapsed());
    let backlog_end = p1.saturating_sub(min_applied(subs));
    pubr.set_rate(0.0);
    let d = drain(pubr, subs, Duration::from_secs(60));
    let secs = el.as_secs_f64();
    let batches_s = (p1 - p0) as f64 / secs;
    // Stable: the engine published what was offered, the backlog did not grow from the middle of
    // the step to its end (beyond a quarter second of batches), it drained within a second, and
    // no subscriber had to open a new stream (a resync after falling behind the history).
    let resynced = sessions() - sessions0;
    let stable = batches_s >= 0.93 * rate
        && backlog_end <= backlog_mid + (rate / 4.0) as u64
        && d.is_some_and(|d| d < Duration::from_secs(1))
        && resynced == 0;
    Step {
        offered: rate,
        batches_s,
        ops_s: (o1 - o0) as f64 / secs,
        backlog_mid,
        backlog_end,
        drain: d,
        relay_cpu: (c1 - c0) / secs,
        bench_cpu: (b1 - b0) / secs,
        resynced,
        stable,
    }
}

pub(crate) fn print_step(st: &Step) {
    println!(
        "  offered {:>7.0} b/s  published {:>7.0} b/s  {:>8.0} ops/s  backlog mid {:>6} end {:>6}  drain {:>8}  relay cpu {:>4.2}  cpu/1k b/s {:>5.3}  bench cpu {:>4.2}  {}",
        st.offered,
        st.batches_s,
        st.ops_s,
        st.backlog_mid,
        st.backlog_end,
        st.drain.map_or("none".to_string(), |d| format!("{:.0}ms", d.as_secs_f64() * 1000.0)),
        st.relay_cpu,
        st.relay_cpu / (st.batches_s / 1000.0),
        st.bench_cpu,
        if st.stable {
            "stable".to_string()
        } else if st.resynced > 0 {
            format!("LAG GROWS ({} resynced)", st.resynced)
        } else {
            "LAG GROWS".to_string()
        }
    );
}

/// How [`search`] steps the offered rate.
pub(crate) struct Ramp {
    pub(crate) start: f64,
    pub(crate) factor: f64,
    pub(crate) max_steps: usize,
    /// Geometric midpoints tried between the last stable and the first unstable rate.
    pub(crate) refine: usize,
    /// Steps down (by `factor`) from an unstable first step, looking for a stable one.
    pub(crate) down: usize,
}

impl Ramp {
    /// The Mooncake rows': x1.4 from 200 batches/s, one midpoint.
    pub(crate) fn mooncake(opts: &Opts) -> Ramp {
        Ramp {
            start: if opts.quick { 100.0 } else { 200.0 },
            factor: 1.4,
            max_steps: if opts.quick { 2 } else { 14 },
            refine: 1,
            down: 0,
        }
    }
}

/// Steps the offered rate up until lag grows (or down from an unstable start until it holds),
/// then tries midpoints between the last stable and the first unstable rate. Returns the highest
/// stable step.
pub(crate) fn search(opts: &Opts, s: &Setup, pubr: &Publisher, subs: &[Sub], ramp: &Ramp) -> Option<Step> {
    let mut best: Option<Step> = None;
    let mut rate = ramp.start;
    let mut failed: Option<f64> = None;
    let mut down = 0;
    for _ in 0..ramp.max_steps {
        let st = run_step(s, pubr, subs, rate, opts.step);
        print_step(&st);
        if !st.stable {
            failed = Some(failed.map_or(rate, |f| f.min(rate)));
            if best.is_none() && down < ramp.down {
                down += 1;
                rate /= ramp.factor;
                continue;
            }
            break;
        }
        best = Some(st);
        if failed.is_some() {
            break; // stable below the first unstable start
        }
        rate *= ramp.factor;
    }
    for _ in 0..ramp.refine {
        let (Some(hi), Some(lo)) = (failed, best.as_ref().map(|b| b.offered)) else { break };
        let mid = (hi * lo).sqrt();
        let st = run_step(s, pubr, subs, mid, opts.step);
        print_step(&st);
        if st.stable {
            best = Some(st);
        } else {
            failed = Some(mid);
        }
    }
    best
}

pub(crate) fn ingest(opts: &Opts, rt: &tokio::runtime::Runtime, cores: Option<&str>, nsubs: usize) -> Option<Step> {
    let s = setup(opts, cores, &[]);
    if cores.is_some() {
        // This process (engine, subscribers) on the other core.
        pin(std::process::id(), "1");
    }
    let url = s.relay.url();
    let subs: Vec<Sub> = (0..nsubs).map(|_| Sub::start(rt.handle(), &url, None)).collect();
    let pubr = Publisher::start(s.engine.clone(), Workload::new(opts));
    // Warm up: fill the caches so removals flow too.
    let warm = if opts.quick { 400.0 } else { 2.0 * opts.cache_blocks as f64 * f64::from(DP) / 8.0 };
    pubr.set_rate(if opts.quick { 400.0 } else { 600.0 });
    while (pubr.published() as f64) < warm {
        std::thread::sleep(Duration::from_millis(20));
    }
    pubr.set_rate(0.0);
    drain(&pubr, &subs, Duration::from_secs(60));
    println!(
        "ingest: relay on {}, {} subscriber(s), load average {}",
        cores.map_or("both cores".to_string(), |c| format!("core {c}, this process on core 1")),
        nsubs,
        loadavg()
    );
    let best = search(opts, &s, &pubr, &subs, &Ramp::mooncake(opts));
    commit_breakdown(&s);
    if cores.is_some() {
        pin(std::process::id(), "0,1");
    }
    drop(pubr);
    for sub in subs {
        sub.finish(rt);
    }
    best
}

/// What the pre-encoded publisher offers with nobody relaying: this process on core 1 (the side
/// the relay's ingest search leaves it), as fast as it can for a while, a counting SUB per rank
/// on core 0 (where the relay would be). In quick mode, unpinned and briefly.
pub(crate) struct Offer {
    pub(crate) batches_s: f64,
    pub(crate) ops_s: f64,
    /// Batches the sinks received, per batch published (PUB drops past its high-water mark).
    pub(crate) received: f64,
    pub(crate) bench_cpu: f64,
}

pub(crate) fn publisher_alone(opts: &Opts, shape: Shape) -> Offer {
    let engine = harness::engine_on(shape.wire(), DP, 10_000);
    if !opts.quick {
        pin(std::process::id(), "1");
    }
    let stop = Arc::new(AtomicBool::new(false));
    let received = Arc::new(AtomicU64::new(0));
    let ready = Arc::new(AtomicU64::new(0));
    let sinks: Vec<_> = engine
        .endpoints()
        .into_iter()
        .map(|ep| {
            let (stop, received, ready, pin_it) = (stop.clone(), received.clone(), ready.clone(), !opts.quick);
            let ctx_like = engine.context().clone();
            std::thread::spawn(move || {
                if pin_it {
                    pin_this_thread("0");
                }
                // A zmq context of its own (the engine's type, made anew) whose I/O thread starts
                // on this thread's core, with the socket.
                let ctx = fresh(&ctx_like);
                let sock = ZmqSub::connect(&ctx, &ep.publisher).expect("SUB");
                ready.fetch_add(1, Ordering::Relaxed);
                while !stop.load(Ordering::Relaxed) {
                    if sock.recv_raw(Duration::from_millis(50)).is_some() {
                        received.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    while ready.load(Ordering::Relaxed) < u64::from(DP) {
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(300)); // the subscriptions reach the PUBs
    let pubr = Publisher::cycle(engine.clone(), Cycle::new(shape, DP, cycle_geometry(opts)));
    let window = if opts.quick { Duration::from_millis(500) } else { Duration::from_secs(3) };
    let me = std::process::id();
    let (b0, t0) = (cpu_seconds(me), Instant::now());
    pubr.set_rate(f64::INFINITY);
    std::thread::sleep(window);
    let (p, o, b1, el) = (pubr.published(), pubr.ops.load(Ordering::Relaxed), cpu_seconds(me), t0.elapsed());
    pubr.set_rate(0.0);
    let all = pubr.published(); // the window's and the few after it
    drop(pubr);
    engine.flush().expect("flush");
    std::thread::sleep(Duration::from_millis(200));
    stop.store(true, Ordering::Relaxed);
    for t in sinks {
        let _ = t.join();
    }
    if !opts.quick {
        pin(me, "0,1");
    }
    let secs = el.as_secs_f64();
    Offer {
        batches_s: p as f64 / secs,
        ops_s: o as f64 / secs,
        received: received.load(Ordering::Relaxed) as f64 / all.max(1) as f64,
        bench_cpu: (b1 - b0) / secs,
    }
}

/// A new value of `T`'s type (a zmq context without naming the crate).
pub(crate) fn fresh<T: Default>(_: &T) -> T {
    T::default()
}

/// Pins the calling thread (`taskset -p -c` on its thread id); threads it starts inherit it.
pub(crate) fn pin_this_thread(cores: &str) {
    let link = std::fs::read_link("/proc/thread-self").expect("/proc/thread-self");
    let tid: u32 = link
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.parse().ok())
        .expect("a thread id in /proc/thread-self");
    pin(tid, cores);
}

/// The ingest search on a pre-encoded shape. The first subscriber applies the stream to an index
/// as the Mooncake rows' do; the others only count (see [`Sub::start_counting`]).
pub(crate) fn ingest_shape(
    opts: &Opts,
    rt: &tokio::runtime::Runtime,
    shape: Shape,
    cores: Option<&str>,
    nsubs: usize,
) -> Option<Step> {
    let s = setup_on(opts, shape.wire(), cores, &[]);
    if cores.is_some() {
        pin(std::process::id(), "1");
    }
    let url = s.relay.url();
    let subs: Vec<Sub> = (0..nsubs)
        .map(|i| if i == 0 { Sub::start(rt.handle(), &url, None) } else { Sub::start_counting(rt.handle(), &url) })
        .collect();
    let cycle = Cycle::new(shape, DP, cycle_geometry(opts));
    let (per_batch, live) = (cycle.ops_per_batch(), cycle.live_blocks());
    let pubr = Publisher::cycle(s.engine.clone(), cycle);
    // Warm up: one whole pass and its prelude on every rank, so that removals flow and the live
    // set is at its size.
    let warm = ((cycle_geometry(opts).0 + cycle_geometry(opts).1) as u64) * u64::from(DP);
    pubr.set_rate(if opts.quick { 1000.0 } else { 500.0 });
    while pubr.published() < warm {
        std::thread::sleep(Duration::from_millis(20));
    }
    pubr.set_rate(0.0);
    drain(&pubr, &subs, Duration::from_secs(120));
    let relay_live = status(&url).ok().and_then(|st| st.counters.get("live_blocks").copied()).unwrap_or(0);
    println!(
        "ingest, {}: relay on {}, {nsubs} subscriber(s) (1 indexing), {per_batch:.1} block ops a batch, live blocks {relay_live} (cycle's {live}), load average {}",
        shape.name(),
        cores.map_or("both cores".to_string(), |c| format!("core {c}, this process on core 1")),
        loadavg()
    );
    // From about 30,000 block operations a second (5,000 in quick mode), x1.6 a step.
    let ramp = Ramp {
        start: (if opts.quick { 5_000.0 } else { 30_000.0 } / per_batch).max(10.0),
        factor: 1.6,
        max_steps: if opts.quick { 2 } else { 16 },
        refine: if opts.quick { 0 } else { 2 },
        down: if opts.quick { 0 } else { 3 },
    };
    let best = search(opts, &s, &pubr, &subs, &ramp);
    commit_breakdown(&s);
    if cores.is_some() {
        pin(std::process::id(), "0,1");
    }
    drop(pubr);
    finish_all(subs, rt);
    best
}

/// Stops the subscribers, printing the errors their streams ended with.
pub(crate) fn finish_all(subs: impl IntoIterator<Item = Sub>, rt: &tokio::runtime::Runtime) {
    for sub in subs {
        let errors = sub.shared.errors.lock().expect("errors").clone();
        if !errors.is_empty() {
            println!("  subscriber errors: {errors:?}");
        }
        sub.finish(rt);
    }
}

/// Where the relay's time went: its commit histograms against its CPU time so far.
pub(crate) fn commit_breakdown(s: &Setup) {
    let m = s.relay.metrics_text();
    let get = |n: &str| metric(&m, n, &[]).unwrap_or(f64::NAN);
    let (secs, n, records) = (
        get("kv_relay_commit_seconds_sum"),
        get("kv_relay_commit_seconds_count"),
        get("kv_relay_commit_group_records_sum"),
    );
    let cpu = cpu_seconds(s.relay.pid().expect("pid"));
    println!(
        "  relay so far: {n:.0} commits of {:.1} records on average, {:.2} ms each ({:.3} ms per record); {secs:.1} s in commits, {cpu:.1} s of CPU",
        records / n,
        secs / n * 1000.0,
        secs / records * 1000.0,
    );
}
