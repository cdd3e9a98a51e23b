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
    pb::SubscribeRequest {
        epoch,
        after_cursor,
        incarnation,
        allow_snapshot,
        ranks: vec![],
        snapshot_token_ids: false,
        omit_token_ids: false,
    }
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

mod limits;
mod other_rpcs;
mod reflection;
mod resume;
mod slow;
mod snapshot;
mod tls;
