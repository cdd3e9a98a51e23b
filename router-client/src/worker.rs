//! What the client tells a router about each worker: its load, freshness and state.

use std::sync::Arc;
use std::time::Duration;

use kv_relay_proto::pb;
use serde::Serialize;

use crate::index::WorkerId;

/// An engine's load, as the relay last reported it for a rank (from a batch or a heartbeat).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Load {
    /// Requests running.
    pub running: f64,
    /// Requests waiting.
    pub waiting: f64,
    /// KV-cache usage, 0..1.
    pub kv_usage: f64,
    /// Unix milliseconds of the relay's scrape of the engine.
    pub scraped_at_ms: u64,
}

impl From<&pb::Load> for Load {
    fn from(l: &pb::Load) -> Self {
        Load { running: l.running, waiting: l.waiting, kv_usage: l.kv_usage, scraped_at_ms: l.scraped_at_ms }
    }
}

/// The engine's liveness as its relay sees it from beside the engine (`kv_relay.v1.Liveness`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EngineLiveness {
    /// Not reported: the relay does not watch the engine (no health endpoint), or is older than
    /// the field. Routed as alive.
    #[default]
    Unknown,
    /// The engine's health endpoint answers and it progresses (or has nothing to do).
    Alive,
    /// The health endpoint does not answer in time, or answers an error.
    Unreachable,
    /// The health endpoint answers, but requests run and nothing progresses.
    Wedged,
    /// Nothing listens on the health endpoint: the engine's process is gone.
    Stopped,
}

impl EngineLiveness {
    /// The state's name as the HTTP API and the metrics spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            EngineLiveness::Unknown => "unknown",
            EngineLiveness::Alive => "alive",
            EngineLiveness::Unreachable => "unreachable",
            EngineLiveness::Wedged => "wedged",
            EngineLiveness::Stopped => "stopped",
        }
    }

    /// Whether a router may send the engine requests: alive, or not reported.
    pub fn serves(self) -> bool {
        matches!(self, EngineLiveness::Alive | EngineLiveness::Unknown)
    }
}

impl From<pb::EngineLiveness> for EngineLiveness {
    fn from(s: pb::EngineLiveness) -> Self {
        match s {
            pb::EngineLiveness::Unspecified => EngineLiveness::Unknown,
            pb::EngineLiveness::Alive => EngineLiveness::Alive,
            pb::EngineLiveness::Unreachable => EngineLiveness::Unreachable,
            pb::EngineLiveness::Wedged => EngineLiveness::Wedged,
            pb::EngineLiveness::Stopped => EngineLiveness::Stopped,
        }
    }
}

/// A rank's engine liveness as the relay last reported it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Liveness {
    /// The state.
    pub state: EngineLiveness,
    /// Why, in words (empty when alive).
    pub reason: String,
    /// Unix milliseconds when the state began.
    pub since_ms: u64,
    /// Unix milliseconds of the relay's observation.
    pub observed_at_ms: u64,
}

impl From<&pb::Liveness> for Liveness {
    fn from(l: &pb::Liveness) -> Self {
        Liveness {
            state: pb::EngineLiveness::try_from(l.state).unwrap_or(pb::EngineLiveness::Unspecified).into(),
            reason: l.reason.clone(),
            since_ms: l.since_ms,
            observed_at_ms: l.observed_at_ms,
        }
    }
}

/// A worker's state, most severe first: the first that applies is reported.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkerState {
    /// The worker's relay is being resynced: its follower waits for a resync slot
    /// ([`crate::FollowConfig::max_concurrent_resyncs`]), or has subscribed and not yet received
    /// a message outside a snapshot. Not ready: [`crate::Follower::match_blocks`] leaves it out.
    Syncing,
    /// The client has no working stream from the worker's relay (connecting, or reconnecting
    /// after an error); the blocks it holds are as of the last record applied.
    RelayUnreachable,
    /// The stream is up but nothing about this rank (batch, heartbeat, control) arrived within
    /// the staleness bound; fresh again at its next batch or heartbeat.
    Stale,
    /// The relay reported a gap it could not refill: stale blocks may be held until the rank
    /// recovers or resets.
    Degraded,
    /// The relay reported that blocks announced before it started may be missing.
    Incomplete,
    /// Current.
    Fresh,
}

impl WorkerState {
    /// Every state, in the order above.
    pub const ALL: [WorkerState; 6] = [
        WorkerState::Syncing,
        WorkerState::RelayUnreachable,
        WorkerState::Stale,
        WorkerState::Degraded,
        WorkerState::Incomplete,
        WorkerState::Fresh,
    ];

    /// The state's name as the HTTP API and the metrics spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            WorkerState::Syncing => "syncing",
            WorkerState::RelayUnreachable => "relay_unreachable",
            WorkerState::Stale => "stale",
            WorkerState::Degraded => "degraded",
            WorkerState::Incomplete => "incomplete",
            WorkerState::Fresh => "fresh",
        }
    }
}

impl WorkerState {
    /// The state of a worker now: its relay being resynced, the relay's stream open, the time
    /// since the worker was last heard of (`None`: never) against the staleness bound, and the
    /// relay's degraded and incomplete flags. The one rule both [`crate::Follower::workers`] and
    /// [`crate::Follower::match_blocks`] report by.
    pub fn of(
        syncing: bool,
        connected: bool,
        last_seen_ago: Option<Duration>,
        stale_after: Duration,
        degraded: bool,
        incomplete: bool,
    ) -> WorkerState {
        if syncing {
            WorkerState::Syncing
        } else if !connected {
            WorkerState::RelayUnreachable
        } else if last_seen_ago.is_none_or(|a| a > stale_after) {
            WorkerState::Stale
        } else if degraded {
            WorkerState::Degraded
        } else if incomplete {
            WorkerState::Incomplete
        } else {
            WorkerState::Fresh
        }
    }
}

impl std::fmt::Display for WorkerState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One worker (relay, DP rank) as the client knows it now.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct WorkerInfo {
    /// The relay's URL, as added.
    #[serde(serialize_with = "ser_arc_str")]
    pub relay: Arc<str>,
    /// The DP rank.
    pub dp_rank: u32,
    /// The worker's id in the prefix index.
    #[serde(skip)]
    pub id: WorkerId,
    /// The state (see [`WorkerState`]).
    pub state: WorkerState,
    /// The latest load, when the relay knows it.
    pub load: Option<Load>,
    /// Time since the last batch, heartbeat or control of this rank (`None`: never).
    #[serde(serialize_with = "ser_opt_ms", rename = "last_seen_ms_ago")]
    pub last_seen_ago: Option<Duration>,
    /// Why the relay reported the rank degraded, while it is.
    pub degraded: Option<String>,
    /// Why the relay reported the rank incomplete, while it is.
    pub incomplete: Option<String>,
    /// The relay's own status for the rank is `STOPPED` (its engine is not being followed).
    pub engine_stopped: bool,
    /// Records of this rank applied.
    pub records_applied: u64,
    /// Rank resets applied.
    pub resets: u64,
    /// The engine's liveness as the relay last reported it (`None`: never reported).
    pub liveness: Option<Liveness>,
    /// Block copies the index holds for the worker (every tier), as the applied events count
    /// them: stores add, removals take away, clears and resets empty.
    pub held_blocks: u64,
    /// The engine's base URL for requests, from the relay's Status (`None`: not configured).
    #[serde(serialize_with = "ser_opt_arc_str")]
    pub engine_url: Option<Arc<str>>,
}

/// Serializes an `Arc<str>` as a string (serde's `rc` feature is not enabled).
pub(crate) fn ser_arc_str<S: serde::Serializer>(v: &Arc<str>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(v)
}

fn ser_opt_arc_str<S: serde::Serializer>(v: &Option<Arc<str>>, s: S) -> Result<S::Ok, S::Error> {
    match v {
        Some(v) => s.serialize_some(&**v),
        None => s.serialize_none(),
    }
}

fn ser_opt_ms<S: serde::Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.serialize_some(&(d.as_millis() as u64)),
        None => s.serialize_none(),
    }
}
