//! What the relay knows about its engine right now, in one place above the ingest and the
//! commits (which write it) and the gRPC server (which reads it for `Status` and for
//! heartbeats); and the live notices the ingest sends the streams.
//!
//! [`RelayStatusHandle`] is a cheap clone (an `Arc`); every setter takes the lock for a few
//! field writes, never across an await, so the ingest's hot path pays a short uncontended lock.

use crate::hashcheck::CheckCounts;
use crate::model::{Liveness, Load, RankHealth};
use crate::sync::Locked;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

/// One rank's status.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RankStatus {
    pub health: RankHealth,
    /// The rank's thread has stopped (shutdown, or the engine is gone): not followed.
    pub stopped: bool,
    /// The last engine seq committed for the rank.
    pub last_engine_seq: u64,
    /// Engine timestamp to commit, of the last batch, in milliseconds.
    pub lag_ms: u64,
    /// The engine's latest load as seen for this rank.
    pub load: Option<Load>,
    /// What the block-hash check found; `None` when the check is off.
    pub hash_check: Option<CheckCounts>,
    /// The engine's liveness for this rank; `None` when it is not watched.
    pub liveness: Option<Liveness>,
}

/// A point-in-time copy of the relay's status.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RelayStatus {
    /// The engine's configured name.
    pub engine: String,
    /// The engine's base URL, where routers send requests; `None` when not known.
    pub engine_url: Option<String>,
    pub ranks: BTreeMap<u32, RankStatus>,
    /// Counters by name (the ingest's and the server's).
    pub counters: BTreeMap<String, u64>,
    /// Subscribe streams open now (kept by the server).
    pub subscribers: u32,
}

/// The shared, mutable relay status. Clone it freely: clones share one state.
#[derive(Debug, Clone, Default)]
pub struct RelayStatusHandle {
    inner: Arc<Mutex<RelayStatus>>,
}

impl RelayStatusHandle {
    pub fn new(engine: impl Into<String>) -> Self {
        let s = RelayStatus { engine: engine.into(), ..RelayStatus::default() };
        RelayStatusHandle { inner: Arc::new(Mutex::new(s)) }
    }

    fn lock(&self) -> MutexGuard<'_, RelayStatus> {
        // A panic while holding this lock leaves plain data behind: keep serving it.
        self.inner.locked()
    }

    /// A copy of the whole status.
    pub fn get(&self) -> RelayStatus {
        self.lock().clone()
    }

    /// A copy of one rank's status.
    pub fn rank(&self, dp_rank: u32) -> Option<RankStatus> {
        self.lock().ranks.get(&dp_rank).cloned()
    }

    /// Runs `f` on a rank's status (created `Ok` when first seen).
    pub fn update_rank<R>(&self, dp_rank: u32, f: impl FnOnce(&mut RankStatus) -> R) -> R {
        f(self.lock().ranks.entry(dp_rank).or_default())
    }

    /// Declares the ranks followed (each starts `Ok` unless already known).
    pub fn add_ranks(&self, ranks: impl IntoIterator<Item = u32>) {
        let mut s = self.lock();
        for r in ranks {
            s.ranks.entry(r).or_default();
        }
    }

    /// Sets a rank's health, and whether its thread has stopped.
    pub fn set_rank_health(&self, dp_rank: u32, health: RankHealth, stopped: bool) {
        self.update_rank(dp_rank, |r| {
            r.health = health;
            r.stopped = stopped;
        });
    }

    /// Records a committed batch of a rank: its engine seq and the commit lag.
    pub fn batch_committed(&self, dp_rank: u32, engine_seq: u64, lag_ms: u64) {
        self.update_rank(dp_rank, |r| {
            r.last_engine_seq = engine_seq;
            r.lag_ms = lag_ms;
        });
    }

    /// Sets what a rank's block-hash check found (`None`: the check is off).
    pub fn set_hash_check(&self, dp_rank: u32, counts: Option<CheckCounts>) {
        self.update_rank(dp_rank, |r| r.hash_check = counts);
    }

    /// Sets the engine's base URL.
    pub fn set_engine_url(&self, url: Option<String>) {
        self.lock().engine_url = url;
    }

    /// Sets a rank's engine liveness.
    pub fn set_liveness(&self, dp_rank: u32, liveness: Liveness) {
        self.update_rank(dp_rank, |r| r.liveness = Some(liveness));
    }

    /// Sets a rank's latest load.
    pub fn set_load(&self, dp_rank: u32, load: Load) {
        self.update_rank(dp_rank, |r| r.load = Some(load));
    }

    /// Adds `n` to a counter.
    pub fn add(&self, counter: &str, n: u64) {
        let mut s = self.lock();
        match s.counters.get_mut(counter) {
            Some(c) => *c += n,
            None => {
                s.counters.insert(counter.to_string(), n);
            }
        }
    }

    /// Sets a counter (or gauge) to a value.
    pub fn set_counter(&self, counter: &str, value: u64) {
        self.lock().counters.insert(counter.to_string(), value);
    }

    pub(crate) fn subscriber_opened(&self) {
        self.lock().subscribers += 1;
    }

    pub(crate) fn subscriber_closed(&self) {
        let mut s = self.lock();
        s.subscribers = s.subscribers.saturating_sub(1);
    }
}

/// A live notice from the ingest to every open stream, through a `tokio::sync::broadcast`
/// channel (see [`notice_channel`]). Notices are lossy by design: a stream that is busy catching
/// up skips them (its receiver lags and drops the oldest), and heartbeats are never in history.
#[derive(Debug, Clone, PartialEq)]
pub enum Notice {
    /// The rank's publisher is followed and this is its load (sent by the ingest about every
    /// second while the rank is quiet, and at once when the engine's liveness changes; the
    /// stream adds the rank's liveness from the status).
    Heartbeat { dp_rank: u32, load: Option<Load> },
}

/// The notice channel's capacity: enough for a second of heartbeats from 64 ranks; a receiver
/// that lags further drops the oldest (bounded memory, shared by every stream).
pub const NOTICE_CAPACITY: usize = 256;

/// Makes the notice channel the ingest sends into and [`crate::server::serve`] reads from.
pub fn notice_channel() -> tokio::sync::broadcast::Sender<Notice> {
    tokio::sync::broadcast::channel(NOTICE_CAPACITY).0
}
