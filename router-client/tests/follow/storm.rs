//! Start-up storms: a slow relay whose snapshots end only when the test lets them (a gate), on
//! `127.0.0.1:0` ports. The follower never has more than `max_concurrent_resyncs` snapshots in
//! flight, the relays waiting show `syncing`, and `/match` leaves syncing workers out.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kv_relay_proto::pb;
use kv_relay_proto::pb::relay_server::Relay;
use kv_relay_proto::pb::Tier::Device;
use kv_router::http::{self, answer_match, prometheus_text, MatchRequest};
use kv_router_client::{FollowConfig, Follower, ResyncSlots, WorkerState};
use tokio::sync::{mpsc, oneshot, Semaphore};
use tonic::{Request, Response, Status};

use crate::relay::{http_call, until};
use crate::util::{serve_relay, snap_begin, snap_chunk, snap_end, BoxStream};

const EPOCH: u64 = 77;
const HASH: u64 = 4242;

/// Relays that answer every Subscribe with a snapshot of one block of rank 0, whose end waits
/// for a permit of `gate`; they count the snapshots in flight.
#[derive(Clone)]
struct Slow {
    gate: Arc<Semaphore>,
    subscribes: Arc<AtomicUsize>,
    in_flight: Arc<AtomicUsize>,
    max_in_flight: Arc<AtomicUsize>,
}

impl Slow {
    fn new() -> Self {
        Slow {
            gate: Arc::new(Semaphore::new(0)),
            subscribes: Arc::default(),
            in_flight: Arc::default(),
            max_in_flight: Arc::default(),
        }
    }
}

#[tonic::async_trait]
impl Relay for Slow {
    type SubscribeStream = BoxStream<pb::SubscribeResponse>;
    type HistoryStream = BoxStream<pb::HistoryResponse>;
    type SnapshotStream = BoxStream<pb::SnapshotResponse>;

    async fn subscribe(&self, _: Request<pb::SubscribeRequest>) -> Result<Response<Self::SubscribeStream>, Status> {
        self.subscribes.fetch_add(1, Ordering::SeqCst);
        let n = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_in_flight.fetch_max(n, Ordering::SeqCst);
        let (tx, rx) = mpsc::channel(4);
        let relay = self.clone();
        tokio::spawn(async move {
            let _ = tx.send(Ok(snap_begin(EPOCH, 1, &[]))).await;
            let _ = tx.send(Ok(snap_chunk(&[(0, Device, HASH, 1)]))).await;
            relay.gate.acquire().await.unwrap().forget();
            relay.in_flight.fetch_sub(1, Ordering::SeqCst);
            let _ = tx.send(Ok(snap_end(1))).await;
            // Then silence, the stream open.
            tx.closed().await;
        });
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }

    async fn status(&self, _: Request<pb::StatusRequest>) -> Result<Response<pb::StatusResponse>, Status> {
        let rank = pb::RankStatus { dp_rank: 0, state: pb::RankState::Ok as i32, ..Default::default() };
        Ok(Response::new(pb::StatusResponse { epoch: EPOCH, ranks: vec![rank], ..Default::default() }))
    }

    async fn history(&self, _: Request<pb::HistoryRequest>) -> Result<Response<Self::HistoryStream>, Status> {
        Err(Status::unimplemented("slow"))
    }

    async fn snapshot(&self, _: Request<pb::SnapshotRequest>) -> Result<Response<Self::SnapshotStream>, Status> {
        Err(Status::unimplemented("slow"))
    }
}

/// Serves `relay` on `n` ports of 127.0.0.1; their URLs.
async fn serve(relay: &Slow, n: usize) -> (Vec<String>, Vec<oneshot::Sender<()>>) {
    let (mut urls, mut stops) = (Vec::new(), Vec::new());
    for _ in 0..n {
        let (url, stop) = serve_relay(relay.clone()).await;
        urls.push(url);
        stops.push(stop);
    }
    (urls, stops)
}

fn cfg(max_concurrent_resyncs: usize) -> FollowConfig {
    FollowConfig {
        max_concurrent_resyncs,
        start_jitter: Duration::ZERO,
        // Silence after the snapshot: neither stale nor dropped during the test.
        stale_after: Duration::from_secs(600),
        receive_timeout: Duration::from_secs(600),
        ..FollowConfig::default()
    }
}

fn by_hash() -> MatchRequest {
    serde_json::from_str(&format!("{{\"block_hashes\": [{HASH}]}}")).unwrap()
}

fn states(f: &Follower) -> Vec<WorkerState> {
    f.workers().iter().map(|w| w.state).collect()
}

#[tokio::test]
async fn no_more_than_the_bound_of_relays_resync_at_once() {
    let relay = Slow::new();
    let (urls, stops) = serve(&relay, 5).await;
    let f = Follower::new(cfg(2));
    for u in &urls {
        f.add_relay(u).unwrap();
    }
    // Two snapshots begun (their Subscribes answered) and three relays waiting for a slot.
    until("2 resyncing and 3 waiting", || {
        f.resync_slots() == ResyncSlots { limit: 2, in_flight: 2, waiting: 3 }
            && f.relays().iter().filter(|r| r.staging).count() == 2
    })
    .await;
    assert_eq!(relay.subscribes.load(Ordering::SeqCst), 2);
    assert_eq!(states(&f), [WorkerState::Syncing; 5]);
    assert_eq!(answer_match(&f, &by_hash()).unwrap().workers.len(), 0);
    for done in 1..=5 {
        relay.gate.add_permits(1);
        until("one more relay synced", || f.relays().iter().filter(|r| !r.syncing).count() == done).await;
    }
    until("every slot free", || f.resync_slots() == ResyncSlots { limit: 2, in_flight: 0, waiting: 0 }).await;
    assert_eq!(relay.subscribes.load(Ordering::SeqCst), 5);
    assert_eq!(relay.max_in_flight.load(Ordering::SeqCst), 2);
    assert_eq!(f.counters().snapshots, 5);
    assert_eq!(states(&f), [WorkerState::Fresh; 5]);
    let answer = answer_match(&f, &by_hash()).unwrap();
    assert_eq!(answer.workers.iter().map(|m| m.matched_blocks).collect::<Vec<_>>(), [1; 5]);
    f.shutdown().await;
    for s in stops {
        let _ = s.send(());
    }
}

#[tokio::test]
async fn a_resync_bound_of_0_is_1_and_a_huge_one_is_accepted() {
    let slots = |n| Follower::new(cfg(n)).resync_slots();
    assert_eq!(slots(0), ResyncSlots { limit: 1, in_flight: 0, waiting: 0 });
    assert_eq!(slots(usize::MAX).in_flight, 0);
}

#[tokio::test]
async fn a_syncing_worker_is_reported_and_left_out_of_match() {
    let relay = Slow::new();
    let (urls, stops) = serve(&relay, 1).await;
    let f = Follower::new(cfg(16));
    f.add_relay(&urls[0]).unwrap();
    until("the snapshot begun", || f.relays()[0].staging).await;
    assert_eq!(states(&f), [WorkerState::Syncing]);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop_http, http_stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(http::serve(listener, f.clone(), async {
        let _ = http_stopped.await;
    }));
    let body = format!("{{\"block_hashes\": [{HASH}]}}");
    let (code, answer) = http_call(addr, "POST", "/match", &body).await;
    assert_eq!((code, answer.as_str()), (200, "{\"blocks\":1,\"workers\":[]}"));
    let (code, workers) = http_call(addr, "GET", "/workers", "").await;
    let workers: serde_json::Value = serde_json::from_str(&workers).unwrap();
    assert_eq!(code, 200);
    assert_eq!(workers["workers"][0]["state"], "syncing");
    assert_eq!(workers["relays"][0]["syncing"], true);
    let metrics = prometheus_text(&f);
    for line in
        ["kv_router_workers{state=\"syncing\"} 1", "kv_router_resyncs_in_flight 1", "kv_router_resyncs_waiting 0"]
    {
        assert!(metrics.lines().any(|l| l == line), "{line} in\n{metrics}");
    }
    relay.gate.add_permits(1);
    until("fresh", || states(&f) == [WorkerState::Fresh]).await;
    let (code, answer) = http_call(addr, "POST", "/match", &body).await;
    let answer: serde_json::Value = serde_json::from_str(&answer).unwrap();
    assert_eq!(code, 200);
    assert_eq!(
        (answer["workers"][0]["matched_blocks"].as_u64(), answer["workers"][0]["state"].as_str()),
        (Some(1), Some("fresh"))
    );
    assert_eq!(answer["workers"].as_array().map(Vec::len), Some(1));
    let metrics = prometheus_text(&f);
    for line in [
        "kv_router_workers{state=\"syncing\"} 0",
        "kv_router_resyncs_in_flight 0",
        "kv_router_workers{state=\"fresh\"} 1",
    ] {
        assert!(metrics.lines().any(|l| l == line), "{line} in\n{metrics}");
    }
    let _ = stop_http.send(());
    server.await.unwrap().unwrap();
    f.shutdown().await;
    for s in stops {
        let _ = s.send(());
    }
}
