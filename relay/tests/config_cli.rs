//! The `kv-relay` binary's handling of configuration: exit code 64 (`EX_USAGE`) and a message
//! naming the setting for bad configuration, and `check-config`.
//!
//! The binary never gets far enough to bind or open anything in these tests: every case fails
//! validation or only prints (and, should one start the relay after all, it is killed after 20 s
//! and binds port 0 in a temporary directory).

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn kv_relay(args: &[&str], envs: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kv-relay"));
    cmd.args(args);
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("KV_RELAY_") || k == "STATE_DIRECTORY" || k == "NOTIFY_SOCKET" {
            cmd.env_remove(k);
        }
    }
    // Should a case start the relay after all, it binds nothing fixed and writes to a temporary
    // directory (STATE_DIRECTORY is below every layer).
    let state = tempfile::tempdir().unwrap();
    cmd.env("STATE_DIRECTORY", state.path());
    cmd.env("KV_RELAY_LISTEN", "127.0.0.1:0").env("KV_RELAY_METRICS_LISTEN", "off");
    cmd.envs(envs.iter().copied());
    // Bounded: a binary that ignored `check-config` would start serving instead of exiting.
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("running kv-relay");
    let deadline = Instant::now() + Duration::from_secs(20);
    while child.try_wait().expect("waiting for kv-relay").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let o = child.wait_with_output().expect("kv-relay output");
            panic!("kv-relay {args:?} did not exit within 20 s; stderr: {}", stderr(&o));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("kv-relay output")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn a_bad_flag_value_exits_64_naming_the_setting() {
    let o = kv_relay(&["--history-bytes", "1000"], &[]);
    assert_eq!(o.status.code(), Some(64), "{}", stderr(&o));
    assert_eq!(stderr(&o).trim_end(), "kv-relay: invalid setting history-bytes: must be at least 1 MiB");
}

#[test]
fn a_bad_environment_value_exits_64_naming_the_setting() {
    let o = kv_relay(&[], &[("KV_RELAY_LOG_FORMAT", "xml")]);
    assert_eq!(o.status.code(), Some(64), "{}", stderr(&o));
    assert_eq!(stderr(&o).trim_end(), "kv-relay: invalid setting log-format: \"xml\": use text or json");
}

#[test]
fn a_bad_file_value_exits_64_naming_the_setting() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("relay.toml");
    std::fs::write(&file, "dp_size = 0\n").unwrap();
    let o = kv_relay(&["--config", file.to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(64), "{}", stderr(&o));
    assert_eq!(stderr(&o).trim_end(), "kv-relay: invalid setting dp-size: must be at least 1");

    std::fs::write(&file, "dp_sise = 2\n").unwrap();
    let o = kv_relay(&["--config", file.to_str().unwrap()], &[]);
    assert_eq!(o.status.code(), Some(64));
    assert!(stderr(&o).starts_with("kv-relay: invalid setting config: "), "{}", stderr(&o));
    assert!(stderr(&o).contains("unknown key `dp_sise`"), "{}", stderr(&o));
}

#[test]
fn a_hash_check_the_relay_cannot_do_exits_64_saying_which_setting_and_why() {
    let args = ["--hash-check", "--hash-engine", "vllm", "--hash-engine-version", "0.28", "--hash-algo", "sha256"];
    let o = kv_relay(&args, &[]);
    assert_eq!(o.status.code(), Some(64), "{}", stderr(&o));
    assert_eq!(
        stderr(&o).trim_end(),
        "kv-relay: invalid setting hash-seed: vllm 0.28.0 seeds the sha256 none hash randomly when PYTHONHASHSEED \
         is unset; set the engine's PYTHONHASHSEED and give it here"
    );
    let o = kv_relay(&["--hash-check"], &[("KV_RELAY_HASH_ENGINE", "trtllm")]);
    assert_eq!(o.status.code(), Some(64), "{}", stderr(&o));
    assert_eq!(stderr(&o).trim_end(), "kv-relay: invalid setting hash-engine: \"trtllm\": use vllm or sglang");
}

#[test]
fn a_malformed_flag_exits_64_and_help_exits_0() {
    let o = kv_relay(&["--dp-size", "two"], &[]);
    assert_eq!(o.status.code(), Some(64), "{}", stderr(&o));
    assert!(stderr(&o).contains("--dp-size"), "{}", stderr(&o));
    assert_eq!(kv_relay(&["--help"], &[]).status.code(), Some(0));
}

#[test]
fn check_config_prints_the_effective_configuration_and_exits_0() {
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "s3cr3t\n").unwrap();
    let file = dir.path().join("relay.toml");
    std::fs::write(&file, format!("dp_size = 2\nstate_dir = \"/var/lib/x\"\n[server]\ntoken_file = {token:?}\n"))
        .unwrap();
    let (listen, metrics) = (("KV_RELAY_LISTEN", "127.0.0.1:0"), ("KV_RELAY_METRICS_LISTEN", "off"));
    let o =
        kv_relay(&["--config", file.to_str().unwrap(), "check-config"], &[("KV_RELAY_QUEUE", "64"), listen, metrics]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = String::from_utf8(o.stdout).unwrap();
    assert!(out.contains("\ndp_ranks = [0, 1]\n"), "{out}");
    assert!(out.contains("\nqueue = 64\n"), "{out}");
    assert!(out.contains("\nstate_dir = \"/var/lib/x\"\n"), "{out}");
    assert!(out.contains("\nlisten = \"127.0.0.1:0\"\n"), "{out}");
    assert!(!out.contains("s3cr3t"), "{out}");
}

/// systemd's side of `Type=notify`: a datagram socket at `$NOTIFY_SOCKET`.
#[test]
fn the_relay_tells_systemd_ready_then_pings_the_watchdog_then_stopping_on_sigterm() {
    use std::os::unix::net::UnixDatagram;
    let dir = tempfile::tempdir().unwrap();
    let sock_path = dir.path().join("notify");
    let sock = UnixDatagram::bind(&sock_path).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kv-relay"));
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("KV_RELAY_")
            || k == "STATE_DIRECTORY"
            || k.to_string_lossy().starts_with("WATCHDOG_")
        {
            cmd.env_remove(k);
        }
    }
    // Nothing listens on the engine's ports: the relay serves and waits for the engine.
    cmd.args(["--listen", "127.0.0.1:0", "--metrics-listen", "off", "--endpoint", "tcp://127.0.0.1:1"])
        .env("STATE_DIRECTORY", dir.path().join("state"))
        .env("NOTIFY_SOCKET", &sock_path)
        .env("WATCHDOG_USEC", "200000")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    let recv = || {
        let mut buf = [0u8; 512];
        let n = sock.recv(&mut buf).expect("a notification within 30 s");
        String::from_utf8_lossy(&buf[..n]).into_owned()
    };
    let mut seen = Vec::new();
    while !seen.iter().any(|m: &String| m == "READY=1") {
        seen.push(recv());
    }
    // Nothing but the status line comes before READY=1 (the watchdog may ping from the start).
    assert!(seen.iter().all(|m| m == "READY=1" || m == "WATCHDOG=1" || m.starts_with("STATUS=")), "{seen:?}");
    let mut after = Vec::new();
    while !after.iter().any(|m: &String| m == "WATCHDOG=1") {
        after.push(recv());
    }
    // The SIGTERM handler is installed before the relay starts: a SIGTERM right after the
    // first watchdog ping drains (exit 0), with no wait.
    let kill = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    assert!(kill.success());
    while !after.iter().any(|m: &String| m == "STOPPING=1") {
        after.push(recv());
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "kv-relay did not exit within 30 s of SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    let err = stderr(&child.wait_with_output().unwrap());
    assert_eq!(status.code(), Some(0), "{err}");
}
