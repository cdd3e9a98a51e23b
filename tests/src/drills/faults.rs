//! The drills of the stream and the engine: restarts, stale cursors, drops, delays, gaps, kills,
//! a dead engine, a slow subscriber, garbage and oversized messages.

use super::*;

pub fn router_restart(scale: Scale) -> Report {
    let mut rep = Report::new(
        "router restarted under load, relay history already rolled past its start",
        "every worker equal within 2.5 s of the router's start",
    );
    let cx = Ctx::new();
    let e = engine(4, 10_000);
    let r = cx.relay(&e, &["--history-batches", "100"]);
    let t = Traffic::start(&e, 200, 1);
    let a = cx.router(&r);
    std::thread::sleep(Duration::from_secs(if scale.long { 10 } else { 1 }));
    let before = a.stop();
    roll_history_past(&mut rep, &r, before.cursor());
    let started = Instant::now();
    let b = cx.router(&r);
    let took = time_to_equal(&e, Some(&t), &[&b], started, Duration::from_secs(5));
    match took {
        Some(d) => {
            rep.measure(format!("restarted router equal {} after its start (under 200 req/s)", ms(d)));
            rep.check(d <= Duration::from_millis(2500), format!("equal only after {}", ms(d)));
        }
        None => {
            rep.check(false, format!("not equal within 5 s: {}", diff(&e, &b.get())));
        }
    }
    let s = b.get();
    rep.measure(format!("its snapshots: {:?}, gaps {}", s.snapshots, s.counters.gaps));
    rep.check(s.counters.gaps == 0, "the router saw a cursor gap");
    rep
}

pub fn stale_cursor(_scale: Scale) -> Report {
    let mut rep =
        Report::new("router's cursor older than the relay's history", "snapshot resync, equal, no rank left degraded");
    let cx = Ctx::new();
    let e = engine(4, 10_000);
    let r = cx.relay(&e, &["--history-batches", "100"]);
    let t = Traffic::start(&e, 200, 2);
    // The router reaches the relay through a proxy; cutting it partitions them while the
    // history rolls past the router's cursor. On its own, it reconnects with that cursor.
    let p = Proxy::start(cx.rt.handle(), r.listen);
    let a = Router::start(cx.rt.handle(), p.url(), FollowConfig::default());
    cx.warm(&e);
    expect_equal(&mut rep, &e, Some(&t), &[&a], "before the partition", Duration::from_secs(10));
    p.set_cut(true);
    wait_until(Duration::from_secs(5), || !a.follower.relays().iter().any(|x| x.connected));
    // What the router still had in hand when the link went is applied before its cursor counts.
    let mut saved = a.get();
    let settle = Instant::now();
    loop {
        std::thread::sleep(Duration::from_millis(300));
        let now = a.get();
        if now.cursor() == saved.cursor() || settle.elapsed() > Duration::from_secs(5) {
            break;
        }
        saved = now;
    }
    roll_history_past(&mut rep, &r, saved.cursor());
    let started = Instant::now();
    p.set_cut(false);
    let took = time_to_equal(&e, Some(&t), &[&a], started, Duration::from_secs(15));
    let s = a.get();
    let trimmed =
        s.snapshots_for("SNAPSHOT_REASON_CURSOR_TRIMMED") - saved.snapshots_for("SNAPSHOT_REASON_CURSOR_TRIMMED");
    rep.measure(format!(
        "partitioned at cursor {}, link restored: now at cursor {}, snapshots {:?} ({trimmed} cursor_trimmed since the partition), equal after {}",
        saved.cursor(),
        s.cursor(),
        s.snapshots,
        took.map(ms).unwrap_or("never".into())
    ));
    rep.check(trimmed >= 1, "no CURSOR_TRIMMED snapshot");
    rep.check(took.is_some(), format!("never equal: {}", diff(&e, &s)));
    rep.check(s.counters.gaps == 0, "a cursor gap");
    let st = status(&r.url()).unwrap_or_default();
    let bad = not_ok_ranks(&st);
    rep.measure(format!("ranks not OK: {bad:?}"));
    rep.check(bad.is_empty() && s.degraded.is_empty(), format!("ranks left degraded: {bad:?} / {:?}", s.degraded));
    rep
}

pub fn wire_drops(_scale: Scale) -> Report {
    let mut rep =
        Report::new("20 batches dropped on the wire", "refilled inside the relay; the router sees no gap; equal");
    let cx = Ctx::new();
    let e = engine(4, 10_000);
    let r = cx.relay(&e, &[]);
    let t = Traffic::start(&e, 200, 3);
    let a = cx.router(&r);
    cx.warm(&e);
    expect_equal(&mut rep, &e, Some(&t), &[&a], "before", Duration::from_secs(10));
    let before = status(&r.url()).unwrap_or_default();
    e.drop_on_wire(1, 20).expect("drop");
    let served = t.served.load(std::sync::atomic::Ordering::Relaxed);
    wait_until(Duration::from_secs(5), || t.served.load(std::sync::atomic::Ordering::Relaxed) > served + 120);
    expect_equal(&mut rep, &e, Some(&t), &[&a], "after", Duration::from_secs(10));
    std::thread::sleep(Duration::from_millis(300));
    let after = status(&r.url()).unwrap_or_default();
    let refilled = counter(&after, "rank1.refilled_batches") - counter(&before, "rank1.refilled_batches");
    let lost: u64 = (0..4).map(|k| counter(&after, &format!("rank{k}.lost_batches"))).sum();
    rep.measure(format!("relay refilled {refilled} batches of rank 1, lost {lost}"));
    rep.check(refilled >= 20, format!("refilled {refilled}, want 20"));
    rep.check(lost == 0, format!("lost {lost}"));
    let s = a.get();
    rep.measure(format!(
        "router: {} records, gaps {}, snapshots {:?}, controls {:?}",
        s.counters.records_applied, s.counters.gaps, s.snapshots, s.controls
    ));
    rep.check(
        s.counters.gaps == 0 && s.counters.snapshots == 0 && s.controls.is_empty(),
        "the router saw a gap, snapshot or control",
    );
    rep
}

pub fn publisher_delay(_scale: Scale) -> Report {
    let mut rep = Report::new(
        "publisher delayed 1.5 s",
        "the lag is visible in status and metrics within 2 s; nothing lost; equal after",
    );
    let cx = Ctx::new();
    let e = engine(4, 10_000);
    let r = cx.relay(&e, &[]);
    let t = Traffic::start(&e, 200, 4);
    let a = cx.router(&r);
    cx.warm(&e);
    expect_equal(&mut rep, &e, Some(&t), &[&a], "before", Duration::from_secs(10));
    let start = Instant::now();
    e.delay(2, Duration::from_millis(1500)).expect("delay");
    let (mut in_status, mut in_metrics) = (None, None);
    let (mut max_status, mut max_metric) = (0u64, 0f64);
    while start.elapsed() < Duration::from_secs(3) && (in_status.is_none() || in_metrics.is_none()) {
        if let Ok(s) = status(&r.url()) {
            let lag = s.ranks.iter().find(|k| k.dp_rank == 2).map_or(0, |k| k.lag_ms);
            max_status = max_status.max(lag);
            if lag >= 1000 && in_status.is_none() {
                in_status = Some(start.elapsed());
            }
        }
        let m = metric(&r.metrics_text(), "kv_relay_ingest_lag_seconds", &["rank=\"2\""]).unwrap_or(0.0);
        max_metric = max_metric.max(m);
        if m >= 1.0 && in_metrics.is_none() {
            in_metrics = Some(start.elapsed());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    rep.measure(format!(
        "lag ≥ 1 s in Status after {}, in metrics after {} (max seen: status {} ms, metric {:.3} s)",
        in_status.map(ms).unwrap_or("never".into()),
        in_metrics.map(ms).unwrap_or("never".into()),
        max_status,
        max_metric
    ));
    rep.check(in_status.is_some_and(|d| d <= Duration::from_secs(2)), "lag not visible in Status within 2 s");
    rep.check(in_metrics.is_some_and(|d| d <= Duration::from_secs(2)), "lag not visible in metrics within 2 s");
    expect_equal(&mut rep, &e, Some(&t), &[&a], "after", Duration::from_secs(10));
    let st = status(&r.url()).unwrap_or_default();
    let lost: u64 = (0..4).map(|k| counter(&st, &format!("rank{k}.lost_batches"))).sum();
    let s = a.get();
    rep.check(
        lost == 0 && s.counters.gaps == 0 && s.controls.is_empty(),
        format!("lost {lost}, gaps {}, controls {:?}", s.counters.gaps, s.controls),
    );
    rep
}

pub fn publisher_restart(_scale: Scale) -> Report {
    let mut rep = Report::new(
        "publisher restarted (one rank of four)",
        "that rank reset and rebuilt, the other three untouched; equal",
    );
    let cx = Ctx::new();
    let e = engine(4, 10_000);
    let r = cx.relay(&e, &[]);
    let t = Traffic::start(&e, 200, 5);
    let a = cx.router(&r);
    cx.warm(&e);
    expect_equal(&mut rep, &e, Some(&t), &[&a], "before", Duration::from_secs(10));
    let before = status(&r.url()).unwrap_or_default();
    let controls_before = a.get().controls.len();
    let start = Instant::now();
    t.hold(|| e.restart(2)).expect("restart");
    let took = time_to_equal(&e, Some(&t), &[&a], start, Duration::from_secs(10));
    rep.measure(format!("equal {} after the restart", took.map(ms).unwrap_or("never".into())));
    rep.check(took.is_some(), format!("not equal: {}", diff(&e, &a.get())));
    // Status counters are copied from the rank threads every 250 ms.
    wait_until(Duration::from_secs(2), || {
        status(&r.url())
            .map(|s| counter(&s, "rank2.publisher_restarts") > counter(&before, "rank2.publisher_restarts"))
            .unwrap_or(false)
    });
    let after = status(&r.url()).unwrap_or_default();
    let s = a.get();
    let new_controls = &s.controls[controls_before..];
    rep.measure(format!("controls the router got: {new_controls:?}"));
    rep.check(new_controls.contains(&(2, "rank_reset")), "no rank_reset for rank 2");
    rep.check(new_controls.iter().all(|c| c.0 == 2), "a control for another rank");
    for k in 0..4 {
        let d = counter(&after, &format!("rank{k}.publisher_restarts"))
            - counter(&before, &format!("rank{k}.publisher_restarts"));
        rep.check((k == 2) == (d >= 1), format!("rank {k}: {d} publisher restarts counted"));
    }
    rep.check(s.counters.gaps == 0, "a cursor gap");
    rep
}

pub fn replay_gap(_scale: Scale) -> Report {
    let mut rep = Report::new(
        "gap beyond the engine's replay buffer",
        "rank marked degraded in status, metrics and stream; recovers at the next clear or restart",
    );
    let cx = Ctx::new();
    let e = engine(4, 10_000);
    let r = cx.relay(&e, &[]);
    let t = Traffic::start(&e, 200, 6);
    let a = cx.router(&r);
    cx.warm(&e);
    expect_equal(&mut rep, &e, Some(&t), &[&a], "before", Duration::from_secs(10));
    let start = Instant::now();
    e.lose(1, 3).expect("lose");
    let seen = std::cell::RefCell::new(String::new());
    let degraded = |want: bool| {
        let st = status(&r.url()).ok().and_then(|s| s.ranks.iter().find(|k| k.dp_rank == 1).map(|k| k.state));
        let in_status = st == Some(if want { pb::RankState::Degraded } else { pb::RankState::Ok } as i32);
        let m = metric(&r.metrics_text(), "kv_relay_rank_degraded", &["rank=\"1\""]);
        let in_metrics = m == Some(if want { 1.0 } else { 0.0 });
        let in_stream = a.get().degraded.contains(&1) == want;
        *seen.borrow_mut() = format!("status state {st:?}, metric {m:?}, stream degraded {:?}", a.get().degraded);
        in_status && in_metrics && in_stream
    };
    let took = wait_until(Duration::from_secs(5), || degraded(true));
    rep.measure(format!(
        "degraded in status, metrics and stream {} after the loss",
        took.map(ms).unwrap_or("never".into())
    ));
    rep.check(took.is_some(), format!("rank 1 not degraded in all three: {}", seen.borrow()));
    let others = status(&r.url()).map(|s| not_ok_ranks(&s)).unwrap_or_default();
    rep.check(others.iter().all(|x| x.0 == 1), format!("other ranks not OK: {others:?}"));
    let start2 = Instant::now();
    t.hold(|| e.clear(1)).expect("clear");
    let rec = wait_until(Duration::from_secs(5), || degraded(false));
    rep.measure(format!("recovered in all three {} after the clear", rec.map(ms).unwrap_or("never".into())));
    rep.check(rec.is_some(), format!("rank 1 did not recover after the clear: {}", seen.borrow()));
    rep.check(a.get().controls.contains(&(1, "rank_recovered")), "no rank_recovered in the stream");
    let _ = (start, start2);
    expect_equal(&mut rep, &e, Some(&t), &[&a], "after", Duration::from_secs(10));
    rep
}

pub fn relay_kill(_scale: Scale) -> Report {
    let mut rep = Report::new(
        "relay killed with SIGKILL under load, restarted",
        "router resumes or resyncs on its own; equal within 2.5 s of the relay's restart",
    );
    let cx = Ctx::new();
    let e = engine(4, 10_000);
    let mut r = cx.relay(&e, &[]);
    let t = Traffic::start(&e, 200, 7);
    let a = cx.router(&r);
    cx.warm(&e);
    expect_equal(&mut rep, &e, Some(&t), &[&a], "before", Duration::from_secs(10));
    for round in 0..3 {
        std::thread::sleep(Duration::from_millis(500));
        let before = a.get();
        r.kill();
        std::thread::sleep(Duration::from_millis(300));
        let start = Instant::now();
        r.spawn_only();
        let took = time_to_equal(&e, Some(&t), &[&a], start, Duration::from_secs(8));
        let s = a.get();
        rep.measure(format!(
            "kill {}: equal {} after the restart (router cursor {} -> {}, snapshots {:?}, gaps {})",
            round + 1,
            took.map(ms).unwrap_or("never".into()),
            before.cursor(),
            s.cursor(),
            s.snapshots,
            s.counters.gaps
        ));
        match took {
            Some(d) => {
                rep.check(d <= Duration::from_millis(2500), format!("kill {}: equal only after {}", round + 1, ms(d)));
            }
            None => {
                rep.check(
                    false,
                    format!("kill {}: never equal: {}; relay log:\n{}", round + 1, diff(&e, &s), r.log_tail()),
                );
            }
        }
        rep.check(s.counters.gaps == 0, "a cursor gap");
    }
    rep
}

pub fn engine_gone(scale: Scale) -> Report {
    let mut rep = Report::new(
        "engine gone for 10 s, then back",
        "relay keeps serving history and status; reconnects; equal after",
    );
    let gone = Duration::from_secs(if scale.long { 10 } else { 2 });
    let cx = Ctx::new();
    let e = engine(2, 10_000);
    let r = cx.relay(&e, &[]);
    let t = Traffic::start(&e, 200, 8);
    let a = cx.router(&r);
    cx.warm(&e);
    expect_equal(&mut rep, &e, Some(&t), &[&a], "before", Duration::from_secs(10));
    let before = status(&r.url()).unwrap_or_default();
    t.hold(|| {
        for k in 0..2 {
            e.stop(k).expect("stop");
        }
    });
    let start = Instant::now();
    let (mut calls, mut failed) = (0, 0);
    while start.elapsed() < gone {
        calls += 1;
        let ok = status(&r.url()).is_ok() && history(&r.url(), 1, 10).map(|h| !h.is_empty()).unwrap_or(false);
        if !ok {
            failed += 1;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    rep.measure(format!("engine gone {}: {calls} Status+History calls, {failed} failed", ms(gone)));
    rep.check(failed == 0, format!("{failed} calls failed while the engine was gone"));
    let back = Instant::now();
    t.hold(|| {
        for k in 0..2 {
            e.start_rank(k).expect("start");
        }
    });
    let took = time_to_equal(&e, Some(&t), &[&a], back, Duration::from_secs(15));
    rep.measure(format!("equal {} after the engine came back", took.map(ms).unwrap_or("never".into())));
    rep.check(took.is_some(), format!("never equal: {}", diff(&e, &a.get())));
    let restarted = |s: &pb::StatusResponse| {
        (0..2)
            .map(|k| {
                counter(s, &format!("rank{k}.publisher_restarts"))
                    - counter(&before, &format!("rank{k}.publisher_restarts"))
            })
            .collect::<Vec<u64>>()
    };
    wait_until(Duration::from_secs(2), || {
        status(&r.url()).map(|s| restarted(&s).iter().all(|&n| n >= 1)).unwrap_or(false)
    });
    let after = status(&r.url()).unwrap_or_default();
    let restarts: Vec<u64> = (0..2)
        .map(|k| {
            counter(&after, &format!("rank{k}.publisher_restarts"))
                - counter(&before, &format!("rank{k}.publisher_restarts"))
        })
        .collect();
    rep.measure(format!("publisher restarts seen per rank: {restarts:?}; ranks not OK: {:?}", not_ok_ranks(&after)));
    rep.check(restarts.iter().all(|&n| n >= 1), "a rank's reconnection not seen");
    rep
}

pub fn slow_subscriber(scale: Scale) -> Report {
    let mut rep =
        Report::new("slow subscriber beside fast ones", "fast ones unaffected; relay RSS bounded; slow one resyncs");
    // The slow router reaches the relay through a proxy that stops forwarding for a while (a
    // stalled router or link), then forwards 16 KiB a second (a slow one). It offers 64 KiB
    // HTTP/2 windows and waits longer than the stall before calling its stream dead. While it
    // stalls, the relay's buffers for it fill (a page of 256 records, a 64-message channel, the
    // window) and its producer stops; the 500-batch history rolls past it. When it reads again
    // it drains what was buffered, is told to resync, and converges from a snapshot. The stall
    // stays under the relay's HTTP/2 keepalive (a ping every 30 s, 20 s to answer), which
    // would otherwise close the stalled connection first.
    let stall = Duration::from_secs(if scale.long { 40 } else { 10 });
    let cx = Ctx::new();
    let e = engine(4, 10_000);
    let r = cx.relay(&e, &["--history-batches", "500"]);
    let t = Traffic::start(&e, 300, 9);
    let fast: Vec<Router> = (0..3).map(|_| cx.router(&r)).collect();
    let p = Proxy::start(cx.rt.handle(), r.listen);
    let slow_cfg = FollowConfig {
        http2_window_bytes: Some(64 << 10),
        receive_timeout: stall + Duration::from_secs(60),
        ..FollowConfig::default()
    };
    let slow = Router::start(cx.rt.handle(), p.url(), slow_cfg);
    cx.warm(&e);
    std::thread::sleep(Duration::from_millis(500));
    p.set_paused(true);
    let rss0 = r.rss_kib().unwrap_or(0);
    let mut rss_max = rss0;
    let start = Instant::now();
    while start.elapsed() < stall {
        rss_max = rss_max.max(r.rss_kib().unwrap_or(0));
        std::thread::sleep(Duration::from_millis(250));
    }
    p.set_rate(16 << 10);
    p.set_paused(false);
    let resynced = wait_until(Duration::from_secs(60), || {
        rss_max = rss_max.max(r.rss_kib().unwrap_or(0));
        let s = slow.get();
        s.counters.resyncs >= 1 && s.snapshots_for("SNAPSHOT_REASON_CURSOR_TRIMMED") >= 1
    });
    let s = slow.get();
    let (newest, oldest) = status(&r.url()).map(|x| (x.newest_cursor, x.oldest_cursor)).unwrap_or((0, 0));
    rep.measure(format!(
        "slow one stalled {}, then 16 KiB/s: told to resync and resynced {} after it read again; now at cursor {} (history {oldest}..{newest}), resyncs {}, snapshots {:?}",
        ms(stall),
        resynced.map(ms).unwrap_or("never".into()),
        s.cursor(),
        s.counters.resyncs,
        s.snapshots
    ));
    rep.check(resynced.is_some(), "the slow one was not told to resync");
    rep.measure(format!("relay RSS {} KiB before the stall, max {} KiB", rss0, rss_max));
    rep.check(rss_max < rss0 + 64 * 1024, "relay RSS grew by more than 64 MiB");
    let fs: Vec<_> = fast.iter().map(Router::get).collect();
    rep.measure(format!(
        "fast: resyncs {:?}, gaps {:?}, snapshots {:?}",
        fs.iter().map(|x| x.counters.resyncs).collect::<Vec<_>>(),
        fs.iter().map(|x| x.counters.gaps).collect::<Vec<_>>(),
        fs.iter().map(|x| x.counters.snapshots).collect::<Vec<_>>()
    ));
    rep.check(
        fs.iter().all(|x| x.counters.resyncs == 0 && x.counters.gaps == 0 && x.counters.snapshots == 0),
        "a fast one was affected",
    );
    let refs: Vec<&Router> = fast.iter().collect();
    expect_equal(&mut rep, &e, Some(&t), &refs, "fast ones", Duration::from_secs(10));
    drop(t);
    expect_equal(&mut rep, &e, None, &[&slow], "slow one after the traffic stops", Duration::from_secs(30));
    rep
}

pub fn garbage(_scale: Scale) -> Report {
    let mut rep = Report::new(
        "garbage and truncated frames mixed into the stream",
        "counted by reason; every well-formed event applied; equal",
    );
    use crate::engine::Garbage;
    let cx = Ctx::new();
    let e = engine(2, 10_000);
    let r = cx.relay(&e, &[]);
    let t = Traffic::start(&e, 200, 10);
    let a = cx.router(&r);
    cx.warm(&e);
    expect_equal(&mut rep, &e, Some(&t), &[&a], "before", Duration::from_secs(10));
    let m0 = r.metrics_text();
    let n = 5u64;
    for i in 0..n {
        for g in Garbage::ALL {
            e.garbage((i % 2) as u32, g).expect("garbage");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    expect_equal(&mut rep, &e, Some(&t), &[&a], "after", Duration::from_secs(10));
    std::thread::sleep(Duration::from_millis(300));
    let m1 = r.metrics_text();
    let by = |name: &str, reason: &str| {
        let l = format!("reason=\"{reason}\"");
        metric(&m1, name, &[&l]).unwrap_or(0.0) - metric(&m0, name, &[&l]).unwrap_or(0.0)
    };
    // Each kind under its own reason: frames that are not a batch are message errors; a batch
    // cut short or with a malformed event loses only that event.
    let mut counts = BTreeMap::new();
    for (metric_name, reason) in [
        ("kv_relay_message_errors_total", "wrong_frame_count"),
        ("kv_relay_message_errors_total", "bad_seq_frame"),
        ("kv_relay_message_errors_total", "not_msgpack"),
        ("kv_relay_dropped_events_total", "truncated_event"),
        ("kv_relay_dropped_events_total", "invalid_block_hashes"),
    ] {
        counts.insert(reason, by(metric_name, reason));
    }
    rep.measure(format!("injected {n} of each of 5 kinds; counted by reason {counts:?}"));
    for (reason, c) in &counts {
        rep.check(*c >= n as f64, format!("{reason}: counted {c}, injected {n}"));
    }
    // Status counts the same drops per rank (`rank<N>.dropped_events.<reason>`, refreshed every
    // second), as the metrics do since the relay started.
    for reason in ["truncated_event", "invalid_block_hashes"] {
        let total =
            metric(&m1, "kv_relay_dropped_events_total", &[&format!("reason=\"{reason}\"")]).unwrap_or(0.0) as u64;
        let suffix = format!(".dropped_events.{reason}");
        let in_status = || {
            status(&r.url()).map(|st| st.counters.iter().filter(|(k, _)| k.ends_with(&suffix)).map(|(_, v)| *v).sum())
        };
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut seen: u64 = in_status().unwrap_or(0);
        while seen != total && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
            seen = in_status().unwrap_or(0);
        }
        rep.check(seen == total, format!("Status counts {seen} {reason} drops, the metrics {total}"));
    }
    let s = a.get();
    let st = status(&r.url()).unwrap_or_default();
    rep.check(
        s.counters.gaps == 0 && not_ok_ranks(&st).is_empty(),
        format!("gaps {} / ranks not OK {:?}", s.counters.gaps, not_ok_ranks(&st)),
    );
    rep
}

pub fn oversized(_scale: Scale) -> Report {
    let mut rep = Report::new(
        "one batch of 16 MiB against max_message_bytes of 1 MiB, then a second",
        "that batch alone lost, the rank degraded with the bound named; relay RSS does not take it; the second counted, its warnings held back; recovers at the next clear; equal",
    );
    use crate::wire::EngineEvent;
    let cx = Ctx::new();
    let e = engine(2, 10_000);
    let r = cx.relay(&e, &["--max-message-bytes", "1048576"]);
    let t = Traffic::start(&e, 200, 11);
    let a = cx.router(&r);
    cx.warm(&e);
    expect_equal(&mut rep, &e, Some(&t), &[&a], "before", Duration::from_secs(10));
    let m0 = r.metrics_text();
    let rss0 = r.rss_kib().unwrap_or(0);
    let blocks = 600_000u64;
    let big = vec![EngineEvent::large_store(blocks)];
    let size =
        crate::wire::encode_batch(&e.wire(), &crate::wire::Batch { ts: 0.0, events: big.clone(), dp_rank: Some(1) })
            .len();
    rep.measure(format!("the batch: {blocks} blocks, {size} bytes"));
    rep.check(size > 16 << 20, format!("the batch is {size} bytes, not over 16 MiB"));
    let first = Instant::now();
    e.publish(1, big.clone()).expect("publish");
    let mut rss_max = rss0;
    let reason = std::cell::RefCell::new(String::new());
    let degraded = wait_until(Duration::from_secs(10), || {
        rss_max = rss_max.max(r.rss_kib().unwrap_or(0));
        let st = status(&r.url()).ok();
        let rank = st.as_ref().and_then(|s| s.ranks.iter().find(|k| k.dp_rank == 1).cloned());
        *reason.borrow_mut() = rank.as_ref().map(|k| k.reason.clone()).unwrap_or_default();
        rank.is_some_and(|k| k.state == pb::RankState::Degraded as i32) && a.get().degraded.contains(&1)
    });
    rep.measure(format!(
        "rank 1 degraded in status and stream {} after the publish: {:?}",
        degraded.map(ms).unwrap_or("never".into()),
        reason.borrow()
    ));
    rep.check(degraded.is_some(), "rank 1 not degraded in status and stream");
    rep.check(reason.borrow().contains("max_message_bytes, 1048576 bytes"), "the reason does not name the bound");
    std::thread::sleep(Duration::from_millis(300));
    rss_max = rss_max.max(r.rss_kib().unwrap_or(0));
    let m1 = r.metrics_text();
    // Rank 1's counters in `m` since the first reading, and the three this drill counts.
    let since = |m: &str, name: &str| {
        metric(m, name, &["rank=\"1\""]).unwrap_or(0.0) - metric(&m0, name, &["rank=\"1\""]).unwrap_or(0.0)
    };
    let counted = |m: &str| {
        let by = |name| since(m, name);
        (by("kv_relay_lost_batches_total"), by("kv_relay_disconnects_total"), by("kv_relay_replay_cuts_total"))
    };
    let (lost, drops, cuts) = counted(&m1);
    rep.measure(format!("rank 1: lost {lost}, PUB connection drops {drops}, replay cuts {cuts}"));
    rep.check(lost == 1.0, format!("lost {lost} batches, not the one"));
    rep.check(drops >= 1.0 && cuts >= 1.0, "no drop or no replay cut counted");
    // Taken, the message alone would be resident (and its commit far more: about 4.7 KB a block).
    rep.measure(format!("relay RSS {rss0} KiB before, max {rss_max} KiB"));
    rep.check(rss_max < rss0 + 16 * 1024, "relay RSS grew by the message's 16 MiB or more");
    // A second such batch once rank 1's new SUB delivers again: counted like the first, its
    // warnings held back (at most one per 10 s per rank and socket).
    let live = |m: &str| metric(m, "kv_relay_batches_total", &["rank=\"1\"", "source=\"live\""]).unwrap_or(0.0);
    let live1 = live(&m1);
    let again = wait_until(Duration::from_secs(5), || live(&r.metrics_text()) > live1);
    rep.check(again.is_some(), "rank 1's SUB delivered nothing after it was replaced");
    e.publish(1, big).expect("publish");
    let second = wait_until(Duration::from_secs(10), || since(&r.metrics_text(), "kv_relay_lost_batches_total") >= 2.0);
    rep.check(second.is_some(), "the second batch was not counted lost");
    std::thread::sleep(Duration::from_millis(300));
    let (lost, drops, cuts) = counted(&r.metrics_text());
    let log = std::fs::read_to_string(&r.log).unwrap_or_default();
    let lines = |needle: &str| log.lines().filter(|l| l.contains(needle)).count();
    let (drop_lines, cut_lines) =
        (lines("the engine's PUB connection dropped"), lines("the replay connection dropped while the engine sent"));
    rep.measure(format!(
        "after a second batch: lost {lost}, PUB connection drops {drops}, replay cuts {cuts}; warn lines: {drop_lines} for the drops, {cut_lines} for the cuts"
    ));
    rep.check(lost == 2.0, format!("lost {lost} batches, not the two"));
    rep.check(drops >= 2.0 && cuts >= 2.0, "the second batch counted no drop or no replay cut");
    // Both within the throttle's 10 s, unless this machine took that long (then the second
    // may be logged too).
    let within = first.elapsed() < Duration::from_secs(10);
    if within {
        rep.check(drop_lines == 1 && cut_lines == 1, "the warnings were not held back to one each");
    } else {
        rep.measure("the two batches took over 10 s: the second's warnings may be logged");
        rep.check((1..=2).contains(&drop_lines) && (1..=2).contains(&cut_lines), "not one or two warnings each");
    }
    let others = status(&r.url()).map(|s| not_ok_ranks(&s)).unwrap_or_default();
    rep.check(others.iter().all(|x| x.0 == 1), format!("other ranks not OK: {others:?}"));
    t.hold(|| e.clear(1)).expect("clear");
    let rec = wait_until(Duration::from_secs(5), || {
        status(&r.url()).is_ok_and(|s| not_ok_ranks(&s).is_empty()) && !a.get().degraded.contains(&1)
    });
    rep.measure(format!("recovered in status and stream {} after the clear", rec.map(ms).unwrap_or("never".into())));
    rep.check(rec.is_some(), "rank 1 did not recover after the clear");
    expect_equal(&mut rep, &e, Some(&t), &[&a], "after", Duration::from_secs(10));
    rep
}
