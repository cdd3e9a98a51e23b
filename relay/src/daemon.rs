//! The daemon: `run(config, shutdown)` wires ingest → commit → serve, and is what the binary
//! and the tests call.
//!
//! * The ingest's rank threads **commit their own batches** (`crate::commit`): each batch gets
//!   its rank's latest load, and what a thread decoded since its socket was last empty goes to
//!   the store as one group. When the store fails (disk full, read-only), the thread keeps the
//!   records, counts the error, and retries with backoff: its SUB queue then backs up onto the
//!   engine's socket, and nothing is dropped.
//! * The **load scraper** polls the engine's `/metrics` (its load, and its progress counters).
//! * The **engine watch** (`crate::watch`) probes its health endpoint and judges each rank's
//!   liveness, which every batch, heartbeat and `Status` then carries.
//! * **Heartbeats**: every `heartbeat` interval, each rank that has been quiet that long gets a
//!   heartbeat with its load, live only (not in the history).

use crate::commit::Commits;
use crate::config::Config;
use crate::ingest::liveness::{Livenesses, Progress};
use crate::ingest::{self, load::Loads, Ingest, Resume};
use crate::model::Load;
use crate::server::{self, ServerConfig};
use crate::shutdown::{Shutdown, ShutdownTrigger};
use crate::status::{notice_channel, Notice, RelayStatusHandle};
use crate::store::{CheckpointPolicy, HistoryLimits, Store, StoreConfig, StoreError};
use crate::sync::{Locked, ReadWrite};
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::broadcast;

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
    let status = RelayStatusHandle::new(engine_name(&cfg));
    status.add_ranks(cfg.ingest.dp_ranks.iter().copied());
    status.set_engine_url(cfg.engine_url.clone());
    // Where each rank stands after a restart, before its next batch is committed.
    for (&r, res) in &resume {
        status.batch_committed(r, res.last_seq, 0);
    }
    let loads: Arc<RwLock<Loads>> = Arc::default();
    let progress: Arc<Mutex<Progress>> = Arc::default();
    let liveness: Livenesses = Arc::default();
    let notices = notice_channel();
    // Each rank's thread commits its own batches; set when the store failed for good (see
    // `commit::STORE_FAILED_EXIT_AFTER`).
    // The one stop of the daemon's tasks, and of the commits' retries, set once the server is done.
    let stop = ShutdownTrigger::new();
    let commits = Commits::new(store.clone(), loads.clone(), liveness.clone(), status.clone(), stop.subscribe());
    let mut failed_rx = commits.failed();
    let ctx = zmq::Context::new();
    let group = cfg.ingest.group_batches;
    let ingest = Ingest::start(&cfg.ingest, ctx, &resume, |rank| Box::new(commits.for_rank(rank, group)))?;
    let shutdown = async move {
        tokio::select! {
            _ = shutdown => {}
            _ = failed_rx.wait_for(|f| *f) => {}
        }
    };
    let mut tasks = Vec::new();
    if let Some(url) = cfg.engine_metrics_url.clone() {
        let scrape = Scrape { url, every: cfg.load_poll, loads: loads.clone(), progress: progress.clone() };
        tasks.push(tokio::spawn(scrape_loop(scrape, status.clone(), stop.subscribe())));
    }
    if let Some(lc) = cfg.liveness.clone() {
        let watch = crate::watch::Watch {
            cfg: lc,
            ranks: ingest.status.clone(),
            loads: loads.clone(),
            progress: progress.clone(),
            liveness: liveness.clone(),
            status: status.clone(),
            notices: notices.clone(),
        };
        tasks.push(tokio::spawn(watch.run(stop.subscribe())));
    }
    tasks.push(tokio::spawn(heartbeat_loop(
        cfg.heartbeat,
        ingest.status.clone(),
        loads.clone(),
        notices.clone(),
        stop.subscribe(),
    )));
    tasks.push(tokio::spawn(status_loop(ingest.status.clone(), status.clone(), stop.subscribe())));
    tasks.push(tokio::spawn(store_gauges_loop(store.clone(), status.clone(), stop.subscribe())));

    on_ready(Running { store: store.clone(), status: status.clone(), listen });
    let server_cfg = ServerConfig { listen, ..cfg.server.clone() };
    let served = server::serve(server_cfg, store.clone(), status, notices, listener, shutdown).await;

    stop.trigger();
    for t in tasks {
        let _ = t.await;
    }
    // The rank threads commit what they hold and stop (a commit the store refuses, on a full
    // disk, is given up rather than retried once the stop is set: the engine's replay refills it
    // at the next start).
    tokio::task::spawn_blocking(move || ingest.stop()).await.ok();
    if let Err(e) = store.flush() {
        tracing::error!(error = %e, "flushing the store at shutdown");
    }
    if let Some(e) = commits.take_failure() {
        return Err(DaemonError::Store(e));
    }
    served.map_err(|e| DaemonError::Serve(e.to_string()))
}

fn engine_name(cfg: &Config) -> String {
    format!("{} ({} ranks)", cfg.ingest.endpoint, cfg.ingest.dp_ranks.len())
}

/// Exports the store's and the server's sizes as gauges, every second: history size, live blocks
/// and copies by rank, tier and group, and the subscribers connected.
async fn store_gauges_loop(store: Store, status: RelayStatusHandle, mut stop: Shutdown) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut seen: std::collections::BTreeSet<(String, String, String)> = Default::default();
    loop {
        tokio::select! {
            _ = stop.recv() => return,
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
async fn status_loop(ranks: BTreeMap<u32, ingest::SharedRankStatus>, status: RelayStatusHandle, mut stop: Shutdown) {
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    loop {
        tokio::select! {
            _ = stop.recv() => return,
            _ = tick.tick() => {}
        }
        for (&rank, st) in &ranks {
            let s = st.locked().clone();
            status.set_rank_health(rank, s.health.clone(), s.stopped);
            status.set_hash_check(rank, s.hash_check.clone());
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

/// What the load scraper reads and where it writes.
struct Scrape {
    url: String,
    every: Duration,
    loads: Arc<RwLock<Loads>>,
    progress: Arc<Mutex<Progress>>,
}

async fn scrape_loop(sc: Scrape, status: RelayStatusHandle, mut stop: Shutdown) {
    let Scrape { url, every, loads, progress } = sc;
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    loop {
        tokio::select! {
            _ = stop.recv() => return,
            _ = tick.tick() => {}
        }
        match ingest::load::scrape(&url, every.max(Duration::from_secs(1))).await {
            Ok(text) => {
                let now = now_ms();
                *loads.writing() = ingest::load::parse(&text, now);
                progress.locked().observe(now, &ingest::load::progress(&text));
                if failing {
                    tracing::info!(%url, "engine metrics reachable again");
                }
                failing = false;
                status.set_counter("engine_metrics_reachable", 1);
                let loads = loads.reading();
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
    mut stop: Shutdown,
) {
    let mut tick = tokio::time::interval(every);
    loop {
        tokio::select! {
            _ = stop.recv() => return,
            _ = tick.tick() => {}
        }
        for (&rank, st) in &ranks {
            let quiet = st.locked().last_batch_at.is_none_or(|t| t.elapsed() >= every);
            if quiet {
                let load: Option<Load> = ingest::load::for_rank(&loads.reading(), rank);
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
}
