//! The mock engine over real sockets on loopback: PUB framing and seq, the replay ROUTER in
//! both layouts, the buffer bound, faults, restarts, `/metrics`, and the truth.

use std::time::{Duration, Instant};

use kv_relay_testkit::client::{free_ports, replay, sync_sub, wait_for, Sub};
use kv_relay_testkit::decode::{decode_batch, WireEvent};
use kv_relay_testkit::engine::{EngineConfig, Garbage, MockEngine};
use kv_relay_testkit::metrics::{http_get, Load};
use kv_relay_testkit::publisher::END_SEQ;
use kv_relay_testkit::traffic::{RandomSource, RequestSource, Rng};
use kv_relay_testkit::truth::{Truth, TruthKey};
use kv_relay_testkit::wire::{BlockHash, Engine, EngineEvent, ReplayLayout, Stored, TokenIds, WireVersion};

const T: Duration = Duration::from_secs(3);

fn vllm() -> WireVersion {
    WireVersion::new(Engine::Vllm, 0, 32, 0)
}

fn sglang() -> WireVersion {
    WireVersion::new(Engine::Sglang, 0, 5, 23)
}

/// An engine on free consecutive loopback ports: PUB base, replay base + dp.
fn engine_with(wire: WireVersion, dp: u32, f: impl FnOnce(&mut EngineConfig)) -> MockEngine {
    let base = free_ports(2 * dp as u16);
    let mut cfg = EngineConfig::new(wire);
    cfg.dp_size = dp;
    cfg.endpoint = format!("tcp://127.0.0.1:{base}");
    cfg.replay_endpoint = Some(format!("tcp://127.0.0.1:{}", base + dp as u16));
    cfg.topic = "kv".into();
    cfg.record = true;
    f(&mut cfg);
    MockEngine::start(cfg).expect("engine starts")
}

fn store(h: u64) -> EngineEvent {
    EngineEvent::Stored(Stored {
        hashes: vec![BlockHash::U64(h)],
        token_ids: TokenIds::Single(vec![1, 2, 3, 4]),
        block_size: 4,
        medium: Some("GPU".into()),
        group_idx: Some(0),
        kind: Some("full_attention".into()),
        ..Default::default()
    })
}

fn sub_for(engine: &MockEngine, ctx: &zmq::Context, rank: u32) -> Sub {
    let sub = Sub::connect(ctx, &engine.endpoints()[rank as usize].publisher).expect("sub");
    sync_sub(engine, rank, &sub);
    sub
}

fn replay_ep(engine: &MockEngine, rank: u32) -> String {
    engine.endpoints()[rank as usize].replay.clone().expect("replay endpoint")
}

fn seqs(msgs: &[kv_relay_testkit::client::Received]) -> Vec<u64> {
    msgs.iter().map(|m| m.seq().expect("3-frame message")).collect()
}

#[test]
fn sub_receives_three_frame_messages_with_consecutive_seq() {
    let engine = engine_with(vllm(), 1, |_| {});
    let ctx = zmq::Context::new();
    let sub = sub_for(&engine, &ctx, 0);
    for i in 0..50 {
        engine.publish(0, vec![store(1000 + i)]).unwrap();
    }
    let got = sub.collect(50, T);
    assert_eq!(seqs(&got), (0..50).collect::<Vec<u64>>());
    let records = engine.records(0).unwrap();
    for (m, r) in got.iter().zip(&records) {
        assert_eq!(m.frames.len(), 3);
        assert_eq!(m.frames[0], b"kv");
        assert_eq!(m.frames[1].len(), 8);
        assert_eq!(m.frames[2], r.payload);
        let b = decode_batch(&m.frames[2]).unwrap();
        assert_eq!(b.dp_rank, Some(0));
    }
    assert!(sub.recv(Duration::from_millis(50)).is_none());
}

#[test]
fn each_rank_publishes_on_base_port_plus_rank_with_its_rank_in_the_batch() {
    let engine = engine_with(vllm(), 3, |_| {});
    let ctx = zmq::Context::new();
    let eps = engine.endpoints();
    let base: u16 = eps[0].publisher.rsplit(':').next().unwrap().parse().unwrap();
    for r in 0..3u32 {
        let port: u16 = eps[r as usize].publisher.rsplit(':').next().unwrap().parse().unwrap();
        assert_eq!(port, base + r as u16);
        let sub = sub_for(&engine, &ctx, r);
        engine.publish(r, vec![store(7)]).unwrap();
        let m = sub.recv(T).expect("message");
        assert_eq!(m.seq(), Some(0));
        assert_eq!(decode_batch(m.payload().unwrap()).unwrap().dp_rank, Some(r));
    }
}

#[test]
fn dealer_replay_from_zero_returns_everything_buffered_in_both_layouts() {
    let engine = engine_with(vllm(), 1, |c| c.replay_layout = Some(ReplayLayout::Old));
    for i in 0..10 {
        engine.publish(0, vec![store(i)]).unwrap();
    }
    engine.flush().unwrap();
    let ctx = zmq::Context::new();
    let ep = replay_ep(&engine, 0);
    let records = engine.records(0).unwrap();

    let old = replay(&ctx, &ep, 0, T).unwrap();
    assert_eq!(old.batches.len(), 10);
    for (b, r) in old.batches.iter().zip(&records) {
        assert_eq!((b.topic.as_ref(), b.seq, &b.payload), (None, r.seq, &r.payload));
    }
    assert_eq!(old.end_marker, vec![END_SEQ.to_vec(), vec![]]);

    engine.set_replay_layout(0, ReplayLayout::New).unwrap();
    engine.flush().unwrap();
    let new = replay(&ctx, &ep, 0, T).unwrap();
    assert_eq!(new.batches.len(), 10);
    for (b, r) in new.batches.iter().zip(&records) {
        assert_eq!((b.topic.as_deref(), b.seq, &b.payload), (Some(&b"kv"[..]), r.seq, &r.payload));
    }
    assert_eq!(new.end_marker, vec![vec![], END_SEQ.to_vec(), vec![]]);

    let tail = replay(&ctx, &ep, 6, T).unwrap();
    assert_eq!(tail.batches.iter().map(|b| b.seq).collect::<Vec<_>>(), vec![6, 7, 8, 9]);
    let past = replay(&ctx, &ep, 1000, T).unwrap();
    assert!(past.batches.is_empty());
    assert_eq!(past.end_marker, vec![vec![], END_SEQ.to_vec(), vec![]]);
}

#[test]
fn replay_layout_defaults_to_the_wire_release() {
    assert_eq!(WireVersion::new(Engine::Vllm, 0, 25, 0).replay_layout(), ReplayLayout::Old);
    assert_eq!(WireVersion::new(Engine::Vllm, 0, 26, 0).replay_layout(), ReplayLayout::New);
    assert_eq!(WireVersion::new(Engine::Sglang, 0, 5, 21).replay_layout(), ReplayLayout::Old);
    assert_eq!(WireVersion::new(Engine::Sglang, 0, 5, 22).replay_layout(), ReplayLayout::New);
}

#[test]
fn replay_buffer_bound_evicts_the_oldest() {
    let engine = engine_with(vllm(), 1, |c| c.buffer_steps = 5);
    for i in 0..12 {
        engine.publish(0, vec![store(i)]).unwrap();
    }
    engine.flush().unwrap();
    let ctx = zmq::Context::new();
    let a = replay(&ctx, &replay_ep(&engine, 0), 0, T).unwrap();
    assert_eq!(a.batches.iter().map(|b| b.seq).collect::<Vec<_>>(), vec![7, 8, 9, 10, 11]);
    let s = engine.stats(0).unwrap();
    assert_eq!((s.buffered, s.oldest_buffered_seq, s.next_seq), (5, Some(7), 12));
}

#[test]
fn dropped_batch_is_absent_on_the_wire_but_present_in_replay() {
    let engine = engine_with(vllm(), 1, |_| {});
    let ctx = zmq::Context::new();
    let sub = sub_for(&engine, &ctx, 0);
    for i in 0..3 {
        engine.publish(0, vec![store(i)]).unwrap();
    }
    engine.drop_on_wire(0, 2).unwrap();
    for i in 3..6 {
        engine.publish(0, vec![store(i)]).unwrap();
    }
    engine.lose(0, 1).unwrap();
    for i in 6..8 {
        engine.publish(0, vec![store(i)]).unwrap();
    }
    let got = sub.collect(5, T);
    assert_eq!(seqs(&got), vec![0, 1, 2, 5, 7]);
    let a = replay(&ctx, &replay_ep(&engine, 0), 0, T).unwrap();
    // seq 6 was lost: neither sent nor buffered.
    assert_eq!(a.batches.iter().map(|b| b.seq).collect::<Vec<_>>(), vec![0, 1, 2, 3, 4, 5, 7]);
    // The truth is the engine's state: all 8 stores, dropped and lost ones included.
    let t = engine.truth();
    assert_eq!(
        t.blocks[&TruthKey::new(0, Some("GPU"), Some(0))].keys().copied().collect::<Vec<_>>(),
        (0..8).collect::<Vec<u64>>()
    );
    engine.flush().unwrap();
    let s = engine.stats(0).unwrap();
    assert_eq!((s.sent, s.dropped_on_wire, s.lost), (5, 2, 1));
}

#[test]
fn a_batch_held_for_a_replay_goes_on_the_wire_after_the_replay_answered() {
    let engine = engine_with(vllm(), 1, |_| {});
    let ctx = zmq::Context::new();
    let sub = sub_for(&engine, &ctx, 0);
    engine.publish(0, vec![store(0)]).unwrap();
    engine.wire_after_replay(0, 2).unwrap();
    for i in 1..3 {
        engine.publish(0, vec![store(i)]).unwrap();
    }
    assert_eq!(seqs(&sub.collect(3, Duration::from_millis(500))), vec![0]);
    // Buffered at once: the replay has them before the wire.
    let a = replay(&ctx, &replay_ep(&engine, 0), 1, T).unwrap();
    assert_eq!(a.batches.iter().map(|b| b.seq).collect::<Vec<_>>(), vec![1, 2]);
    assert_eq!(seqs(&sub.collect(2, T)), vec![1, 2]);
    // The fault is spent: the next batch goes out at once.
    engine.publish(0, vec![store(3)]).unwrap();
    assert_eq!(seqs(&sub.collect(1, T)), vec![3]);
    engine.flush().unwrap();
    let s = engine.stats(0).unwrap();
    assert_eq!((s.sent, s.dropped_on_wire, s.replay_requests, s.replayed_batches), (4, 0, 1, 2));
}

#[test]
fn trimming_the_buffer_forgets_the_oldest_batches() {
    let engine = engine_with(vllm(), 1, |_| {});
    for i in 0..6 {
        engine.publish(0, vec![store(i)]).unwrap();
    }
    engine.trim_buffer(0, 2).unwrap();
    engine.flush().unwrap();
    let ctx = zmq::Context::new();
    let a = replay(&ctx, &replay_ep(&engine, 0), 0, T).unwrap();
    assert_eq!(a.batches.iter().map(|b| b.seq).collect::<Vec<_>>(), vec![4, 5]);
}

#[test]
fn restart_resets_seq_empties_the_buffer_and_clears_only_that_rank() {
    let engine = engine_with(vllm(), 2, |_| {});
    let ctx = zmq::Context::new();
    for i in 0..5 {
        engine.publish(0, vec![store(i)]).unwrap();
        engine.publish(1, vec![store(100 + i)]).unwrap();
    }
    engine.flush().unwrap();
    let before = engine.endpoints();
    engine.restart(0).unwrap();
    assert_eq!(engine.endpoints(), before, "a restart binds the same endpoints");
    let a = replay(&ctx, &replay_ep(&engine, 0), 0, T).unwrap();
    assert!(a.batches.is_empty());
    let t = engine.truth();
    assert_eq!(t.rank(0), Truth::new());
    assert_eq!(t.rank(1).copies(), 5);

    let sub = sub_for(&engine, &ctx, 0);
    engine.publish(0, vec![store(42)]).unwrap();
    engine.publish(0, vec![store(43)]).unwrap();
    assert_eq!(seqs(&sub.collect(2, T)), vec![0, 1]);
    engine.flush().unwrap();
    let s = engine.stats(0).unwrap();
    assert_eq!((s.generation, s.next_seq), (1, 2));
    assert_eq!(engine.stats(1).unwrap().next_seq, 5);
}

#[test]
fn sglang_publisher_starts_and_restarts_with_all_blocks_cleared() {
    let engine = engine_with(sglang(), 1, |_| {});
    let ctx = zmq::Context::new();
    let sub = sub_for(&engine, &ctx, 0);
    let first_events = |sub: &Sub| {
        let m = sub.recv(T).expect("message");
        decode_batch(m.payload().unwrap()).unwrap().events.into_iter().map(Result::unwrap).collect::<Vec<_>>()
    };
    engine.publish(0, vec![store(1)]).unwrap();
    let ev = first_events(&sub);
    assert_eq!(ev.len(), 2);
    assert_eq!(ev[0], WireEvent::Cleared);
    engine.publish(0, vec![store(2)]).unwrap();
    assert_eq!(first_events(&sub).len(), 1);

    engine.restart(0).unwrap();
    let sub = sub_for(&engine, &ctx, 0);
    engine.publish(0, vec![store(3)]).unwrap();
    let ev = first_events(&sub);
    assert_eq!(ev[0], WireEvent::Cleared);
    assert_eq!(engine.truth().copies(), 1);
}

#[test]
fn stopped_rank_publishes_nothing_and_starts_again_at_seq_zero() {
    let engine = engine_with(vllm(), 1, |_| {});
    let ctx = zmq::Context::new();
    engine.publish(0, vec![store(1)]).unwrap();
    engine.stop(0).unwrap();
    assert!(engine.publish(0, vec![store(2)]).is_err());
    engine.flush().unwrap();
    assert!(!engine.stats(0).unwrap().running);
    assert_eq!(engine.truth(), Truth::new());
    engine.start_rank(0).unwrap();
    let sub = sub_for(&engine, &ctx, 0);
    engine.publish(0, vec![store(3)]).unwrap();
    assert_eq!(sub.recv(T).and_then(|m| m.seq()), Some(0));
}

#[test]
fn delay_holds_batches_then_sends_them_in_order() {
    let engine = engine_with(vllm(), 1, |_| {});
    let ctx = zmq::Context::new();
    let sub = sub_for(&engine, &ctx, 0);
    let start = Instant::now();
    engine.delay(0, Duration::from_millis(300)).unwrap();
    for i in 0..3 {
        engine.publish(0, vec![store(i)]).unwrap();
    }
    let got = sub.collect(3, T);
    assert!(start.elapsed() >= Duration::from_millis(300));
    assert_eq!(seqs(&got), vec![0, 1, 2]);
}

#[test]
fn garbage_frames_go_out_as_asked_and_only_good_events_reach_the_truth() {
    let engine = engine_with(vllm(), 1, |_| {});
    let ctx = zmq::Context::new();
    let sub = sub_for(&engine, &ctx, 0);
    for g in Garbage::ALL {
        engine.garbage(0, g).unwrap();
    }
    engine.publish(0, vec![store(9)]).unwrap();
    let got = sub.collect(6, T);
    assert_eq!(got.len(), 6);
    // wrong frame count: 2 frames
    assert_eq!(got[0].frames.len(), 2);
    // short seq frame
    assert_eq!(got[1].frames.len(), 3);
    assert_eq!(got[1].frames[1].len(), 4);
    // not msgpack, truncated, malformed event: seq 0, 1, 2; then the good batch seq 3
    assert_eq!(seqs(&got[2..]), vec![0, 1, 2, 3]);
    assert!(decode_batch(got[2].payload().unwrap()).is_err());
    assert!(decode_batch(got[3].payload().unwrap()).is_err());
    let mixed = decode_batch(got[4].payload().unwrap()).unwrap();
    assert_eq!(mixed.events.len(), 3);
    assert!(mixed.events[0].is_ok() && mixed.events[1].is_err() && mixed.events[2].is_ok());
    // Truth: the two good stores of the mixed batch and the final store.
    assert_eq!(engine.truth().copies(), 3);
}

#[test]
fn metrics_endpoint_serves_the_engines_load_gauges() {
    let engine = engine_with(vllm(), 2, |c| {
        c.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
        c.model_name = "tiny".into();
    });
    let addr = engine.metrics_addr().unwrap();
    engine.set_load(1, Load { running: 3, waiting: 2, kv_usage: 0.25 }).unwrap();
    let (status, body) = http_get(addr, "/metrics").unwrap();
    assert_eq!(status, 200);
    for line in [
        "# TYPE vllm:num_requests_running gauge",
        "vllm:num_requests_running{engine=\"0\",model_name=\"tiny\"} 0.0",
        "vllm:num_requests_running{engine=\"1\",model_name=\"tiny\"} 3.0",
        "vllm:num_requests_waiting{engine=\"1\",model_name=\"tiny\"} 2.0",
        "vllm:kv_cache_usage_perc{engine=\"1\",model_name=\"tiny\"} 0.25",
    ] {
        assert!(body.lines().any(|l| l == line), "missing {line:?} in\n{body}");
    }
    assert_eq!(http_get(addr, "/other").unwrap().0, 404);

    let sg = engine_with(sglang(), 1, |c| {
        c.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
        c.model_name = "tiny".into();
    });
    sg.set_load(0, Load { running: 5, waiting: 1, kv_usage: 0.5 }).unwrap();
    let (_, body) = http_get(sg.metrics_addr().unwrap(), "/metrics").unwrap();
    for name in ["sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage"] {
        assert!(body.contains(&format!("# TYPE {name} gauge")), "{body}");
    }
    assert!(body.contains("sglang:num_running_reqs{model_name=\"tiny\",engine_type=\"unified\",tp_rank=\"0\",pp_rank=\"0\",dp_rank=\"0\"} 5.0"), "{body}");
    assert!(body.contains("sglang:token_usage{model_name=\"tiny\",engine_type=\"unified\",tp_rank=\"0\",pp_rank=\"0\",dp_rank=\"0\"} 0.5"), "{body}");
}

/// Walk every batch the engine was asked to publish (on the wire or not), in order per rank,
/// with the restart rule: the reference truth.
fn walk_records(engine: &MockEngine) -> Truth {
    let mut t = Truth::new();
    for rank in 0..engine.dp_size() {
        let mut generation = 0;
        for r in engine.records(rank).unwrap() {
            if r.generation != generation {
                generation = r.generation;
                t.clear_rank(rank);
            }
            if let Ok(b) = decode_batch(&r.payload) {
                for ev in b.events.iter().flatten() {
                    t.apply(rank, ev);
                }
            }
        }
    }
    t
}

#[test]
fn truth_after_a_generated_run_equals_the_walk_of_everything_published() {
    for wire in [vllm(), sglang(), WireVersion::new(Engine::Vllm, 0, 10, 2)] {
        let engine = engine_with(wire, 2, |c| {
            c.cache_blocks = 24;
            c.block_size = 4;
        });
        let mut src = RandomSource::new(7, 4, 6);
        let mut rng = Rng::new(11);
        for i in 0..400u64 {
            let rank = rng.below(2) as u32;
            let blocks = src.next_request().unwrap();
            engine.serve_request(rank, &blocks, rng.chance(0.02)).unwrap();
            match i {
                100 => engine.drop_on_wire(0, 5).unwrap(),
                150 => engine.lose(1, 3).unwrap(),
                250 => engine.restart(1).unwrap(),
                _ => {}
            }
        }
        engine.flush().unwrap();
        let truth = engine.truth();
        assert_eq!(truth, walk_records(&engine), "{wire}");
        // The truth is also exactly what each rank's cache holds, one copy each.
        for rank in 0..2 {
            let live: std::collections::BTreeSet<u64> =
                truth.rank(rank).blocks.values().flat_map(|m| m.keys().copied()).collect();
            assert_eq!(live, engine.cache_hashes(rank).unwrap(), "{wire} rank {rank}");
            assert!(live.len() <= 24);
            assert!(truth.rank(rank).blocks.values().all(|m| m.values().all(|&n| n == 1)));
        }
        let s0 = engine.stats(0).unwrap();
        assert_eq!(s0.dropped_on_wire, 5);
        assert!(engine.stats(1).unwrap().generation == 1);
        // Pre-0.20 vLLM has no group_idx on the wire: keys follow the wire.
        if wire.release == (0, 10, 2) {
            assert!(truth.blocks.keys().all(|k| k.group.is_none()));
        }
    }
}

#[test]
fn pause_blocks_traffic_sources_until_resume() {
    let engine = engine_with(vllm(), 1, |_| {});
    engine.pause();
    assert!(!engine.wait_unpaused(Duration::from_millis(20)));
    engine.resume();
    assert!(engine.wait_unpaused(Duration::from_millis(20)));
    assert!(wait_for(T, || (!engine.is_paused()).then_some(())).is_some());
}

#[test]
fn every_random_request_publishes_exactly_one_batch() {
    let engine = engine_with(vllm(), 1, |c| {
        c.cache_blocks = 64;
        c.block_size = 4;
    });
    let mut src = RandomSource::new(9, 4, 6);
    for _ in 0..100 {
        engine.serve_request(0, &src.next_request().unwrap(), false).unwrap();
    }
    engine.flush().unwrap();
    assert_eq!(engine.stats(0).unwrap().next_seq, 100);
}

#[test]
fn inproc_ranks_use_the_dp_suffix_in_a_shared_context() {
    let ctx = zmq::Context::new();
    let mut cfg = EngineConfig::new(vllm());
    cfg.dp_size = 2;
    cfg.endpoint = "inproc://mock-kv".into();
    cfg.replay_endpoint = Some("inproc://mock-kv-replay".into());
    let engine = MockEngine::start_in(cfg, ctx.clone()).unwrap();
    let eps = engine.endpoints();
    assert_eq!(eps[0].publisher, "inproc://mock-kv");
    assert_eq!(eps[1].publisher, "inproc://mock-kv_dp1");
    assert_eq!(eps[1].replay.as_deref(), Some("inproc://mock-kv-replay_dp1"));
    let sub = Sub::connect(&ctx, "inproc://mock-kv_dp1").unwrap();
    sync_sub(&engine, 1, &sub);
    engine.publish(1, vec![store(5)]).unwrap();
    let m = sub.recv(T).expect("message");
    assert_eq!(decode_batch(m.payload().unwrap()).unwrap().dp_rank, Some(1));
    let a = replay(&ctx, "inproc://mock-kv-replay_dp1", 0, T).unwrap();
    assert_eq!(a.batches.len(), 1);
}

#[test]
fn host_tier_bytes_hashes_and_eagle_pages_keep_the_truth_equal_to_each_tier() {
    for (wire, bytes, eagle) in [(vllm(), true, false), (sglang(), false, false), (sglang(), false, true)] {
        let engine = engine_with(wire, 1, |c| {
            c.cache_blocks = 16;
            c.block_size = 4;
            c.host_tier_blocks = 12;
            c.bytes_hashes = bytes;
            c.eagle = eagle;
        });
        let mut src = RandomSource::new(21, 4, 8);
        for _ in 0..200 {
            engine.serve_request(0, &src.next_request().unwrap(), false).unwrap();
        }
        engine.flush().unwrap();
        let truth = engine.truth();
        assert_eq!(truth, walk_records(&engine), "{wire}");
        let (gpu_group, host_medium) = match wire.engine {
            Engine::Vllm => (Some(0), "CPU"),
            Engine::Sglang => (None, "CPU_PINNED"),
        };
        let set = |k: TruthKey| -> std::collections::BTreeSet<u64> {
            truth.blocks.get(&k).map(|m| m.keys().copied().collect()).unwrap_or_default()
        };
        assert_eq!(set(TruthKey::new(0, Some("GPU"), gpu_group)), engine.cache_hashes(0).unwrap());
        let host = set(TruthKey::new(0, Some(host_medium), None));
        assert_eq!(host, engine.host_hashes(0).unwrap());
        assert_eq!(host.len(), 12, "{wire}: the host tier fills up");
        if bytes {
            let first = &engine.records(0).unwrap()[0].payload;
            let v = rmpv::decode::read_value(&mut first.as_slice()).unwrap();
            let hashes = v[1][0]
                .as_map()
                .unwrap()
                .iter()
                .find(|(k, _)| k.as_str() == Some("block_hashes"))
                .map(|(_, v)| v.clone())
                .unwrap();
            assert!(matches!(&hashes[0], rmpv::Value::Binary(b) if b.len() == 32));
        }
    }
}

#[test]
fn restart_answers_a_flush_held_by_a_delay_and_keeps_armed_drops() {
    let engine = std::sync::Arc::new(engine_with(vllm(), 1, |_| {}));
    engine.delay(0, Duration::from_secs(5)).unwrap();
    engine.publish(0, vec![store(1)]).unwrap();
    let e2 = engine.clone();
    let start = Instant::now();
    let flusher = std::thread::spawn(move || e2.flush());
    // The flush waits behind the held batch until the restart drops it.
    std::thread::sleep(Duration::from_millis(50));
    engine.drop_on_wire(0, 1).unwrap();
    engine.restart(0).unwrap();
    flusher.join().unwrap().unwrap();
    assert!(start.elapsed() < Duration::from_secs(4));
    let ctx = zmq::Context::new();
    let sub = sub_for(&engine, &ctx, 0);
    engine.publish(0, vec![store(2)]).unwrap();
    engine.publish(0, vec![store(3)]).unwrap();
    // seq 0 was dropped on the wire by the drop armed before the restart.
    assert_eq!(seqs(&sub.collect(1, T)), vec![1]);
    assert_eq!(engine.truth().copies(), 2);
}

#[test]
fn clear_with_next_batch_rides_in_front_of_the_next_step() {
    let engine = engine_with(vllm(), 1, |c| c.block_size = 4);
    let mut src = RandomSource::new(2, 4, 4);
    engine.serve_request(0, &src.next_request().unwrap(), false).unwrap();
    engine.clear_with_next_batch(0).unwrap();
    engine.flush().unwrap();
    assert_eq!(engine.stats(0).unwrap().next_seq, 1, "nothing published by the clear itself");
    let req = src.next_request().unwrap();
    engine.serve_request(0, &req, false).unwrap();
    engine.flush().unwrap();
    let recs = engine.records(0).unwrap();
    let events: Vec<WireEvent> =
        decode_batch(&recs[1].payload).unwrap().events.into_iter().map(Result::unwrap).collect();
    assert_eq!(events[0], WireEvent::Cleared);
    assert!(matches!(&events[1], WireEvent::Stored { hashes, .. } if hashes.len() == req.len()));
    assert_eq!(events.len(), 2);
    assert_eq!(engine.truth().copies(), req.len() as u64);
}

#[test]
fn faults_racing_a_running_generator_keep_the_truth_equal_to_the_walk() {
    use kv_relay_testkit::generate::{generate, GenerateOptions};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    let engine = Arc::new(engine_with(sglang(), 2, |c| {
        c.cache_blocks = 32;
        c.block_size = 4;
        c.buffer_steps = 50;
    }));
    let stop = Arc::new(AtomicBool::new(false));
    let gen = {
        let (engine, stop) = (engine.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut src = RandomSource::new(13, 4, 8);
            let opts = GenerateOptions { clear_probability: 0.01, seed: 13, ..Default::default() };
            generate(&engine, &mut src, &opts, &stop)
        })
    };
    let progressed = |rank: u32, past: u64| {
        wait_for(T, || {
            engine.flush().ok()?;
            (engine.stats(rank).ok()?.next_seq > past).then_some(())
        })
        .is_some()
    };
    assert!(progressed(0, 20));
    engine.drop_on_wire(0, 7).unwrap();
    engine.lose(1, 2).unwrap();
    engine.restart(1).unwrap();
    engine.garbage(0, Garbage::MalformedEvent).unwrap();
    engine.stop(0).unwrap();
    assert!(progressed(1, 20));
    engine.start_rank(0).unwrap();
    engine.pause();
    engine.resume();
    assert!(progressed(0, 20));
    stop.store(true, Ordering::SeqCst);
    let served = gen.join().unwrap().unwrap();
    assert!(served > 40);
    engine.flush().unwrap();
    assert_eq!(engine.truth(), walk_records(&engine));
    for rank in 0..2 {
        let live: std::collections::BTreeSet<u64> =
            engine.truth().rank(rank).blocks.values().flat_map(|m| m.keys().copied()).collect();
        assert_eq!(live, engine.cache_hashes(rank).unwrap(), "rank {rank}");
    }
}
