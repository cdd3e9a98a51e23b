//! The relay's ingest against the mock engine on loopback: every rule of the ingest, each test
//! named for what it proves. The relay side's output (the items it hands to the committer) is
//! applied to `kv_relay::live::LiveBlocks` and compared with the mock engine's truth.

use kv_relay::ingest::{Ingest, IngestConfig, IngestItem, Resume};
use kv_relay::live::LiveBlocks;
use kv_relay::model::ControlKind;
use kv_relay_testkit::drills::harness::truth_as_live;
use kv_relay_testkit::engine::{EngineConfig, Garbage, MockEngine};
use kv_relay_testkit::fixtures::{self, Fixture};
use kv_relay_testkit::traffic::{RandomSource, RequestSource};
use kv_relay_testkit::wire::{encode_batch, Batch, Engine, EngineEvent, WireVersion};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Starts a mock engine on free loopback ports.
fn engine(wire: WireVersion, dp_size: u32, replay: bool, buffer_steps: usize) -> MockEngine {
    let mut cfg = EngineConfig::new(wire);
    cfg.dp_size = dp_size;
    cfg.topic = "kv".into();
    cfg.buffer_steps = buffer_steps;
    cfg.block_size = 4;
    cfg.cache_blocks = 64;
    kv_relay_testkit::client::start_engine_on_free_ports(cfg, replay)
}

fn vllm() -> WireVersion {
    WireVersion::parse(Engine::Vllm, "0.32").unwrap()
}

fn sglang() -> WireVersion {
    WireVersion::parse(Engine::Sglang, "0.5.23").unwrap()
}

/// What the relay handed on, applied.
#[derive(Default)]
struct Seen {
    live: LiveBlocks,
    controls: Vec<(u32, ControlKind)>,
    batches: u64,
    refilled: u64,
    /// (rank, seq) in the order handed on.
    order: Vec<(u32, u64)>,
    drops: BTreeMap<&'static str, u64>,
}

struct Relay {
    ingest: Option<Ingest>,
    seen: Arc<Mutex<Seen>>,
    collector: Option<std::thread::JoinHandle<()>>,
}

fn relay_cfg(e: &MockEngine) -> IngestConfig {
    let c = e.config();
    IngestConfig {
        endpoint: c.endpoint.clone(),
        replay_endpoint: c.replay_endpoint.clone(),
        dp_ranks: (0..c.dp_size).collect(),
        topic: c.topic.clone(),
        replay_timeout: Duration::from_secs(2),
        tail_probe: Duration::from_millis(300),
        rcvhwm: 100_000,
        max_message_bytes: kv_relay::ingest::DEFAULT_MAX_MESSAGE_BYTES,
        group_batches: 64,
        hash_check: None,
    }
}

impl Relay {
    fn start(cfg: IngestConfig, resume: BTreeMap<u32, Resume>) -> Relay {
        Relay::start_with(cfg, resume, LiveBlocks::default())
    }

    /// [`Relay::start`] whose collector starts from `live` (what a restarted relay's store
    /// holds), before the first batch is handed on.
    fn start_with(cfg: IngestConfig, resume: BTreeMap<u32, Resume>, live: LiveBlocks) -> Relay {
        let (tx, mut rx) = tokio::sync::mpsc::channel(cfg.group_batches);
        let seen = Arc::new(Mutex::new(Seen { live, ..Seen::default() }));
        let s2 = seen.clone();
        let collector = std::thread::spawn(move || {
            while let Some(item) = rx.blocking_recv() {
                let mut s = s2.lock().unwrap();
                match item {
                    IngestItem::Batch { batch, drops, refilled } => {
                        s.batches += 1;
                        s.refilled += u64::from(refilled);
                        s.order.push((batch.dp_rank, batch.seq));
                        for (k, v) in drops.0 {
                            *s.drops.entry(k).or_default() += v;
                        }
                        s.live.apply(&batch);
                    }
                    IngestItem::Control(c) => {
                        if matches!(c.kind, ControlKind::RankReset { .. }) {
                            s.live.reset_rank(c.dp_rank);
                        }
                        s.controls.push((c.dp_rank, c.kind));
                    }
                }
            }
        });
        let ingest = Ingest::start(&cfg, zmq::Context::new(), &resume, |_| Box::new(tx.clone())).unwrap();
        Relay { ingest: Some(ingest), seen, collector: Some(collector) }
    }

    fn health(&self, rank: u32) -> &'static str {
        self.ingest.as_ref().unwrap().status[&rank].lock().unwrap().health.as_str()
    }

    fn status(&self, rank: u32) -> kv_relay::ingest::RankStatus {
        self.ingest.as_ref().unwrap().status[&rank].lock().unwrap().clone()
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        if let Some(i) = self.ingest.take() {
            i.stop();
        }
        if let Some(c) = self.collector.take() {
            let _ = c.join();
        }
    }
}

fn wait_for(what: &str, f: impl FnMut() -> bool) {
    let waited = kv_relay_testkit::kit::poll_until(Duration::from_secs(15), Duration::from_millis(20), f);
    assert!(waited.is_some(), "timed out waiting for {what}");
}

fn wait_equal(relay: &Relay, e: &MockEngine) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let want = truth_as_live(&e.truth());
        let got = relay.seen.lock().unwrap().live.blocks.clone();
        if got == want {
            return;
        }
        assert!(Instant::now() < deadline, "relay never equalled the truth:\n got {got:?}\nwant {want:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn traffic(e: &MockEngine, rank: u32, src: &mut RandomSource, n: usize) {
    for _ in 0..n {
        let req = src.next_request().unwrap();
        e.serve_request(rank, &req, false).unwrap();
    }
}

/// Serves requests on `rank` until the engine has given out seq `next_seq - 1` (a request the
/// cache already holds publishes nothing).
fn traffic_until(e: &MockEngine, rank: u32, src: &mut RandomSource, next_seq: u64) {
    while e.stats(rank).unwrap().next_seq < next_seq {
        traffic(e, rank, src, 1);
        e.flush().unwrap();
    }
    assert_eq!(e.stats(rank).unwrap().next_seq, next_seq);
}

/// Waits until the relay's SUB sockets receive: publishes a probe-free request stream until
/// the relay has seen a batch of every rank.
fn warm_up(relay: &Relay, e: &MockEngine, src: &mut RandomSource) {
    for r in 0..e.dp_size() {
        wait_for("the relay to see rank traffic", || {
            traffic(e, r, src, 1);
            std::thread::sleep(Duration::from_millis(10));
            relay.seen.lock().unwrap().order.iter().any(|(rank, _)| *rank == r)
        });
    }
    wait_equal(relay, e);
}

fn controls_of(relay: &Relay, rank: u32) -> Vec<ControlKind> {
    relay.seen.lock().unwrap().controls.iter().filter(|(r, _)| *r == rank).map(|(_, k)| k.clone()).collect()
}

/// Waits until the rank's health is `h` and the relay has handed on `n` controls for it (the
/// status is updated before the control reaches the committer's side of the channel).
fn wait_health(relay: &Relay, rank: u32, h: &str, n: usize) {
    wait_for("rank health and controls", || relay.health(rank) == h && controls_of(relay, rank).len() >= n);
}

#[test]
fn twenty_batches_dropped_on_the_wire_are_refilled_and_state_equals_truth() {
    let e = engine(vllm(), 1, true, 10_000);
    let relay = Relay::start(relay_cfg(&e), BTreeMap::new());
    let mut src = RandomSource::new(1, 4, 6);
    warm_up(&relay, &e, &mut src);
    let before = relay.status(0);
    e.drop_on_wire(0, 20).unwrap();
    traffic(&e, 0, &mut src, 25);
    wait_equal(&relay, &e);
    let after = relay.status(0);
    assert_eq!(after.refilled - before.refilled, 20);
    assert_eq!(after.lost, 0);
    assert_eq!(relay.health(0), "ok");
    // In order, no hole.
    let order = relay.seen.lock().unwrap().order.clone();
    assert!(order.windows(2).all(|w| w[1].1 == w[0].1 + 1), "{order:?}");
    assert!(controls_of(&relay, 0).is_empty());
}

#[test]
fn gap_beyond_the_replay_buffer_marks_the_rank_degraded_until_a_clear() {
    let e = engine(vllm(), 1, true, 10_000);
    let relay = Relay::start(relay_cfg(&e), BTreeMap::new());
    let mut src = RandomSource::new(2, 4, 6);
    warm_up(&relay, &e, &mut src);
    e.lose(0, 3).unwrap();
    traffic(&e, 0, &mut src, 5);
    wait_health(&relay, 0, "degraded", 1);
    assert_eq!(relay.status(0).lost, 3);
    assert!(
        matches!(&controls_of(&relay, 0)[..], [ControlKind::RankDegraded { reason }] if reason.contains("3 batches"))
    );
    e.clear(0).unwrap();
    traffic(&e, 0, &mut src, 3);
    wait_health(&relay, 0, "ok", 2);
    assert!(matches!(controls_of(&relay, 0).last(), Some(ControlKind::RankRecovered)));
    wait_equal(&relay, &e);
}

#[test]
fn publisher_restart_resets_that_rank_only() {
    let e = engine(vllm(), 4, true, 10_000);
    let relay = Relay::start(relay_cfg(&e), BTreeMap::new());
    let mut src = RandomSource::new(3, 4, 8);
    warm_up(&relay, &e, &mut src);
    for r in 0..4 {
        traffic(&e, r, &mut src, 5);
    }
    wait_equal(&relay, &e);
    e.restart(2).unwrap();
    // The new publisher's first batches may precede the SUB's reconnection: they are refilled.
    for r in 0..4 {
        traffic(&e, r, &mut src, 5);
    }
    wait_equal(&relay, &e);
    for r in [0, 1, 3] {
        assert!(controls_of(&relay, r).is_empty(), "rank {r}");
        assert_eq!(relay.status(r).restarts, 0);
    }
    assert!(matches!(&controls_of(&relay, 2)[..], [ControlKind::RankReset { .. }]));
    assert_eq!(relay.status(2).restarts, 1);
}

#[test]
fn relay_started_after_the_engine_primes_from_replay_and_equals_truth() {
    let e = engine(sglang(), 2, true, 10_000);
    let mut src = RandomSource::new(4, 4, 6);
    for r in 0..2 {
        traffic(&e, r, &mut src, 30);
    }
    e.flush().unwrap();
    let relay = Relay::start(relay_cfg(&e), BTreeMap::new());
    wait_equal(&relay, &e);
    let s = relay.seen.lock().unwrap();
    assert_eq!(s.refilled, e.stats(0).unwrap().next_seq + e.stats(1).unwrap().next_seq);
    assert!(s.controls.is_empty(), "{:?}", s.controls);
}

#[test]
fn priming_from_a_buffer_that_no_longer_starts_at_zero_marks_the_rank_incomplete() {
    let e = engine(vllm(), 1, true, 10);
    let mut src = RandomSource::new(5, 4, 6);
    traffic(&e, 0, &mut src, 30);
    // Every batch is in the replay buffer before the relay asks for it.
    e.flush().unwrap();
    let relay = Relay::start(relay_cfg(&e), BTreeMap::new());
    wait_health(&relay, 0, "incomplete", 1);
    let c = controls_of(&relay, 0);
    assert!(matches!(&c[..], [ControlKind::RankIncomplete { reason }] if reason.contains("starts at seq 20")), "{c:?}");
    // It holds no stale block: everything it holds is in the truth.
    wait_for("10 batches applied", || relay.seen.lock().unwrap().batches == 10);
    let want = truth_as_live(&e.truth());
    for (k, set) in &relay.seen.lock().unwrap().live.blocks {
        for h in set.keys() {
            assert!(want.get(k).is_some_and(|w| w.contains_key(h)), "stale block {h}");
        }
    }
    e.clear(0).unwrap();
    wait_for("recovered", || relay.health(0) == "ok");
    wait_equal(&relay, &e);
}

#[test]
fn garbage_frames_are_counted_and_nothing_else_is_lost() {
    let e = engine(vllm(), 1, true, 10_000);
    let relay = Relay::start(relay_cfg(&e), BTreeMap::new());
    let mut src = RandomSource::new(6, 4, 6);
    warm_up(&relay, &e, &mut src);
    for g in Garbage::ALL {
        e.garbage(0, g).unwrap();
        traffic(&e, 0, &mut src, 2);
    }
    wait_equal(&relay, &e);
    let st = relay.status(0);
    // wrong frame count, short seq, not msgpack, truncated batch: one each.
    assert_eq!(st.message_errors, 4);
    assert_eq!(relay.seen.lock().unwrap().drops.get("invalid_block_hashes"), Some(&1));
    // The rank's status counts them by reason too (Status shows them as counters): the bad hash,
    // and the event cut off by the truncated batch.
    assert_eq!(st.dropped.0, BTreeMap::from([("invalid_block_hashes", 1), ("truncated_event", 1)]));
    assert_eq!(st.lost, 0);
    assert_eq!(relay.health(0), "ok");
}

#[test]
fn a_lost_tail_is_found_while_the_rank_is_quiet() {
    let e = engine(vllm(), 1, true, 10_000);
    let relay = Relay::start(relay_cfg(&e), BTreeMap::new());
    let mut src = RandomSource::new(7, 4, 6);
    warm_up(&relay, &e, &mut src);
    let before = relay.status(0);
    e.drop_on_wire(0, 2).unwrap();
    traffic(&e, 0, &mut src, 2);
    wait_equal(&relay, &e);
    let after = relay.status(0);
    assert!(after.tail_probes > before.tail_probes);
    assert_eq!(after.refilled - before.refilled, 2);
    assert_eq!(after.gaps - before.gaps, 1);
    assert_eq!(after.batches - before.batches, 2);
}

#[test]
fn a_batch_a_tail_probe_reads_before_its_live_copy_is_no_gap() {
    let e = engine(vllm(), 1, true, 10_000);
    let relay = Relay::start(relay_cfg(&e), BTreeMap::new());
    let mut src = RandomSource::new(9, 4, 6);
    warm_up(&relay, &e, &mut src);
    e.flush().unwrap();
    let (next, requests) = (e.stats(0).unwrap().next_seq, e.stats(0).unwrap().replay_requests);
    let before = relay.status(0);
    let seen_before = relay.seen.lock().unwrap().order.len();
    // The next batch is in the replay buffer at once and on the wire only once the replay has
    // answered a request: the relay's tail probe of the quiet rank reads it there first.
    e.wire_after_replay(0, 1).unwrap();
    traffic_until(&e, 0, &mut src, next + 1);
    wait_equal(&relay, &e);
    wait_for("the live copy", || e.stats(0).unwrap().sent == next + 1);
    let after = relay.status(0);
    assert!(e.stats(0).unwrap().replay_requests > requests);
    assert!(after.tail_probes > before.tail_probes);
    // Taken from the live socket, once; no gap, nothing refilled.
    assert_eq!(after.last_seq, Some(next));
    assert_eq!((after.gaps, after.refilled, after.lost), (before.gaps, before.refilled, 0));
    assert_eq!(after.batches, before.batches + 1);
    assert_eq!(relay.seen.lock().unwrap().order[seen_before..], [(0, next)]);
    assert_eq!(relay.health(0), "ok");
}

#[test]
fn a_tail_probe_refills_only_what_the_live_socket_does_not_deliver() {
    let Armed { e, relay, mut src, next, before, seen_before } = Armed::start(10, |_| {});
    // Batch `next` reaches the wire right after the probe's replay; `next + 1` never does.
    e.wire_after_replay(0, 1).unwrap();
    e.drop_on_wire(0, 1).unwrap();
    traffic_until(&e, 0, &mut src, next + 2);
    wait_equal(&relay, &e);
    wait_for("the last batch", || relay.status(0).last_seq == Some(next + 1));
    let after = relay.status(0);
    assert_eq!((after.gaps, after.refilled, after.lost), (before.gaps + 1, before.refilled + 1, 0));
    assert_eq!(after.batches, before.batches + 2);
    assert_eq!(relay.seen.lock().unwrap().order[seen_before..], [(0, next), (0, next + 1)]);
    assert_eq!(relay.seen.lock().unwrap().refilled, before.refilled + 1);
}

#[test]
fn without_a_replay_endpoint_gaps_are_counted_and_the_rank_degraded() {
    let e = engine(vllm(), 1, false, 10_000);
    let relay = Relay::start(relay_cfg(&e), BTreeMap::new());
    let mut src = RandomSource::new(8, 4, 6);
    // Without replay, the batches published before the SUB joined are lost too (the rank is
    // then incomplete): only count what this test drops.
    wait_for("the relay to see traffic", || {
        traffic(&e, 0, &mut src, 1);
        std::thread::sleep(Duration::from_millis(10));
        relay.status(0).last_seq.is_some()
    });
    let before = relay.status(0);
    e.drop_on_wire(0, 4).unwrap();
    traffic(&e, 0, &mut src, 6);
    wait_for("degraded", || {
        relay.health(0) == "degraded" && matches!(controls_of(&relay, 0).last(), Some(ControlKind::RankDegraded { .. }))
    });
    wait_for("all batches", || relay.status(0).last_seq == Some(e.stats(0).unwrap().next_seq - 1));
    let st = relay.status(0);
    assert_eq!((st.gaps - before.gaps, st.lost - before.lost), (1, 4));
    assert!(
        matches!(controls_of(&relay, 0).last(), Some(ControlKind::RankDegraded { reason }) if reason.contains("no replay endpoint"))
    );
}

/// A one-rank engine with a replay socket and a relay on it, warmed up, and where the rank
/// stood just before a test's faults.
struct Armed {
    e: MockEngine,
    relay: Relay,
    src: RandomSource,
    /// The engine's next seq: the first batch the faults reach.
    next: u64,
    before: kv_relay::ingest::RankStatus,
    /// How many batches the relay had handed on.
    seen_before: usize,
}

impl Armed {
    fn start(seed: u64, tune: impl FnOnce(&mut IngestConfig)) -> Armed {
        let e = engine(vllm(), 1, true, 10_000);
        let mut cfg = relay_cfg(&e);
        tune(&mut cfg);
        let relay = Relay::start(cfg, BTreeMap::new());
        let mut src = RandomSource::new(seed, 4, 6);
        warm_up(&relay, &e, &mut src);
        e.flush().unwrap();
        let next = e.stats(0).unwrap().next_seq;
        let before = relay.status(0);
        let seen_before = relay.seen.lock().unwrap().order.len();
        Armed { e, relay, src, next, before, seen_before }
    }
}

/// The seqs the relay handed on after its first `seen_before` batches, in order.
fn seqs_since(relay: &Relay, seen_before: usize) -> Vec<u64> {
    relay.seen.lock().unwrap().order[seen_before..].iter().map(|o| o.1).collect()
}

/// The reasons of every control of `rank`, each of which must be a degraded event.
fn degraded_reasons(relay: &Relay, rank: u32) -> Vec<String> {
    controls_of(relay, rank)
        .into_iter()
        .map(|k| match k {
            ControlKind::RankDegraded { reason } => reason,
            other => panic!("not a degraded event: {other:?}"),
        })
        .collect()
}

/// Two batches only in the replay buffer, then one past `max_message_bytes` (64 KiB: it drops
/// the SUB's connection, and the DEALER's when a replay reaches it), then three more: the
/// refused batch is the one lost, the five around it are refilled or live, in order. With
/// `by_probe`, the three are only in the replay buffer too, so the quiet rank's tail probe
/// finds them (a second after the last live batch: everything is published well before); else
/// more follow until the replaced SUB takes one live, and its gap finds them.
fn a_refused_batch_is_lost_alone(by_probe: bool) {
    let Armed { e, relay, mut src, next, before, seen_before } = Armed::start(11, |cfg| {
        cfg.max_message_bytes = 64 << 10;
        cfg.tail_probe = Duration::from_secs(if by_probe { 1 } else { 600 });
    });
    e.drop_on_wire(0, 2).unwrap();
    traffic_until(&e, 0, &mut src, next + 2);
    let big = vec![EngineEvent::large_store(4_000)];
    let size = encode_batch(&vllm(), &Batch { ts: 0.0, events: big.clone(), dp_rank: Some(0) }).len();
    assert!(size > 100_000, "{size}");
    e.publish(0, big).unwrap();
    if by_probe {
        e.drop_on_wire(0, 3).unwrap();
    }
    let mut end = next + 6;
    traffic_until(&e, 0, &mut src, end);
    if !by_probe {
        // Until the reconnected SUB takes one live (the ones before are refilled by its gap).
        wait_for("a live batch", || {
            if relay.status(0).last_seq == Some(end - 1) {
                return true;
            }
            end += 1;
            traffic_until(&e, 0, &mut src, end);
            std::thread::sleep(Duration::from_millis(50));
            false
        });
    }
    // The status is updated before the batch reaches the collector: wait for both.
    wait_for("the last batch", || {
        relay.status(0).last_seq == Some(end - 1) && relay.seen.lock().unwrap().order.last() == Some(&(0, end - 1))
    });
    wait_health(&relay, 0, "degraded", 1);
    let after = relay.status(0);
    assert_eq!(after.lost - before.lost, 1);
    assert_eq!(after.replay_cuts - before.replay_cuts, 1);
    assert_eq!(after.disconnects - before.disconnects, 1);
    assert_eq!(after.batches - before.batches, end - next - 1);
    assert_eq!(after.gaps - before.gaps, 1);
    assert_eq!(after.tail_probes > before.tail_probes, by_probe);
    let order = seqs_since(&relay, seen_before);
    let want: Vec<u64> = (next..end).filter(|&s| s != next + 2).collect();
    assert_eq!(order, want);
    let c = controls_of(&relay, 0);
    assert!(
        matches!(&c[..], [ControlKind::RankDegraded { reason }]
            if reason.contains(&format!("seq {}..{}", next + 2, next + 2)) && reason.contains("max_message_bytes, 65536 bytes")),
        "{c:?}"
    );
    // A clear makes the rank known again: equal to the engine, the refused batch's blocks gone.
    e.clear(0).unwrap();
    traffic(&e, 0, &mut src, 3);
    wait_health(&relay, 0, "ok", 2);
    wait_equal(&relay, &e);
}

#[test]
fn a_batch_over_max_message_bytes_is_lost_alone_and_a_tail_probe_refills_the_rest() {
    a_refused_batch_is_lost_alone(true);
}

#[test]
fn a_batch_over_max_message_bytes_is_lost_alone_and_the_gap_refills_the_rest() {
    a_refused_batch_is_lost_alone(false);
}

/// Ten batches only in the replay buffer, then a live one: the gap's replay answer stops after
/// four (the engine stops answering; no end marker). The relay keeps the four once its replay
/// times out, counts the other six lost with that reason, and hands on the live one after
/// them. With `forgotten`, the buffer has also forgotten the first that many of the ten before
/// the relay asks: its answer starts past the gap, and those are lost beyond the buffer, in a
/// hole of their own, not to the timeout.
fn a_stalled_replay_keeps_what_came(forgotten: u64, seed: u64) {
    let Armed { e, relay, mut src, next, before, seen_before } = Armed::start(seed, |cfg| {
        cfg.replay_timeout = Duration::from_millis(300);
        cfg.tail_probe = Duration::from_secs(600);
    });
    e.drop_on_wire(0, 10).unwrap();
    traffic_until(&e, 0, &mut src, next + 10);
    e.trim_buffer(0, (10 - forgotten) as usize).unwrap();
    e.stall_replay(0, 4).unwrap();
    traffic_until(&e, 0, &mut src, next + 11);
    wait_for("the live batch", || {
        relay.status(0).last_seq == Some(next + 10) && relay.seen.lock().unwrap().order.last() == Some(&(0, next + 10))
    });
    let mut want = Vec::new();
    if forgotten > 0 {
        want.push(format!(
            "{forgotten} batches (seq {next}..{}) lost beyond the engine's replay buffer",
            next + forgotten - 1
        ));
    }
    let stop = next + forgotten + 4;
    want.push(format!(
        "{} batches (seq {stop}..{}) lost: the replay ended before the engine sent them all \
         (the replay socket did not answer within replay_timeout_ms, 300)",
        next + 10 - stop,
        next + 9
    ));
    wait_health(&relay, 0, "degraded", want.len());
    let after = relay.status(0);
    assert_eq!(
        (after.lost - before.lost, after.gaps - before.gaps, after.batches - before.batches, after.replay_cuts),
        (6, 1, 5, before.replay_cuts)
    );
    let order = seqs_since(&relay, seen_before);
    assert_eq!(order, (next + forgotten..stop).chain([next + 10]).collect::<Vec<_>>());
    let reasons = degraded_reasons(&relay, 0);
    assert_eq!(reasons, want);
    // The next replay is answered whole; a clear makes the rank known again.
    e.clear(0).unwrap();
    traffic(&e, 0, &mut src, 3);
    wait_health(&relay, 0, "ok", want.len() + 1);
    wait_equal(&relay, &e);
}

#[test]
fn a_replay_that_stops_answering_keeps_what_came_and_loses_only_the_rest() {
    a_stalled_replay_keeps_what_came(0, 12);
}

#[test]
fn a_replay_that_starts_past_the_gap_and_stops_answering_says_why_each_hole_is_lost() {
    a_stalled_replay_keeps_what_came(3, 13);
}

/// One replay with both causes: of ten batches missed on the wire the third is over
/// `max_message_bytes`, so the answer is cut there, and the answer asked for past it stops after
/// three batches. The refused batch is lost to the cut and the last four to the timeout, each
/// hole with its own reason; the five around them are refilled in order.
#[test]
fn a_replay_cut_and_then_stalled_names_each_cause_for_its_own_hole() {
    let Armed { e, relay, mut src, next, before, seen_before } = Armed::start(14, |cfg| {
        cfg.max_message_bytes = 64 << 10;
        cfg.replay_timeout = Duration::from_millis(300);
        cfg.tail_probe = Duration::from_secs(600);
    });
    e.drop_on_wire(0, 10).unwrap();
    traffic_until(&e, 0, &mut src, next + 2);
    e.publish(0, vec![EngineEvent::large_store(4_000)]).unwrap();
    traffic_until(&e, 0, &mut src, next + 10);
    e.stall_replay_after(0, 1, 3).unwrap();
    traffic_until(&e, 0, &mut src, next + 11);
    wait_for("the live batch", || {
        relay.status(0).last_seq == Some(next + 10) && relay.seen.lock().unwrap().order.last() == Some(&(0, next + 10))
    });
    wait_health(&relay, 0, "degraded", 2);
    let after = relay.status(0);
    assert_eq!(
        (
            after.lost - before.lost,
            after.gaps - before.gaps,
            after.batches - before.batches,
            after.replay_cuts - before.replay_cuts,
            after.disconnects - before.disconnects
        ),
        (5, 1, 6, 1, 0)
    );
    let order = seqs_since(&relay, seen_before);
    assert_eq!(order, [next, next + 1, next + 3, next + 4, next + 5, next + 10]);
    let reasons = degraded_reasons(&relay, 0);
    assert_eq!(
        reasons,
        [
            format!(
                "1 batches (seq {0}..{0}) lost: the connection dropped while the engine sent them (a message over \
                 max_message_bytes, 65536 bytes, drops it)",
                next + 2
            ),
            format!(
                "4 batches (seq {}..{}) lost: the replay ended before the engine sent them all (the replay socket did \
                 not answer within replay_timeout_ms, 300)",
                next + 6,
                next + 9
            ),
        ]
    );
    e.clear(0).unwrap();
    traffic(&e, 0, &mut src, 3);
    wait_health(&relay, 0, "ok", 3);
    wait_equal(&relay, &e);
}

/// Runs a relay until it equals the truth after some traffic, stops it, and returns where it
/// stood (what the store would hand a restarted relay) and what it had applied.
fn run_relay_then_stop(e: &MockEngine, src: &mut RandomSource) -> (Resume, LiveBlocks) {
    let relay = Relay::start(relay_cfg(e), BTreeMap::new());
    warm_up(&relay, e, src);
    traffic(e, 0, src, 5);
    wait_equal(&relay, e);
    let st = relay.status(0);
    let resume = Resume { last_seq: st.last_seq.unwrap(), last_ts: st.last_ts.unwrap() };
    let before = relay.seen.lock().unwrap().live.clone();
    (resume, before)
}

#[test]
fn a_restarted_relay_resumes_the_same_publisher_from_its_last_seq() {
    let e = engine(vllm(), 1, true, 10_000);
    let mut src = RandomSource::new(9, 4, 6);
    let (resume, before) = run_relay_then_stop(&e, &mut src);
    traffic(&e, 0, &mut src, 7);
    let relay = Relay::start_with(relay_cfg(&e), BTreeMap::from([(0, resume)]), before);
    wait_equal(&relay, &e);
    let s = relay.seen.lock().unwrap();
    assert_eq!(s.order.first().map(|o| o.1), Some(resume.last_seq + 1));
    assert!(s.controls.is_empty(), "{:?}", s.controls);
}

#[test]
fn a_restarted_relay_resets_a_rank_whose_publisher_changed_meanwhile() {
    let e = engine(vllm(), 1, true, 10_000);
    let mut src = RandomSource::new(10, 4, 6);
    let (resume, before) = run_relay_then_stop(&e, &mut src);
    e.restart(0).unwrap();
    traffic(&e, 0, &mut src, 12);
    let relay = Relay::start_with(relay_cfg(&e), BTreeMap::from([(0, resume)]), before);
    wait_equal(&relay, &e);
    assert!(matches!(&controls_of(&relay, 0)[..], [ControlKind::RankReset { .. }]));
}

/// Waits until the relay has handed on every `pub` batch of the fixture (each exactly once).
fn wait_all_batches(relay: &Relay, f: &Fixture) {
    let mut per_rank: BTreeMap<u32, u64> = BTreeMap::new();
    for l in f.lines.iter().filter(|l| l.socket == "pub") {
        *per_rank.entry(l.dp_rank.unwrap_or(0)).or_default() += 1;
    }
    for (&rank, &n) in &per_rank {
        wait_for("every batch of the capture", || relay.status(rank).batches == n);
    }
}

/// What the hash check found on each rank: (checked, mismatched, skipped).
fn hash_counts(relay: &Relay, ranks: u32) -> Vec<(u64, u64, u64)> {
    (0..ranks)
        .map(|r| {
            let c = relay.status(r).hash_check.expect("the hash check is on");
            (c.checked, c.mismatched, c.skipped_total())
        })
        .collect()
}

/// Every capture and golden stream, played by the mock engine at full speed with the relay
/// already subscribed, leaves the relay's state equal to the manifest's expected live blocks
/// (copies counted) — through slow joiners, replay refills and vllm-restart's publisher restart.
/// With the engine's hash settings from the manifest, the relay's hash check finds no mismatch.
#[test]
fn captures_played_by_the_mock_engine_leave_the_relay_equal_to_each_manifest() {
    let names = fixtures::names();
    assert_eq!(names.len(), 22);
    let mut figures = Vec::new();
    for name in names {
        let f = Fixture::load(&name);
        let m = &f.manifest;
        let e = engine(f.wire(), f.ranks(), true, 10_000);
        let mut cfg = relay_cfg(&e);
        cfg.topic = String::new();
        let settings = f.hash_settings();
        cfg.hash_check = settings.as_ref().map(|h| Arc::new(h.check_config()));
        let relay = Relay::start(cfg, BTreeMap::new());
        let report =
            f.play(&e, |before| wait_for("the first publisher's batches", || relay.status(0).last_seq == Some(before)));
        // Every batch first: the state may pass through the final one before the stream ends.
        wait_all_batches(&relay, &f);
        let want = f.expected();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let got = relay.seen.lock().unwrap().live.blocks.clone();
            if got == want {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{name}: relay never equalled the manifest\n got {got:?}\nwant {want:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(report.restarts, m["counts"]["restarts_detected"].as_u64().unwrap_or(0), "{name}");
        let resets = relay
            .seen
            .lock()
            .unwrap()
            .controls
            .iter()
            .filter(|(_, k)| matches!(k, ControlKind::RankReset { .. }))
            .count() as u64;
        wait_for("the reset control", || {
            relay
                .seen
                .lock()
                .unwrap()
                .controls
                .iter()
                .filter(|(_, k)| matches!(k, ControlKind::RankReset { .. }))
                .count() as u64
                >= report.restarts
        });
        assert_eq!(resets.max(report.restarts), report.restarts, "{name}: resets");
        if settings.is_some() {
            figures.push((name.clone(), hash_counts(&relay, f.ranks())));
        } else {
            assert_eq!(relay.status(0).hash_check, None, "{name}");
        }
    }
    let want: Vec<(String, Vec<fixtures::CheckFigures>)> =
        fixtures::HASH_CHECK_FIGURES.iter().map(|(n, c)| (n.to_string(), c.to_vec())).collect();
    assert_eq!(figures, want);
}

/// A relay told another `PYTHONHASHSEED` than the engine's (vLLM), or another release (SGLang
/// 0.5.5's tuple hash instead of 0.5.23's chain), finds every block it checks mismatched, and
/// still hands every event on unchanged.
#[test]
fn a_wrong_hash_setting_makes_every_checked_block_a_mismatch_and_changes_nothing_else() {
    for (name, wrong, want) in
        [("vllm-basic", ("seed", "1"), (99, 99, 0)), ("sglang-eagle", ("version", "0.5.5"), (84, 84, 0))]
    {
        let f = Fixture::load(name);
        let e = engine(f.wire(), 1, true, 10_000);
        let mut cfg = relay_cfg(&e);
        cfg.topic = String::new();
        let mut settings = f.hash_settings().unwrap();
        match wrong {
            ("seed", s) => {
                assert_eq!(settings.seed.as_deref(), Some("0"));
                settings.seed = Some(s.into());
            }
            (_, v) => settings.version = v.into(),
        }
        cfg.hash_check = Some(Arc::new(settings.check_config()));
        let relay = Relay::start(cfg, BTreeMap::new());
        f.play(&e, |_| unreachable!("{name} has no restart"));
        wait_all_batches(&relay, &f);
        assert_eq!(hash_counts(&relay, 1), [want], "{name}");
        wait_for("the manifest's state", || relay.seen.lock().unwrap().live.blocks == f.expected());
    }
}
