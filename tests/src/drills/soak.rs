//! The long drills: the soak (memory flat over hours of churn) and a full disk.

use super::*;

/// A setting of the soak from the environment (to rerun it in another shape), else `default`.
fn soak_env(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// RSS samples (KiB, one a second) as MiB every `step` samples, for the report.
fn rss_shape(samples: &[u64], step: usize) -> String {
    let mut out: Vec<String> =
        samples.iter().step_by(step.max(1)).map(|k| format!("{:.1}", *k as f64 / 1024.0)).collect();
    if let Some(last) = samples.last() {
        if !(samples.len() - 1).is_multiple_of(step.max(1)) {
            out.push(format!("{:.1}", *last as f64 / 1024.0));
        }
    }
    out.join(" ")
}

pub fn soak(scale: Scale) -> Report {
    let mut rep = Report::new(
        "64 subscribers for 10 minutes of steady traffic",
        "none falls behind; relay RSS flat (growth under 10%) after warm-up",
    );
    // Long: 64 routers, 200 requests/s, 10 minutes after a 3-minute warm-up (run it in release:
    // docs/drills.md). Short (CI, debug build): 8 routers at 100 requests/s for 20 s after 20 s.
    // KV_RELAY_SOAK_{ROUTERS,RATE,WARMUP_S,RUN_S} override either.
    let (routers_n, rate, warm, run) = if scale.long { (64, 200, 180, 600) } else { (8, 100, 20, 20) };
    let routers_n = soak_env("KV_RELAY_SOAK_ROUTERS", routers_n) as usize;
    let rate = soak_env("KV_RELAY_SOAK_RATE", rate) as u32;
    let warm = Duration::from_secs(soak_env("KV_RELAY_SOAK_WARMUP_S", warm));
    let run = Duration::from_secs(soak_env("KV_RELAY_SOAK_RUN_S", run));
    // The warm-up outlasts the history reaching its bound (1000 batches: about 5 s at 200 a
    // second) and the relay's caches filling (docs/drills.md: the RSS curve), so the growth
    // measured after it is not memory the relay was always going to use.
    let cx = Ctx::new();
    let e = engine(4, 10_000);
    let r = cx.relay(&e, &["--history-batches", "1000"]);
    let t = Traffic::start(&e, rate, 11);
    let routers: Vec<Router> = (0..routers_n).map(|_| cx.router(&r)).collect();
    let mut samples = Vec::new();
    let started = Instant::now();
    while started.elapsed() < warm {
        std::thread::sleep(Duration::from_secs(1));
        samples.push(r.rss_kib().unwrap_or(0));
    }
    let warm_samples = samples.len();
    let threads0 = r.proc_status("Threads").unwrap_or(0);
    let rss0 = r.rss_kib().unwrap_or(0);
    let (mut rss_max, mut behind, mut checks) = (rss0, 0u64, 0u64);
    let start = Instant::now();
    while start.elapsed() < run {
        let Ok(s) = status(&r.url()) else {
            behind += 1;
            continue;
        };
        std::thread::sleep(Duration::from_secs(1));
        checks += 1;
        // Every router has what was committed a second ago.
        behind += routers.iter().filter(|x| x.cursor() < s.newest_cursor).count() as u64;
        let rss = r.rss_kib().unwrap_or(0);
        samples.push(rss);
        rss_max = rss_max.max(rss);
    }
    let growth = (rss_max as f64 - rss0 as f64) / rss0.max(1) as f64 * 100.0;
    let newest = status(&r.url()).map(|s| s.newest_cursor).unwrap_or(0);
    rep.measure(format!(
        "{routers_n} routers, {rate} requests/s, {} after {} warm-up, newest cursor {newest}: {behind} of {} checks behind by > 1 s",
        ms(run),
        ms(warm),
        checks * routers_n as u64
    ));
    let step = (samples.len() / 20).max(1);
    rep.measure(format!(
        "relay RSS, MiB, every {step} s from its start (warm-up ends after sample {}): {}",
        warm_samples / step,
        rss_shape(&samples, step)
    ));
    rep.measure(format!(
        "relay RSS {rss0} KiB after warm-up, max {rss_max} KiB ({growth:.1}% growth); threads {threads0} -> {}",
        r.proc_status("Threads").unwrap_or(0)
    ));
    rep.check(behind == 0, "a router fell behind");
    rep.check(growth < 10.0, format!("RSS grew {growth:.1}%"));
    let all: Vec<_> = routers.iter().map(Router::get).collect();
    let (gaps, resyncs): (u64, u64) = all.iter().fold((0, 0), |a, x| (a.0 + x.counters.gaps, a.1 + x.counters.resyncs));
    rep.measure(format!("routers: gaps {gaps}, resyncs {resyncs}"));
    rep.check(gaps == 0 && resyncs == 0, "a router saw a gap or resync");
    let refs: Vec<&Router> = routers.iter().collect();
    expect_equal(&mut rep, &e, Some(&t), &refs, "every router", Duration::from_secs(10));
    rep
}

/// Mounts a tmpfs of `mib` MiB at `at`; false when this machine cannot.
fn mount_tmpfs(at: &Path, mib: u64) -> Result<(), String> {
    std::fs::create_dir_all(at).map_err(|e| e.to_string())?;
    let out = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", &format!("size={mib}m"), "tmpfs"])
        .arg(at)
        .output()
        .map_err(|e| format!("running mount: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("mount -t tmpfs failed: {}", String::from_utf8_lossy(&out.stderr).trim()))
    }
}

/// Fills the filesystem of `path` until it reports no space left; bytes written.
fn fill(path: &Path) -> u64 {
    use std::io::Write;
    let mut f = match std::fs::File::create(path) {
        Ok(f) => f,
        Err(_) => return 0,
    };
    let chunk = vec![0u8; 64 << 10];
    let mut n = 0u64;
    while f.write_all(&chunk).is_ok() {
        n += chunk.len() as u64;
    }
    let small = [0u8; 512];
    while f.write_all(&small).is_ok() {
        n += small.len() as u64;
    }
    let _ = f.flush();
    n
}

pub fn disk_full(_scale: Scale) -> Report {
    let mut rep = Report::new(
        "relay's disk full",
        "clear error and metric; no corrupt store; recovers when space returns; stops when asked",
    );
    let cx = Ctx::new();
    let mnt = cx.dir.path().join("disk");
    if let Err(why) = mount_tmpfs(&mnt, 64) {
        rep.skipped = Some(format!("cannot make a small filesystem here: {why}"));
        return rep;
    }
    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg("-l").arg(&self.0).status();
        }
    }
    let _unmount = Unmount(mnt.clone());
    let e = engine(2, 10_000);
    let mut r =
        RelayProc::start(&e, &mnt.join("state"), &cx.dir.path().join("relay.log"), &["--history-batches", "100000"]);
    let t = Traffic::start(&e, 200, 12);
    let a = cx.router(&r);
    cx.warm(&e);
    expect_equal(&mut rep, &e, Some(&t), &[&a], "before", Duration::from_secs(10));
    let filler = mnt.join("filler");
    let filled = fill(&filler);
    rep.measure(format!("filled the 64 MiB tmpfs with {} MiB", filled >> 20));
    let errors = wait_until(Duration::from_secs(30), || {
        let s = status(&r.url()).map(|s| counter(&s, "store_errors")).unwrap_or(0);
        let m = metric(&r.metrics_text(), "kv_relay_store_errors_total", &[]).unwrap_or(0.0);
        // Top the disk up: the store may have freed space (a segment or a checkpoint removed).
        let _ = fill(&mnt.join("filler2"));
        s > 0 && m > 0.0
    });
    rep.measure(format!(
        "store errors in Status and metrics {} after the disk filled",
        errors.map(ms).unwrap_or("never".into())
    ));
    rep.check(errors.is_some(), "no store error counted");
    let log = std::fs::read_to_string(&r.log).unwrap_or_default();
    let clear = log.lines().find(|l| l.contains("commit failed") || l.to_lowercase().contains("no space"));
    rep.measure(format!("log: {}", clear.unwrap_or("(none)").chars().take(300).collect::<String>()));
    rep.check(clear.is_some_and(|l| l.to_lowercase().contains("space")), "no clear 'no space' error in the log");
    // A full disk does not fail the store: each refused commit is undone and retried, ingest is
    // held (the engine's replay socket refills what the queue could not take), and the relay
    // catches up by itself once there is room.
    let epoch = status(&r.url()).map(|s| s.epoch).unwrap_or(0);
    let _ = std::fs::remove_file(&filler);
    let _ = std::fs::remove_file(mnt.join("filler2"));
    let back = Instant::now();
    let took = time_to_equal(&e, Some(&t), &[&a], back, Duration::from_secs(30));
    rep.measure(format!("space returned: equal {} later, without a restart", took.map(ms).unwrap_or("never".into())));
    if took.is_none() {
        rep.measure(format!("relay log:\n{}", r.log_tail()));
        let relay_equal = t.hold(|| {
            let _ = e.flush();
            std::thread::sleep(Duration::from_millis(500));
            snapshot(&r.url()).map(|(_, b)| b == truth_as_live(&e.truth()))
        });
        rep.measure(format!("the relay's own snapshot equals the truth: {relay_equal:?}"));
    }
    rep.check(took.is_some(), format!("not equal after space returned: {}", diff(&e, &a.get())));
    rep.check(r.exited().is_none(), "the relay stopped on a full disk");
    // Stopped while its disk is full: the ranks' threads give up the commit they retry (its
    // batches were never served, and the engine's replay refills them at the next start), so
    // the relay exits well within the unit's 30 s stop timeout.
    let errors_before = status(&r.url()).map(|s| counter(&s, "store_errors")).unwrap_or(0);
    let _ = fill(&filler);
    let refused = wait_until(Duration::from_secs(30), || {
        let _ = fill(&mnt.join("filler2"));
        status(&r.url()).map(|s| counter(&s, "store_errors")).unwrap_or(0) > errors_before
    });
    rep.check(refused.is_some(), "no store error counted when the disk filled again");
    let stopped = r.terminate(Duration::from_secs(20));
    rep.measure(format!(
        "SIGTERM while the disk is full: exited after {}",
        stopped.map(ms).unwrap_or("more than 20 s (killed)".into())
    ));
    rep.check(
        stopped.is_some_and(|t| t < Duration::from_secs(5)),
        "the relay took 5 s or more to stop while its disk was full",
    );
    let _ = std::fs::remove_file(&filler);
    let _ = std::fs::remove_file(mnt.join("filler2"));
    r.spawn();
    let took = time_to_equal(&e, Some(&t), &[&a], Instant::now(), Duration::from_secs(20));
    rep.measure(format!("started again with room: equal {} later", took.map(ms).unwrap_or("never".into())));
    rep.check(took.is_some(), format!("not equal after the restart with room: {}", diff(&e, &a.get())));
    // Then a restart (kill -9): the store reopens intact.
    r.kill();
    r.spawn();
    let took = time_to_equal(&e, Some(&t), &[&a], Instant::now(), Duration::from_secs(20));
    rep.measure(format!("killed and restarted: equal {} later", took.map(ms).unwrap_or("never".into())));
    rep.check(took.is_some(), format!("not equal after the restart: {}", diff(&e, &a.get())));
    // No corrupt store: it reopened with its epoch, and its history is contiguous.
    let s = status(&r.url()).unwrap_or_default();
    let h = history(&r.url(), 0, 100_000).unwrap_or_default();
    let cursors: Vec<u64> = h.iter().map(record_cursor).collect();
    let contiguous = cursors.windows(2).all(|w| w[1] == w[0] + 1);
    rep.measure(format!(
        "reopened: epoch kept {}, {} history records {}..{}, contiguous {contiguous}",
        s.epoch == epoch,
        cursors.len(),
        cursors.first().unwrap_or(&0),
        cursors.last().unwrap_or(&0)
    ));
    rep.check(s.epoch == epoch && contiguous && !cursors.is_empty(), "the store did not reopen intact");
    expect_equal(&mut rep, &e, Some(&t), &[&a], "after the reopen", Duration::from_secs(10));
    rep
}
