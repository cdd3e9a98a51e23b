//! The footprint part: a million live blocks (RSS, disk), latency at steady rates, a snapshot
//! resync and the commit pause beside it, and recovery after SIGKILL.

use super::*;

pub(crate) fn footprint_latency_resync(opts: &Opts, rt: &tokio::runtime::Runtime, table: &mut Table) {
    // The history holds the catch-up and no more, so that a new subscriber takes the snapshot path.
    let history = opts.history_batches.to_string();
    let mut s = setup(opts, None, &["--history-batches", &history]);
    let url = s.relay.url();
    std::thread::sleep(Duration::from_millis(500));
    let rss_idle = s.relay.rss_kib().unwrap_or(0);
    println!("footprint: relay RSS idle {:.1} MiB (load average {})", rss_idle as f64 / 1024.0, loadavg());
    table.row("RSS idle", format!("{:.1} MiB", rss_idle as f64 / 1024.0), "", "");

    let direct = Direct::start(&s.engine);
    let sub = Sub::start(rt.handle(), &url, None);
    let pubr = Publisher::start(s.engine.clone(), Workload::new(opts));
    std::thread::sleep(Duration::from_millis(300));

    let mut catchup_rate = if opts.quick { 500.0 } else { 300.0 };
    if opts.part("latency") {
        // Warm the caches, then find the highest stable rate with one subscriber (short steps).
        pubr.set_rate(300.0);
        std::thread::sleep(Duration::from_secs(if opts.quick { 1 } else { 4 }));
        pubr.set_rate(0.0);
        drain(&pubr, std::slice::from_ref(&sub), Duration::from_secs(60));
        // Issue 28's rates (p50 at 250, p99 at 750, CPU at 1,000 batches/s), then the overload
        // rate and the sustainable rate and half of it.
        let mut rates =
            if opts.quick { vec![250.0, opts.latency_rate] } else { vec![250.0, 750.0, 1000.0, opts.latency_rate] };
        if let Some(r) = &opts.rates {
            rates.clone_from(r);
        }
        let sustainable = if opts.quick || opts.rates.is_some() {
            None
        } else {
            search(opts, &s, &pubr, std::slice::from_ref(&sub), &Ramp::mooncake(opts))
                .map(|b| (b.batches_s / 50.0).floor() * 50.0)
        };
        if let Some(r) = sustainable {
            catchup_rate = (0.8 * r).max(100.0);
            if r < opts.latency_rate {
                rates.push(r);
                rates.push((r / 2.0).max(50.0));
            }
        }
        for rate in rates {
            // Above the sustainable rate the backlog grows all along: a shorter window.
            let window =
                if sustainable.is_some_and(|r| rate > r) { Duration::from_secs(2) } else { opts.latency_window };
            let mut rows: Vec<[f64; 8]> = Vec::new();
            for _ in 0..opts.runs {
                let w = latency_window(&s, &pubr, &sub, &direct, rate, window);
                println!(
                    "latency at {rate:.0} b/s offered ({:.0} published): relay p50 {:.2} p99 {:.2} p99.9 {:.2} ms; direct p50 {:.3} p99 {:.3} p99.9 {:.3} ms; relay cpu {:.2}",
                    w[6], w[0], w[1], w[2], w[3], w[4], w[5], w[7]
                );
                rows.push(w);
            }
            let m = |i: usize| median(&mut rows.iter().map(|r| r[i]).collect::<Vec<_>>());
            let ratio = |a: usize, b: usize| median(&mut rows.iter().map(|r| r[a] / r[b]).collect::<Vec<_>>());
            let what =
                format!("{rate:.0} batches/s offered ({:.0} published), Mooncake, median of {}", m(6), opts.runs);
            table.row(
                format!("latency through gRPC at {what}"),
                format!(
                    "relay path p50 {:.2} / p99 {:.2} / p99.9 {:.2} ms; ratio {:.0}x / {:.0}x / {:.0}x",
                    m(0),
                    m(1),
                    m(2),
                    ratio(0, 3),
                    ratio(1, 4),
                    ratio(2, 5),
                ),
                format!("direct SUB p50 {:.3} / p99 {:.3} / p99.9 {:.3} ms", m(3), m(4), m(5)),
                match rate as u64 {
                    250 => "relay p50 under 0.5 ms",
                    750 => "relay p99 at most direct p99 + 1 ms",
                    _ => "",
                },
            );
            table.row(
                format!("relay CPU at {what}"),
                format!("{:.3} cores ({:.3} per 1,000 batches/s)", m(7), m(7) / (m(6) / 1000.0)),
                "",
                if rate as u64 == 1000 { "at most 0.1 core" } else { "" },
            );
        }
    }

    if opts.part("footprint") {
        // Catch-up: a subscriber leaves, the history grows by N batches, it comes back.
        let sub_state = sub.finish(rt);
        let mut catchups = Vec::new();
        let mut held = Some(sub_state);
        let mut sub_again = None;
        for run in 0..opts.runs {
            let target = pubr.published() + opts.catchup_batches;
            pubr.set_rate(catchup_rate);
            while pubr.published() < target {
                std::thread::sleep(Duration::from_millis(10));
            }
            pubr.set_rate(0.0);
            // Wait until the relay has committed them all.
            let want: u64 = target;
            let ok = harness_wait(Duration::from_secs(300), || {
                let (_, seqs) = relay_position(&url);
                seqs.iter().map(|s| s + 1).sum::<u64>() >= want
            });
            assert!(ok, "the relay never committed the catch-up batches");
            let (newest, _) = relay_position(&url);
            let st = match (held.take(), sub_again.take()) {
                (Some(st), _) => st,
                (None, Some(s)) => Sub::finish(s, rt),
                _ => unreachable!(),
            };
            let from = st.admission.position().cursor;
            let t = Instant::now();
            let sub2 = Sub::start(rt.handle(), &url, Some(st));
            let ok = harness_wait(Duration::from_secs(300), || sub2.cursor() >= newest);
            assert!(ok, "the subscriber never caught up to {newest}: {:?}", sub2.shared.errors.lock().expect("e"));
            let took = t.elapsed();
            println!(
                "catch-up {}: {} records of history (cursor {from} -> {newest}) in {:.0} ms, snapshots {}",
                run + 1,
                newest - from,
                took.as_secs_f64() * 1000.0,
                sub2.shared.snapshots.load(Ordering::Relaxed)
            );
            catchups.push(took.as_secs_f64() * 1000.0);
            // Leave it stopped for the next run.
            held = Some(sub2.finish(rt));
        }
        let (hist_rss, hist) =
            (s.relay.rss_kib().unwrap_or(0), status(&url).map(|x| (x.history_records, x.history_bytes)));
        let live_cache = metric(&s.relay.metrics_text(), "kv_relay_live_blocks", &[]).unwrap_or(0.0);
        println!(
            "history: {:?} (records, bytes), live blocks {live_cache}, RSS {:.1} MiB",
            hist,
            hist_rss as f64 / 1024.0
        );
        table.row(
            format!("catch-up of {} batches of history (median of {})", opts.catchup_batches, opts.runs),
            format!("{:.0} ms", median(&mut catchups)),
            "",
            "",
        );
        table.row(
            "RSS with a full history",
            format!(
                "{:.1} MiB ({} records, {:.1} MiB of history, {live_cache:.0} live blocks)",
                hist_rss as f64 / 1024.0,
                hist.as_ref().map_or(0, |h| h.0),
                hist.as_ref().map_or(0, |h| h.1) as f64 / (1 << 20) as f64
            ),
            "",
            "",
        );
    } else {
        sub.finish(rt);
    }
    drop(pubr);
    if !opts.part("footprint") && !opts.part("recovery") {
        return;
    }

    // Fill: fresh chained prefixes of 128 blocks, alternating ranks, until fill_blocks are live.
    let pid = s.relay.pid().expect("pid");
    let t = Instant::now();
    let c0 = cpu_seconds(pid);
    let per = 128u64;
    let total = opts.fill_blocks;
    let mut next_hash = 1u64 << 62;
    let mut sent = 0u64;
    let mut published = 0u64;
    let base_seq: u64 = (0..DP).map(|r| s.engine.stats(r).map(|x| x.next_seq).unwrap_or(0)).sum();
    while sent < total {
        let rank = (published % u64::from(DP)) as u32;
        let n = per.min(total - sent);
        let hashes: Vec<BlockHash> = (0..n).map(|i| BlockHash::U64(next_hash + i)).collect();
        next_hash += n;
        let tokens: Vec<u64> = (0..n * u64::from(BLOCK_SIZE)).map(|i| 1 + (next_hash ^ i) % 32_000).collect();
        s.engine.publish(rank, vec![vllm_prefix(hashes, tokens)]).expect("publish");
        sent += n;
        published += 1;
        // Keep at most ~400 batches ahead of the relay.
        if published.is_multiple_of(100) {
            harness_wait(Duration::from_secs(120), || {
                let (_, seqs) = relay_position(&url);
                seqs.iter().map(|s| s + 1).sum::<u64>() + 400 >= base_seq + published
            });
        }
    }
    harness_wait(Duration::from_secs(300), || {
        let (_, seqs) = relay_position(&url);
        seqs.iter().map(|s| s + 1).sum::<u64>() >= base_seq + published
    });
    let fill_secs = t.elapsed().as_secs_f64();
    let fill_cpu = cpu_seconds(pid) - c0;
    std::thread::sleep(Duration::from_secs(2)); // sled's background flush, the live gauges
    let rss_full = s.relay.rss_kib().unwrap_or(0);
    let live = live_blocks(&url) as f64;
    let disk = dir_bytes(&s.relay.state_dir);
    println!(
        "fill: {published} batches of {per} stores in {fill_secs:.1} s ({:.0} block ops/s, relay CPU {:.2} cores); live blocks {live}, RSS {:.1} MiB, state directory {:.1} MiB ({:.0} B per live block); load average {}",
        total as f64 / fill_secs,
        fill_cpu / fill_secs,
        rss_full as f64 / 1024.0,
        disk as f64 / (1 << 20) as f64,
        disk as f64 / live.max(1.0),
        loadavg()
    );
    table.row(
        format!("RSS at {} live blocks of {BLOCK_SIZE} tokens, full history", th(live)),
        format!("{:.1} MiB", rss_full as f64 / 1024.0),
        format!("RSS idle {:.1} MiB", rss_idle as f64 / 1024.0),
        "at most 200 MiB",
    );
    table.row(
        "bytes on disk per live block (state directory: log, history and checkpoint)",
        format!("{:.0} ({:.1} MiB)", disk as f64 / live.max(1.0), disk as f64 / (1 << 20) as f64),
        "",
        "at most 150",
    );
    table.row(
        format!("fill, {per} stores per batch"),
        format!("{} block ops/s, relay CPU {:.2} cores", th(total as f64 / fill_secs), fill_cpu / fill_secs),
        "",
        "",
    );

    if opts.part("footprint") {
        resync_and_pause(opts, rt, &s, live, table);
    }
    if opts.part("recovery") {
        recovery(rt, &mut s, table);
    }
    drop(direct);
}

/// The relay's live blocks (Status's `live_blocks` counter).
pub(crate) fn live_blocks(url: &str) -> u64 {
    status(url).ok().and_then(|st| st.counters.get("live_blocks").copied()).unwrap_or(0)
}

/// A histogram's (sum, count) from the relay's metrics endpoint.
pub(crate) fn histogram(s: &Setup, name: &str) -> Option<(f64, f64)> {
    let m = s.relay.metrics_text();
    Some((metric(&m, &format!("{name}_sum"), &[])?, metric(&m, &format!("{name}_count"), &[])?))
}

/// A new subscriber rebuilds its index through the snapshot path, `runs` times; each snapshot's
/// commit pause is read from the relay's `kv_relay_store_snapshot_pause_seconds` (the growth of
/// its sum and count across the run), beside the mean commit of the same run as the peer.
pub(crate) fn resync_and_pause(opts: &Opts, rt: &tokio::runtime::Runtime, s: &Setup, live: f64, table: &mut Table) {
    pub(crate) const PAUSE: &str = "kv_relay_store_snapshot_pause_seconds";
    let url = s.relay.url();
    let (newest, _) = relay_position(&url);
    let mut resyncs = Vec::new();
    let mut pauses = Vec::new();
    for run in 0..opts.runs {
        let p0 = histogram(s, PAUSE);
        let t = Instant::now();
        let sub = Sub::start(rt.handle(), &url, None);
        let ok = harness_wait(Duration::from_secs(600), || sub.cursor() >= newest);
        assert!(ok, "the new subscriber never reached cursor {newest}: {:?}", sub.shared.errors.lock().expect("e"));
        let took = t.elapsed();
        let snaps = sub.shared.snapshots.load(Ordering::Relaxed);
        let st = sub.finish(rt);
        let blocks = st.index.stats().blocks;
        let pause = match (p0, histogram(s, PAUSE)) {
            (Some((s0, n0)), Some((s1, n1))) if n1 > n0 => Some((s1 - s0) / (n1 - n0) * 1000.0),
            (None, Some((s1, n1))) if n1 > 0.0 => Some(s1 / n1 * 1000.0),
            _ => None,
        };
        println!(
            "snapshot resync {}: {blocks} blocks indexed at cursor {} in {:.0} ms, snapshots {snaps}, commit pause {} (relay RSS {:.1} MiB)",
            run + 1,
            st.admission.position().cursor,
            took.as_secs_f64() * 1000.0,
            pause.map_or("not exported".to_string(), |p| format!("{p:.2} ms")),
            s.relay.rss_kib().unwrap_or(0) as f64 / 1024.0
        );
        resyncs.push(took.as_secs_f64() * 1000.0);
        pauses.extend(pause);
    }
    table.row(
        format!("snapshot resync of {} blocks into kv-router-client's index (median of {})", th(live), opts.runs),
        format!("{:.0} ms", median(&mut resyncs)),
        "",
        "at most 1 s",
    );
    let commit = histogram(s, "kv_relay_commit_seconds").map(|(sum, n)| sum / n * 1000.0);
    let max = pauses.iter().copied().fold(f64::NAN, f64::max);
    table.row(
        format!("commit pause while a snapshot of {} blocks is taken ({PAUSE}, median of {})", th(live), pauses.len()),
        if pauses.is_empty() {
            "not exported".to_string()
        } else {
            format!("{:.2} ms (max {max:.2} ms)", median(&mut pauses))
        },
        commit.map_or(String::new(), |c| format!("a commit takes {c:.2} ms on average")),
        "at most 5 ms",
    );
}

/// Recovery after SIGKILL at the fill's live blocks: the relay is killed (-9) with a subscriber
/// following, started again on the same state directory and ports, and timed until Status
/// answers, until its live blocks equal what it had, and until the subscriber is following again
/// at the newest cursor. The peer: the same after a clean stop (SIGTERM).
pub(crate) fn recovery(rt: &tokio::runtime::Runtime, s: &mut Setup, table: &mut Table) {
    let url = s.relay.url();
    let sub = Sub::start(rt.handle(), &url, None);
    let (newest, _) = relay_position(&url);
    let ok = harness_wait(Duration::from_secs(600), || sub.cursor() >= newest);
    assert!(ok, "the subscriber never reached cursor {newest}: {:?}", sub.shared.errors.lock().expect("e"));
    let live = live_blocks(&url);
    let mut times: Vec<[f64; 3]> = Vec::new();
    let mut resumed = Vec::new();
    for (how, signal) in [("SIGKILL", "KILL"), ("SIGTERM", "TERM")] {
        let sessions = sub.shared.sessions.load(Ordering::Relaxed);
        let snapshots = sub.shared.snapshots.load(Ordering::Relaxed);
        if signal == "KILL" {
            s.relay.kill();
        } else {
            let stopped = s.relay.terminate(Duration::from_secs(60));
            assert!(stopped.is_some(), "the relay did not exit within 60 s of SIGTERM");
        }
        let t = Instant::now();
        s.relay.spawn_only();
        let ok = harness_wait(Duration::from_secs(300), || status(&url).is_ok());
        assert!(ok, "the restarted relay never answered Status; log:\n{}", s.relay.log_tail());
        let serving = t.elapsed();
        let ok = harness_wait(Duration::from_secs(300), || live_blocks(&url) == live);
        assert!(ok, "the restarted relay's live blocks never came back to {live} ({} now)", live_blocks(&url));
        let equal = t.elapsed();
        let (newest, _) = relay_position(&url);
        let ok = harness_wait(Duration::from_secs(300), || {
            sub.shared.sessions.load(Ordering::Relaxed) > sessions && sub.cursor() >= newest
        });
        assert!(ok, "the subscriber never followed the restarted relay: {:?}", sub.shared.errors.lock().expect("e"));
        let resynced = t.elapsed();
        println!(
            "restart after {how} at {live} live blocks: Status answers in {:.0} ms, live blocks equal in {:.0} ms, subscriber following at cursor {newest} in {:.0} ms (snapshots so far {}; load average {})",
            serving.as_secs_f64() * 1000.0,
            equal.as_secs_f64() * 1000.0,
            resynced.as_secs_f64() * 1000.0,
            sub.shared.snapshots.load(Ordering::Relaxed),
            loadavg()
        );
        times.push([serving, equal, resynced].map(|d| d.as_secs_f64() * 1000.0));
        resumed.push(sub.shared.snapshots.load(Ordering::Relaxed) == snapshots);
    }
    sub.finish(rt);
    let [k, c] = [times[0], times[1]];
    table.row(
        format!("recovery after SIGKILL at {} live blocks, to serving", th(live as f64)),
        format!(
            "Status answers {:.0} ms, live blocks equal {:.0} ms, subscriber following {:.0} ms ({})",
            k[0],
            k[1],
            k[2],
            if resumed[0] { "resumed" } else { "through a snapshot" }
        ),
        format!(
            "after SIGTERM: {:.0} / {:.0} / {:.0} ms ({})",
            c[0],
            c[1],
            c[2],
            if resumed[1] { "resumed" } else { "through a snapshot" }
        ),
        "at most 3 s, log replay included",
    );
}
