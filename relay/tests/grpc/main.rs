//! The gRPC server against a real store, on a real socket (`127.0.0.1:0`): resume, snapshots,
//! slow subscribers, limits, TLS, token, health and reflection. The store is fed directly with
//! generated, seeded batches.

use kv_relay::live::{LiveBlocks, LiveKey};
use kv_relay::model::{Batch, Block, Control, ControlKind, Event, Load, Record, RecordBody, Removed, Stored, Tier};
use kv_relay::server::convert::{record_from_subscribe, snapshot_block_from_pb};
use kv_relay::server::{notice_channel, serve, Notice, RelayStatusHandle, ServerConfig, TlsConfig, RETRY_AFTER_MS};
use kv_relay::store::{HistoryLimits, Store, StoreConfig};
use kv_relay_proto::pb;
use kv_relay_proto::pb::relay_client::RelayClient;
use kv_relay_proto::pb::subscribe_response::Message as M;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::sync::{broadcast, oneshot};
use tokio::task::JoinHandle;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};
use tonic::{Code, Streaming};

/// Generous: nothing here should take more than a fraction of it.
const T: Duration = Duration::from_secs(20);

// ---- fixtures ---------------------------------------------------------------------------------

/// Generated engine traffic with its truth: which copies are live, so removals hit live blocks.
struct Traffic {
    rng: StdRng,
    live: Vec<(u32, Tier, u32, u64)>,
    seq: BTreeMap<u32, u64>,
    next_hash: u64,
    ranks: u32,
}

impl Traffic {
    fn new(seed: u64, ranks: u32) -> Self {
        Traffic { rng: StdRng::seed_from_u64(seed), live: Vec::new(), seq: BTreeMap::new(), next_hash: 1, ranks }
    }

    fn body(&mut self) -> RecordBody {
        let dp_rank = self.rng.random_range(0..self.ranks);
        if self.rng.random_ratio(1, 40) {
            self.live.retain(|l| l.0 != dp_rank);
            self.seq.insert(dp_rank, 0);
            return RecordBody::Control(Control { dp_rank, kind: ControlKind::RankReset { reason: "restart".into() } });
        }
        let mut events = Vec::new();
        for _ in 0..self.rng.random_range(1..4) {
            let mine: Vec<usize> = (0..self.live.len()).filter(|&i| self.live[i].0 == dp_rank).collect();
            if !mine.is_empty() && self.rng.random_ratio(1, 3) {
                let (_, tier, group, hash) = self.live.swap_remove(mine[self.rng.random_range(0..mine.len())]);
                events.push(Event::Removed(Removed { tier, group, block_hashes: vec![hash], ownership: None }));
            } else {
                let tier = if self.rng.random_ratio(1, 4) { Tier::Host } else { Tier::Device };
                let group = self.rng.random_range(0..2);
                let mut blocks = Vec::new();
                for _ in 0..self.rng.random_range(1..5) {
                    // Now and then store a hash that is already live: a second physical copy.
                    let hash = match self.live.iter().find(|l| l.0 == dp_rank && l.1 == tier && l.2 == group) {
                        Some(l) if self.rng.random_ratio(1, 5) => l.3,
                        _ => {
                            self.next_hash += 1;
                            self.next_hash.wrapping_mul(0x9e37_79b9_7f4a_7c15)
                        }
                    };
                    self.live.push((dp_rank, tier.clone(), group, hash));
                    blocks.push(Block { hash, token_ids: vec![1, 2, 3, 4], extra_keys: None });
                }
                events.push(Event::Stored(Stored::plain(tier, group, 4, blocks)));
            }
        }
        let seq = self.seq.entry(dp_rank).or_insert(0);
        *seq += 1;
        let load = Load { running: 1.0, waiting: 0.0, kv_usage: 0.25, scraped_at_ms: *seq };
        RecordBody::Batch {
            batch: Batch { dp_rank, seq: *seq, ts: *seq as f64, events },
            load: Some(load),
            liveness: None,
        }
    }

    fn commit(&mut self, store: &Store, n: usize) -> Vec<Record> {
        (0..n).map(|_| store.commit(self.body()).expect("commit")).collect()
    }
}

/// The truth rebuilt from records, as [`LiveBlocks`] applies them.
fn apply(live: &mut LiveBlocks, r: &Record) {
    match &r.body {
        RecordBody::Batch { batch, .. } => live.apply(batch),
        RecordBody::Control(Control { dp_rank, kind: ControlKind::RankReset { .. } }) => live.reset_rank(*dp_rank),
        RecordBody::Control(_) => {}
    }
}

struct Relay {
    addr: SocketAddr,
    store: Store,
    notices: broadcast::Sender<Notice>,
    status: RelayStatusHandle,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
    _dir: tempfile::TempDir,
}

impl Relay {
    async fn start(cfg: ServerConfig, limits: HistoryLimits) -> Relay {
        let dir = tempfile::tempdir().unwrap();
        let mut scfg = StoreConfig::new(dir.path());
        scfg.limits = limits;
        scfg.cache_bytes = 4 << 20;
        let store = Store::open(scfg).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let notices = notice_channel();
        let status = RelayStatusHandle::new("test-engine");
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(serve(cfg, store.clone(), status.clone(), notices.clone(), listener, async {
            let _ = stopped.await;
        }));
        let task = tokio::spawn(async move { task.await.unwrap().unwrap() });
        Relay { addr, store, notices, status, stop: Some(stop), task, _dir: dir }
    }

    async fn client(&self) -> RelayClient<Channel> {
        let ep = Endpoint::from_shared(format!("http://{}", self.addr)).unwrap();
        RelayClient::new(ep.connect().await.unwrap())
    }

    async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        tokio::time::timeout(T, self.task).await.unwrap().unwrap();
    }
}

fn cfg() -> ServerConfig {
    ServerConfig { rate_per_second: 10_000, rate_burst: 10_000, ..ServerConfig::default() }
}

fn big_history() -> HistoryLimits {
    HistoryLimits::default()
}

fn req(epoch: u64, after_cursor: u64, incarnation: u32, allow_snapshot: bool) -> pb::SubscribeRequest {
    pb::SubscribeRequest { epoch, after_cursor, incarnation, allow_snapshot, ranks: vec![], snapshot_token_ids: false }
}

async fn next(s: &mut Streaming<pb::SubscribeResponse>) -> M {
    let m = tokio::time::timeout(T, s.message()).await.expect("timely message");
    m.expect("a message, not a status").expect("stream open").message.expect("a oneof")
}

/// The next record (skipping heartbeats).
async fn next_record(s: &mut Streaming<pb::SubscribeResponse>) -> Record {
    loop {
        let m = next(s).await;
        if let M::Heartbeat(_) = m {
            continue;
        }
        let resp = pb::SubscribeResponse { message: Some(m) };
        match record_from_subscribe(&resp) {
            Some(r) => return r.expect("converts"),
            None => panic!("expected a record, got {resp:?}"),
        }
    }
}

/// The stream's terminal status.
async fn status_of(s: &mut Streaming<pb::SubscribeResponse>) -> tonic::Status {
    for _ in 0..10_000 {
        match tokio::time::timeout(T, s.message()).await.expect("timely") {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("stream ended OK"),
            Err(st) => return st,
        }
    }
    panic!("the stream did not end");
}

/// Reads a snapshot (after its begin) into live blocks; returns (begin, end).
async fn read_snapshot(s: &mut Streaming<pb::SubscribeResponse>) -> (pb::SnapshotBegin, pb::SnapshotEnd, LiveBlocks) {
    let begin = match next(s).await {
        M::SnapshotBegin(b) => b,
        other => panic!("expected a snapshot begin, got {other:?}"),
    };
    let (end, live) = read_snapshot_after_begin(s).await;
    (begin, end, live)
}

/// Reads a snapshot's chunks and end into live blocks.
async fn read_snapshot_after_begin(s: &mut Streaming<pb::SubscribeResponse>) -> (pb::SnapshotEnd, LiveBlocks) {
    let mut live = LiveBlocks::new();
    loop {
        match next(s).await {
            M::SnapshotChunk(c) => {
                for b in &c.blocks {
                    let b = snapshot_block_from_pb(b).unwrap();
                    let key = LiveKey { dp_rank: b.dp_rank, tier: b.tier, group: b.group };
                    live.blocks.entry(key).or_default().insert(b.hash, b.copies);
                }
            }
            M::SnapshotEnd(e) => return (e, live),
            other => panic!("unexpected in a snapshot: {other:?}"),
        }
    }
}

// ---- resume -----------------------------------------------------------------------------------

#[tokio::test]
async fn resuming_at_random_points_receives_the_uninterrupted_sequence() {
    let relay = Relay::start(cfg(), big_history()).await;
    let mut traffic = Traffic::new(7, 3);
    traffic.commit(&relay.store, 200);
    let epoch = relay.store.epoch();

    // The uninterrupted subscriber: from scratch, through history into live.
    let mut steady = relay.client().await.subscribe(req(0, 0, 0, false)).await.unwrap().into_inner();

    let mut rng = StdRng::seed_from_u64(11);
    let mut got: Vec<Record> = Vec::new();
    let (mut cursor, mut inc) = (0u64, 0u32);
    let mut client = relay.client().await;
    for _ in 0..100 {
        // New records keep arriving between and during the resumes.
        traffic.commit(&relay.store, rng.random_range(0..4));
        let mut s = client.subscribe(req(epoch, cursor, inc, false)).await.unwrap().into_inner();
        for _ in 0..rng.random_range(1..8) {
            if cursor == relay.store.newest_cursor() {
                break;
            }
            let r = next_record(&mut s).await;
            (cursor, inc) = (r.cursor, r.incarnation);
            got.push(r);
        }
        drop(s); // disconnect at a random point
    }
    traffic.commit(&relay.store, 5);
    let newest = relay.store.newest_cursor();
    let mut s = client.subscribe(req(epoch, cursor, inc, false)).await.unwrap().into_inner();
    while cursor < newest {
        let r = next_record(&mut s).await;
        cursor = r.cursor;
        got.push(r);
    }

    let mut want = Vec::new();
    while want.len() < newest as usize {
        want.push(next_record(&mut steady).await);
    }
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(g, w, "resumed subscriber differs at cursor {}", w.cursor);
    }
    // And both equal the history as committed.
    let history = relay.store.history(0, usize::MAX).unwrap();
    assert_eq!(want, history);
    relay.stop().await;
}

// ---- snapshots --------------------------------------------------------------------------------

#[tokio::test]
async fn cursor_predating_history_gets_snapshot_then_batches_and_rebuilds_the_state() {
    let relay = Relay::start(cfg(), HistoryLimits { max_batches: 20, max_bytes: 1 << 30 }).await;
    let mut traffic = Traffic::new(3, 2);
    let mut truth = LiveBlocks::new();
    for r in traffic.commit(&relay.store, 150) {
        apply(&mut truth, &r);
    }
    assert!(relay.store.oldest_cursor().unwrap() > 2, "the history was trimmed");
    let epoch = relay.store.epoch();
    let mut client = relay.client().await;

    // Refused without snapshots.
    let err = client.subscribe(req(epoch, 1, relay.store.incarnation(), false)).await.unwrap_err();
    assert_eq!(err.code(), Code::OutOfRange, "{err:?}");

    let mut s = client.subscribe(req(epoch, 1, relay.store.incarnation(), true)).await.unwrap().into_inner();
    let (begin, end, mut live) = read_snapshot(&mut s).await;
    assert_eq!(begin.reason, pb::SnapshotReason::CursorTrimmed as i32);
    assert_eq!(begin.epoch, epoch);
    assert_eq!(begin.cursor, end.cursor);
    assert_eq!(begin.block_count, Some(end.block_count));
    assert_eq!(end.cursor, 150);
    assert_eq!(live.blocks, truth.blocks, "snapshot equals the state at its cursor");

    // Then live batches (fewer than the history holds, so this reader cannot fall behind); the
    // rebuilt state follows the truth.
    for r in traffic.commit(&relay.store, 15) {
        apply(&mut truth, &r);
    }
    let mut cursor = end.cursor;
    while cursor < relay.store.newest_cursor() {
        let r = next_record(&mut s).await;
        assert_eq!(r.cursor, cursor + 1, "no gap after the snapshot");
        cursor = r.cursor;
        apply(&mut live, &r);
    }
    assert_eq!(live.blocks, truth.blocks, "snapshot + batches rebuild the store's state");

    // A resume from the snapshot's end cursor continues without another snapshot.
    let mut s = client.subscribe(req(epoch, end.cursor, end.incarnation, false)).await.unwrap().into_inner();
    assert_eq!(next_record(&mut s).await.cursor, end.cursor + 1);
    relay.stop().await;
}

#[tokio::test]
async fn cursor_zero_after_a_trimmed_history_is_a_new_client_with_or_without_the_epoch() {
    let relay = Relay::start(cfg(), HistoryLimits { max_batches: 20, max_bytes: 1 << 30 }).await;
    Traffic::new(5, 2).commit(&relay.store, 60);
    let (epoch, incarnation) = (relay.store.epoch(), relay.store.incarnation());
    let mut client = relay.client().await;
    // A router learns the epoch from Status before its first Subscribe; it has still applied
    // nothing, so it is as new as one that sends no epoch.
    for e in [0, epoch] {
        let err = client.subscribe(req(e, 0, incarnation, false)).await.unwrap_err();
        assert_eq!(err.code(), Code::OutOfRange, "{err:?}");
        let mut s = client.subscribe(req(e, 0, incarnation, true)).await.unwrap().into_inner();
        let (begin, end, _) = read_snapshot(&mut s).await;
        assert_eq!((begin.reason, begin.epoch, end.cursor), (pb::SnapshotReason::NewClient as i32, epoch, 60));
    }
    relay.stop().await;
}

#[tokio::test]
async fn new_client_streams_the_whole_history_when_it_starts_at_one() {
    let relay = Relay::start(cfg(), big_history()).await;
    Traffic::new(1, 1).commit(&relay.store, 10);
    let mut s = relay.client().await.subscribe(req(0, 0, 0, false)).await.unwrap().into_inner();
    for c in 1..=10 {
        assert_eq!(next_record(&mut s).await.cursor, c);
    }
    relay.stop().await;
}

#[tokio::test]
async fn rank_filter_passes_only_the_ranks_asked_for() {
    let relay = Relay::start(cfg(), big_history()).await;
    let committed = Traffic::new(17, 3).commit(&relay.store, 60);
    let want: Vec<&Record> = committed
        .iter()
        .filter(|r| match &r.body {
            RecordBody::Batch { batch, .. } => batch.dp_rank == 2,
            RecordBody::Control(c) => c.dp_rank == 2,
        })
        .collect();
    let r = pb::SubscribeRequest { ranks: vec![2], ..req(0, 0, 0, false) };
    let mut s = relay.client().await.subscribe(r).await.unwrap().into_inner();
    for w in want {
        assert_eq!(&next_record(&mut s).await, w);
    }
    relay.stop().await;
}

#[tokio::test]
async fn epoch_change_forces_a_snapshot() {
    let relay = Relay::start(cfg(), big_history()).await;
    let mut traffic = Traffic::new(5, 2);
    let mut truth = LiveBlocks::new();
    for r in traffic.commit(&relay.store, 40) {
        apply(&mut truth, &r);
    }
    let other = relay.store.epoch().wrapping_add(1);
    let mut client = relay.client().await;
    let err = client.subscribe(req(other, 10, 1, false)).await.unwrap_err();
    assert_eq!(err.code(), Code::OutOfRange, "{err:?}");

    let mut s = client.subscribe(req(other, 10, 1, true)).await.unwrap().into_inner();
    let (begin, end, live) = read_snapshot(&mut s).await;
    assert_eq!(begin.reason, pb::SnapshotReason::EpochChanged as i32);
    assert_eq!(begin.epoch, relay.store.epoch());
    assert_eq!(end.cursor, 40);
    assert_eq!(live.blocks, truth.blocks);
    relay.stop().await;
}

#[tokio::test]
async fn lost_or_ahead_cursor_gets_a_snapshot_or_failed_precondition() {
    let relay = Relay::start(cfg(), big_history()).await;
    Traffic::new(9, 2).commit(&relay.store, 30);
    let (epoch, inc) = (relay.store.epoch(), relay.store.incarnation());
    let mut client = relay.client().await;

    // Ahead of the newest: the relay lost its tail.
    let err = client.subscribe(req(epoch, 35, inc, false)).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    let mut s = client.subscribe(req(epoch, 35, inc, true)).await.unwrap().into_inner();
    let (begin, end, _) = read_snapshot(&mut s).await;
    assert_eq!(begin.reason, pb::SnapshotReason::CursorLost as i32);
    assert_eq!(end.cursor, 30);

    // The record at the cursor was committed by another incarnation.
    let err = client.subscribe(req(epoch, 20, inc + 1, false)).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    let mut s = client.subscribe(req(epoch, 20, inc + 1, true)).await.unwrap().into_inner();
    let (begin, _, _) = read_snapshot(&mut s).await;
    assert_eq!(begin.reason, pb::SnapshotReason::CursorLost as i32);

    // The right incarnation resumes in place.
    let mut s = client.subscribe(req(epoch, 20, inc, false)).await.unwrap().into_inner();
    assert_eq!(next_record(&mut s).await.cursor, 21);
    relay.stop().await;
}

#[tokio::test]
async fn snapshot_incarnation_resumes_across_a_reopened_store() {
    // A snapshot taken before the reopened store commits anything ends at a cursor the previous
    // incarnation committed; resuming with the incarnation it gave must not snapshot again.
    let dir = tempfile::tempdir().unwrap();
    {
        let store = Store::open(StoreConfig::new(dir.path())).unwrap();
        Traffic::new(2, 1).commit(&store, 5);
        store.flush().unwrap();
    }
    let store = Store::open(StoreConfig::new(dir.path())).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let task =
        tokio::spawn(serve(cfg(), store.clone(), RelayStatusHandle::new("e"), notice_channel(), listener, async {
            let _ = stopped.await;
        }));
    let mut client = RelayClient::connect(format!("http://{addr}")).await.unwrap();
    let mut s = client.subscribe(req(store.epoch(), 99, 1, true)).await.unwrap().into_inner();
    let (_, end, _) = read_snapshot(&mut s).await;
    assert_eq!(end.cursor, 5);
    let mut s = client.subscribe(req(store.epoch(), end.cursor, end.incarnation, false)).await.unwrap().into_inner();
    Traffic::new(4, 1).commit(&store, 1);
    assert_eq!(next_record(&mut s).await.cursor, 6);
    let _ = stop.send(());
    tokio::time::timeout(T, task).await.unwrap().unwrap().unwrap();
}

// ---- slow subscribers ---------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_subscriber_does_not_hold_back_a_fast_one_and_resyncs_only_behind_the_history() {
    let cfg = ServerConfig { stream_buffer: 4, history_page: 8, ..cfg() };
    let relay = Relay::start(cfg, HistoryLimits { max_batches: 50, max_bytes: 1 << 30 }).await;
    let mut traffic = Traffic::new(13, 2);
    let mut client = relay.client().await;
    // The slow reader on its own connection with small HTTP/2 windows (16 KiB), so what is in
    // flight to it is small: the rest waits in the store.
    let ep = Endpoint::from_shared(format!("http://{}", relay.addr))
        .unwrap()
        .initial_stream_window_size(Some(16 << 10))
        .initial_connection_window_size(Some(16 << 10));
    let mut slow_client = RelayClient::new(ep.connect().await.unwrap());
    let mut slow = slow_client.subscribe(req(0, 0, 0, false)).await.unwrap().into_inner();
    let mut fast = client.subscribe(req(0, 0, 0, false)).await.unwrap().into_inner();

    // Within the history: the slow one lags (reads 3, pauses) but is never told to resync.
    traffic.commit(&relay.store, 40);
    for c in 1..=3 {
        assert_eq!(next_record(&mut slow).await.cursor, c);
    }
    for c in 1..=40 {
        assert_eq!(next_record(&mut fast).await.cursor, c);
    }
    for c in 4..=40 {
        assert_eq!(next_record(&mut slow).await.cursor, c, "a lagging subscriber within the history catches up");
    }

    // The slow one pauses while 1,000 more records are committed (the history keeps 50; far more
    // than its windows hold): the fast one gets every record meanwhile.
    for _ in 0..100 {
        for r in traffic.commit(&relay.store, 10) {
            assert_eq!(next_record(&mut fast).await.cursor, r.cursor);
        }
    }
    // The slow one gets what was in flight (its channel, one page, the HTTP/2 windows), then the
    // resync.
    let mut last = 40;
    let mut heartbeats = 0;
    let resync = loop {
        match next(&mut slow).await {
            M::Resync(r) => break r,
            M::Heartbeat(_) => {
                heartbeats += 1;
                assert!(heartbeats < 5, "caught up at {last} without a resync");
            }
            m => {
                let r = record_from_subscribe(&pb::SubscribeResponse { message: Some(m) }).unwrap().unwrap();
                assert_eq!(r.cursor, last + 1, "contiguous until the resync");
                last = r.cursor;
            }
        }
    };
    assert_eq!(resync.after_cursor, last);
    assert!(resync.oldest_cursor > last + 1, "told to resync only once behind the history");
    assert_eq!(status_of(&mut slow).await.code(), Code::OutOfRange);
    relay.stop().await;
}

// ---- other RPCs -------------------------------------------------------------------------------

#[tokio::test]
async fn history_status_and_snapshot_rpcs() {
    let relay = Relay::start(cfg(), big_history()).await;
    let mut traffic = Traffic::new(21, 3);
    let mut truth = LiveBlocks::new();
    let committed = traffic.commit(&relay.store, 60);
    for r in &committed {
        apply(&mut truth, r);
    }
    relay.status.set_rank_state(1, kv_relay::server::RankState::Degraded, "gap 5..9");
    let mut client = relay.client().await;

    let mut h = client
        .history(pb::HistoryRequest { from_cursor: 10, to_cursor: 30, limit: 0, ranks: vec![1], epoch: 0 })
        .await
        .unwrap()
        .into_inner();
    let mut got = Vec::new();
    while let Some(m) = tokio::time::timeout(T, h.message()).await.unwrap().unwrap() {
        let m = match m.record.unwrap() {
            pb::history_response::Record::Batch(b) => M::Batch(b),
            pb::history_response::Record::Control(c) => M::Control(c),
        };
        got.push(record_from_subscribe(&pb::SubscribeResponse { message: Some(m) }).unwrap().unwrap());
    }
    let want: Vec<Record> = committed[9..30]
        .iter()
        .filter(|r| match &r.body {
            RecordBody::Batch { batch, .. } => batch.dp_rank == 1,
            RecordBody::Control(c) => c.dp_rank == 1,
        })
        .cloned()
        .collect();
    assert_eq!(got, want);
    let err = client.history(pb::HistoryRequest { epoch: 1, ..Default::default() }).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);

    let st = client.status(pb::StatusRequest {}).await.unwrap().into_inner();
    assert_eq!(st.epoch, relay.store.epoch());
    assert_eq!(st.engine, "test-engine");
    assert_eq!((st.oldest_cursor, st.newest_cursor, st.history_records), (1, 60, 60));
    assert_eq!(st.counters["live_blocks"], truth.len() as u64);
    let r1 = st.ranks.iter().find(|r| r.dp_rank == 1).unwrap();
    assert_eq!((r1.state, r1.reason.as_str()), (pb::RankState::Degraded as i32, "gap 5..9"));

    let mut s = client
        .snapshot(pb::SnapshotRequest { ranks: vec![0, 2], tiers: vec!["device".into()], include_token_ids: true })
        .await
        .unwrap()
        .into_inner();
    let mut live = LiveBlocks::new();
    let mut end = None;
    while let Some(m) = tokio::time::timeout(T, s.message()).await.unwrap().unwrap() {
        match m.message.unwrap() {
            pb::snapshot_response::Message::Begin(b) => assert_eq!(b.cursor, 60),
            pb::snapshot_response::Message::Chunk(c) => {
                for b in &c.blocks {
                    assert_eq!(b.token_ids, vec![1, 2, 3, 4]);
                    let b = snapshot_block_from_pb(b).unwrap();
                    live.blocks
                        .entry(LiveKey { dp_rank: b.dp_rank, tier: b.tier, group: b.group })
                        .or_default()
                        .insert(b.hash, b.copies);
                }
            }
            pb::snapshot_response::Message::End(e) => end = Some(e),
        }
    }
    assert_eq!(end.unwrap().cursor, 60);
    let mut want = truth.clone();
    want.blocks.retain(|k, _| k.dp_rank != 1 && k.tier == Tier::Device);
    assert_eq!(live.blocks, want.blocks);
    relay.stop().await;
}

#[tokio::test]
async fn quiet_streams_get_heartbeats_with_the_load() {
    let cfg = ServerConfig { heartbeat_interval: Duration::from_millis(200), ..cfg() };
    let relay = Relay::start(cfg, big_history()).await;
    let load = Load { running: 3.0, waiting: 1.0, kv_usage: 0.5, scraped_at_ms: 7 };
    relay.status.set_load(2, load);
    let mut s = relay.client().await.subscribe(req(0, 0, 0, false)).await.unwrap().into_inner();
    // The server's own heartbeat, from the status.
    match next(&mut s).await {
        M::Heartbeat(h) => {
            assert_eq!(h.dp_rank, 2);
            assert_eq!(h.load.unwrap().running, 3.0);
        }
        other => panic!("expected a heartbeat, got {other:?}"),
    }
    // One the ingest sends.
    let sent = Load { running: 9.0, ..load };
    let mut tries = 0;
    let hb = loop {
        tries += 1;
        assert!(tries < 100, "the ingest's heartbeat never came through");
        let _ = relay.notices.send(Notice::Heartbeat { dp_rank: 5, load: Some(sent) });
        match next(&mut s).await {
            M::Heartbeat(h) if h.dp_rank == 5 => break h,
            M::Heartbeat(_) => {}
            other => panic!("expected a heartbeat, got {other:?}"),
        }
    };
    assert_eq!(hb.load.unwrap().running, 9.0);
    relay.stop().await;
}

// ---- limits and shutdown ------------------------------------------------------------------------

#[tokio::test]
async fn rate_limit_returns_resource_exhausted_with_a_retry_hint() {
    let cfg = ServerConfig { rate_per_second: 1, rate_burst: 2, ..ServerConfig::default() };
    let relay = Relay::start(cfg, big_history()).await;
    let mut client = relay.client().await;
    let _a = client.subscribe(req(0, 0, 0, true)).await.unwrap();
    let _b = client.snapshot(pb::SnapshotRequest::default()).await.unwrap();
    let err = client.subscribe(req(0, 0, 0, true)).await.unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    let ms: u64 = err.metadata().get(RETRY_AFTER_MS).unwrap().to_str().unwrap().parse().unwrap();
    assert!(ms > 0 && ms <= 1000, "retry after {ms} ms");
    // Status is not rate limited.
    client.status(pb::StatusRequest {}).await.unwrap();
    relay.stop().await;
}

#[tokio::test]
async fn subscriber_limit_returns_resource_exhausted() {
    let cfg = ServerConfig { max_subscribers: 1, ..cfg() };
    let relay = Relay::start(cfg, big_history()).await;
    let mut client = relay.client().await;
    let a = client.subscribe(req(0, 0, 0, true)).await.unwrap();
    let err = client.subscribe(req(0, 0, 0, true)).await.unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted);
    drop(a);
    // The slot comes back once the first stream's producer sees the client gone.
    let ok = tokio::time::timeout(T, async {
        loop {
            if client.subscribe(req(0, 0, 0, true)).await.is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(ok.is_ok());
    relay.stop().await;
}

/// A live set of 40,000 blocks of 16 token ids on rank 0, in 40 records (the history holds 5);
/// returns the truth.
fn big_live_set(store: &Store) -> LiveBlocks {
    let mut truth = LiveBlocks::new();
    for r in 0..40u64 {
        let blocks = (0..1000).map(|i| Block { hash: r << 32 | i, token_ids: vec![7; 16], extra_keys: None }).collect();
        let batch = Batch {
            dp_rank: 0,
            seq: r + 1,
            ts: 0.0,
            events: vec![Event::Stored(Stored::plain(Tier::Device, 0, 16, blocks))],
        };
        apply(&mut truth, &store.commit(RecordBody::Batch { batch, load: None, liveness: None }).unwrap());
    }
    truth
}

#[tokio::test]
async fn max_snapshots_bounds_the_snapshots_in_flight_and_the_others_wait_their_turn() {
    // 2 snapshots at once; a one-message buffer and readers with 64 KiB windows, so a snapshot
    // (2.6 MB) whose reader reads nothing holds its slot: its chunks wait for the window.
    let cfg = ServerConfig { max_snapshots: 2, snapshot_chunk_blocks: 100, stream_buffer: 1, ..cfg() };
    let relay = Relay::start(cfg, HistoryLimits { max_batches: 5, max_bytes: 1 << 30 }).await;
    let truth = big_live_set(&relay.store);
    let epoch = relay.store.epoch();
    let with_tokens = pb::SubscribeRequest { snapshot_token_ids: true, ..req(0, 0, 0, true) };
    // Five routers starting from nothing, each on its own connection (a shared connection's
    // window would stall them all).
    let mut streams = Vec::new();
    let mut clients = Vec::new();
    for _ in 0..5 {
        let ep = Endpoint::from_shared(format!("http://{}", relay.addr)).unwrap();
        let ep = ep.initial_stream_window_size(64 << 10).initial_connection_window_size(64 << 10);
        let mut c = RelayClient::new(ep.connect().await.unwrap());
        streams.push(c.subscribe(with_tokens.clone()).await.unwrap().into_inner());
        clients.push(c);
    }
    // The first two hold the slots: a Snapshot call finds none free.
    let mut begun = Vec::new();
    for s in &mut streams[..2] {
        match next(s).await {
            M::SnapshotBegin(b) => begun.push(b),
            other => panic!("expected a snapshot begin, got {other:?}"),
        }
    }
    assert!(begun.iter().all(|b| b.epoch == epoch && b.cursor == 40));
    let err = clients[0].snapshot(pb::SnapshotRequest::default()).await.unwrap_err();
    assert_eq!((err.code(), err.message()), (Code::ResourceExhausted, "too many snapshots in progress"));
    // The other three wait: nothing at all reaches them while both slots are held.
    for s in &mut streams[2..] {
        let waited = tokio::time::timeout(Duration::from_millis(300), s.message()).await;
        assert!(waited.is_err(), "a third snapshot began while two were in flight: {waited:?}");
    }
    // Each in turn completes, every one the whole live set at the newest cursor.
    let (first, rest) = streams.split_at_mut(2);
    for s in first {
        let (end, live) = read_snapshot_after_begin(s).await;
        assert_eq!((end.cursor, end.block_count, &live.blocks), (40, 40_000, &truth.blocks));
    }
    for s in rest {
        let (begin, end, live) = read_snapshot(s).await;
        assert_eq!((begin.epoch, begin.cursor, end.cursor, end.block_count), (epoch, 40, 40, 40_000));
        assert_eq!(live.blocks, truth.blocks);
    }
    relay.stop().await;
}

#[tokio::test]
async fn shutdown_ends_streams_with_unavailable() {
    let relay = Relay::start(cfg(), big_history()).await;
    Traffic::new(1, 1).commit(&relay.store, 3);
    let mut s = relay.client().await.subscribe(req(0, 0, 0, false)).await.unwrap().into_inner();
    for _ in 0..3 {
        next_record(&mut s).await;
    }
    let Relay { stop, task, .. } = relay;
    let _ = stop.unwrap().send(());
    let st = status_of(&mut s).await;
    assert_eq!(st.code(), Code::Unavailable, "{st:?}");
    assert_eq!(st.message(), "relay shutting down");
    tokio::time::timeout(T, task).await.unwrap().unwrap();
}

// ---- token, TLS, mTLS ---------------------------------------------------------------------------

#[tokio::test]
async fn bearer_token_is_required_and_checked() {
    let cfg = ServerConfig { bearer_token: Some("s3cret".into()), ..cfg() };
    let relay = Relay::start(cfg, big_history()).await;
    let mut client = relay.client().await;
    let err = client.status(pb::StatusRequest {}).await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated);
    let with = |t: &str| {
        let mut r = tonic::Request::new(pb::StatusRequest {});
        r.metadata_mut().insert("authorization", format!("Bearer {t}").parse().unwrap());
        r
    };
    assert_eq!(client.status(with("wrong")).await.unwrap_err().code(), Code::Unauthenticated);
    client.status(with("s3cret")).await.unwrap();
    let mut sub = tonic::Request::new(req(0, 0, 0, true));
    sub.metadata_mut().insert("authorization", "Bearer wrong".parse().unwrap());
    assert_eq!(client.subscribe(sub).await.unwrap_err().code(), Code::Unauthenticated);

    // Health stays open for probes.
    let mut health = tonic_health::pb::health_client::HealthClient::new(
        Endpoint::from_shared(format!("http://{}", relay.addr)).unwrap().connect().await.unwrap(),
    );
    let h = health.check(tonic_health::pb::HealthCheckRequest { service: "kv_relay.v1.Relay".into() }).await.unwrap();
    assert_eq!(h.into_inner().status, tonic_health::pb::health_check_response::ServingStatus::Serving as i32);
    relay.stop().await;
}

struct Pki {
    ca: String,
    server_cert: String,
    server_key: String,
    client_cert: String,
    client_key: String,
}

fn pki() -> Pki {
    use rcgen::{
        BasicConstraints, CertificateParams, CertifiedIssuer, ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose,
    };
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate().unwrap()).unwrap();
    let leaf = |eku| {
        let mut p = CertificateParams::new(vec!["localhost".to_string()]).unwrap();
        p.extended_key_usages = vec![eku];
        let key = KeyPair::generate().unwrap();
        let cert = p.signed_by(&key, &ca).unwrap();
        (cert.pem(), key.serialize_pem())
    };
    let (server_cert, server_key) = leaf(ExtendedKeyUsagePurpose::ServerAuth);
    let (client_cert, client_key) = leaf(ExtendedKeyUsagePurpose::ClientAuth);
    Pki { ca: ca.pem(), server_cert, server_key, client_cert, client_key }
}

async fn tls_client(
    addr: SocketAddr,
    ca: &str,
    identity: Option<(&str, &str)>,
) -> Result<RelayClient<Channel>, String> {
    let mut tls =
        ClientTlsConfig::new().ca_certificate(tonic::transport::Certificate::from_pem(ca)).domain_name("localhost");
    if let Some((cert, key)) = identity {
        tls = tls.identity(tonic::transport::Identity::from_pem(cert, key));
    }
    let ep = Endpoint::from_shared(format!("https://{addr}")).unwrap().tls_config(tls).map_err(|e| e.to_string())?;
    let ch = ep.connect().await.map_err(|e| format!("{e:?}"))?;
    Ok(RelayClient::new(ch))
}

/// A call that must fail, at connect or at the first RPC (TLS 1.3 reports a refused client
/// certificate after the handshake).
async fn refused(c: Result<RelayClient<Channel>, String>) -> bool {
    match c {
        Err(_) => true,
        Ok(mut c) => c.status(pb::StatusRequest {}).await.is_err(),
    }
}

#[tokio::test]
async fn tls_serves_trusting_clients_and_refuses_plaintext() {
    let p = pki();
    let tls = TlsConfig { cert_pem: p.server_cert.into(), key_pem: p.server_key.into(), client_ca_pem: None };
    let relay = Relay::start(ServerConfig { tls: Some(tls), ..cfg() }, big_history()).await;
    let mut c = tls_client(relay.addr, &p.ca, None).await.unwrap();
    c.status(pb::StatusRequest {}).await.unwrap();
    // Plaintext to a TLS port fails.
    let plain = Endpoint::from_shared(format!("http://{}", relay.addr)).unwrap().connect().await;
    if let Ok(ch) = plain {
        assert!(RelayClient::new(ch).status(pb::StatusRequest {}).await.is_err());
    }
    // A client that does not trust the server's CA refuses it.
    let other = pki();
    assert!(refused(tls_client(relay.addr, &other.ca, None).await).await);
    relay.stop().await;
}

/// A relay serving TLS with `p`'s server certificate, requiring a client certificate from `p`'s CA.
async fn start_mtls(p: &Pki) -> Relay {
    let tls = TlsConfig {
        cert_pem: p.server_cert.clone().into(),
        key_pem: p.server_key.clone().into(),
        client_ca_pem: Some(p.ca.clone().into()),
    };
    Relay::start(ServerConfig { tls: Some(tls), ..cfg() }, big_history()).await
}

#[tokio::test]
async fn mtls_requires_a_client_certificate_from_the_configured_ca() {
    let p = pki();
    let relay = start_mtls(&p).await;
    let mut c = tls_client(relay.addr, &p.ca, Some((&p.client_cert, &p.client_key))).await.unwrap();
    c.status(pb::StatusRequest {}).await.unwrap();
    // No client certificate.
    assert!(refused(tls_client(relay.addr, &p.ca, None).await).await);
    // A client certificate from another CA.
    let other = pki();
    assert!(refused(tls_client(relay.addr, &p.ca, Some((&other.client_cert, &other.client_key))).await).await);
    relay.stop().await;
}

// ---- relayctl's token and TLS flags -------------------------------------------------------------

/// The real `relayctl ARGS` with `env` and no other `KV_RELAY_*` variable, off the runtime's
/// thread: (exit status, stdout, stderr).
async fn relayctl(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_relayctl"));
    for (k, _) in std::env::vars() {
        if k.starts_with("KV_RELAY_") {
            c.env_remove(k);
        }
    }
    c.args(args).envs(env.iter().copied()).stdin(std::process::Stdio::null());
    let out = tokio::task::spawn_blocking(move || c.output().unwrap()).await.unwrap();
    let text = |b: Vec<u8>| String::from_utf8(b).unwrap();
    (out.status.code().expect("relayctl exited by a signal"), text(out.stdout), text(out.stderr))
}

/// `relayctl status --json`'s `relay` field, after a successful run.
fn relay_of(run: (i32, String, String)) -> String {
    let (code, out, err) = run;
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    v["relay"].as_str().unwrap().to_string()
}

#[tokio::test]
async fn relayctl_sends_the_token_from_its_flag_or_environment_and_exits_77_when_refused() {
    let relay = Relay::start(ServerConfig { bearer_token: Some("s3cret".into()), ..cfg() }, big_history()).await;
    let url = format!("http://{}", relay.addr);
    let (code, out, missing) = relayctl(&["--relay", &url, "status"], &[]).await;
    assert_eq!((code, out.as_str()), (77, ""), "{missing}");
    insta::assert_snapshot!("relayctl_token_missing", missing.replace(&url, "[relay]"));
    let wrong = relayctl(&["--relay", &url, "--token", "guess", "snapshot"], &[]).await;
    assert_eq!(wrong, (77, String::new(), missing.clone()));
    let wrong = relayctl(&["--relay", &url, "history"], &[("KV_RELAY_TOKEN", "guess")]).await;
    assert_eq!(wrong, (77, String::new(), missing.clone()));

    assert_eq!(relay_of(relayctl(&["--relay", &url, "--token", "s3cret", "status", "--json"], &[]).await), url);
    let env = [("KV_RELAY_ADDR", url.as_str()), ("KV_RELAY_TOKEN", "s3cret")];
    assert_eq!(relay_of(relayctl(&["status", "--json"], &env).await), url);
    relay.stop().await;
}

#[tokio::test]
async fn relayctl_verifies_the_relay_and_presents_its_certificate_with_its_tls_flags() {
    let p = pki();
    let relay = start_mtls(&p).await;
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str, pem: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, pem).unwrap();
        path.display().to_string()
    };
    let (ca, cert, key) =
        (file("ca.pem", &p.ca), file("client.pem", &p.client_cert), file("client.key", &p.client_key));
    // HOST:PORT with a --tls-* flag means https.
    let host_port = relay.addr.to_string();
    let https = format!("https://{host_port}");
    let flags =
        ["--relay", &host_port, "--tls-ca", &ca, "--tls-cert", &cert, "--tls-key", &key, "--tls-domain", "localhost"];
    assert_eq!(relay_of(relayctl(&[&flags[..], &["status", "--json"]].concat(), &[]).await), https);
    let env = [
        ("KV_RELAY_ADDR", https.as_str()),
        ("KV_RELAY_TLS_CA", &ca),
        ("KV_RELAY_TLS_CERT", &cert),
        ("KV_RELAY_TLS_KEY", &key),
        ("KV_RELAY_TLS_DOMAIN", "localhost"),
    ];
    assert_eq!(relay_of(relayctl(&["status", "--json"], &env).await), https);

    // Without the client certificate, or trusting another CA: refused, and said so.
    let (code, out, no_cert) = relayctl(&[&flags[..4], &flags[8..], &["status"]].concat(), &[]).await;
    assert_eq!((code, out.as_str()), (69, ""), "{no_cert}");
    insta::assert_snapshot!("relayctl_tls_no_client_certificate", no_cert.replace(&host_port, "[addr]"));
    let other = file("other-ca.pem", &pki().ca);
    let (code, out, untrusted) =
        relayctl(&["--relay", &https, "--tls-ca", &other, "--tls-domain", "localhost", "status"], &[]).await;
    assert_eq!((code, out.as_str()), (69, ""), "{untrusted}");
    insta::assert_snapshot!("relayctl_tls_untrusted_relay", untrusted.replace(&host_port, "[addr]"));
    relay.stop().await;
}

// ---- reflection ---------------------------------------------------------------------------------

#[tokio::test]
async fn reflection_lists_the_services() {
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    use tonic_reflection::pb::v1::ServerReflectionRequest;

    let relay = Relay::start(cfg(), big_history()).await;
    let ch = Endpoint::from_shared(format!("http://{}", relay.addr)).unwrap().connect().await.unwrap();
    let mut client = ServerReflectionClient::new(ch);
    let reqs = vec![
        ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        },
        ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::FileContainingSymbol("kv_relay.v1.Relay".into())),
        },
    ];
    let mut resp = client.server_reflection_info(tokio_stream::iter(reqs)).await.unwrap().into_inner();
    let list = resp.message().await.unwrap().unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = list.message_response else { panic!("not a list") };
    let mut names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    names.sort();
    assert!(names.contains(&"kv_relay.v1.Relay".to_string()), "{names:?}");
    assert!(names.contains(&"grpc.health.v1.Health".to_string()), "{names:?}");
    let file = resp.message().await.unwrap().unwrap();
    let Some(MessageResponse::FileDescriptorResponse(fd)) = file.message_response else { panic!("not a file") };
    assert!(!fd.file_descriptor_proto.is_empty());
    relay.stop().await;
}
