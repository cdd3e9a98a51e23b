//! The daemon: `run(config, shutdown)` wires ingest → commit → serve, and is what the binary
//! and the tests call.
//!
//! * The ingest's rank threads hand items to the **committer**, a thread of its own that owns the
//!   store's write side: it attaches the rank's latest load to each batch and commits it. When
//!   the store fails (disk full, read-only), the committer keeps the item, counts the error,
//!   and retries with backoff: the bounded queue then backs up onto the engine's sockets, and
//!   nothing is dropped.
//! * The **load scraper** polls the engine's `/metrics`.
//! * **Heartbeats**: every `heartbeat` interval, each rank that has been quiet that long gets a
//!   heartbeat with its load, live only (not in the history).

use crate::config::Config;
use crate::ingest::{self, load::Loads, Ingest, IngestItem, Resume};
use crate::model::{Control, ControlKind, Load, RecordBody};
use crate::server::status::{notice_channel, HashCheckCounts, Notice, RankState, RelayStatusHandle};
use crate::server::{self, ServerConfig};
use crate::store::{CheckpointPolicy, HistoryLimits, Store, StoreConfig, StoreError};
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::{broadcast, mpsc};

/// Why the daemon could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("store: {0}")]
    Store(#[from] StoreError),
    #[error("binding the gRPC listener on {0}: {1}")]
    Listen(std::net::SocketAddr, std::io::Error),
    #[error("starting the metrics listener on {0}: {1}")]
    Metrics(std::net::SocketAddr, String),
    #[error("ingest: {0}")]
    Endpoint(#[from] ingest::endpoint::EndpointError),
    #[error("gRPC server: {0}")]
    Serve(String),
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// What a running daemon exposes to its caller (tests, the demo).
#[derive(Clone)]
pub struct Running {
    pub store: Store,
    pub status: RelayStatusHandle,
    pub listen: std::net::SocketAddr,
}

/// The store's settings from the relay's: its directory, history bounds and page cache.
fn store_config(cfg: &Config) -> StoreConfig {
    StoreConfig {
        limits: HistoryLimits { max_batches: cfg.history_batches, max_bytes: cfg.history_bytes },
        cache_bytes: cfg.store_cache_bytes,
        // Recovery replays at most about half a history of log after the newest checkpoint.
        checkpoint: CheckpointPolicy::default(),
        ..StoreConfig::new(cfg.state_dir.clone())
    }
}

/// Runs the relay until `shutdown` completes. `on_ready` is called once the store is open and
/// the listener bound (systemd's READY=1).
pub async fn run(
    cfg: Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
    on_ready: impl FnOnce(Running) + Send,
) -> Result<(), DaemonError> {
    let store = Store::open(store_config(&cfg))?;
    if cfg.ingest.replay_endpoint.is_none() {
        tracing::warn!(
            "no replay endpoint configured: batches the relay misses cannot be refilled, and a restarted relay \
             cannot learn what the engine announced before; set --replay-endpoint"
        );
    }
    if let Some(addr) = cfg.metrics_listen {
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .with_http_listener(addr)
            .install()
            .map_err(|e| DaemonError::Metrics(addr, e.to_string()))?;
    }
    let listener = tokio::net::TcpListener::bind(cfg.listen).await.map_err(|e| DaemonError::Listen(cfg.listen, e))?;
    let listen = listener.local_addr().map_err(|e| DaemonError::Listen(cfg.listen, e))?;

    let resume: BTreeMap<u32, Resume> = cfg
        .ingest
        .dp_ranks
        .iter()
        .filter_map(|&r| {
            let s = store.rank_state(r)?;
            Some((r, Resume { last_seq: s.last_seq?, last_ts: s.last_ts? }))
        })
        .collect();
    let (tx, rx) = mpsc::channel::<IngestItem>(cfg.ingest.queue);
    let ctx = zmq::Context::new();
    let ingest = Ingest::start(&cfg.ingest, ctx, &resume, tx)?;
    let status = RelayStatusHandle::new(engine_name(&cfg));
    status.add_ranks(cfg.ingest.dp_ranks.iter().copied());
    // Where each rank stands after a restart, before its next batch is committed.
    for (&r, res) in &resume {
        status.batch_committed(r, res.last_seq, 0);
    }
    let loads: Arc<RwLock<Loads>> = Arc::default();
    let notices = notice_channel();

    // Set by the committer when the store failed for good (see `STORE_FAILED_EXIT_AFTER`).
    let store_failed: Arc<std::sync::Mutex<Option<StoreError>>> = Arc::default();
    let (failed_tx, mut failed_rx) = tokio::sync::watch::channel(false);
    let committer = {
        let (store, loads, status) = (store.clone(), loads.clone(), status.clone());
        std::thread::Builder::new()
            .name("committer".into())
            .spawn({
                let store_failed = store_failed.clone();
                move || commit_loop(rx, store, loads, status, (failed_tx, store_failed))
            })
            .expect("spawning the committer")
    };
    let shutdown = async move {
        tokio::select! {
            _ = shutdown => {}
            _ = failed_rx.wait_for(|f| *f) => {}
        }
    };
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut tasks = Vec::new();
    if let Some(url) = cfg.engine_metrics_url.clone() {
        tasks.push(tokio::spawn(scrape_loop(url, cfg.load_poll, loads.clone(), status.clone(), stop_rx.clone())));
    }
    tasks.push(tokio::spawn(heartbeat_loop(
        cfg.heartbeat,
        ingest.status.clone(),
        loads.clone(),
        notices.clone(),
        stop_rx.clone(),
    )));
    tasks.push(tokio::spawn(status_loop(ingest.status.clone(), status.clone(), stop_rx.clone())));
    tasks.push(tokio::spawn(store_gauges_loop(store.clone(), status.clone(), stop_rx.clone())));

    on_ready(Running { store: store.clone(), status: status.clone(), listen });
    let server_cfg = ServerConfig { listen, ..cfg.server.clone() };
    let served = server::serve(server_cfg, store.clone(), status, notices, listener, shutdown).await;

    let _ = stop_tx.send(true);
    for t in tasks {
        let _ = t.await;
    }
    // The rank threads stop; then the channel closes and the committer drains what is queued.
    tokio::task::spawn_blocking(move || ingest.stop()).await.ok();
    tokio::task::spawn_blocking(move || committer.join()).await.ok();
    if let Err(e) = store.flush() {
        tracing::error!(error = %e, "flushing the store at shutdown");
    }
    if let Some(e) = store_failed.lock().unwrap_or_else(|p| p.into_inner()).take() {
        return Err(DaemonError::Store(e));
    }
    served.map_err(|e| DaemonError::Serve(e.to_string()))
}

/// How long the committer retries a store that failed and must be reopened (a sync of the log
/// failed, or a failed write could not be cut back) before the daemon stops with that error, so
/// that its supervisor (systemd `Restart=on-failure`, a pod's restart policy) reopens the store:
/// the reopened store holds every commit whose frame is whole on disk, and the relay refills the
/// rest from the engine's replay socket. A full disk does not fail the store: commits are
/// refused, and retried, until there is room. Meanwhile Status and metrics show the errors.
pub const STORE_FAILED_EXIT_AFTER: Duration = Duration::from_secs(5);

fn engine_name(cfg: &Config) -> String {
    format!("{} ({} ranks)", cfg.ingest.endpoint, cfg.ingest.dp_ranks.len())
}

/// The ingest lag a rank reports: the largest of the batches committed in the last
/// [`LAG_WINDOW`]. A delayed publisher's held batches arrive in one burst, oldest first, and
/// are committed together with the newest: the last batch's lag alone would hide the delay.
#[derive(Default)]
struct LagWindow {
    since: Option<Instant>,
    max_ms: u64,
}

/// How long a lag stays reported after its batch was committed.
const LAG_WINDOW: Duration = Duration::from_secs(2);

impl LagWindow {
    /// Adds a committed batch's lag; returns the lag to report.
    fn add(&mut self, lag_ms: u64) -> u64 {
        match self.since {
            Some(t) if t.elapsed() < LAG_WINDOW => self.max_ms = self.max_ms.max(lag_ms),
            _ => {
                self.since = Some(Instant::now());
                self.max_ms = lag_ms;
            }
        }
        self.max_ms
    }
}

/// Commits `group` one record at a time after the store refused it as a whole because a record
/// is one it cannot hold (`StoreError::Invalid`): each such record is dropped, logged and
/// counted (`store_refused`), and its rank marked degraded, in the stream and in the status,
/// since its blocks may no longer be the engine's. The decoder bounds what reaches the store,
/// so this is a guard, not a path: without it one such record would hold ingest for good. On
/// any other error the records not committed are left in `group`, in order, for the caller's
/// retry.
fn commit_holdable(store: &Store, group: &mut Vec<RecordBody>, status: &RelayStatusHandle) {
    let mut rest: std::collections::VecDeque<RecordBody> = std::mem::take(group).into();
    while let Some(body) = rest.pop_front() {
        let mut one = vec![body];
        match store.commit_group(&mut one) {
            Ok(_) => {}
            Err(e @ StoreError::Invalid { .. }) => {
                let (dp_rank, what, batch) = match &one[0] {
                    RecordBody::Batch { batch, .. } => (batch.dp_rank, format!("batch seq {}", batch.seq), true),
                    RecordBody::Control(c) => (c.dp_rank, "a control record".to_string(), false),
                };
                let reason = format!("{what} could not be stored ({e}) and was dropped");
                tracing::error!(dp_rank, %reason, "record dropped: the store cannot hold it");
                status.add("store_refused", 1);
                status.set_rank_state(dp_rank, RankState::Degraded, reason.clone());
                // A refused control is not answered with another (it could be refused in turn).
                if batch {
                    let degraded = Control { dp_rank, kind: ControlKind::RankDegraded { reason } };
                    rest.push_front(RecordBody::Control(degraded));
                }
            }
            Err(_) => {
                group.extend(one);
                group.extend(rest);
                return;
            }
        }
    }
}

/// Most records committed in one sled transaction: what is already queued when the committer
/// wakes, up to this many, goes in together.
const COMMIT_GROUP: usize = 256;

fn commit_loop(
    mut rx: mpsc::Receiver<IngestItem>,
    store: Store,
    loads: Arc<RwLock<Loads>>,
    status: RelayStatusHandle,
    failed: (tokio::sync::watch::Sender<bool>, Arc<std::sync::Mutex<Option<StoreError>>>),
) {
    let mut group: Vec<RecordBody> = Vec::with_capacity(COMMIT_GROUP);
    let mut batches: Vec<(u32, u64, f64)> = Vec::with_capacity(COMMIT_GROUP);
    let mut lag_window: BTreeMap<u32, LagWindow> = BTreeMap::new();
    while let Some(first) = rx.blocking_recv() {
        let mut next = Some(first);
        while let Some(item) = next.take() {
            group.push(match item {
                IngestItem::Batch { batch, .. } => {
                    let load = ingest::load::for_rank(&loads.read().expect("loads"), batch.dp_rank);
                    batches.push((batch.dp_rank, batch.seq, batch.ts));
                    RecordBody::Batch { batch, load }
                }
                IngestItem::Control(c) => RecordBody::Control(c),
            });
            if group.len() < COMMIT_GROUP {
                next = rx.try_recv().ok();
            }
        }
        let started = Instant::now();
        let records = group.len();
        let mut backoff = Duration::from_millis(50);
        loop {
            match store.commit_group(&mut group) {
                Ok(_) => break,
                Err(StoreError::Invalid { .. }) => {
                    // A record the store cannot hold: committing it again cannot help.
                    status.add("store_errors", 1);
                    commit_holdable(&store, &mut group, &status);
                    if group.is_empty() {
                        break;
                    }
                }
                Err(e) => {
                    status.add("store_errors", 1);
                    if matches!(e, StoreError::Failed { .. }) && started.elapsed() >= STORE_FAILED_EXIT_AFTER {
                        tracing::error!(error = %e, "the store must be reopened: stopping the relay so it restarts");
                        *failed.1.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                        failed.0.send_replace(true);
                        return;
                    }
                    // Keep the records and retry: the queue backs up onto the engine's sockets.
                    tracing::error!(error = %e, retry_in = ?backoff, "commit failed; ingest is held until the store accepts it");
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
        }
        metrics::histogram!("kv_relay_commit_seconds").record(started.elapsed().as_secs_f64());
        metrics::histogram!("kv_relay_commit_group_records").record(records as f64);
        let now = now_ms() as f64;
        for (rank, seq, ts) in batches.drain(..) {
            let lag_ms = lag_window.entry(rank).or_default().add((now - ts * 1000.0).max(0.0) as u64);
            metrics::gauge!("kv_relay_ingest_lag_seconds", "rank" => rank.to_string()).set(lag_ms as f64 / 1000.0);
            status.batch_committed(rank, seq, lag_ms);
        }
    }
}

/// Exports the store's and the server's sizes as gauges, every second: history size, live blocks
/// and copies by rank, tier and group, and the subscribers connected.
async fn store_gauges_loop(store: Store, status: RelayStatusHandle, mut stop: tokio::sync::watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut seen: std::collections::BTreeSet<(String, String, String)> = Default::default();
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            _ = tick.tick() => {}
        }
        let s = store.clone();
        let Ok((hist, live)) = tokio::task::spawn_blocking(move || (s.history_stats(), s.live_summary())).await else {
            continue;
        };
        metrics::gauge!("kv_relay_history_records").set(hist.batches as f64);
        metrics::gauge!("kv_relay_history_bytes").set(hist.bytes as f64);
        metrics::gauge!("kv_relay_subscribers").set(f64::from(status.get().subscribers));
        let mut now = std::collections::BTreeSet::new();
        for g in live {
            let key = (g.dp_rank.to_string(), g.tier.to_string(), g.group.to_string());
            metrics::gauge!("kv_relay_live_blocks", "rank" => key.0.clone(), "tier" => key.1.clone(), "group" => key.2.clone())
                .set(g.blocks as f64);
            metrics::gauge!("kv_relay_live_copies", "rank" => key.0.clone(), "tier" => key.1.clone(), "group" => key.2.clone())
                .set(g.copies as f64);
            now.insert(key);
        }
        // A group that emptied reads 0, not its last value.
        for (r, t, g) in seen.difference(&now) {
            metrics::gauge!("kv_relay_live_blocks", "rank" => r.clone(), "tier" => t.clone(), "group" => g.clone())
                .set(0.0);
            metrics::gauge!("kv_relay_live_copies", "rank" => r.clone(), "tier" => t.clone(), "group" => g.clone())
                .set(0.0);
        }
        seen = now;
    }
}

/// Copies the rank threads' view into the status the server reads, every 250 ms.
async fn status_loop(
    ranks: BTreeMap<u32, ingest::SharedRankStatus>,
    status: RelayStatusHandle,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            _ = tick.tick() => {}
        }
        for (&rank, st) in &ranks {
            let s = st.lock().expect("rank status").clone();
            let state = match (s.stopped, s.health) {
                (true, _) => RankState::Stopped,
                (false, ingest::Health::Ok) => RankState::Ok,
                (false, ingest::Health::Degraded) => RankState::Degraded,
                (false, ingest::Health::Incomplete) => RankState::Incomplete,
            };
            status.set_rank_state(rank, state, s.reason.clone().unwrap_or_default());
            status.set_hash_check(
                rank,
                s.hash_check.as_ref().map(|h| HashCheckCounts {
                    checked: h.checked,
                    mismatched: h.mismatched,
                    skipped: h.skipped_total(),
                }),
            );
            for (name, v) in [
                ("batches", s.batches),
                ("gaps", s.gaps),
                ("refilled_batches", s.refilled),
                ("lost_batches", s.lost),
                ("publisher_restarts", s.restarts),
                ("message_errors", s.message_errors),
                ("disconnects", s.disconnects),
                ("replay_cuts", s.replay_cuts),
            ] {
                status.set_counter(&format!("rank{rank}.{name}"), v);
            }
            for (reason, v) in &s.dropped.0 {
                status.set_counter(&format!("rank{rank}.dropped_events.{reason}"), *v);
            }
        }
    }
}

async fn scrape_loop(
    url: String,
    every: Duration,
    loads: Arc<RwLock<Loads>>,
    status: RelayStatusHandle,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            _ = tick.tick() => {}
        }
        match ingest::load::scrape(&url, every.max(Duration::from_secs(1))).await {
            Ok(text) => {
                *loads.write().expect("loads") = ingest::load::parse(&text, now_ms());
                if failing {
                    tracing::info!(%url, "engine metrics reachable again");
                }
                failing = false;
                status.set_counter("engine_metrics_reachable", 1);
                let loads = loads.read().expect("loads");
                for rank in status.get().ranks.keys() {
                    if let Some(l) = ingest::load::for_rank(&loads, *rank) {
                        status.set_load(*rank, l);
                    }
                }
            }
            Err(e) => {
                if !failing {
                    tracing::warn!(%url, error = %e, "engine metrics unreachable");
                }
                failing = true;
                status.set_counter("engine_metrics_reachable", 0);
                metrics::counter!("kv_relay_load_scrape_errors_total").increment(1);
            }
        }
    }
}

async fn heartbeat_loop(
    every: Duration,
    ranks: BTreeMap<u32, ingest::SharedRankStatus>,
    loads: Arc<RwLock<Loads>>,
    notices: broadcast::Sender<Notice>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(every);
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            _ = tick.tick() => {}
        }
        for (&rank, st) in &ranks {
            let quiet = st.lock().expect("rank status").last_batch_at.is_none_or(|t| t.elapsed() >= every);
            if quiet {
                let load: Option<Load> = ingest::load::for_rank(&loads.read().expect("loads"), rank);
                // No receiver is not an error: nobody is subscribed.
                let _ = notices.send(Notice::Heartbeat { dp_rank: rank, load });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn the_store_gets_the_relays_directory_bounds_and_cache() {
        let cfg = crate::config::Args::try_parse_from([
            "kv-relay",
            "--state-dir",
            "/var/lib/kv-relay/a",
            "--history-batches",
            "500",
            "--history-bytes",
            "2097152",
            "--store-cache-bytes",
            "8388608",
        ])
        .unwrap()
        .validate()
        .unwrap();
        let s = store_config(&cfg);
        assert_eq!(s.dir, std::path::PathBuf::from("/var/lib/kv-relay/a"));
        assert_eq!(s.limits, HistoryLimits { max_batches: 500, max_bytes: 2 << 20 });
        assert_eq!(s.cache_bytes, 8 << 20);
        assert_eq!(s.recent, StoreConfig::new("/var/lib/kv-relay/a").recent);
    }

    /// A record the store cannot hold is dropped, its rank marked degraded, and ingest goes on:
    /// it must not be retried for good (it would hold every later batch back).
    #[test]
    fn the_committer_drops_a_record_the_store_cannot_hold_and_goes_on() {
        use crate::model::{Batch, Block, Event, Group, Namespace, Stored, Tier, TokenLayout};
        let stored = |seq: u64, tier: Tier, hash: u64| IngestItem::Batch {
            batch: Batch {
                dp_rank: 1,
                seq,
                ts: 0.0,
                events: vec![Event::Stored(Stored {
                    tier,
                    group: Group::default(),
                    parent: None,
                    block_size: 16,
                    token_layout: TokenLayout::Single,
                    blocks: vec![Block { hash, token_ids: vec![], extra_keys: None }],
                    namespace: Namespace::default(),
                    session_id: None,
                    ownership: None,
                    lookahead_token_ids: None,
                    block_mm_infos: None,
                })],
            },
            drops: Default::default(),
            refilled: false,
        };
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(StoreConfig::new(dir.path())).unwrap();
        let status = RelayStatusHandle::new("test");
        let (tx, rx) = mpsc::channel(8);
        // Queued before the committer starts: the three go to the store as one group.
        for item in
            [stored(10, Tier::Device, 1), stored(11, Tier::Other("m".repeat(70_000)), 2), stored(12, Tier::Device, 3)]
        {
            tx.try_send(item).unwrap();
        }
        drop(tx);
        let failed = (tokio::sync::watch::channel(false).0, Arc::new(std::sync::Mutex::new(None)));
        commit_loop(rx, store.clone(), Arc::default(), status.clone(), failed);
        let reason =
            "batch seq 11 could not be stored (cannot store this tier: tier name of 70000 bytes) and was dropped";
        let got: Vec<(u64, String)> = store
            .history(0, 10)
            .unwrap()
            .into_iter()
            .map(|r| {
                let what = match r.body {
                    RecordBody::Batch { batch, .. } => format!("batch {}", batch.seq),
                    RecordBody::Control(c) => format!("{:?} of rank {}", c.kind, c.dp_rank),
                };
                (r.cursor, what)
            })
            .collect();
        assert_eq!(
            got,
            vec![
                (1, "batch 10".to_string()),
                (2, format!("RankDegraded {{ reason: {reason:?} }} of rank 1")),
                (3, "batch 12".to_string()),
            ]
        );
        let rank = status.rank(1).unwrap();
        assert_eq!((rank.state, rank.reason.as_str(), rank.last_engine_seq), (RankState::Degraded, reason, 12));
        assert_eq!(status.get().counters.get("store_refused"), Some(&1));
        assert_eq!(store.live_stats().blocks, 2);
    }
}
