//! Builders of stream messages, a scripted admission with its expected state beside it, and a
//! relay daemon run in the test's runtime.

use std::sync::Arc;

use kv_relay_proto::pb;
use kv_relay_proto::pb::subscribe_response::Message as M;
use kv_router_client::index::reference::ReferenceIndex;
use kv_router_client::index::{LookupResult, PrefixIndex, StagedSnapshot, TierId, WorkerId};
use kv_router_client::{ClientEvent, RelayAdmission, Verdict};
use tokio::time::Instant;

pub const URL: &str = "http://relay-a:50051";

/// The streams of a test relay's `Relay` implementation.
#[allow(dead_code)]
pub type BoxStream<T> = std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<T, tonic::Status>> + Send + 'static>>;

pub fn msg(m: M) -> pb::SubscribeResponse {
    pb::SubscribeResponse { message: Some(m) }
}

pub fn stored(tier: pb::Tier, hashes: &[u64]) -> pb::Event {
    pb::Event {
        event: Some(pb::event::Event::Stored(pb::Stored {
            tier: tier as i32,
            block_size: 4,
            blocks: hashes.iter().map(|&hash| pb::Block { hash, ..Default::default() }).collect(),
            ..Default::default()
        })),
    }
}

pub fn removed(tier: pb::Tier, hashes: &[u64]) -> pb::Event {
    pb::Event {
        event: Some(pb::event::Event::Removed(pb::Removed {
            tier: tier as i32,
            block_hashes: hashes.to_vec(),
            ..Default::default()
        })),
    }
}

pub fn load(running: f64) -> pb::Load {
    pb::Load { running, waiting: 1.0, kv_usage: 0.5, scraped_at_ms: 7 }
}

pub fn batch(cursor: u64, dp_rank: u32, events: Vec<pb::Event>) -> pb::SubscribeResponse {
    msg(M::Batch(pb::Batch {
        cursor,
        incarnation: 1,
        dp_rank,
        engine_seq: cursor,
        events,
        load: None,
        engine_ts: 0.0,
        liveness: None,
    }))
}

pub fn control(cursor: u64, dp_rank: u32, kind: pb::ControlKind, reason: &str) -> pb::SubscribeResponse {
    msg(M::Control(pb::Control { cursor, incarnation: 1, dp_rank, kind: kind as i32, reason: reason.into() }))
}

pub fn heartbeat(dp_rank: u32, running: f64) -> pb::SubscribeResponse {
    msg(M::Heartbeat(pb::Heartbeat {
        dp_rank,
        load: Some(load(running)),
        newest_cursor: 0,
        sent_at_ms: 0,
        liveness: None,
    }))
}

pub fn snap_begin(epoch: u64, cursor: u64, ranks: &[u32]) -> pb::SubscribeResponse {
    msg(M::SnapshotBegin(pb::SnapshotBegin {
        cursor,
        epoch,
        incarnation: 2,
        block_count: None,
        reason: pb::SnapshotReason::EpochChanged as i32,
        ranks: ranks.to_vec(),
    }))
}

/// `(rank, tier, hash, copies)` blocks.
pub fn snap_chunk(blocks: &[(u32, pb::Tier, u64, u32)]) -> pb::SubscribeResponse {
    msg(M::SnapshotChunk(pb::SnapshotChunk {
        blocks: blocks
            .iter()
            .map(|&(dp_rank, tier, hash, copies)| pb::SnapshotBlock {
                dp_rank,
                tier: tier as i32,
                hash,
                copies,
                block_size: 4,
                ..Default::default()
            })
            .collect(),
    }))
}

pub fn snap_end(cursor: u64) -> pb::SubscribeResponse {
    msg(M::SnapshotEnd(pb::SnapshotEnd { cursor, incarnation: 2, block_count: 0 }))
}

/// One relay's admission over a real index, with the events it reported.
pub struct Script {
    pub index: PrefixIndex,
    pub adm: RelayAdmission,
    pub events: Vec<ClientEvent>,
}

impl Script {
    pub fn new() -> Self {
        let mut s = Script { index: PrefixIndex::default(), adm: RelayAdmission::new(URL), events: Vec::new() };
        s.adm.on_connected(&mut s.events);
        s.events.clear();
        s
    }

    pub fn apply(&mut self, m: pb::SubscribeResponse) -> Verdict {
        self.adm.apply(m, &self.index, Instant::now(), &mut self.events)
    }

    /// Applies messages that must all be accepted.
    pub fn feed(&mut self, ms: impl IntoIterator<Item = pb::SubscribeResponse>) {
        for m in ms {
            let v = self.apply(m);
            assert_eq!(v, Verdict::Continue);
        }
    }

    pub fn worker(&self, dp_rank: u32) -> WorkerId {
        self.index.worker(URL, dp_rank).unwrap()
    }

    pub fn lookup(&self, hashes: &[u64]) -> LookupResult {
        self.index.lookup(hashes)
    }
}

/// The expected state, built independently: `(rank, tier, hashes)` stores on a reference index.
pub fn expected(s: &Script, state: &[(u32, TierId, &[u64])]) -> ReferenceIndex {
    let mut r = ReferenceIndex::new();
    for &(rank, tier, hashes) in state {
        r.store(s.worker(rank), tier, hashes);
    }
    r
}

#[allow(dead_code)]
pub fn staged(blocks: &[(TierId, u64, u32)]) -> StagedSnapshot {
    let mut s = StagedSnapshot::new();
    for &(t, h, c) in blocks {
        s.push(t, h, c);
    }
    s
}

#[allow(dead_code)]
pub fn arc(s: &str) -> Arc<str> {
    Arc::from(s)
}

/// Serves a relay implementation on a new port of 127.0.0.1: its URL, and what stops it.
#[allow(dead_code)]
pub async fn serve_relay<R: kv_relay_proto::pb::relay_server::Relay>(
    relay: R,
) -> (String, tokio::sync::oneshot::Sender<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let svc = kv_relay_proto::pb::relay_server::RelayServer::new(relay);
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming_shutdown(tokio_stream::wrappers::TcpListenerStream::new(listener), async {
                let _ = stopped.await;
            })
            .await
            .unwrap();
    });
    (url, stop)
}

/// A follower that reconnects quickly (20 ms, up to 200 ms), for tests against a real relay.
#[allow(dead_code)]
pub fn quick_follower() -> kv_router_client::Follower {
    quick_follower_of(false)
}

/// [`quick_follower`], asking for full records (with token ids) when `full_records`: what a
/// relay that predates lean records sends whatever it is asked.
#[allow(dead_code)]
pub fn quick_follower_of(full_records: bool) -> kv_router_client::Follower {
    kv_router_client::Follower::new(kv_router_client::FollowConfig {
        full_records,
        backoff: kv_router_client::backoff::BackoffConfig {
            initial: std::time::Duration::from_millis(20),
            max: std::time::Duration::from_millis(200),
            multiplier: 2.0,
            jitter: 0.5,
        },
        ..kv_router_client::FollowConfig::default()
    })
}

/// A relay daemon (`kv_relay::daemon::run`) in the test's runtime, started from its command line
/// (`kv-relay` first) and ready: its store open and its listener bound.
pub struct Daemon {
    pub running: kv_relay::daemon::Running,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), kv_relay::daemon::DaemonError>>,
}

impl Daemon {
    pub async fn start(argv: &[String]) -> Daemon {
        let cfg = <kv_relay::config::Args as clap::Parser>::try_parse_from(argv).unwrap().validate().unwrap();
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(kv_relay::daemon::run(
            cfg,
            async {
                let _ = stop_rx.await;
            },
            move |r| {
                let _ = ready_tx.send(r);
            },
        ));
        Daemon { running: ready_rx.await.unwrap(), stop, task }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.running.listen)
    }

    /// Stops it, and checks that it ended without an error.
    pub async fn stop(self) {
        let _ = self.stop.send(());
        tokio::time::timeout(std::time::Duration::from_secs(20), self.task).await.unwrap().unwrap().unwrap();
    }
}
