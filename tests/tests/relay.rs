//! The whole daemon, in-process (`kv_relay::daemon::run`), beside the mock engine: a gRPC
//! subscriber rebuilds the engine's state exactly, and the engine's load arrives on batches and
//! on heartbeats, as does its liveness per rank.

use kv_relay::ctl::{self, Target};
use kv_relay::live::{LiveBlocks, LiveKey};
use kv_relay::model::{ControlKind, RecordBody};
use kv_relay::server::convert;
use kv_relay_proto::pb;
use kv_relay_testkit::client::start_engine_on_free_ports;
use kv_relay_testkit::daemon::{start_relay, start_relay_in};
use kv_relay_testkit::drills::harness::truth_as_live;
use kv_relay_testkit::engine::{EngineConfig, MockEngine};
use kv_relay_testkit::face::Fault;
use kv_relay_testkit::metrics::{http_post, Load as EngineLoad};
use kv_relay_testkit::traffic::{RandomSource, RequestSource};
use kv_relay_testkit::wire::{Engine, WireVersion};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What one subscriber rebuilt.
#[derive(Default)]
struct Rebuilt {
    live: LiveBlocks,
    last_cursor: u64,
    batches_with_load: u64,
    heartbeats_with_load: u64,
    heartbeat_load: Option<(u32, pb::Load)>,
    controls: Vec<ControlKind>,
}

fn apply(r: &mut Rebuilt, m: pb::SubscribeResponse) {
    use pb::subscribe_response::Message as M;
    match &m.message {
        Some(M::Heartbeat(h)) if h.load.is_some() => {
            r.heartbeats_with_load += 1;
            r.heartbeat_load = h.load.map(|l| (h.dp_rank, l));
        }
        Some(M::Heartbeat(_)) => {}
        Some(M::SnapshotBegin(_)) => r.live = LiveBlocks::new(),
        Some(M::SnapshotChunk(c)) => {
            for b in &c.blocks {
                let b = convert::snapshot_block_from_pb(b).unwrap();
                let key = LiveKey { dp_rank: b.dp_rank, tier: b.tier, group: b.group };
                r.live.blocks.entry(key).or_default().insert(b.hash, b.copies);
            }
        }
        Some(M::SnapshotEnd(e)) => r.last_cursor = e.cursor,
        Some(M::Batch(_)) | Some(M::Control(_)) => {
            let rec = convert::record_from_subscribe(&m).unwrap().unwrap();
            assert_eq!(rec.cursor, r.last_cursor + 1, "records arrive in cursor order with no hole");
            r.last_cursor = rec.cursor;
            match rec.body {
                RecordBody::Batch { batch, load, .. } => {
                    r.batches_with_load += u64::from(load.is_some());
                    r.live.apply(&batch);
                }
                RecordBody::Control(c) => {
                    if matches!(c.kind, ControlKind::RankReset { .. }) {
                        r.live.reset_rank(c.dp_rank);
                    }
                    r.controls.push(c.kind);
                }
            }
        }
        Some(M::Resync(x)) => panic!("unexpected resync: {x:?}"),
        None => {}
    }
}

fn engine(dp: u32) -> MockEngine {
    let mut cfg = EngineConfig::new(WireVersion::parse(Engine::Vllm, "0.32").unwrap());
    cfg.dp_size = dp;
    cfg.topic = "kv".into();
    cfg.block_size = 4;
    cfg.cache_blocks = 64;
    cfg.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
    start_engine_on_free_ports(cfg, true)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscriber_rebuilds_the_engine_state_and_sees_its_load_on_batches_and_heartbeats() {
    let e = engine(2);
    for r in 0..2 {
        e.set_load(r, EngineLoad { running: 3 + r, waiting: 1, kv_usage: 0.25 }).unwrap();
    }
    let mut src = RandomSource::new(11, 4, 8);
    // Published before the relay starts: primed from the replay socket.
    for _ in 0..10 {
        for r in 0..2 {
            e.serve_request(r, &src.next_request().unwrap(), false).unwrap();
        }
    }
    let d = start_relay(&e, &[]).await;
    // Let one load scrape happen before live traffic, so batches carry it.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut client = ctl::connect(&Target { url: d.url.clone(), ..Target::default() }).await.unwrap();
    let req = pb::SubscribeRequest { allow_snapshot: true, ..Default::default() };
    let mut stream = client.subscribe(req).await.unwrap().into_inner();
    for _ in 0..20 {
        for r in 0..2 {
            e.serve_request(r, &src.next_request().unwrap(), false).unwrap();
        }
    }
    e.drop_on_wire(1, 5).unwrap();
    for _ in 0..8 {
        e.serve_request(1, &src.next_request().unwrap(), false).unwrap();
    }
    let mut r = Rebuilt::default();
    let want = truth_as_live(&e.truth());
    let deadline = Instant::now() + Duration::from_secs(20);
    // Traffic has stopped: the engine's load is stable, and a heartbeat must carry it exactly.
    let engine_load = |rank: u32| {
        let l = e.load(rank).unwrap();
        (f64::from(l.running), f64::from(l.waiting), l.kv_usage)
    };
    let hb_matches =
        |r: &Rebuilt| r.heartbeat_load.is_some_and(|(rank, l)| (l.running, l.waiting, l.kv_usage) == engine_load(rank));
    while r.live.blocks != want || !hb_matches(&r) {
        assert!(Instant::now() < deadline, "never equal: got {:?}\nwant {want:?}", r.live.blocks);
        let m = tokio::time::timeout(Duration::from_secs(5), stream.message()).await.unwrap().unwrap().unwrap();
        apply(&mut r, m);
    }
    assert!(r.batches_with_load > 0);
    let (rank, hb) = r.heartbeat_load.unwrap();
    assert_eq!((hb.running, hb.waiting), (f64::from(3 + rank), 1.0));
    assert!(r.controls.is_empty(), "{:?}", r.controls);
    // The relay's own snapshot agrees.
    let s = client.status(pb::StatusRequest {}).await.unwrap().into_inner();
    assert_eq!(s.newest_cursor, r.last_cursor);
    assert_eq!(s.ranks.len(), 2);
    drop(stream);
    d.stop().await;
}

/// Publishes `n` requests round-robin over the engine's ranks, then waits until the relay has
/// committed every batch the engine published; returns the relay's newest cursor.
async fn traffic_and_settle(e: &MockEngine, client: &mut ctl::Client, src: &mut RandomSource, n: usize) -> u64 {
    for i in 0..n {
        let r = (i as u32) % e.dp_size();
        e.serve_request(r, &src.next_request().unwrap(), false).unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let s = client.status(pb::StatusRequest {}).await.unwrap().into_inner();
        let done = (0..e.dp_size()).all(|r| {
            // The publisher thread counts asynchronously: nothing counted yet is not settled.
            let Some(want) = e.stats(r).unwrap().next_seq.checked_sub(1) else { return false };
            s.ranks.iter().any(|x| x.dp_rank == r && x.last_engine_seq == want)
        });
        if done {
            return s.newest_cursor;
        }
        assert!(Instant::now() < deadline, "the relay did not catch up: {s:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn record_of(m: pb::SubscribeResponse) -> Option<(u64, pb::subscribe_response::Message)> {
    use pb::subscribe_response::Message as M;
    match m.message? {
        M::Batch(b) => Some((b.cursor, M::Batch(b))),
        M::Control(c) => Some((c.cursor, M::Control(c))),
        M::Heartbeat(_) => None,
        other => panic!("unexpected {other:?}"),
    }
}

/// With the mock engine feeding the daemon: a subscriber that disconnects and resumes at seeded
/// random points, at least 100 times, receives exactly the sequence an uninterrupted subscriber
/// receives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resuming_at_random_points_receives_what_an_uninterrupted_subscriber_receives() {
    let e = engine(2);
    // Over 100 subscriptions in a few seconds: above the default per-client rate limit.
    let d = start_relay(&e, &["--server-rate-per-second", "10000", "--server-rate-burst", "10000"]).await;
    let mut client = ctl::connect(&Target { url: d.url.clone(), ..Target::default() }).await.unwrap();
    let mut src = RandomSource::new(21, 4, 8);
    let newest = traffic_and_settle(&e, &mut client, &mut src, 400).await;
    assert!(newest >= 400, "{newest}");
    let st = client.status(pb::StatusRequest {}).await.unwrap().into_inner();

    let mut whole = Vec::new();
    let mut s = client.subscribe(pb::SubscribeRequest::default()).await.unwrap().into_inner();
    while whole.len() < newest as usize {
        if let Some(r) = record_of(s.message().await.unwrap().unwrap()) {
            whole.push(r);
        }
    }
    drop(s);

    let mut rng = kv_relay_testkit::traffic::Rng::new(5);
    let mut resumed = Vec::new();
    let mut sessions = 0;
    while resumed.len() < newest as usize {
        let (after, incarnation) = match resumed.last() {
            Some((c, pb::subscribe_response::Message::Batch(b))) => (*c, b.incarnation),
            Some((c, pb::subscribe_response::Message::Control(x))) => (*c, x.incarnation),
            _ => (0, 0),
        };
        let req = pb::SubscribeRequest {
            epoch: st.epoch,
            after_cursor: after,
            incarnation,
            allow_snapshot: false,
            ..Default::default()
        };
        let mut s = client.subscribe(req).await.unwrap().into_inner();
        sessions += 1;
        let take = 1 + rng.below(6) as usize;
        let mut got = 0;
        while got < take && resumed.len() < newest as usize {
            if let Some(r) = record_of(s.message().await.unwrap().unwrap()) {
                resumed.push(r);
                got += 1;
            }
        }
    }
    assert!(sessions >= 100, "only {sessions} sessions");
    assert_eq!(resumed, whole);
    d.stop().await;
}

/// With the mock engine feeding the daemon: a subscriber whose cursor predates the history gets
/// a snapshot then batches, and rebuilds exactly the engine's truth; refused without snapshots.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cursor_older_than_the_history_gets_a_snapshot_and_rebuilds_the_engine_truth() {
    let e = engine(2);
    let d = start_relay(&e, &["--history-batches", "20"]).await;
    let mut client = ctl::connect(&Target { url: d.url.clone(), ..Target::default() }).await.unwrap();
    let mut src = RandomSource::new(22, 4, 8);
    traffic_and_settle(&e, &mut client, &mut src, 120).await;
    let st = client.status(pb::StatusRequest {}).await.unwrap().into_inner();
    assert!(st.oldest_cursor > 2, "{st:?}");
    let old =
        pb::SubscribeRequest { epoch: st.epoch, after_cursor: 1, incarnation: st.incarnation, ..Default::default() };

    let refused = client.subscribe(old.clone()).await;
    let code = match refused {
        Err(s) => s.code(),
        Ok(r) => r.into_inner().message().await.unwrap_err().code(),
    };
    assert_eq!(code, tonic::Code::OutOfRange);

    let mut s = client.subscribe(pb::SubscribeRequest { allow_snapshot: true, ..old }).await.unwrap().into_inner();
    let first = s.message().await.unwrap().unwrap();
    assert!(matches!(first.message, Some(pb::subscribe_response::Message::SnapshotBegin(_))), "{first:?}");
    let mut r = Rebuilt::default();
    apply(&mut r, first);
    loop {
        let m = tokio::time::timeout(Duration::from_secs(5), s.message()).await.unwrap().unwrap().unwrap();
        let end = matches!(m.message, Some(pb::subscribe_response::Message::SnapshotEnd(_)));
        apply(&mut r, m);
        if end {
            break;
        }
    }
    // More traffic after the snapshot (less than the history holds): applied on top.
    traffic_and_settle(&e, &mut client, &mut src, 8).await;
    let want = truth_as_live(&e.truth());
    let deadline = Instant::now() + Duration::from_secs(20);
    while r.live.blocks != want {
        assert!(Instant::now() < deadline, "never equal: got {:?}\nwant {want:?}", r.live.blocks);
        let m = tokio::time::timeout(Duration::from_secs(5), s.message()).await.unwrap().unwrap().unwrap();
        apply(&mut r, m);
    }
    drop(s);
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_relay_reports_each_ranks_last_engine_seq_before_new_batches() {
    let e = engine(2);
    let d = start_relay(&e, &[]).await;
    let mut client = ctl::connect(&Target { url: d.url.clone(), ..Target::default() }).await.unwrap();
    let mut src = RandomSource::new(31, 4, 8);
    traffic_and_settle(&e, &mut client, &mut src, 10).await;
    let seqs = |s: &pb::StatusResponse| s.ranks.iter().map(|r| (r.dp_rank, r.last_engine_seq)).collect::<Vec<_>>();
    let before = client.status(pb::StatusRequest {}).await.unwrap().into_inner();
    let want: Vec<(u32, u64)> = (0..2).map(|r| (r, e.stats(r).unwrap().next_seq - 1)).collect();
    assert_eq!(seqs(&before), want);
    let dir = d.stop_keeping_state().await;
    // Restarted with the engine quiet: the status says where each rank stood, not 0.
    let d = start_relay_in(&e, dir, &[]).await;
    let mut client = ctl::connect(&Target { url: d.url.clone(), ..Target::default() }).await.unwrap();
    let after = client.status(pb::StatusRequest {}).await.unwrap().into_inner();
    assert_eq!(after.newest_cursor, before.newest_cursor);
    assert_eq!(seqs(&after), want);
    d.stop().await;
}

/// Each rank's engine liveness in `Status`: its state and reason (0 and empty: none).
async fn liveness_of(client: &mut ctl::Client) -> Vec<(i32, String)> {
    let s = client.status(pb::StatusRequest {}).await.unwrap().into_inner();
    s.ranks.iter().map(|r| r.liveness.as_ref().map_or((0, String::new()), |l| (l.state, l.reason.clone()))).collect()
}

async fn wait_liveness(
    client: &mut ctl::Client,
    want: [pb::EngineLiveness; 2],
    within: Duration,
) -> Vec<(i32, String)> {
    let deadline = Instant::now() + within;
    loop {
        let got = liveness_of(client).await;
        if got.iter().map(|g| g.0).eq(want.iter().map(|w| *w as i32)) {
            return got;
        }
        assert!(Instant::now() < deadline, "liveness never became {want:?}: {got:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engines_liveness_per_rank_rides_on_status_heartbeats_and_batches() {
    use pb::EngineLiveness::{Alive, Stopped, Unreachable, Wedged};
    let e = Arc::new(engine(2));
    e.serve_completions();
    let face = e.face().unwrap();
    let d = start_relay(&e, &["--engine-wedge-secs", "1", "--engine-health-timeout-ms", "300"]).await;
    let mut client = ctl::connect(&Target { url: d.url.clone(), ..Target::default() }).await.unwrap();
    let got = wait_liveness(&mut client, [Alive, Alive], Duration::from_secs(10)).await;
    assert_eq!(got, vec![(Alive as i32, String::new()), (Alive as i32, String::new())]);
    let s = client.status(pb::StatusRequest {}).await.unwrap().into_inner();
    assert_eq!(s.engine_url, e.url().unwrap());

    // A batch committed now carries the rank's liveness; a heartbeat does too.
    let mut stream = client
        .subscribe(pb::SubscribeRequest { allow_snapshot: true, ..Default::default() })
        .await
        .unwrap()
        .into_inner();
    let addr = e.metrics_addr().unwrap();
    let post = move |rank: &'static str| {
        std::thread::spawn(move || {
            http_post(addr, "/v1/completions", &[("X-data-parallel-rank", rank)], r#"{"prompt": [1,2,3,4,5,6,7,8]}"#)
                .unwrap()
        })
    };
    assert_eq!(post("1").join().unwrap().0, 200);
    let (mut batch_seen, mut heartbeat_seen) = (None, None);
    let deadline = Instant::now() + Duration::from_secs(10);
    while batch_seen.is_none() || heartbeat_seen.is_none() {
        assert!(Instant::now() < deadline, "no batch or heartbeat with liveness");
        let m = tokio::time::timeout(Duration::from_secs(5), stream.message()).await.unwrap().unwrap().unwrap();
        match m.message {
            Some(pb::subscribe_response::Message::Batch(b)) if b.dp_rank == 1 => {
                batch_seen = Some(b.liveness.map(|l| l.state));
            }
            Some(pb::subscribe_response::Message::Heartbeat(h)) => heartbeat_seen = Some(h.liveness.map(|l| l.state)),
            _ => {}
        }
    }
    assert_eq!((batch_seen, heartbeat_seen), (Some(Some(Alive as i32)), Some(Some(Alive as i32))));
    drop(stream);

    // Health answering 503: unreachable, with the answer as the reason; then alive again.
    face.set_fault(Fault::Unhealthy).unwrap();
    let got = wait_liveness(&mut client, [Unreachable, Unreachable], Duration::from_secs(5)).await;
    assert!(got[0].1.contains("503"), "{got:?}");
    face.set_fault(Fault::None).unwrap();
    wait_liveness(&mut client, [Alive, Alive], Duration::from_secs(5)).await;

    // Wedged: a completion hangs on rank 1 (it runs, nothing progresses): rank 1 wedged after
    // the wedge time, rank 0 (idle) alive; released, it progresses and is alive again.
    face.set_fault(Fault::Wedged).unwrap();
    let hung = post("1");
    let got = wait_liveness(&mut client, [Alive, Wedged], Duration::from_secs(8)).await;
    assert!(got[1].1.starts_with("requests running, no progress for "), "{got:?}");
    face.set_fault(Fault::None).unwrap();
    assert_eq!(hung.join().unwrap().0, 200);
    wait_liveness(&mut client, [Alive, Alive], Duration::from_secs(5)).await;

    // Nothing listens: stopped; the listener back: alive.
    face.set_fault(Fault::ListenerGone).unwrap();
    let got = wait_liveness(&mut client, [Stopped, Stopped], Duration::from_secs(5)).await;
    assert!(got[0].1.ends_with("/health: connection refused"), "{got:?}");
    face.set_fault(Fault::None).unwrap();
    wait_liveness(&mut client, [Alive, Alive], Duration::from_secs(5)).await;
    d.stop().await;
}
