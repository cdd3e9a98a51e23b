//! Decode benchmark: messages/s and events/s over every fixture's batch payloads, for our decoder
//! alone (`wire::decode_batch`), our whole path (split frames, decode, normalize:
//! `capture::decode_message`), and, with `--features dynamo-bench`, NVIDIA Dynamo's decoder
//! (`dynamo_kv_router::zmq_wire::decode_event_batch`), measured side by side in the same run.
//! It also reports which batches each decoder can read, and what encoding the decoded batches as
//! Subscribe messages costs: straight from the model (`server::encode::subscribe_bytes`, what
//! the relay sends) against through the contract's structs (`record_to_pb` and prost), checked
//! byte for byte, interleaved in each run.
//!
//! ```text
//! cargo bench -p kv-relay --bench decode --features dynamo-bench     # full, with Dynamo
//! KV_RELAY_BENCH_QUICK=1 cargo bench -p kv-relay --bench decode      # seconds, for CI
//! ```
//!
//! Each measurement loops over one fixture's payloads until `KV_RELAY_BENCH_MS` (default 150,
//! quick 10) milliseconds have passed; `KV_RELAY_BENCH_RUNS` (default 7, quick 1) runs are made,
//! the decoders interleaved within each run, and medians are printed: throughputs, and the
//! per-run ratios ours / Dynamo.

use kv_relay::capture::{self, CapturedMessage, Decoded, SocketKind};
use kv_relay::model::{Load, Record, RecordBody};
use kv_relay::normalize::Normalizer;
use kv_relay::server::convert::record_to_pb;
use kv_relay::server::encode::{subscribe_bytes, Shape};
use kv_relay::wire::{self, ReplayReply};
use prost::Message;
use std::hint::black_box;
use std::time::{Duration, Instant};

struct Fixture {
    name: String,
    /// Messages that carry a batch (replay end markers left out).
    messages: Vec<CapturedMessage>,
    /// Their payloads.
    payloads: Vec<Vec<u8>>,
    /// Events on the wire (the length of each batch's events array, read by our decoder).
    wire_events: usize,
}

fn payload_of(m: &CapturedMessage) -> Option<Vec<u8>> {
    let frames: Vec<&[u8]> = m.frames.iter().map(Vec::as_slice).collect();
    let f = match m.socket {
        SocketKind::Pub => wire::split_pub(&frames).ok()?,
        SocketKind::Replay => match wire::split_replay(&frames).ok()? {
            ReplayReply::Batch(f) => f,
            ReplayReply::End => return None,
        },
    };
    Some(f.payload.to_vec())
}

fn load() -> Vec<Fixture> {
    kv_relay_testdata::captures()
        .into_iter()
        .map(|p| {
            let name = p.file_stem().unwrap().to_string_lossy().into_owned();
            let mut messages = Vec::new();
            let mut payloads = Vec::new();
            for m in capture::read(&p).unwrap() {
                if let Some(pl) = payload_of(&m) {
                    payloads.push(pl);
                    messages.push(m);
                }
            }
            let wire_events = payloads.iter().map(|p| wire::decode_batch(p).map(|b| b.events.len()).unwrap_or(0)).sum();
            Fixture { name, messages, payloads, wire_events }
        })
        .collect()
}

/// What a decoder made of one fixture: batches read whole, and events it returned.
#[derive(Default, Clone, Copy)]
struct Readable {
    batches: usize,
    events: usize,
}

fn ours_readable(f: &Fixture) -> Readable {
    let mut r = Readable::default();
    for p in &f.payloads {
        if let Ok(b) = wire::decode_batch(p) {
            r.batches += usize::from(!b.truncated);
            r.events += b.events.iter().filter(|e| e.is_ok()).count();
        }
    }
    r
}

#[cfg(feature = "dynamo-bench")]
mod dynamo {
    use dynamo_kv_router::zmq_wire::decode_event_batch;

    /// Events Dynamo returned (its `Ignored` placeholder for events it skips not counted).
    pub fn decode(payload: &[u8]) -> Option<usize> {
        decode_event_batch(payload).ok().map(|b| b.events.iter().filter(|e| !e.is_ignored()).count())
    }

    pub fn first_error(payloads: &[Vec<u8>]) -> Option<String> {
        payloads.iter().find_map(|p| decode_event_batch(p).err()).map(|e| e.to_string())
    }
}

#[cfg(feature = "dynamo-bench")]
fn dynamo_readable(f: &Fixture) -> Option<Readable> {
    let mut r = Readable::default();
    for p in &f.payloads {
        if let Some(n) = dynamo::decode(p) {
            r.batches += 1;
            r.events += n;
        }
    }
    Some(r)
}

#[cfg(not(feature = "dynamo-bench"))]
fn dynamo_readable(_: &Fixture) -> Option<Readable> {
    None
}

/// Passes over one fixture per second, looping until `budget` has passed.
fn measure(budget: Duration, mut pass: impl FnMut() -> usize) -> f64 {
    // One warm-up pass.
    black_box(pass());
    let start = Instant::now();
    let mut passes = 0u64;
    loop {
        black_box(pass());
        passes += 1;
        let el = start.elapsed();
        if el >= budget {
            return passes as f64 / el.as_secs_f64();
        }
    }
}

fn pass_ours_decode(f: &Fixture) -> usize {
    let mut n = 0;
    for p in &f.payloads {
        if let Ok(b) = wire::decode_batch(black_box(p)) {
            n += b.events.len();
        }
    }
    n
}

fn pass_ours_full(f: &Fixture) -> usize {
    let mut norm = Normalizer::new();
    let mut n = 0;
    for m in &f.messages {
        if let Decoded::Batch { normalized, .. } = capture::decode_message(&mut norm, black_box(m)) {
            n += normalized.batch.events.len();
        }
    }
    n
}

#[cfg(feature = "dynamo-bench")]
fn pass_dynamo(f: &Fixture) -> Option<usize> {
    let mut n = 0;
    for p in &f.payloads {
        n += dynamo::decode(black_box(p)).unwrap_or(0);
    }
    Some(n)
}

#[cfg(not(feature = "dynamo-bench"))]
fn pass_dynamo(_: &Fixture) -> Option<usize> {
    None
}

/// Every fixture's batches as committed records (cursors from 1, a load on each), in order.
fn records(fixtures: &[Fixture]) -> Vec<Record> {
    let mut out = Vec::new();
    for f in fixtures {
        let mut norm = Normalizer::new();
        for m in &f.messages {
            if let Decoded::Batch { normalized, .. } = capture::decode_message(&mut norm, m) {
                let load = Load { running: 3.0, waiting: 1.0, kv_usage: 0.42, scraped_at_ms: 1_764_000_000_000 };
                let body = RecordBody::Batch { batch: normalized.batch, load: Some(load), liveness: None };
                out.push(Record { cursor: out.len() as u64 + 1, incarnation: 1, body });
            }
        }
    }
    out
}

/// The bytes of every record's Subscribe message, summed: straight from the model.
fn pass_encode_direct(records: &[Record]) -> usize {
    records.iter().map(|r| subscribe_bytes(black_box(r), Shape::Full).len()).sum()
}

/// The same through the contract's structs, as the relay encoded before.
fn pass_encode_prost(records: &[Record]) -> usize {
    records.iter().map(|r| bytes::Bytes::from(record_to_pb(black_box(r)).into_subscribe().encode_to_vec()).len()).sum()
}

fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

fn env_num(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Per-run passes/s of each decoder over one fixture.
#[derive(Default)]
struct Runs {
    decode: Vec<f64>,
    full: Vec<f64>,
    dynamo: Vec<f64>,
}

fn si(x: f64) -> String {
    if !x.is_finite() {
        "-".into()
    } else if x >= 1e6 {
        format!("{:.2}M", x / 1e6)
    } else if x >= 1e3 {
        format!("{:.1}k", x / 1e3)
    } else {
        format!("{x:.0}")
    }
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` passes nothing else: run quick then.
    let quick = std::env::var_os("KV_RELAY_BENCH_QUICK").is_some() || !std::env::args().any(|a| a == "--bench");
    let budget = Duration::from_millis(env_num("KV_RELAY_BENCH_MS", if quick { 10 } else { 150 }));
    let runs = env_num("KV_RELAY_BENCH_RUNS", if quick { 1 } else { 7 }).max(1) as usize;
    let fixtures = load();
    let with_dynamo = cfg!(feature = "dynamo-bench");
    println!(
        "decode benchmark: {} fixtures, {} runs x {} ms per measurement{}",
        fixtures.len(),
        runs,
        budget.as_millis(),
        if with_dynamo { ", with Dynamo (dynamo-kv-router)" } else { " (Dynamo: build with --features dynamo-bench)" }
    );

    // Which batches each decoder can read.
    println!();
    println!("readability: batches read whole / batches, events returned / events on the wire");
    println!("{:<22} {:>6} {:>7}  {:>15} {:>15}", "fixture", "msgs", "events", "ours", "dynamo");
    for f in &fixtures {
        let o = ours_readable(f);
        let d = dynamo_readable(f)
            .map(|d| format!("{}/{} {}", d.batches, f.payloads.len(), d.events))
            .unwrap_or_else(|| "-".into());
        println!(
            "{:<22} {:>6} {:>7}  {:>15} {:>15}",
            f.name,
            f.payloads.len(),
            f.wire_events,
            format!("{}/{} {}", o.batches, f.payloads.len(), o.events),
            d
        );
        #[cfg(feature = "dynamo-bench")]
        if let Some(e) = dynamo::first_error(&f.payloads) {
            println!("{:<22}   dynamo's first error: {e}", "");
        }
    }

    let recs = records(&fixtures);
    for r in &recs {
        let via = record_to_pb(r).into_subscribe().encode_to_vec();
        assert_eq!(subscribe_bytes(r, Shape::Full).to_vec(), via, "record {} encodes otherwise than prost", r.cursor);
    }
    let (mut direct, mut via_pb) = (Vec::new(), Vec::new());
    let mut per: Vec<Runs> = fixtures.iter().map(|_| Runs::default()).collect();
    for run in 0..runs {
        direct.push(measure(budget, || pass_encode_direct(&recs)));
        via_pb.push(measure(budget, || pass_encode_prost(&recs)));
        for (f, r) in fixtures.iter().zip(per.iter_mut()) {
            r.decode.push(measure(budget, || pass_ours_decode(f)));
            if with_dynamo {
                r.dynamo.push(measure(budget, || pass_dynamo(f).unwrap_or(0)));
            }
            r.full.push(measure(budget, || pass_ours_full(f)));
        }
        eprintln!("run {}/{} done", run + 1, runs);
    }

    println!();
    println!("throughput, medians over {runs} runs (msgs/s, events/s = wire events / s); ratio = median of per-run ours / dynamo");
    println!(
        "{:<22} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}  {:>7} {:>7}",
        "fixture", "dec msg/s", "dec ev/s", "d+n msg/s", "d+n ev/s", "dyn msg/s", "dyn ev/s", "dec/dyn", "d+n/dyn"
    );
    let (mut all_msgs, mut all_events) = (0usize, 0usize);
    let mut tot: Vec<[f64; 3]> = vec![[0.0; 3]; runs];
    for (f, r) in fixtures.iter().zip(per.iter_mut()) {
        let (m, e) = (f.payloads.len() as f64, f.wire_events as f64);
        all_msgs += f.payloads.len();
        all_events += f.wire_events;
        for (i, t) in tot.iter_mut().enumerate() {
            // Seconds for one pass over every fixture, summed fixture by fixture.
            t[0] += 1.0 / r.decode[i];
            t[1] += 1.0 / r.full[i];
            if with_dynamo {
                t[2] += 1.0 / r.dynamo[i];
            }
        }
        let mut rd: Vec<f64> = r.decode.iter().zip(&r.dynamo).map(|(a, b)| a / b).collect();
        let mut rf: Vec<f64> = r.full.iter().zip(&r.dynamo).map(|(a, b)| a / b).collect();
        let (dec, full, dynm) = (median(&mut r.decode), median(&mut r.full), median(&mut r.dynamo));
        println!(
            "{:<22} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}  {:>7} {:>7}",
            f.name,
            si(dec * m),
            si(dec * e),
            si(full * m),
            si(full * e),
            si(dynm * m),
            si(dynm * e),
            ratio(median(&mut rd)),
            ratio(median(&mut rf)),
        );
    }
    let (m, e) = (all_msgs as f64, all_events as f64);
    let mut dec: Vec<f64> = tot.iter().map(|t| 1.0 / t[0]).collect();
    let mut full: Vec<f64> = tot.iter().map(|t| 1.0 / t[1]).collect();
    let mut dynm: Vec<f64> = tot.iter().filter(|_| with_dynamo).map(|t| 1.0 / t[2]).collect();
    let mut rd: Vec<f64> = tot.iter().filter(|_| with_dynamo).map(|t| t[2] / t[0]).collect();
    let mut rf: Vec<f64> = tot.iter().filter(|_| with_dynamo).map(|t| t[2] / t[1]).collect();
    let (dec, full, dynm) = (median(&mut dec), median(&mut full), median(&mut dynm));
    println!(
        "{:<22} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}  {:>7} {:>7}",
        "ALL",
        si(dec * m),
        si(dec * e),
        si(full * m),
        si(full * e),
        si(dynm * m),
        si(dynm * e),
        ratio(median(&mut rd)),
        ratio(median(&mut rf)),
    );
    println!("({all_msgs} messages, {all_events} wire events in all; Dynamo's rates count the batches it rejects as messages too)");

    let mut ratios: Vec<f64> = direct.iter().zip(&via_pb).map(|(a, b)| a / b).collect();
    let n = recs.len() as f64;
    let bytes = pass_encode_direct(&recs);
    println!();
    println!(
        "Subscribe encoding of the {} records ({bytes} bytes, equal both ways), medians over {runs} runs: straight from the model {} msgs/s, through the contract's structs {} msgs/s: {} (median of per-run ratios)",
        recs.len(),
        si(median(&mut direct) * n),
        si(median(&mut via_pb) * n),
        ratio(median(&mut ratios))
    );
    // What a subscriber that asks for lean records (`omit_token_ids`) receives of the same.
    let lean: usize = recs.iter().map(|r| subscribe_bytes(r, Shape::Lean).len()).sum();
    let ops: usize = recs
        .iter()
        .map(|r| match &r.body {
            RecordBody::Batch { batch, .. } => batch.events.iter().map(|e| e.block_ops()).sum::<usize>(),
            RecordBody::Control(_) => 0,
        })
        .sum();
    println!(
        "Subscribe bytes per block operation ({ops} block operations): full {:.1}, lean {:.1}: lean/full {:.3}",
        bytes as f64 / ops.max(1) as f64,
        lean as f64 / ops.max(1) as f64,
        lean as f64 / bytes.max(1) as f64
    );
}

fn ratio(x: f64) -> String {
    if x.is_finite() {
        format!("{x:.2}x")
    } else {
        "-".into()
    }
}
