//! The follower against a scripted gRPC relay on `127.0.0.1:0`: each Subscribe gets the next
//! scripted stream (then silence), and every request is recorded, so the tests see exactly
//! where the follower resumes from.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kv_relay_proto::pb;
use kv_relay_proto::pb::relay_server::Relay;
use kv_relay_proto::pb::Tier::Device;
use kv_router_client::backoff::BackoffConfig;
use kv_router_client::{FollowConfig, Follower, WorkerState};
use tokio::sync::oneshot;
use tonic::{Request, Response, Status};

use crate::util::{batch, serve_relay, stored, BoxStream};

const EPOCH: u64 = 4242;
const T: Duration = Duration::from_secs(20);

type Script = Vec<Result<pb::SubscribeResponse, Status>>;

#[derive(Clone, Default)]
struct Scripted {
    requests: Arc<Mutex<Vec<pb::SubscribeRequest>>>,
    scripts: Arc<Mutex<VecDeque<Script>>>,
}

#[tonic::async_trait]
impl Relay for Scripted {
    type SubscribeStream = BoxStream<pb::SubscribeResponse>;
    type HistoryStream = BoxStream<pb::HistoryResponse>;
    type SnapshotStream = BoxStream<pb::SnapshotResponse>;

    async fn subscribe(&self, r: Request<pb::SubscribeRequest>) -> Result<Response<Self::SubscribeStream>, Status> {
        self.requests.lock().unwrap().push(r.into_inner());
        let script = self.scripts.lock().unwrap().pop_front().unwrap_or_default();
        // The script, then silence (no heartbeat either).
        let s = tokio_stream::StreamExt::chain(tokio_stream::iter(script), tokio_stream::pending());
        Ok(Response::new(Box::pin(s)))
    }

    async fn status(&self, _: Request<pb::StatusRequest>) -> Result<Response<pb::StatusResponse>, Status> {
        Ok(Response::new(pb::StatusResponse { epoch: EPOCH, ..Default::default() }))
    }

    async fn history(&self, _: Request<pb::HistoryRequest>) -> Result<Response<Self::HistoryStream>, Status> {
        Err(Status::unimplemented("scripted"))
    }

    async fn snapshot(&self, _: Request<pb::SnapshotRequest>) -> Result<Response<Self::SnapshotStream>, Status> {
        Err(Status::unimplemented("scripted"))
    }
}

async fn start(scripts: Vec<Script>) -> (Scripted, String, oneshot::Sender<()>) {
    let relay = Scripted::default();
    relay.scripts.lock().unwrap().extend(scripts);
    let (url, stop) = serve_relay(relay.clone()).await;
    (relay, url, stop)
}

fn cfg(receive_timeout: Duration) -> FollowConfig {
    FollowConfig {
        receive_timeout,
        backoff: BackoffConfig {
            initial: Duration::from_millis(10),
            max: Duration::from_millis(50),
            multiplier: 2.0,
            jitter: 0.5,
        },
        ..FollowConfig::default()
    }
}

async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + T;
    while !cond() {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn positions(r: &Scripted) -> Vec<(u64, u64, u32, bool)> {
    r.requests.lock().unwrap().iter().map(|q| (q.epoch, q.after_cursor, q.incarnation, q.allow_snapshot)).collect()
}

fn b(cursor: u64, hash: u64) -> Result<pb::SubscribeResponse, Status> {
    Ok(batch(cursor, 0, vec![stored(Device, &[hash])]))
}

#[tokio::test]
async fn a_gap_resubscribes_after_the_last_applied_cursor() {
    let (relay, url, stop) = start(vec![vec![b(1, 10), b(2, 20), b(4, 40)], vec![b(3, 30), b(4, 40)]]).await;
    let f = Follower::new(cfg(Duration::from_secs(5)));
    f.add_relay(&url).unwrap();
    until("cursor 4", || f.relays()[0].cursor == 4).await;
    // First start: the relay's epoch from Status, cursor 0; then resumed after cursor 2.
    assert_eq!(positions(&relay), [(EPOCH, 0, 0, true), (EPOCH, 2, 1, true)]);
    let c = f.counters();
    assert_eq!((c.gaps, c.duplicates, c.records_applied, c.reconnects), (1, 0, 4, 1));
    assert_eq!(f.index().lookup(&[10]).len(), 1);
    assert_eq!(f.index().stats().blocks, 4);
    f.shutdown().await;
    let _ = stop.send(());
}

#[tokio::test]
async fn a_silent_stream_is_dropped_after_the_receive_timeout_and_resumed() {
    let (relay, url, stop) = start(vec![vec![b(1, 10)], vec![b(1, 10), b(2, 20)]]).await;
    let f = Follower::new(cfg(Duration::from_millis(300)));
    f.add_relay(&url).unwrap();
    until("cursor 2", || f.relays()[0].cursor == 2).await;
    assert_eq!(positions(&relay), [(EPOCH, 0, 0, true), (EPOCH, 1, 1, true)]);
    let c = f.counters();
    assert_eq!((c.receive_timeouts, c.duplicates, c.records_applied), (1, 1, 2));
    f.shutdown().await;
    let _ = stop.send(());
}

#[tokio::test]
async fn a_refusal_is_retried_with_backoff_and_the_worker_reported_unreachable() {
    let refusal = || vec![Err(Status::unavailable("relay shutting down"))];
    let (relay, url, stop) = start(vec![vec![b(1, 10)], refusal(), refusal(), vec![b(2, 20)]]).await;
    let f = Follower::new(cfg(Duration::from_millis(200)));
    f.add_relay(&url).unwrap();
    until("cursor 1", || f.relays()[0].cursor == 1).await;
    until("unreachable", || f.workers().iter().any(|w| w.state == WorkerState::RelayUnreachable)).await;
    until("cursor 2", || f.relays()[0].cursor == 2).await;
    assert_eq!(positions(&relay).last(), Some(&(EPOCH, 1, 1, true)));
    assert!(f.relays()[0].connected);
    f.shutdown().await;
    let _ = stop.send(());
}
