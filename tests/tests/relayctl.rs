//! The real `relayctl` binary against a live `kv-relay` process beside the mock engine (two DP
//! ranks, seeded traffic published one request at a time, so cursors and loads are the same on
//! every run): every command's table and JSON as insta snapshots, the JSON checked against what
//! the engine published and its truth, the relay found by `--relay` and `KV_RELAY_ADDR`, and an
//! unreachable relay's message and exit status. (The token and TLS flags are tested against the
//! gRPC server in `relay/tests/grpc.rs`.)
//!
//! Needs `target/debug/kv-relay` and `target/debug/relayctl` (`cargo build -p kv-relay --bins`;
//! `scripts/test.sh` builds every binary first). Values that differ between runs (ports, the
//! epoch, lags, timestamps) are replaced by `[name]` before a snapshot; everything else is
//! exact. After a deliberate output change, `INSTA_UPDATE=always cargo test -p kv-relay-testkit
//! --test relayctl` (or `cargo insta review`), and review the `.snap` diff.

use kv_relay::live::LiveKey;
use kv_relay::model::Tier;
use kv_relay_proto::pb;
use kv_relay_testkit::client::{free_ports, start_engine_on_free_ports};
use kv_relay_testkit::decode::{decode_batch, WireEvent};
use kv_relay_testkit::drills::harness::{relay_bin, status, truth_as_live, Blocks, RelayProc};
use kv_relay_testkit::engine::{EngineConfig, MockEngine};
use kv_relay_testkit::metrics::Load;
use kv_relay_testkit::traffic::{RandomSource, RequestSource};
use kv_relay_testkit::wire::{Engine, WireVersion};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::io::{BufRead as _, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Generous: a loaded machine may be slow, and nothing passes or fails on time.
const DEADLINE: Duration = Duration::from_secs(60);

/// Requests served in the main test: cursor `c` is then rank `(c - 1) % 2`'s seq `(c - 1) / 2`.
const SERVED: u64 = 16;

/// The mock engine and a `kv-relay` process following it.
struct Live {
    e: MockEngine,
    relay: RelayProc,
    src: RandomSource,
    /// The engine's load when the relay scraped it.
    load: [Load; 2],
    _dir: tempfile::TempDir,
}

impl Live {
    /// A 2-rank vLLM 0.32 engine (small caches, so blocks are evicted and offloaded to the host
    /// tier) with a fixed load, and a relay following it.
    fn start(extra: &[&str]) -> Live {
        let mut cfg = EngineConfig::new(WireVersion::parse(Engine::Vllm, "0.32").unwrap());
        cfg.dp_size = 2;
        cfg.topic = "kv".into();
        cfg.block_size = 4;
        cfg.cache_blocks = 12;
        cfg.host_tier_blocks = 6;
        cfg.record = true;
        cfg.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
        let e = start_engine_on_free_ports(cfg, true);
        for r in 0..2 {
            e.set_load(r, Load { running: 3 + r, waiting: r, kv_usage: 0.0 }).unwrap();
        }
        let dir = tempfile::tempdir().unwrap();
        // The load is scraped once, at start: every batch carries the same load on every run (the
        // engine's KV usage moves with each request, and a later scrape could land before or
        // after a batch). The test polls Status often: above the default per-client rate limit.
        // The engine's liveness is not watched: its load says requests run, and nothing
        // progresses between the test's steps (the liveness rides on batches, and its reason
        // would count the seconds).
        let mut args = vec![
            "--load-poll-ms",
            "3600000",
            "--server-rate-per-second",
            "10000",
            "--server-rate-burst",
            "10000",
            "--engine-health-url",
            "off",
        ];
        args.extend_from_slice(extra);
        let relay = RelayProc::start(&e, &dir.path().join("state"), &dir.path().join("relay.log"), &args);
        let load = [e.load(0).unwrap(), e.load(1).unwrap()];
        Live { e, relay, src: RandomSource::new(7, 4, 6), load, _dir: dir }
    }

    /// [`Live::start`], once the relay has scraped the engine's load, then one request on each
    /// rank.
    fn warm() -> Live {
        let mut l = Live::start(&[]);
        l.settle();
        l.serve(0);
        l.serve(1);
        l
    }

    fn url(&self) -> String {
        self.relay.url()
    }

    /// Waits until the relay's Status shows every rank's last seq and batch count as the engine
    /// has them now, and the load it scraped at start.
    fn settle(&self) {
        self.e.flush().unwrap();
        let want: Vec<(u32, u64, Load)> =
            (0..2).map(|r| (r, self.e.stats(r).unwrap().next_seq, self.load[r as usize])).collect();
        let deadline = Instant::now() + DEADLINE;
        loop {
            let s = status(&self.url()).unwrap();
            let done = want.iter().all(|(r, n, load)| {
                counter(&s, &format!("rank{r}.batches")) == *n
                    && s.ranks.iter().any(|x| {
                        x.dp_rank == *r
                            && (*n == 0 || x.last_engine_seq == n - 1)
                            && x.load.is_some_and(|l| {
                                (l.running, l.waiting, l.kv_usage)
                                    == (f64::from(load.running), f64::from(load.waiting), load.kv_usage)
                            })
                    })
            });
            if done {
                return;
            }
            assert!(Instant::now() < deadline, "the relay did not catch up: {s:?}\nwant {want:?}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// One seeded request on `rank`, committed before the next: the relay numbers batches in
    /// the order they were served.
    fn serve(&mut self, rank: u32) {
        let req = self.src.next_request().unwrap();
        self.e.serve_request(rank, &req, false).unwrap();
        self.settle();
    }

    /// What differs between runs, by its value: the relay's address, the engine's endpoint and
    /// URL, the epoch.
    fn varying(&self) -> Vec<(String, &'static str)> {
        let epoch = status(&self.url()).unwrap().epoch;
        vec![
            (self.url(), "[relay]"),
            (self.e.config().endpoint.clone(), "[endpoint]"),
            (self.e.url().unwrap(), "[engine]"),
            (format!("{epoch:016x}"), "[epoch]"),
        ]
    }
}

/// A counter of the relay's Status (0 when absent).
fn counter(s: &pb::StatusResponse, name: &str) -> u64 {
    s.counters.get(name).copied().unwrap_or(0)
}

/// The `relayctl` binary: `KV_RELAYCTL_BIN`, else beside the relay binary.
fn relayctl_bin() -> PathBuf {
    std::env::var_os("KV_RELAYCTL_BIN").map_or_else(|| relay_bin().with_file_name("relayctl"), PathBuf::from)
}

/// `relayctl ARGS` with no `KV_RELAY_*` variable but those in `env`.
fn relayctl(args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut c = Command::new(relayctl_bin());
    for (k, _) in std::env::vars() {
        if k.starts_with("KV_RELAY_") {
            c.env_remove(k);
        }
    }
    c.args(args).envs(env.iter().copied()).stdin(Stdio::null());
    c
}

fn run(args: &[&str], env: &[(&str, &str)]) -> Output {
    relayctl(args, env).output().unwrap_or_else(|e| {
        panic!("running {}: {e} (build it: cargo build -p kv-relay --bins)", relayctl_bin().display())
    })
}

/// stdout of a successful `relayctl --relay URL ARGS`. stderr must be empty: no progress is
/// shown when stderr is not a terminal.
fn ok(url: &str, args: &[&str]) -> String {
    let out = run(&[&["--relay", url], args].concat(), &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "relayctl {args:?}: {}\n{stderr}", out.status);
    assert_eq!(stderr, "", "relayctl {args:?} wrote to stderr");
    String::from_utf8(out.stdout).unwrap()
}

/// A failed `relayctl ARGS`: its exit status and stderr; stdout must be empty.
fn fails(args: &[&str], env: &[(&str, &str)]) -> (i32, String) {
    let out = run(args, env);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "", "relayctl {args:?} wrote to stdout");
    (out.status.code().expect("relayctl exited by a signal"), String::from_utf8(out.stderr).unwrap())
}

fn json(s: &str) -> Value {
    serde_json::from_str(s).unwrap_or_else(|e| panic!("not JSON ({e}):\n{s}"))
}

fn json_lines(s: &str) -> Vec<Value> {
    s.lines().map(json).collect()
}

/// Replaces each value by its name, and the values of the counters that depend on timing.
///
/// `rank<N>.gaps` and `rank<N>.refilled_batches` are such: a batch the SUB socket missed (it
/// joined after the engine's first batch) or that a tail probe of a rank quiet for a moment read
/// from the replay socket before the SUB delivered it, is counted as a gap and refilled; it is
/// committed all the same, with the same cursor. The test asserts no batch was lost instead.
fn redact(s: &str, varying: &[(String, &str)]) -> String {
    let s = varying.iter().fold(s.to_string(), |s, (v, name)| s.replace(v.as_str(), name));
    s.lines()
        .map(|l| {
            let t = l.trim_start();
            let timing = t.starts_with("rank") && (t.contains(".gaps") || t.contains(".refilled_batches"));
            match l.rfind(|c: char| !c.is_ascii_digit()) {
                Some(i) if timing && i + 1 < l.len() && !t.starts_with('"') => format!("{}[timing]", &l[..=i]),
                _ => l.to_string(),
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
        + if s.ends_with('\n') { "\n" } else { "" }
}

/// Sets `key` to `"[key]"` in every object it is in, at any depth.
fn redact_key(v: &mut Value, key: &str) {
    match v {
        Value::Object(m) => {
            for (k, x) in m.iter_mut() {
                if k == key {
                    *x = json!(format!("[{key}]"));
                } else {
                    redact_key(x, key);
                }
            }
        }
        Value::Array(a) => a.iter_mut().for_each(|x| redact_key(x, key)),
        _ => {}
    }
}

/// JSON with the keys and values that vary between runs redacted.
fn redacted(v: &Value) -> Value {
    let mut v = v.clone();
    for key in [
        "lag_ms",
        "scraped_at_ms",
        "engine_ts",
        "rank0.gaps",
        "rank1.gaps",
        "rank0.refilled_batches",
        "rank1.refilled_batches",
    ] {
        redact_key(&mut v, key);
    }
    v
}

/// Redacted JSON, pretty-printed as `--json` prints one object; the timing counters of
/// [`redact`] too.
fn pretty(v: &Value, varying: &[(String, &str)]) -> String {
    redact(&serde_json::to_string_pretty(&redacted(v)).unwrap(), varying)
}

/// Redacted JSON on one line, as `history --json` prints each record.
fn compact(v: &Value, varying: &[(String, &str)]) -> String {
    redact(&serde_json::to_string(&redacted(v)).unwrap(), varying)
}

/// `relayctl status`'s table with the LAG column's values replaced by `[lag]` (right-aligned
/// under the header as they were).
fn redact_lag(table: &str) -> String {
    let header = table.lines().find(|l| l.starts_with("RANK  STATE")).expect("rank table");
    let end = header.find("LAG").expect("LAG column") + "LAG".len();
    let mut in_ranks = false;
    let mut out = String::new();
    for line in table.lines() {
        let mut line = line.to_string();
        if in_ranks && !line.is_empty() {
            let start = line[..end].trim_end_matches(|c: char| c != ' ').trim_end().len();
            line = format!("{} {:>w$}{}", &line[..start], "[lag]", &line[end..], w = end - start - 1);
        }
        in_ranks = (in_ranks || line == header) && !line.is_empty();
        out.push_str(&line);
        out.push('\n');
    }
    out
}

/// The cursors of `relayctl history`'s table lines.
fn table_cursors(table: &str) -> Vec<u64> {
    let mut lines = table.lines();
    assert_eq!(lines.next(), Some(kv_relay::ctl::HISTORY_HEADER));
    lines.map(|l| l.split_whitespace().next().unwrap().parse().unwrap()).collect()
}

/// The rank and engine seq of cursor `c` in the main test's traffic.
fn rank_seq(c: u64) -> (u32, u64) {
    (((c - 1) % 2) as u32, (c - 1) / 2)
}

/// A history record's events as the engine's wire says them: (stored?, tier, hashes).
fn record_events(record: &Value) -> Vec<(bool, String, Vec<u64>)> {
    let hashes = |a: &Value| a.as_array().unwrap().iter().map(|h| h.as_u64().unwrap()).collect::<Vec<_>>();
    record["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| match e["type"].as_str().unwrap() {
            "stored" => {
                let hs = e["blocks"].as_array().unwrap().iter().map(|b| b["hash"].as_u64().unwrap()).collect();
                (true, e["tier"].as_str().unwrap().to_string(), hs)
            }
            "removed" => (false, e["tier"].as_str().unwrap().to_string(), hashes(&e["block_hashes"])),
            other => panic!("unexpected event {other}: {e}"),
        })
        .collect()
}

/// What `rank` published with `seq`: its timestamp and events as (stored?, tier, hashes).
fn published(e: &MockEngine, rank: u32, seq: u64) -> (f64, Vec<(bool, String, Vec<u64>)>) {
    let rec = e.records(rank).unwrap().into_iter().find(|r| r.seq == seq).expect("published seq");
    let b = decode_batch(&rec.payload).unwrap();
    let tier = |m: &Option<String>| Tier::from_medium(m.as_deref()).to_string();
    let events = b
        .events
        .into_iter()
        .map(|e| match e.unwrap() {
            WireEvent::Stored { hashes, medium, .. } => (true, tier(&medium), hashes),
            WireEvent::Removed { hashes, medium, .. } => (false, tier(&medium), hashes),
            WireEvent::Cleared => panic!("no clears in this traffic"),
        })
        .collect();
    (b.ts, events)
}

/// `history --json` records: their snapshot (one line each, as printed), their cursors, and each
/// one as the engine published it (rank, seq, timestamp, events).
fn same_as_published(l: &Live, name: &str, records: &[Value], cursors: &[u64]) {
    let varying = l.varying();
    insta::assert_snapshot!(name, records.iter().map(|r| compact(r, &varying)).collect::<Vec<_>>().join("\n"));
    assert_eq!(records.iter().map(|r| r["cursor"].as_u64().unwrap()).collect::<Vec<_>>(), cursors);
    for r in records {
        let (rank, seq) = rank_seq(r["cursor"].as_u64().unwrap());
        assert_eq!(
            (r["record"].as_str(), r["dp_rank"].as_u64(), r["engine_seq"].as_u64()),
            (Some("batch"), Some(u64::from(rank)), Some(seq))
        );
        let (ts, events) = published(&l.e, rank, seq);
        // The relay keeps the engine's timestamp to the microsecond.
        let got = r["engine_ts"].as_f64().unwrap();
        assert!((got - ts).abs() <= 1e-6, "engine_ts {got}, published {ts}");
        assert_eq!(record_events(r), events);
    }
}

/// `relayctl snapshot --blocks --json`'s blocks keyed as the truth is.
fn snapshot_blocks(v: &Value) -> Blocks {
    let mut out = Blocks::new();
    for b in v["blocks"].as_array().unwrap() {
        let tier: Tier = serde_json::from_value(b["tier"].clone()).unwrap();
        let key = LiveKey {
            dp_rank: b["dp_rank"].as_u64().unwrap() as u32,
            tier,
            group: b["group"].as_u64().unwrap() as u32,
        };
        let prev =
            out.entry(key).or_default().insert(b["hash"].as_u64().unwrap(), b["copies"].as_u64().unwrap() as u32);
        assert_eq!(prev, None, "a block listed twice: {b}");
    }
    out
}

#[test]
fn every_command_against_a_live_relay_shows_what_the_engine_published() {
    let mut l = Live::warm();
    for i in 2..SERVED {
        l.serve((i % 2) as u32);
    }
    let url = l.url();
    let varying = l.varying();
    let per_rank = SERVED / 2;

    // status
    insta::assert_snapshot!("status", redact_lag(&redact(&ok(&url, &["status"]), &varying)));
    let st = json(&ok(&url, &["status", "--json"]));
    insta::assert_snapshot!("status_json", pretty(&st, &varying));
    let truth = truth_as_live(&l.e.truth());
    let (blocks, copies) = (truth.values().map(BTreeMap::len).sum::<usize>(), truth.values().flatten().count());
    assert_eq!((st["oldest_cursor"].as_u64(), st["newest_cursor"].as_u64()), (Some(1), Some(SERVED)));
    assert_eq!(st["history_records"], SERVED);
    assert_eq!(
        (st["counters"]["live_blocks"].as_u64(), st["counters"]["live_copies"].as_u64()),
        (Some(blocks as u64), Some(copies as u64))
    );
    for r in 0..2u32 {
        let rank = &st["ranks"][r as usize];
        assert_eq!((rank["dp_rank"].as_u64(), rank["state"].as_str()), (Some(u64::from(r)), Some("ok")));
        assert_eq!(rank["last_engine_seq"], l.e.stats(r).unwrap().next_seq - 1);
        assert_eq!(st["counters"][format!("rank{r}.batches")], per_rank);
        assert_eq!(st["counters"][format!("rank{r}.lost_batches")], 0);
        let load = l.load[r as usize];
        assert_eq!(
            (&rank["load"]["running"], &rank["load"]["waiting"], &rank["load"]["kv_usage"]),
            (&json!(f64::from(load.running)), &json!(f64::from(load.waiting)), &json!(load.kv_usage))
        );
    }

    // The relay by KV_RELAY_ADDR, by HOST:PORT, and --relay before KV_RELAY_ADDR.
    let by_env = run(&["status", "--json"], &[("KV_RELAY_ADDR", &url)]);
    assert!(by_env.status.success(), "{}", String::from_utf8_lossy(&by_env.stderr));
    assert_eq!(pretty(&json(&String::from_utf8(by_env.stdout).unwrap()), &varying), pretty(&st, &varying));
    let host_port = url.strip_prefix("http://").unwrap();
    assert_eq!(pretty(&json(&ok(host_port, &["status", "--json"])), &varying), pretty(&st, &varying));
    let nobody = format!("http://127.0.0.1:{}", free_ports(1));
    let both = run(&["--relay", &url, "status", "--json"], &[("KV_RELAY_ADDR", &nobody)]);
    assert!(both.status.success(), "{}", String::from_utf8_lossy(&both.stderr));

    // history: the newest records by default.
    let newest = ok(&url, &["history", "--limit", "6"]);
    insta::assert_snapshot!("history_limit", redact(&newest, &varying));
    assert_eq!(table_cursors(&newest), (SERVED - 5..=SERVED).collect::<Vec<_>>());
    // With a rank: that rank's newest records, however the ranks interleave.
    assert_eq!(table_cursors(&ok(&url, &["history", "--rank", "1", "--limit", "3"])), [12, 14, 16]);
    // Up to a cursor.
    assert_eq!(table_cursors(&ok(&url, &["history", "--to", "5", "--limit", "2"])), [4, 5]);
    assert_eq!(table_cursors(&ok(&url, &["history", "--rank", "0", "--to", "6", "--limit", "2"])), [3, 5]);

    // history --json: every record as the engine published it.
    let range = json_lines(&ok(&url, &["history", "--rank", "1", "--from", "3", "--to", "9", "--json"]));
    same_as_published(&l, "history_rank_range_json", &range, &[4, 6, 8]);
    // The whole history, in the table, matches the engine seq by seq.
    let all = json_lines(&ok(&url, &["history", "--from", "1", "--json"]));
    assert_eq!(all.len() as u64, SERVED);
    for (i, r) in all.iter().enumerate() {
        let c = i as u64 + 1;
        let (rank, seq) = rank_seq(c);
        assert_eq!(
            (r["cursor"].as_u64(), r["dp_rank"].as_u64(), r["engine_seq"].as_u64()),
            (Some(c), Some(u64::from(rank)), Some(seq))
        );
        assert_eq!(record_events(r), published(&l.e, rank, seq).1, "cursor {c}");
    }

    // snapshot
    insta::assert_snapshot!("snapshot", redact(&ok(&url, &["snapshot"]), &varying));
    let sum = json(&ok(&url, &["snapshot", "--json"]));
    insta::assert_snapshot!("snapshot_json", pretty(&sum, &varying));
    let groups: Vec<Value> = truth
        .iter()
        .map(|(k, set)| {
            json!({"dp_rank": k.dp_rank, "tier": k.tier.to_string(), "group": k.group, "blocks": set.len(),
                   "copies": set.values().map(|&c| u64::from(c)).sum::<u64>(), "namespaces": 1})
        })
        .collect();
    assert_eq!(sum["groups"], json!(groups));
    assert_eq!(sum["cursor"], SERVED);
    let listed = json(&ok(&url, &["snapshot", "--blocks", "--json"]));
    insta::assert_snapshot!("snapshot_blocks_json", pretty(&listed, &varying));
    assert_eq!(snapshot_blocks(&listed), truth);
    assert_eq!(listed["groups"], sum["groups"]);

    let device0 = ok(&url, &["snapshot", "--blocks", "--include-token-ids", "--rank", "0", "--tier", "device"]);
    insta::assert_snapshot!("snapshot_blocks_tokens_rank0_device", redact(&device0, &varying));
    let with_tokens =
        json(&ok(&url, &["snapshot", "--blocks", "--include-token-ids", "--rank", "0", "--tier", "device", "--json"]));
    let want: Blocks = truth.into_iter().filter(|(k, _)| k.dp_rank == 0 && k.tier == Tier::Device).collect();
    assert_eq!(snapshot_blocks(&with_tokens), want);
    for b in with_tokens["blocks"].as_array().unwrap() {
        assert_eq!(b["token_ids"].as_array().map(Vec::len), Some(4), "{b}");
    }
}

/// Lines a child prints on stdout, as they come.
fn lines_of(child: &mut Child) -> mpsc::Receiver<String> {
    let out = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            if line.map(|l| tx.send(l)).is_err() {
                break;
            }
        }
    });
    rx
}

fn next_lines(rx: &mpsc::Receiver<String>, n: usize) -> Vec<String> {
    (0..n).map(|i| rx.recv_timeout(DEADLINE).unwrap_or_else(|e| panic!("line {i} of {n}: {e}"))).collect()
}

#[test]
fn history_follow_prints_the_newest_records_then_new_ones_as_they_are_committed() {
    let mut l = Live::warm();
    for i in 2..6 {
        l.serve(i % 2);
    }
    let url = l.url();
    let spawn = |args: &[&str]| {
        relayctl(&[&["--relay", url.as_str(), "history", "--follow"], args].concat(), &[])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    };
    let mut table = spawn(&["--rank", "1", "--limit", "2"]);
    let mut from = spawn(&["--from", "6", "--json"]);
    let (table_rx, from_rx) = (lines_of(&mut table), lines_of(&mut from));
    let mut got = next_lines(&table_rx, 3);
    let mut got_json = next_lines(&from_rx, 1);
    l.serve(0);
    l.serve(1);
    got.extend(next_lines(&table_rx, 1));
    got_json.extend(next_lines(&from_rx, 2));
    for mut c in [table, from] {
        c.kill().unwrap();
        c.wait().unwrap();
    }
    // Nothing else was printed: rank 0's new batch is not rank 1's.
    assert_eq!(table_rx.iter().collect::<Vec<_>>(), Vec::<String>::new());
    assert_eq!(from_rx.iter().collect::<Vec<_>>(), Vec::<String>::new());
    insta::assert_snapshot!("history_follow_rank1", got.join("\n"));
    assert_eq!(table_cursors(&got.join("\n")), [4, 6, 8]);
    let followed: Vec<Value> = got_json.iter().map(|s| json(s)).collect();
    same_as_published(&l, "history_follow_json", &followed, &[6, 7, 8]);
}

#[test]
fn an_unreachable_relay_is_named_with_what_to_check_and_exits_69() {
    let port = free_ports(1).to_string();
    let nobody = format!("http://127.0.0.1:{port}");
    let mut seen = Vec::new();
    for args in [&["status"][..], &["history", "--limit", "3"], &["snapshot", "--blocks"]] {
        let (code, stderr) = fails(&[&["--relay", nobody.as_str()], args].concat(), &[]);
        assert_eq!(code, 69, "relayctl {args:?}: {stderr}");
        seen.push(stderr);
    }
    assert!(seen.windows(2).all(|w| w[0] == w[1]), "{seen:?}");
    insta::assert_snapshot!("unreachable", seen[0].replace(&port, "[port]"));
    // KV_RELAY_ADDR is named the same way.
    assert_eq!(fails(&["status"], &[("KV_RELAY_ADDR", &nobody)]), (69, seen[0].clone()));
}
