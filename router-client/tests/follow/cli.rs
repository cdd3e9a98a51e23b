//! `kv-router`'s refusals of bad discovery settings: the exit status and the message, before
//! anything is bound.

use std::process::Command;

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
    let (code, err) = run(&["--relays-dns", "kv-relay:50051", "--dns-interval-ms", "0"]);
    assert_eq!(code, Some(2));
    assert!(err.contains("invalid value '0' for '--dns-interval-ms <DNS_INTERVAL_MS>'"), "{err}");
    let (code, err) = run(&["--relays-dns", "kv-relay:50051", "--max-concurrent-resyncs", "0"]);
    assert_eq!(code, Some(2));
    assert!(err.contains("invalid value '0' for '--max-concurrent-resyncs <MAX_CONCURRENT_RESYNCS>'"), "{err}");
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
