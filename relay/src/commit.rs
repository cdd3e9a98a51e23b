//! The commit path: each rank's thread commits its own batches ([`RankCommitter`], the relay's
//! [`Sink`]), with no hand-off to another thread.
//!
//! A rank's thread decodes what its SUB socket has ready, holding the records, and commits them
//! as one group when the socket has nothing more ready, when it holds [`IngestConfig::group_batches`]
//! batches, or before it waits on the replay socket. Under load a group is every batch that
//! arrived while the last one was committed; at light load a batch is committed as soon as it
//! is decoded, on the thread its message woke. Ranks commit side by side: the store takes one
//! group at a time, in the order they reach it, and a rank's records keep its order.
//!
//! Each batch gets its rank's latest load when it is taken. When the store fails (disk full,
//! read-only), the records are kept, the error counted, and the commit retried with backoff:
//! the rank's thread reads nothing meanwhile, so its SUB queue backs up onto the engine's
//! socket, and nothing is dropped. A store that must be reopened stops the relay after
//! [`STORE_FAILED_EXIT_AFTER`].
//!
//! [`IngestConfig::group_batches`]: crate::ingest::IngestConfig::group_batches

use crate::ingest::{self, liveness::Livenesses, load::Loads, Closed, IngestItem, Sink};
use crate::model::{Control, ControlKind, RankHealth, RecordBody};
use crate::shutdown::Shutdown;
use crate::status::RelayStatusHandle;
use crate::store::{Store, StoreError};
use crate::sync::{Locked, ReadWrite};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// How long a rank retries a store that failed and must be reopened (a sync of the log failed,
/// or a failed write could not be cut back) before the daemon stops with that error, so that
/// its supervisor (systemd `Restart=on-failure`, a pod's restart policy) reopens the store: the
/// reopened store holds every commit whose frame is whole on disk, and the relay refills the
/// rest from the engine's replay socket. A full disk does not fail the store: commits are
/// refused, and retried, until there is room. Meanwhile Status and metrics show the errors.
pub const STORE_FAILED_EXIT_AFTER: Duration = Duration::from_secs(5);

/// How long a lag stays reported after its batch was committed.
const LAG_WINDOW: Duration = Duration::from_secs(2);

/// What every rank's committer shares: the store, the engine's loads and liveness, the status, and the
/// store's failure (set once, by the first rank that gives up on it).
#[derive(Clone)]
pub struct Commits {
    store: Store,
    loads: Arc<RwLock<Loads>>,
    liveness: Livenesses,
    status: RelayStatusHandle,
    failed: Arc<Failure>,
    /// Set when the relay stops: a commit the store refuses (a full disk) is then given up
    /// instead of retried, so that the ranks' threads stop. Its records were never served, and
    /// the store's cursors do not include them: the engine's replay refills them at the next
    /// start, as after a crash.
    stopping: Shutdown,
}

/// The store failed for good: the error, and a watch the daemon waits on to stop.
struct Failure {
    set: AtomicBool,
    error: Mutex<Option<StoreError>>,
    tx: tokio::sync::watch::Sender<bool>,
}

impl Commits {
    pub fn new(
        store: Store,
        loads: Arc<RwLock<Loads>>,
        liveness: Livenesses,
        status: RelayStatusHandle,
        stopping: Shutdown,
    ) -> Commits {
        let failed =
            Failure { set: AtomicBool::new(false), error: Mutex::default(), tx: tokio::sync::watch::channel(false).0 };
        Commits { store, loads, liveness, status, failed: Arc::new(failed), stopping }
    }

    /// Becomes `true` when the store failed for good.
    pub fn failed(&self) -> tokio::sync::watch::Receiver<bool> {
        self.failed.tx.subscribe()
    }

    /// The error the store failed with, once (`None` after, or when it did not fail).
    pub fn take_failure(&self) -> Option<StoreError> {
        self.failed.error.locked().take()
    }

    fn fail(&self, e: StoreError) {
        *self.failed.error.locked() = Some(e);
        self.failed.set.store(true, Ordering::Release);
        self.failed.tx.send_replace(true);
    }

    /// A rank's committer; `group` is the most batches it holds ([`IngestConfig::group_batches`]).
    ///
    /// [`IngestConfig::group_batches`]: crate::ingest::IngestConfig::group_batches
    pub fn for_rank(&self, dp_rank: u32, group: usize) -> RankCommitter {
        let group = group.max(1);
        RankCommitter {
            commits: self.clone(),
            group_batches: group,
            group: Vec::with_capacity(group),
            batches: Vec::with_capacity(group),
            lag: LagWindow::default(),
            lag_gauge: metrics::gauge!("kv_relay_ingest_lag_seconds", "rank" => dp_rank.to_string()),
        }
    }
}

/// One rank's sink: holds what its thread decoded, and commits it on that thread.
pub struct RankCommitter {
    commits: Commits,
    /// The most batches it holds before it commits them.
    group_batches: usize,
    group: Vec<RecordBody>,
    /// (rank, seq, ts) of the batches in `group`.
    batches: Vec<(u32, u64, f64)>,
    lag: LagWindow,
    lag_gauge: metrics::Gauge,
}

impl Sink for RankCommitter {
    fn put(&mut self, item: IngestItem) -> Result<(), Closed> {
        self.group.push(match item {
            IngestItem::Batch { batch, .. } => {
                let load = ingest::load::for_rank(&self.commits.loads.reading(), batch.dp_rank);
                self.batches.push((batch.dp_rank, batch.seq, batch.ts));
                let liveness = self.commits.liveness.reading().get(&batch.dp_rank).cloned();
                RecordBody::Batch { batch, load, liveness }
            }
            IngestItem::Control(c) => RecordBody::Control(c),
        });
        if self.group.len() >= self.group_batches {
            return self.flush();
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<(), Closed> {
        if self.commits.failed.set.load(Ordering::Acquire) {
            return Err(Closed);
        }
        if self.group.is_empty() {
            return Ok(());
        }
        let (store, status) = (&self.commits.store, &self.commits.status);
        let started = Instant::now();
        let records = self.group.len();
        let mut backoff = Duration::from_millis(50);
        loop {
            match store.commit_group(&mut self.group) {
                Ok(_) => break,
                Err(StoreError::Invalid { .. }) => {
                    // A record the store cannot hold: committing it again cannot help.
                    status.add("store_errors", 1);
                    commit_holdable(store, &mut self.group, status);
                    if self.group.is_empty() {
                        break;
                    }
                }
                Err(e) => {
                    status.add("store_errors", 1);
                    if matches!(e, StoreError::Failed { .. }) && started.elapsed() >= STORE_FAILED_EXIT_AFTER {
                        tracing::error!(error = %e, "the store must be reopened: stopping the relay so it restarts");
                        self.commits.fail(e);
                        return Err(Closed);
                    }
                    if self.commits.failed.set.load(Ordering::Acquire) {
                        return Err(Closed);
                    }
                    if self.stopping() {
                        tracing::warn!(
                            error = %e,
                            records,
                            "stopping with a group the store refused: the engine's replay refills it at the next start"
                        );
                        self.group.clear();
                        self.batches.clear();
                        return Err(Closed);
                    }
                    // Keep the records and retry: the rank's SUB queue backs up onto the engine.
                    tracing::error!(error = %e, retry_in = ?backoff, "commit failed; ingest is held until the store accepts it");
                    let until = Instant::now() + backoff;
                    while !self.stopping() {
                        let left = until.saturating_duration_since(Instant::now());
                        if left.is_zero() {
                            break;
                        }
                        std::thread::sleep(left.min(RETRY_LOOK));
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
        }
        metrics::histogram!("kv_relay_commit_seconds").record(started.elapsed().as_secs_f64());
        metrics::histogram!("kv_relay_commit_group_records").record(records as f64);
        let now = now_ms() as f64;
        for (rank, seq, ts) in self.batches.drain(..) {
            let lag_ms = self.lag.add((now - ts * 1000.0).max(0.0) as u64);
            self.lag_gauge.set(lag_ms as f64 / 1000.0);
            status.batch_committed(rank, seq, lag_ms);
        }
        Ok(())
    }

    fn holding(&self) -> bool {
        !self.group.is_empty()
    }
}

impl RankCommitter {
    fn stopping(&self) -> bool {
        self.commits.stopping.is_shutdown()
    }
}

/// How often a commit waiting to be retried looks whether the relay is stopping.
const RETRY_LOOK: Duration = Duration::from_millis(50);

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// The ingest lag a rank reports: the largest of the batches committed in the last
/// [`LAG_WINDOW`]. A delayed publisher's held batches arrive in one burst, oldest first, and
/// are committed together with the newest: the last batch's lag alone would hide the delay.
#[derive(Default)]
struct LagWindow {
    since: Option<Instant>,
    max_ms: u64,
}

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
    let mut rest: VecDeque<RecordBody> = std::mem::take(group).into();
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
                status.set_rank_health(dp_rank, RankHealth::Degraded { reason: reason.clone() }, false);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Batch, Block, Event, Stored, Tier};
    use crate::shutdown::ShutdownTrigger;
    use crate::store::StoreConfig;

    fn stored(seq: u64, tier: Tier, hash: u64) -> IngestItem {
        IngestItem::Batch {
            batch: Batch {
                dp_rank: 1,
                seq,
                ts: 0.0,
                events: vec![Event::Stored(Stored::plain(tier, 0, 16, vec![Block::new(hash, vec![])]))],
            },
            drops: Default::default(),
            refilled: false,
        }
    }

    /// (cursor, what) of every record the store holds.
    fn history(store: &Store) -> Vec<(u64, String)> {
        store
            .history(0, 100)
            .unwrap()
            .into_iter()
            .map(|r| {
                let what = match r.body {
                    RecordBody::Batch { batch, .. } => format!("batch {}", batch.seq),
                    RecordBody::Control(c) => format!("{:?} of rank {}", c.kind, c.dp_rank),
                };
                (r.cursor, what)
            })
            .collect()
    }

    /// A record the store cannot hold is dropped, its rank marked degraded, and ingest goes on:
    /// it must not be retried for good (it would hold every later batch back).
    #[test]
    fn a_record_the_store_cannot_hold_is_dropped_and_the_rest_committed() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(StoreConfig::new(dir.path())).unwrap();
        let status = RelayStatusHandle::new("test");
        let stop = ShutdownTrigger::new();
        let mut sink = Commits::new(store.clone(), Arc::default(), Arc::default(), status.clone(), stop.subscribe())
            .for_rank(1, 8);
        // Held until the flush: the three go to the store as one group.
        for item in
            [stored(10, Tier::Device, 1), stored(11, Tier::Other("m".repeat(70_000)), 2), stored(12, Tier::Device, 3)]
        {
            sink.put(item).unwrap();
        }
        assert!(sink.holding());
        assert_eq!(store.newest_cursor(), 0);
        sink.flush().unwrap();
        assert!(!sink.holding());
        let reason =
            "batch seq 11 could not be stored (cannot store this tier: tier name of 70000 bytes) and was dropped";
        assert_eq!(
            history(&store),
            vec![
                (1, "batch 10".to_string()),
                (2, format!("RankDegraded {{ reason: {reason:?} }} of rank 1")),
                (3, "batch 12".to_string()),
            ]
        );
        let rank = status.rank(1).unwrap();
        assert_eq!((rank.health.as_str(), rank.health.reason(), rank.last_engine_seq), ("degraded", reason, 12));
        assert_eq!(status.get().counters.get("store_refused"), Some(&1));
        assert_eq!(store.live_stats().blocks, 2);
    }

    /// A committer commits what it holds when it holds its group's most batches, each group in
    /// one commit, and ranks committing side by side each keep their order.
    #[test]
    fn a_full_group_is_committed_and_ranks_commit_side_by_side() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(StoreConfig::new(dir.path())).unwrap();
        let stop = ShutdownTrigger::new();
        let commits = Commits::new(
            store.clone(),
            Arc::default(),
            Arc::default(),
            RelayStatusHandle::new("test"),
            stop.subscribe(),
        );
        let mut one = commits.for_rank(1, 3);
        one.put(stored(0, Tier::Device, 1)).unwrap();
        one.put(stored(1, Tier::Device, 2)).unwrap();
        assert_eq!(store.newest_cursor(), 0);
        one.put(stored(2, Tier::Device, 3)).unwrap();
        assert_eq!((store.newest_cursor(), one.holding()), (3, false));

        let ranks: Vec<_> = (0..4u64)
            .map(|r| {
                let mut sink = commits.for_rank(r as u32 + 2, 7);
                std::thread::spawn(move || {
                    for seq in 0..500u64 {
                        let mut item = stored(seq, Tier::Device, (r + 1) << 32 | seq);
                        if let IngestItem::Batch { batch, .. } = &mut item {
                            batch.dp_rank = r as u32 + 2;
                        }
                        sink.put(item).unwrap();
                    }
                    sink.flush().unwrap();
                })
            })
            .collect();
        for t in ranks {
            t.join().unwrap();
        }
        let mut seqs: std::collections::BTreeMap<u32, Vec<u64>> = Default::default();
        for r in store.history(3, 10_000).unwrap() {
            if let RecordBody::Batch { batch, .. } = r.body {
                seqs.entry(batch.dp_rank).or_default().push(batch.seq);
            }
        }
        let want: Vec<u64> = (0..500).collect();
        assert_eq!(seqs.keys().copied().collect::<Vec<_>>(), vec![2, 3, 4, 5]);
        assert!(seqs.values().all(|s| *s == want));
        assert_eq!((store.newest_cursor(), store.live_stats().blocks), (2003, 2003));
    }
}
