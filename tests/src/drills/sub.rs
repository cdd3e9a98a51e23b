//! A small resuming subscriber: what a router does with one relay's Subscribe stream, kept
//! simple and fully observable for the drills. It holds the live blocks (copies counted) in a
//! [`LiveBlocks`], resumes with (epoch, cursor, incarnation) after any disconnect, swaps a
//! snapshot in whole at its end, and counts everything it sees (gaps, duplicates, snapshots by
//! reason, resyncs, error codes).

use kv_relay::live::{LiveBlocks, LiveKey};
use kv_relay::model::{ControlKind, RecordBody};
use kv_relay::server::convert::{record_from_subscribe, snapshot_block_from_pb};
use kv_relay_proto::pb;
use pb::relay_client::RelayClient;
use pb::subscribe_response::Message as M;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What one subscriber holds and has seen.
#[derive(Debug, Clone, Default)]
pub struct SubState {
    /// The live blocks it holds (applied records, or the last snapshot and what followed).
    pub live: LiveBlocks,
    pub epoch: u64,
    /// The cursor of the last record (or snapshot end) applied.
    pub cursor: u64,
    pub incarnation: u32,
    /// Records applied.
    pub records: u64,
    /// A record whose cursor was not the next one, outside a snapshot: must never happen.
    pub gaps: u64,
    /// A record at or before the cursor held (skipped).
    pub duplicates: u64,
    /// Snapshots swapped in, by reason (`SnapshotReason` names).
    pub snapshots: BTreeMap<String, u64>,
    /// `Resync` messages received (the relay said this subscriber fell behind its history).
    pub resyncs: u64,
    /// Ranks a control said are degraded and no later control recovered or reset.
    pub degraded: BTreeSet<u32>,
    /// Every control received: (rank, kind name).
    pub controls: Vec<(u32, &'static str)>,
    /// Stream ends and failed calls, by status code or cause.
    pub errors: BTreeMap<String, u64>,
    /// Streams opened.
    pub connects: u64,
    /// The newest cursor heartbeats reported.
    pub heartbeat_newest: u64,
    /// When the last message of any kind arrived.
    pub last_message: Option<Instant>,
}

impl SubState {
    /// The live blocks without empty sets.
    pub fn blocks(&self) -> BTreeMap<LiveKey, BTreeMap<u64, u32>> {
        self.live.blocks.iter().filter(|(_, s)| !s.is_empty()).map(|(k, s)| (k.clone(), s.clone())).collect()
    }

    pub fn snapshot_count(&self) -> u64 {
        self.snapshots.values().sum()
    }
}

/// A running subscriber (a task on the drill's runtime).
pub struct Subscriber {
    pub state: Arc<Mutex<SubState>>,
    /// While set, the subscriber reads nothing (a stalled router).
    paused: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Subscriber {
    /// Follows the relay at `url` (`http://127.0.0.1:port`), sleeping `pace` after each message
    /// (a slow reader), starting from `from` (a restarted router's saved position) or nothing.
    /// A slow reader also uses 64 KiB HTTP/2 windows instead of tonic's megabytes, so the relay
    /// notices it within seconds rather than after megabytes of buffering in the client.
    pub fn start(rt: &tokio::runtime::Handle, url: String, pace: Duration, from: Option<SubState>) -> Subscriber {
        let state = Arc::new(Mutex::new(from.unwrap_or_default()));
        let paused = Arc::new(AtomicBool::new(false));
        let task = rt.spawn(follow(url, state.clone(), pace, paused.clone()));
        Subscriber { state, paused, task }
    }

    /// Stops (or restarts) reading its stream, keeping the connection open.
    pub fn set_paused(&self, on: bool) {
        self.paused.store(on, Ordering::SeqCst);
    }

    pub fn get(&self) -> SubState {
        self.state.lock().expect("sub state").clone()
    }

    /// Stops following and returns what it held.
    pub fn stop(self) -> SubState {
        self.task.abort();
        let s = self.state.lock().expect("sub state").clone();
        s
    }
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn note(state: &Mutex<SubState>, what: String) {
    *state.lock().expect("sub state").errors.entry(what).or_default() += 1;
}

async fn connect(url: &str, small_window: bool) -> Result<Client, tonic::transport::Error> {
    let mut ep = tonic::transport::Channel::from_shared(url.to_string())
        .expect("relay url")
        .connect_timeout(Duration::from_secs(2));
    if small_window {
        ep = ep.initial_stream_window_size(64 << 10).initial_connection_window_size(64 << 10);
    }
    Ok(RelayClient::new(ep.connect().await?).max_decoding_message_size(64 << 20))
}

type Client = RelayClient<tonic::transport::Channel>;

async fn follow(url: String, state: Arc<Mutex<SubState>>, pace: Duration, paused: Arc<AtomicBool>) {
    let mut backoff = Duration::from_millis(20);
    loop {
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_millis(500));
        let mut client = match connect(&url, !pace.is_zero()).await {
            Ok(c) => c,
            Err(_) => {
                note(&state, "connect".into());
                continue;
            }
        };
        // A first subscription learns the epoch from Status, so a later resume carries it.
        let needs_epoch = state.lock().expect("sub state").epoch == 0;
        if needs_epoch {
            match client.status(pb::StatusRequest {}).await {
                Ok(s) => {
                    let mut st = state.lock().expect("sub state");
                    if st.cursor == 0 {
                        st.epoch = s.into_inner().epoch;
                    }
                }
                Err(s) => {
                    note(&state, format!("status {:?}", s.code()));
                    continue;
                }
            }
        }
        let req = {
            let st = state.lock().expect("sub state");
            pb::SubscribeRequest {
                epoch: st.epoch,
                after_cursor: st.cursor,
                incarnation: st.incarnation,
                allow_snapshot: true,
                ranks: vec![],
                snapshot_token_ids: false,
            }
        };
        let mut stream = match client.subscribe(req).await {
            Ok(r) => r.into_inner(),
            Err(s) => {
                note(&state, format!("{:?}", s.code()));
                continue;
            }
        };
        state.lock().expect("sub state").connects += 1;
        let mut staged: Option<(LiveBlocks, u64, String)> = None;
        loop {
            match stream.message().await {
                Ok(Some(m)) => {
                    backoff = Duration::from_millis(20);
                    handle(&state, &mut staged, m);
                    if !pace.is_zero() {
                        tokio::time::sleep(pace).await;
                    }
                    while paused.load(Ordering::SeqCst) {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
                Ok(None) => {
                    note(&state, "stream ended".into());
                    break;
                }
                Err(s) => {
                    note(&state, format!("{:?}", s.code()));
                    break;
                }
            }
        }
    }
}

fn control_name(k: &ControlKind) -> &'static str {
    match k {
        ControlKind::RankReset { .. } => "rank_reset",
        ControlKind::RankDegraded { .. } => "rank_degraded",
        ControlKind::RankIncomplete { .. } => "rank_incomplete",
        ControlKind::RankRecovered => "rank_recovered",
    }
}

fn handle(state: &Mutex<SubState>, staged: &mut Option<(LiveBlocks, u64, String)>, m: pb::SubscribeResponse) {
    let mut st = state.lock().expect("sub state");
    st.last_message = Some(Instant::now());
    match &m.message {
        Some(M::SnapshotBegin(b)) => {
            let reason = pb::SnapshotReason::try_from(b.reason)
                .map(|r| r.as_str_name().to_string())
                .unwrap_or_else(|_| b.reason.to_string());
            *staged = Some((LiveBlocks::new(), b.epoch, reason));
        }
        Some(M::SnapshotChunk(c)) => {
            if let Some((live, _, _)) = staged.as_mut() {
                for b in &c.blocks {
                    match snapshot_block_from_pb(b) {
                        Ok(sb) => {
                            let key = LiveKey { dp_rank: sb.dp_rank, tier: sb.tier, group: sb.group };
                            live.blocks.entry(key).or_default().insert(sb.hash, sb.copies);
                        }
                        Err(e) => *st.errors.entry(format!("snapshot block: {e}")).or_default() += 1,
                    }
                }
            }
        }
        Some(M::SnapshotEnd(e)) => {
            if let Some((live, epoch, reason)) = staged.take() {
                st.live = live;
                st.epoch = epoch;
                st.cursor = e.cursor;
                st.incarnation = e.incarnation;
                *st.snapshots.entry(reason).or_default() += 1;
            }
        }
        Some(M::Heartbeat(h)) => st.heartbeat_newest = st.heartbeat_newest.max(h.newest_cursor),
        Some(M::Resync(_)) => st.resyncs += 1,
        Some(M::Batch(_)) | Some(M::Control(_)) => match record_from_subscribe(&m) {
            Some(Ok(rec)) => {
                if rec.cursor <= st.cursor {
                    st.duplicates += 1;
                    return;
                }
                if rec.cursor != st.cursor + 1 {
                    st.gaps += 1;
                }
                st.cursor = rec.cursor;
                st.incarnation = rec.incarnation;
                st.records += 1;
                match &rec.body {
                    RecordBody::Batch { batch, .. } => st.live.apply(batch),
                    RecordBody::Control(c) => {
                        match &c.kind {
                            ControlKind::RankReset { .. } => {
                                st.live.reset_rank(c.dp_rank);
                                st.degraded.remove(&c.dp_rank);
                            }
                            ControlKind::RankDegraded { .. } => {
                                st.degraded.insert(c.dp_rank);
                            }
                            ControlKind::RankRecovered => {
                                st.degraded.remove(&c.dp_rank);
                            }
                            ControlKind::RankIncomplete { .. } => {}
                        }
                        st.controls.push((c.dp_rank, control_name(&c.kind)));
                    }
                }
            }
            Some(Err(e)) => *st.errors.entry(format!("record: {e}")).or_default() += 1,
            None => {}
        },
        None => {}
    }
}
