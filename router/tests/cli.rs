//! `kv-router`'s refusals of bad settings (the exit status and the message, before anything is
//! bound), and its threads: the HTTP API apart from the streams, which run nicer.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

/// Runs `kv-router` with `args`: its exit status and stderr.
fn run(args: &[&str]) -> (Option<i32>, String) {
    let out =
        Command::new(env!("CARGO_BIN_EXE_kv-router")).args(args).env_remove("KV_ROUTER_RELAY_TOKEN").output().unwrap();
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn bad_discovery_settings_are_refused_with_the_reason() {
    let (code, err) = run(&[]);
    assert_eq!(
        (code, err.trim_end()),
        (
            Some(64),
            "kv-router: no relay given: use --relay URL (repeatable), --relays-file FILE or --relays-dns NAME:PORT \
             (repeatable)"
        )
    );
    let (code, err) = run(&["--relays-dns", "kv-relay.default.svc"]);
    assert_eq!(code, Some(2));
    assert!(
        err.contains(
            "invalid value 'kv-relay.default.svc' for '--relays-dns <NAME:PORT>': \"kv-relay.default.svc\" is not \
             NAME:PORT (no port), e.g. kv-relay.default.svc.cluster.local:50051"
        ),
        "{err}"
    );
    // Values out of a flag's range: clap's usage error.
    for (args, message) in [
        (
            ["--relays-dns", "kv-relay:50051", "--dns-interval-ms", "0"],
            "invalid value '0' for '--dns-interval-ms <DNS_INTERVAL_MS>'",
        ),
        (
            ["--relays-dns", "kv-relay:50051", "--max-concurrent-resyncs", "0"],
            "invalid value '0' for '--max-concurrent-resyncs <MAX_CONCURRENT_RESYNCS>'",
        ),
        (
            ["--relay", "http://127.0.0.1:1", "--http-threads", "0"],
            "invalid value '0' for '--http-threads <HTTP_THREADS>'",
        ),
        (
            ["--relay", "http://127.0.0.1:1", "--stream-niceness", "20"],
            "invalid value '20' for '--stream-niceness <STREAM_NICENESS>'",
        ),
    ] {
        let (code, err) = run(&args);
        assert_eq!(code, Some(2), "{args:?}");
        assert!(err.contains(message), "{err}");
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("relays.txt");
    std::fs::write(&file, "http://127.0.0.1:1\n127.0.0.1:2\n").unwrap();
    let (code, err) = run(&["--relays-file", file.to_str().unwrap()]);
    assert_eq!(
        (code, err.trim_end().to_string()),
        (
            Some(64),
            format!(
                "kv-router: {}: line 2: invalid relay url \"127.0.0.1:2\": must start with http:// or https://",
                file.display()
            )
        )
    );
    let (code, err) = run(&["--relays-file", dir.path().join("none.txt").to_str().unwrap()]);
    assert_eq!(code, Some(64));
    assert!(err.starts_with(&format!("kv-router: reading {}: ", dir.path().join("none.txt").display())), "{err}");
}

/// Each thread of `pid`: its name and niceness (`/proc/PID/task/TID/stat`, field 19).
fn thread_niceness(pid: u32) -> Vec<(String, i32)> {
    let mut out: Vec<(String, i32)> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .map(|t| {
            let stat = std::fs::read_to_string(t.unwrap().path().join("stat")).unwrap();
            let (head, rest) = stat.rsplit_once(')').unwrap();
            let name = head.split_once('(').unwrap().1.to_string();
            (name, rest.split_whitespace().nth(16).unwrap().parse().unwrap())
        })
        .collect();
    out.sort();
    out
}

#[test]
fn the_streams_run_nicer_than_the_http_api() {
    // (flags, how much nicer the streams run, threads named for HTTP: one, or the thread
    // accepting connections and its N workers)
    for (args, by, http) in [(&[][..], 5, 1), (&["--stream-niceness", "3", "--http-threads", "2"][..], 3, 3)] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kv-router"))
            .args(["--relay", "http://127.0.0.1:1", "--listen", "127.0.0.1:0"])
            .args(args)
            .env_remove("KV_ROUTER_RELAY_TOKEN")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        assert!(line.starts_with("kv-router listening on http://127.0.0.1:"), "{line}");
        // A new thread names itself once it runs, and a worker renices itself just after: read
        // until they have, and until a worker exists at all (a failure to renice then shows in
        // the assertions below, after the deadline).
        let named = |t: &[(String, i32)]| {
            let main = t.iter().find(|(n, _)| n == "kv-router").map_or(0, |m| m.1);
            let mut workers = t.iter().filter(|(n, _)| n == "tokio-rt-worker").peekable();
            t.iter().filter(|(n, _)| n == "kv-router-http").count() == http
                && workers.peek().is_some()
                && workers.all(|w| w.1 != main)
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut threads = thread_niceness(child.id());
        while !named(&threads) && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(10));
            threads = thread_niceness(child.id());
        }
        child.kill().unwrap();
        child.wait().unwrap();
        // The main thread's niceness is this test's (CI may run under nice).
        let base = threads.iter().find(|(n, _)| n == "kv-router").expect("the main thread").1;
        let of = |name: &str| threads.iter().filter(|(n, _)| n == name).map(|t| t.1).collect::<Vec<_>>();
        assert_eq!(of("kv-router-http"), vec![base; http], "{threads:?}");
        let workers = of("tokio-rt-worker");
        assert!(!workers.is_empty(), "{threads:?}");
        assert_eq!(workers, vec![(base + by).min(19); workers.len()], "{threads:?}");
    }
}
