//! The engine watch: its health endpoint probed every second, each rank judged with its progress
//! (the counters the load scraper reads, the KV batches the ingest receives) by
//! [`ingest::liveness::Judge`], and the result published: to the committers (every batch carries
//! it), to the status (`Status`, heartbeats), to the metrics, and, when a rank's state changes,
//! in a heartbeat sent at once.

use crate::config::LivenessConfig;
use crate::ingest::liveness::{self, Activity, Judge, Livenesses, Probe, Progress};
use crate::ingest::{self, load::Loads, SharedRankStatus};
use crate::model::EngineState;
use crate::shutdown::Shutdown;
use crate::status::{Notice, RelayStatusHandle};
use crate::sync::{Locked, ReadWrite};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::{broadcast, watch};

/// How often the health endpoint is probed.
pub const PROBE_EVERY: Duration = Duration::from_secs(1);

/// How often each rank is judged (progress is seen at the load scraper's pace).
const JUDGE_EVERY: Duration = Duration::from_millis(250);

const STATES: [EngineState; 4] =
    [EngineState::Alive, EngineState::Unreachable, EngineState::Wedged, EngineState::Stopped];

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// What the watch reads and writes.
pub struct Watch {
    pub cfg: LivenessConfig,
    pub ranks: BTreeMap<u32, SharedRankStatus>,
    pub loads: Arc<RwLock<Loads>>,
    pub progress: Arc<Mutex<Progress>>,
    pub liveness: Livenesses,
    pub status: RelayStatusHandle,
    pub notices: broadcast::Sender<Notice>,
}

/// Probes the health endpoint every [`PROBE_EVERY`] (each probe waits at most the configured
/// timeout), publishing each answer.
async fn probe_loop(url: String, timeout: Duration, tx: watch::Sender<Option<Probe>>, mut stop: Shutdown) {
    let mut tick = tokio::time::interval(PROBE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.recv() => return,
            _ = tick.tick() => {}
        }
        let p = tokio::select! {
            _ = stop.recv() => return,
            p = liveness::probe(&url, timeout) => p,
        };
        if p != Probe::Healthy {
            metrics::counter!("kv_relay_engine_health_probe_errors_total").increment(1);
        }
        tx.send_if_modified(|old| {
            let changed = old.as_ref() != Some(&p);
            *old = Some(p);
            changed
        });
    }
}

impl Watch {
    /// Runs until `stop` is set.
    pub async fn run(self, mut stop: Shutdown) {
        // Nothing is judged before the first probe answers; each answer that differs from the
        // last is judged when it comes, not at the next tick.
        let (probe_tx, mut probe_rx) = watch::channel(None);
        let prober =
            tokio::spawn(probe_loop(self.cfg.health_url.clone(), self.cfg.probe_timeout, probe_tx, stop.clone()));
        let mut judge = Judge::new(self.cfg.wedge_after);
        let mut tick = tokio::time::interval(JUDGE_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stop.recv() => break,
                _ = tick.tick() => {}
                r = probe_rx.changed() => {
                    if r.is_err() {
                        break;
                    }
                }
            }
            let probe = probe_rx.borrow_and_update().clone();
            if let Some(probe) = probe {
                self.judge_all(&mut judge, &probe);
            }
        }
        let _ = prober.await;
    }

    fn judge_all(&self, judge: &mut Judge, probe: &Probe) {
        let now = now_ms();
        for (&rank, st) in &self.ranks {
            let batch_at = st.locked().last_batch_at.map(|t| now.saturating_sub(t.elapsed().as_millis() as u64));
            let moved_at = self.progress.locked().moved_at(rank);
            let busy = ingest::load::for_rank(&self.loads.reading(), rank).is_some_and(|l| l.running + l.waiting > 0.0);
            let progressed_at_ms = batch_at.max(moved_at);
            let (l, changed) = judge.judge(now, rank, probe, Activity { busy, progressed_at_ms });
            if changed {
                match l.state {
                    EngineState::Alive => tracing::info!(rank, "engine alive"),
                    s => tracing::warn!(rank, state = s.as_str(), reason = %l.reason, "engine not alive"),
                }
                let label = rank.to_string();
                for s in STATES {
                    let v = if s == l.state { 1.0 } else { 0.0 };
                    metrics::gauge!("kv_relay_engine_liveness", "rank" => label.clone(), "state" => s.as_str()).set(v);
                }
                metrics::counter!("kv_relay_engine_liveness_changes_total", "rank" => label, "state" => l.state.as_str())
                    .increment(1);
            }
            self.liveness.writing().insert(rank, l.clone());
            self.status.set_liveness(rank, l);
            if changed {
                let load = ingest::load::for_rank(&self.loads.reading(), rank);
                // No receiver is not an error: nobody is subscribed.
                let _ = self.notices.send(Notice::Heartbeat { dp_rank: rank, load });
            }
        }
    }
}
