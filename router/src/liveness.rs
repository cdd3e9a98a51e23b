//! Which workers may be routed to: each worker's circuit breaker, driven by what the router
//! observes of it. Pure: the caller passes the time and the worker's [`Signals`].
//!
//! A worker leaves routing when any of these holds ([`Cause`]):
//! - its relay reports the engine not alive (unreachable, wedged, stopped), or that it does not
//!   follow the rank's engine;
//! - its relay's stream is down, or silent about the worker for the stall bound (the follower's
//!   `stale_after`): the host is cut off or the relay is gone;
//! - a request the router sent it failed to connect ([`Outcome::Failed`] with `connect`).
//!
//! It comes back at the first good contact: the signals are good again (and, after a refused
//! connection, [`TrackerConfig::retry_after`] has passed). Its breaker is then half open: one
//! request is its probe, and its success closes the breaker (full routing); its failure opens it
//! again. A probe that is never reported frees the slot after [`TrackerConfig::probe_timeout`].

use std::collections::HashMap;
use std::time::Duration;

use kv_router_client::index::WorkerId;
use kv_router_client::{EngineLiveness, WorkerState};
use serde::Serialize;
use tokio::time::Instant;

/// What the router observes of a worker now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Signals {
    /// The follower's state of the worker (`stale`: its stream was silent past the bound).
    pub state: WorkerState,
    /// The engine's liveness as its relay reports it.
    pub engine: EngineLiveness,
    /// The relay reports the rank `STOPPED`: it does not follow the rank's engine.
    pub engine_stopped: bool,
    /// The follower has heard of the worker at least once (a record, heartbeat or snapshot).
    pub heard: bool,
}

impl Signals {
    /// Why the signals keep the worker out of routing, if they do.
    pub fn cause(&self) -> Option<Cause> {
        match self.state {
            WorkerState::RelayUnreachable => return Some(Cause::RelayUnreachable),
            WorkerState::Stale if !self.heard => return Some(Cause::NotYetHeard),
            WorkerState::Stale => return Some(Cause::StreamSilent),
            WorkerState::Syncing => return Some(Cause::Syncing),
            WorkerState::Degraded | WorkerState::Incomplete | WorkerState::Fresh => {}
        }
        if !self.engine.serves() {
            return Some(Cause::Engine(self.engine));
        }
        self.engine_stopped.then_some(Cause::RankNotFollowed)
    }
}

/// Why a worker is out of routing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Cause {
    /// The router has no stream from the worker's relay.
    RelayUnreachable,
    /// The relay's stream said nothing of the worker within the stall bound.
    StreamSilent,
    /// The relay is being resynced.
    Syncing,
    /// The relay's stream has not said anything of the worker yet (it was just listed, or the
    /// stream just opened).
    NotYetHeard,
    /// The relay reports the engine unreachable, wedged or stopped.
    Engine(EngineLiveness),
    /// The relay reports that it does not follow the rank's engine.
    RankNotFollowed,
    /// A request the router sent failed to connect.
    ConnectFailed,
    /// Its probe request is in flight (half open).
    Probing,
}

impl Cause {
    /// The cause's name, as the HTTP API and the metrics spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Cause::RelayUnreachable => "relay_unreachable",
            Cause::StreamSilent => "stream_silent",
            Cause::Syncing => "syncing",
            Cause::NotYetHeard => "not_yet_heard",
            Cause::Engine(EngineLiveness::Unreachable) => "engine_unreachable",
            Cause::Engine(EngineLiveness::Wedged) => "engine_wedged",
            Cause::Engine(EngineLiveness::Stopped) => "engine_stopped",
            Cause::Engine(_) => "engine_not_alive",
            Cause::RankNotFollowed => "rank_not_followed",
            Cause::ConnectFailed => "connect_failed",
            Cause::Probing => "probing",
        }
    }
}

impl Serialize for Cause {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

/// A worker's circuit breaker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Breaker {
    /// Routed to.
    Closed,
    /// Out of routing since `since`, for `cause`.
    Open { cause: Cause, since: Instant },
    /// Back on good contact: one probe request; `probe` is the one in flight, and when it was sent.
    HalfOpen { probe: Option<(u64, Instant)> },
}

/// What the tracker lets a request do with a worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gate {
    /// Route to it freely.
    Route,
    /// It may take one request: its probe.
    Probe,
    /// Out of routing.
    Out(Cause),
}

/// How a request the router sent ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "outcome")]
pub enum Outcome {
    /// The engine answered it (whatever its status).
    Done,
    /// It failed. `connect`: before the engine's first byte (refused, reset, timed out
    /// connecting): the worker leaves routing.
    Failed { connect: bool },
}

/// The tracker's settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TrackerConfig {
    /// After a refused connection, a worker whose signals are good is probed again after this.
    pub retry_after: Duration,
    /// A probe that is not reported within this long frees the probe slot.
    pub probe_timeout: Duration,
    /// A routed request that is not reported within this long is forgotten (it no longer counts
    /// as in flight).
    pub request_timeout: Duration,
    /// At most this many routed requests are remembered; past it the oldest are forgotten.
    pub max_tickets: usize,
}

impl Default for TrackerConfig {
    fn default() -> Self {
        TrackerConfig {
            retry_after: Duration::from_secs(1),
            probe_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(600),
            max_tickets: 1 << 20,
        }
    }
}

/// One worker's routing state.
#[derive(Clone, Copy, Debug)]
struct Entry {
    breaker: Breaker,
    in_flight: u32,
    /// Times the worker left routing.
    outs: u64,
    /// Requests routed to it.
    routed: u64,
    /// Why it waited without a verdict when last gated: its relay being resynced, or nothing
    /// heard of it yet.
    waiting: Option<Cause>,
}

impl Default for Entry {
    fn default() -> Self {
        Entry { breaker: Breaker::Closed, in_flight: 0, outs: 0, routed: 0, waiting: None }
    }
}

/// A routed request not yet reported.
#[derive(Clone, Copy, Debug)]
struct Ticket {
    worker: WorkerId,
    at: Instant,
}

/// A worker's routing state, as [`Tracker::state`] reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct RoutingState {
    /// `routable`, `probing` (half open) or `out`.
    pub routing: &'static str,
    /// Why it is out (absent when routable).
    pub cause: Option<Cause>,
    /// Requests routed to it and not reported.
    pub in_flight: u32,
    /// Times it left routing.
    pub outs: u64,
    /// Requests routed to it.
    pub routed: u64,
}

/// Why a report was not taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ReportError {
    #[error("no routed request {0} is in flight (unknown, already reported, or forgotten)")]
    UnknownRequest(u64),
}

/// Counts of the tracker's transitions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct TrackerCounters {
    /// Workers that left routing.
    pub outs: u64,
    /// Probes sent (a worker back on good contact took its first request).
    pub probes: u64,
    /// Probes that succeeded: the worker is fully back.
    pub returns: u64,
    /// Reports: done.
    pub done: u64,
    /// Reports: failed before the first byte.
    pub connect_failures: u64,
    /// Reports: failed after the engine answered.
    pub failures: u64,
    /// Routed requests forgotten unreported ([`TrackerConfig::request_timeout`], `max_tickets`).
    pub forgotten: u64,
}

/// Every worker's breaker and requests in flight.
#[derive(Debug)]
pub struct Tracker {
    cfg: TrackerConfig,
    /// By raw worker id (dense: the index interns them).
    workers: Vec<Entry>,
    tickets: HashMap<u64, Ticket>,
    next_ticket: u64,
    counters: TrackerCounters,
    last_sweep: Option<Instant>,
}

impl Tracker {
    pub fn new(cfg: TrackerConfig) -> Self {
        Tracker {
            cfg,
            workers: Vec::new(),
            tickets: HashMap::new(),
            next_ticket: 1,
            counters: TrackerCounters::default(),
            last_sweep: None,
        }
    }

    fn entry(&mut self, id: WorkerId) -> &mut Entry {
        let i = id.get() as usize;
        if self.workers.len() <= i {
            self.workers.resize(i + 1, Entry::default());
        }
        &mut self.workers[i]
    }

    fn open(&mut self, id: WorkerId, cause: Cause, now: Instant) {
        let e = self.entry(id);
        if !matches!(e.breaker, Breaker::Open { .. }) {
            e.outs += 1;
            self.counters.outs += 1;
        }
        let e = self.entry(id);
        e.breaker = Breaker::Open { cause, since: now };
    }

    /// Whether a request may go to worker `id`, whose signals are `s`, at `now`; moves its
    /// breaker by what the signals say.
    pub fn gate(&mut self, id: WorkerId, s: &Signals, now: Instant) -> Gate {
        let bad = s.cause();
        let probe_timeout = self.cfg.probe_timeout;
        let retry_after = self.cfg.retry_after;
        let e = self.entry(id);
        // A resync says nothing of the engine, nor does a stream that has not spoken of the
        // worker yet: it waits without a verdict (no breaker moves, no out is counted, and no
        // probe is owed when it ends).
        e.waiting = bad.filter(|c| matches!(c, Cause::Syncing | Cause::NotYetHeard));
        if let Some(c) = e.waiting {
            return Gate::Out(c);
        }
        let breaker = e.breaker;
        match (breaker, bad) {
            (Breaker::Closed, None) => Gate::Route,
            (Breaker::Closed | Breaker::HalfOpen { .. }, Some(c)) => {
                self.open(id, c, now);
                Gate::Out(c)
            }
            (Breaker::Open { cause, since }, Some(c)) => {
                if cause != c {
                    self.entry(id).breaker = Breaker::Open { cause: c, since };
                }
                Gate::Out(c)
            }
            (Breaker::Open { cause: Cause::ConnectFailed, since }, None)
                if now.saturating_duration_since(since) < retry_after =>
            {
                Gate::Out(Cause::ConnectFailed)
            }
            (Breaker::Open { .. }, None) => {
                self.entry(id).breaker = Breaker::HalfOpen { probe: None };
                Gate::Probe
            }
            (Breaker::HalfOpen { probe: Some((_, sent)) }, None)
                if now.saturating_duration_since(sent) < probe_timeout =>
            {
                Gate::Out(Cause::Probing)
            }
            (Breaker::HalfOpen { .. }, None) => Gate::Probe,
        }
    }

    /// A request was routed to `id` (as its probe when the gate said [`Gate::Probe`]): its
    /// ticket, to report its end with.
    pub fn routed(&mut self, id: WorkerId, gate: Gate, now: Instant) -> u64 {
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        let e = self.entry(id);
        e.in_flight += 1;
        e.routed += 1;
        if gate == Gate::Probe {
            e.breaker = Breaker::HalfOpen { probe: Some((ticket, now)) };
            self.counters.probes += 1;
        }
        self.tickets.insert(ticket, Ticket { worker: id, at: now });
        if self.tickets.len() > self.cfg.max_tickets {
            self.forget(now, true);
        }
        ticket
    }

    /// Takes a routed request's end: the worker it went to.
    pub fn report(&mut self, ticket: u64, outcome: Outcome, now: Instant) -> Result<WorkerId, ReportError> {
        let t = self.tickets.remove(&ticket).ok_or(ReportError::UnknownRequest(ticket))?;
        let e = self.entry(t.worker);
        e.in_flight = e.in_flight.saturating_sub(1);
        let probe = matches!(e.breaker, Breaker::HalfOpen { probe: Some((p, _)) } if p == ticket);
        match outcome {
            Outcome::Done => {
                self.counters.done += 1;
                if probe {
                    self.entry(t.worker).breaker = Breaker::Closed;
                    self.counters.returns += 1;
                }
            }
            Outcome::Failed { connect: true } => {
                self.counters.connect_failures += 1;
                self.open(t.worker, Cause::ConnectFailed, now);
            }
            Outcome::Failed { connect: false } => {
                self.counters.failures += 1;
                if probe {
                    // The engine answered: it serves; its error is the request's.
                    self.entry(t.worker).breaker = Breaker::Closed;
                    self.counters.returns += 1;
                }
            }
        }
        Ok(t.worker)
    }

    /// Worker `id`'s engine refused a connection the router made for another worker behind it:
    /// it leaves routing as if its own request had (its probe comes after `retry_after`).
    pub fn refused(&mut self, id: WorkerId, now: Instant) {
        self.open(id, Cause::ConnectFailed, now);
    }

    /// Forgets the routed requests older than the request timeout (at most once a second), or,
    /// with `all_over_bound`, also the oldest past `max_tickets`.
    pub fn forget(&mut self, now: Instant, over_bound: bool) {
        if !over_bound && self.last_sweep.is_some_and(|t| now.saturating_duration_since(t) < Duration::from_secs(1)) {
            return;
        }
        self.last_sweep = Some(now);
        let timeout = self.cfg.request_timeout;
        let mut gone = Vec::new();
        self.tickets.retain(|_, t| {
            let keep = now.saturating_duration_since(t.at) < timeout;
            if !keep {
                gone.push(t.worker);
            }
            keep
        });
        if over_bound && self.tickets.len() > self.cfg.max_tickets {
            let mut ages: Vec<(u64, Instant)> = self.tickets.iter().map(|(&k, t)| (k, t.at)).collect();
            ages.sort_unstable_by_key(|&(k, at)| (at, k));
            let excess = self.tickets.len() - self.cfg.max_tickets;
            for (k, _) in ages.into_iter().take(excess) {
                if let Some(t) = self.tickets.remove(&k) {
                    gone.push(t.worker);
                }
            }
        }
        self.counters.forgotten += gone.len() as u64;
        for w in gone {
            let e = self.entry(w);
            e.in_flight = e.in_flight.saturating_sub(1);
        }
    }

    /// Requests routed to `id` and not reported.
    pub fn in_flight(&self, id: WorkerId) -> u32 {
        self.workers.get(id.get() as usize).map_or(0, |e| e.in_flight)
    }

    /// Worker `id`'s routing state as last gated.
    pub fn state(&self, id: WorkerId) -> RoutingState {
        let e = self.workers.get(id.get() as usize).copied().unwrap_or_default();
        let (routing, cause) = match e.breaker {
            Breaker::Closed if e.waiting.is_some() => ("out", e.waiting),
            Breaker::Closed => ("routable", None),
            Breaker::Open { cause, .. } => ("out", Some(cause)),
            Breaker::HalfOpen { probe: None } => ("probing", None),
            Breaker::HalfOpen { probe: Some(_) } => ("probing", Some(Cause::Probing)),
        };
        RoutingState { routing, cause, in_flight: e.in_flight, outs: e.outs, routed: e.routed }
    }

    /// Worker `id`'s breaker.
    pub fn breaker(&self, id: WorkerId) -> Breaker {
        self.workers.get(id.get() as usize).map_or(Breaker::Closed, |e| e.breaker)
    }

    /// Routed requests not yet reported.
    pub fn tickets(&self) -> usize {
        self.tickets.len()
    }

    pub fn counters(&self) -> TrackerCounters {
        self.counters
    }
}
