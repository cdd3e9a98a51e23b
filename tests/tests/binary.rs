//! The `mock-engine` binary as a separate process: it prints its endpoints, generates, takes
//! fault commands on stdin, and its printed truth equals what its replay sockets hold.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use kv_relay_testkit::client::{free_ports, replay};
use kv_relay_testkit::decode::decode_batch;
use kv_relay_testkit::metrics::http_get;
use kv_relay_testkit::truth::Truth;
use serde_json::Value as Json;

const T: Duration = Duration::from_secs(5);

struct Proc {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
}

impl Proc {
    fn spawn(args: &[String]) -> Proc {
        let mut child = Command::new(env!("CARGO_BIN_EXE_mock-engine"))
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn mock-engine");
        let stdin = child.stdin.take().expect("stdin");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Proc { child, stdin, lines }
    }

    /// The next line starting with `prefix` (others are skipped).
    fn line_starting(&self, prefix: &str) -> String {
        loop {
            let line = self.lines.recv_timeout(T).unwrap_or_else(|_| panic!("no line starting with {prefix:?}"));
            if line.starts_with(prefix) {
                return line;
            }
        }
    }

    fn ask(&mut self, cmd: &str) -> String {
        writeln!(self.stdin, "{cmd}").expect("write command");
        self.stdin.flush().expect("flush");
        self.lines.recv_timeout(T).expect("answer")
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn binary_prints_endpoints_generates_obeys_commands_and_reports_its_truth() {
    let base = free_ports(4);
    let args: Vec<String> = [
        "--engine",
        "sglang",
        "--wire-version",
        "0.5.18",
        "--endpoint",
        &format!("tcp://127.0.0.1:{base}"),
        "--replay-endpoint",
        &format!("tcp://127.0.0.1:{}", base + 2),
        "--dp-size",
        "2",
        "--topic",
        "kv",
        "--metrics-listen",
        "127.0.0.1:0",
        "--generate",
        "random",
        "--requests",
        "60",
        "--cache-blocks",
        "20",
        "--block-size",
        "4",
        "--seed",
        "5",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut p = Proc::spawn(&args);
    let ready: Json = serde_json::from_str(p.line_starting("ready ").trim_start_matches("ready ")).expect("ready json");
    assert_eq!(ready["wire"], "sglang 0.5.18");
    assert_eq!(ready["ranks"][1]["publisher"], format!("tcp://127.0.0.1:{}", base + 1));
    assert_eq!(ready["ranks"][1]["replay"], format!("tcp://127.0.0.1:{}", base + 3));
    assert_eq!(p.line_starting("done "), "done {\"requests\":60}");

    let stats: Json = serde_json::from_str(&p.ask("stats")).expect("stats json");
    // Every random request stores at least one new block: one batch each.
    let published: u64 = (0..2).map(|r| stats["stats"][r]["next_seq"].as_u64().unwrap()).sum();
    assert_eq!(published, 60);
    let truth_line = p.ask("truth");
    let printed: Json = serde_json::from_str(&truth_line).expect("truth json");
    let printed = Truth::from_json(&printed["truth"]).expect("truth shape");

    // Walk both ranks' replay buffers (everything published, nothing dropped).
    let ctx = zmq::Context::new();
    let mut walk = Truth::new();
    let mut batches = 0;
    for rank in 0..2u32 {
        let ep = ready["ranks"][rank as usize]["replay"].as_str().unwrap();
        let a = replay(&ctx, ep, 0, T).unwrap();
        // SGLang 0.5.18 answers in the old layout.
        assert!(a.batches.iter().all(|b| b.topic.is_none()));
        for b in &a.batches {
            for e in decode_batch(&b.payload).unwrap().events.iter().flatten() {
                walk.apply(rank, e);
            }
        }
        batches += a.batches.len();
    }
    assert_eq!(batches as u64, published);
    assert_eq!(printed, walk);
    assert!(printed.copies() > 0 && printed.copies() <= 40);

    let metrics = ready["metrics"].as_str().unwrap();
    let addr = metrics.trim_start_matches("http://").trim_end_matches("/metrics").parse().unwrap();
    let (status, body) = http_get(addr, "/metrics").unwrap();
    assert_eq!(status, 200);
    assert!(body.contains("sglang:token_usage{"), "{body}");

    assert_eq!(p.ask("drop 3 0"), "ok");
    assert_eq!(p.ask("garbage 1 frames"), "ok");
    assert_eq!(p.ask("delay 10ms"), "ok");
    assert_eq!(p.ask("restart 1"), "ok");
    assert!(p.ask("bogus").starts_with("error: unknown command"));
    let stats: Json = serde_json::from_str(&p.ask("stats")).expect("stats json");
    assert_eq!(stats["stats"][1]["generation"], 1);
    assert_eq!(stats["stats"][1]["next_seq"], 0);
    assert_eq!(stats["stats"][1]["buffered"], 0);
    let after: Json = serde_json::from_str(&p.ask("truth")).unwrap();
    let after = Truth::from_json(&after["truth"]).unwrap();
    assert_eq!(after, printed.rank(0));

    writeln!(p.stdin, "quit").unwrap();
    let status = p.child.wait().expect("exit");
    assert!(status.success());
}

#[test]
fn binary_plays_a_capture_and_exits_when_done() {
    let capture = kv_relay_testdata::capture("sglang-dp2");
    let args: Vec<String> = [
        "--engine",
        "sglang",
        "--endpoint",
        "tcp://127.0.0.1:0",
        "--replay-endpoint",
        "tcp://127.0.0.1:0",
        "--play",
        capture.to_str().unwrap(),
        "--exit-when-done",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut p = Proc::spawn(&args);
    let ready: Json = serde_json::from_str(p.line_starting("ready ").trim_start_matches("ready ")).unwrap();
    // The capture needs two ranks: the engine grows to two.
    assert_eq!(ready["ranks"].as_array().unwrap().len(), 2);
    let done: Json = serde_json::from_str(p.line_starting("done ").trim_start_matches("done ")).unwrap();
    assert_eq!(done["play"]["batches"], 101);
    assert_eq!(done["play"]["restarts"], 0);
    assert!(p.child.wait().expect("exit").success());
}

#[test]
fn binary_generates_from_a_mooncake_trace() {
    let trace = kv_relay_testdata::mooncake("synthetic_trace.jsonl");
    let args: Vec<String> = [
        "--endpoint",
        "tcp://127.0.0.1:0",
        "--generate",
        &format!("mooncake:{}", trace.display()),
        "--requests",
        "25",
        "--block-size",
        "8",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut p = Proc::spawn(&args);
    p.line_starting("ready ");
    assert_eq!(p.line_starting("done "), "done {\"requests\":25}");
    let truth: Json = serde_json::from_str(&p.ask("truth")).unwrap();
    assert_eq!(truth["truth"][0]["medium"], "GPU");
    assert!(!truth["truth"][0]["block_hashes"].as_array().unwrap().is_empty());
    assert!(p.ask("restart 7").starts_with("error: no rank 7"));
    writeln!(p.stdin, "quit").unwrap();
    assert!(p.child.wait().expect("exit").success());
}
