//! Traffic sources: captures played through the mock engine, Mooncake traces and the
//! generator loop.

use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use kv_relay_testkit::capture::{play, ranks_needed, read_capture};
use kv_relay_testkit::client::{replay, sync_sub, Sub};
use kv_relay_testkit::decode::decode_batch;
use kv_relay_testkit::engine::{EngineConfig, MockEngine};
use kv_relay_testkit::generate::{generate, GenerateOptions};
use kv_relay_testkit::traffic::{mooncake_block_tokens, MooncakeSource, RequestSource};
use kv_relay_testkit::truth::Truth;
use kv_relay_testkit::wire::{Engine, WireVersion};
use serde_json::Value as Json;

const T: Duration = Duration::from_secs(3);

fn manifest(name: &str) -> Json {
    let p = kv_relay_testdata::manifest(name);
    serde_json::from_slice(&std::fs::read(p).expect("manifest")).expect("json")
}

/// An engine with ephemeral loopback ports for every rank.
fn engine_for(engine: Engine, dp: u32, f: impl FnOnce(&mut EngineConfig)) -> MockEngine {
    let mut cfg = EngineConfig::new(WireVersion::latest(engine));
    cfg.dp_size = dp;
    cfg.endpoint = "tcp://127.0.0.1:0".into();
    cfg.replay_endpoint = Some("tcp://127.0.0.1:0".into());
    cfg.record = true;
    f(&mut cfg);
    MockEngine::start(cfg).expect("engine starts")
}

#[test]
fn every_capture_played_leaves_the_truth_equal_to_its_manifest() {
    let names = kv_relay_testdata::names();
    // 10 real captures and 12 goldens (fixtures README).
    assert_eq!(names.len(), 22, "{names:?}");
    let stop = AtomicBool::new(false);
    for name in &names {
        let m = manifest(name);
        let lines = read_capture(&kv_relay_testdata::capture(name)).unwrap();
        let kind = if m["engine"].as_str().unwrap().starts_with("sglang") { Engine::Sglang } else { Engine::Vllm };
        let engine = engine_for(kind, ranks_needed(&lines), |_| {});
        let report = play(&engine, &lines, false, &stop).unwrap();
        engine.flush().unwrap();
        let expected = Truth::from_json(&m["expected_refcounted"]).expect("expected_refcounted");
        assert_eq!(engine.truth(), expected, "{name}");
        assert_eq!(
            report.batches,
            m["num_pub_messages"].as_u64().or_else(|| m["num_messages"].as_u64()).unwrap(),
            "{name}"
        );
        assert_eq!(report.restarts, m["counts"]["restarts_detected"].as_u64().unwrap_or(0), "{name}");
    }
}

#[test]
fn played_capture_reaches_subscribers_byte_identical_per_rank() {
    let lines = read_capture(&kv_relay_testdata::capture("vllm-dp2")).unwrap();
    let engine = engine_for(Engine::Vllm, 2, |_| {});
    let ctx = zmq::Context::new();
    let subs: Vec<Sub> = (0..2)
        .map(|r| {
            let s = Sub::connect(&ctx, &engine.endpoints()[r].publisher).unwrap();
            sync_sub(&engine, r as u32, &s);
            s
        })
        .collect();
    play(&engine, &lines, false, &AtomicBool::new(false)).unwrap();
    for rank in 0..2u32 {
        let recorded: Vec<&Vec<Vec<u8>>> =
            lines.iter().filter(|l| l.socket == "pub" && l.dp_rank == Some(rank)).map(|l| &l.frames).collect();
        let got = subs[rank as usize].collect(recorded.len(), T);
        assert_eq!(got.len(), recorded.len(), "rank {rank}");
        for (g, r) in got.iter().zip(&recorded) {
            assert_eq!(&g.frames, *r, "rank {rank}: frames differ from the capture");
        }
        let a = replay(&ctx, engine.endpoints()[rank as usize].replay.as_ref().unwrap(), 0, T).unwrap();
        assert_eq!(a.batches.len(), recorded.len());
        assert!(a.batches.iter().all(|b| b.topic.as_deref() == Some(&b"kv"[..])));
    }
}

#[test]
fn played_restart_capture_restarts_the_rank_and_replays_only_the_new_engine() {
    let lines = read_capture(&kv_relay_testdata::capture("vllm-restart")).unwrap();
    let engine = engine_for(Engine::Vllm, 1, |_| {});
    let report = play(&engine, &lines, false, &AtomicBool::new(false)).unwrap();
    assert_eq!((report.batches, report.restarts), (44, 1));
    engine.flush().unwrap();
    let s = engine.stats(0).unwrap();
    assert_eq!((s.generation, s.next_seq), (1, 19));
    let ctx = zmq::Context::new();
    let a = replay(&ctx, engine.endpoints()[0].replay.as_ref().unwrap(), 0, T).unwrap();
    assert_eq!(a.batches.iter().map(|b| b.seq).collect::<Vec<_>>(), (0..19).collect::<Vec<_>>());
}

#[test]
fn mooncake_ids_become_chained_blocks_that_share_prefixes() {
    let path = kv_relay_testdata::mooncake("conversation_trace.jsonl");
    let mut src = MooncakeSource::open(&path, 16).unwrap();
    assert_eq!(src.len(), 12_031);
    let engine = engine_for(Engine::Vllm, 1, |c| {
        c.block_size = 16;
        c.cache_blocks = 4096;
    });
    // Request 1: ids 0..=13 (14 blocks); request 2: ids [0, 14..=27] (15 blocks, id 0 shared).
    let r1 = src.next_request().unwrap();
    let r2 = src.next_request().unwrap();
    assert_eq!((r1.len(), r2.len()), (14, 15));
    assert_eq!(r1[0], mooncake_block_tokens(0, 16));
    assert_eq!(r1[0], r2[0]);
    engine.serve_request(0, &r1, false).unwrap();
    engine.serve_request(0, &r2, false).unwrap();
    engine.flush().unwrap();
    let recs = engine.records(0).unwrap();
    let ev = |i: usize| decode_batch(&recs[i].payload).unwrap().events;
    let hashes_of = |i: usize| match ev(i)[0].clone().unwrap() {
        kv_relay_testkit::decode::WireEvent::Stored { hashes, .. } => hashes,
        other => panic!("store expected, got {other:?}"),
    };
    let h1 = hashes_of(0);
    let h2 = hashes_of(1);
    assert_eq!((h1.len(), h2.len()), (14, 14));
    assert!(h1.iter().all(|h| !h2.contains(h)));
    // The second store continues the shared block 0: its parent is block 0's hash.
    let v = rmpv::decode::read_value(&mut recs[1].payload.as_slice()).unwrap();
    let event = &v[1][0];
    let parent = event
        .as_map()
        .unwrap()
        .iter()
        .find(|(k, _)| k.as_str() == Some("parent_block_hash"))
        .and_then(|(_, v)| v.as_u64());
    assert_eq!(parent, Some(h1[0]));
    assert_eq!(engine.truth().copies(), 28);
}

#[test]
fn generated_mooncake_run_matches_the_walk_and_the_caches() {
    let path = kv_relay_testdata::mooncake("synthetic_trace.jsonl");
    let mut src = MooncakeSource::open(&path, 8).unwrap();
    let engine = engine_for(Engine::Sglang, 2, |c| {
        c.block_size = 8;
        c.cache_blocks = 200;
    });
    let opts = GenerateOptions { max_requests: Some(300), clear_probability: 0.01, seed: 3, ..Default::default() };
    let served = generate(&engine, &mut src, &opts, &AtomicBool::new(false)).unwrap();
    assert_eq!(served, 300);
    engine.flush().unwrap();
    let mut walk = Truth::new();
    let mut removals = 0;
    for rank in 0..2 {
        for (i, r) in engine.records(rank).unwrap().iter().enumerate() {
            let b = decode_batch(&r.payload).unwrap();
            if i == 0 {
                // SGLang publishers start with AllBlocksCleared.
                assert_eq!(b.events[0], Ok(kv_relay_testkit::decode::WireEvent::Cleared));
            }
            for e in b.events.iter().flatten() {
                if matches!(e, kv_relay_testkit::decode::WireEvent::Removed { .. }) {
                    removals += 1;
                }
                walk.apply(rank, e);
            }
        }
        let live: std::collections::BTreeSet<u64> =
            engine.truth().rank(rank).blocks.values().flat_map(|m| m.keys().copied()).collect();
        assert_eq!(live, engine.cache_hashes(rank).unwrap());
    }
    assert_eq!(engine.truth(), walk);
    assert!(removals > 0, "capacity 200 must have evicted");
}

#[test]
fn generator_keeps_its_rate() {
    let engine = engine_for(Engine::Vllm, 1, |_| {});
    let mut src = kv_relay_testkit::traffic::RandomSource::new(1, 16, 4);
    let opts = GenerateOptions { rate: Some(100.0), max_requests: Some(30), ..Default::default() };
    let start = Instant::now();
    assert_eq!(generate(&engine, &mut src, &opts, &AtomicBool::new(false)).unwrap(), 30);
    // Request i is due at i/rate: the 30th at 0.29 s.
    assert!(start.elapsed() >= Duration::from_millis(290), "{:?}", start.elapsed());
}

#[test]
fn paced_playback_keeps_the_recorded_gaps() {
    // Three pub lines 0.15 s apart, built from the first golden payloads.
    let src = read_capture(&kv_relay_testdata::capture("golden-vllm-0.9.1")).unwrap();
    let mut lines: Vec<_> = src.into_iter().filter(|l| l.socket == "pub").take(3).collect();
    for (i, l) in lines.iter_mut().enumerate() {
        l.t = 10.0 + 0.15 * i as f64;
    }
    let engine = engine_for(Engine::Vllm, 1, |_| {});
    let start = Instant::now();
    let report = play(&engine, &lines, true, &AtomicBool::new(false)).unwrap();
    assert_eq!(report.batches, 3);
    assert!(start.elapsed() >= Duration::from_millis(300), "{:?}", start.elapsed());
    let start = Instant::now();
    play(&engine, &lines, false, &AtomicBool::new(false)).unwrap();
    assert!(start.elapsed() < Duration::from_millis(300));
}
