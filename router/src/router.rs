//! [`Router`]: a [`Follower`] with a routing decision. [`Router::route`] looks the request's
//! blocks up in the prefix index, keeps the workers its [`Tracker`] lets through, and asks the
//! [`Policy`] to choose; [`Router::report`] takes each routed request's end, which moves the
//! worker's circuit breaker and its count of requests in flight.
//!
//! One lock guards the tracker, the generator and the candidate buffers; a decision holds it
//! for the gating and the policy's pass over the candidates, never across an await.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use kv_relay_proto::hash::{block_event_hashes, EngineHashConfig, RequestKeys};
use kv_router_client::index::{TierId, WorkerId};
use kv_router_client::{EngineLiveness, Follower, MatchOptions, WorkerInfo};
use rand::rngs::StdRng;
use rand::SeedableRng;
use serde::Serialize;
use tokio::time::Instant;

use crate::liveness::{Gate, Outcome, ReportError, RoutingState, Signals, Tracker, TrackerConfig, TrackerCounters};
use crate::policy::{CacheAwareConfig, Candidate, Choice, Policy, PolicyKind, Reason, RouteInput};

/// The router's settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RouterConfig {
    /// The policy (`cache_aware` by default).
    pub policy: PolicyKind,
    /// `cache_aware`'s knobs (overload protection among them).
    pub cache_aware: CacheAwareConfig,
    /// The circuit breakers' settings.
    pub tracker: TrackerConfig,
    /// A routable worker holding fewer block copies than this share of the routable workers'
    /// mean is warming (it takes a share of the misses, see [`CacheAwareConfig::warm_share`]).
    pub warm_below: f64,
    /// No worker is warming while the routable workers' mean is below this many copies (a
    /// fleet that is itself cold warms evenly by load).
    pub warm_min_blocks: u64,
    /// Seeds the generator the policy draws ties from (`None`: from the OS).
    pub seed: Option<u64>,
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            policy: PolicyKind::CacheAware,
            cache_aware: CacheAwareConfig::default(),
            tracker: TrackerConfig::default(),
            warm_below: 0.1,
            warm_min_blocks: 64,
            seed: None,
        }
    }
}

/// Where a request goes.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Routed {
    /// Report the request's end with this id ([`Router::report`], `POST /route/report`).
    pub request_id: u64,
    /// The chosen worker's relay.
    #[serde(serialize_with = "ser_arc_str")]
    pub relay: Arc<str>,
    /// Its DP rank.
    pub dp_rank: u32,
    /// The engine's base URL, as its relay reports it (`None`: the relay has none configured).
    #[serde(serialize_with = "ser_opt_arc_str")]
    pub engine_url: Option<Arc<str>>,
    /// The request's blocks.
    pub blocks: u32,
    /// Leading blocks of the request the worker holds, any tier.
    pub matched_blocks: u32,
    /// Of those, in the device tier.
    pub device_blocks: u32,
    /// Why it was chosen.
    pub reason: Reason,
    /// The policy that chose.
    pub policy: &'static str,
    /// The expected wait the choice was made by, in microseconds (`cache_aware`; 0 otherwise).
    pub expected_wait_us: f64,
}

fn ser_arc_str<S: serde::Serializer>(v: &Arc<str>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(v)
}

fn ser_opt_arc_str<S: serde::Serializer>(v: &Option<Arc<str>>, s: S) -> Result<S::Ok, S::Error> {
    match v {
        Some(v) => s.serialize_some(&**v),
        None => s.serialize_none(),
    }
}

/// Why a request could not be routed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    #[error("no worker is routable ({known} known, {out} out of routing)")]
    NoWorker { known: usize, out: usize },
    #[error("every routable worker is overloaded, and shedding is on")]
    Shed,
    #[error("{0}")]
    Hash(String),
}

/// A request's end, as the caller reports it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Tokens {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// The engine's `cached_tokens`, when it reported them.
    pub cached_tokens: Option<u64>,
}

/// What [`Router::report`] found: the worker the request had gone to.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Reported {
    #[serde(serialize_with = "ser_arc_str")]
    pub relay: Arc<str>,
    pub dp_rank: u32,
}

/// One worker with its routing state ([`Router::workers`]).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RoutedWorker {
    #[serde(flatten)]
    pub worker: WorkerInfo,
    pub routing: RoutingState,
}

/// The router's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RouterCounters {
    /// Decisions, by reason (in [`Reason::ALL`]'s order).
    pub routed: [u64; Reason::ALL.len()],
    /// Requests refused: every worker overloaded, shedding on.
    pub shed: u64,
    /// Requests with no routable worker.
    pub no_worker: u64,
    pub tracker: TrackerCounters,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub cached_tokens: u64,
}

#[derive(Debug)]
struct Inner {
    tracker: Tracker,
    rng: StdRng,
    cands: Vec<Candidate>,
    /// For each candidate, its row in the match and its gate.
    rows: Vec<(usize, Gate)>,
    counters: RouterCounters,
}

/// A router over a [`Follower`]: decides where requests go. Cheap to share (`Arc`).
#[derive(Debug)]
pub struct Router {
    follower: Follower,
    cfg: RouterConfig,
    policy: Box<dyn Policy>,
    inner: Mutex<Inner>,
    tokens: [AtomicU64; 3],
}

impl Router {
    /// A router over `follower`'s relays.
    pub fn new(follower: Follower, cfg: RouterConfig) -> Self {
        let rng = match cfg.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_os_rng(),
        };
        Router {
            policy: cfg.policy.build(cfg.cache_aware),
            inner: Mutex::new(Inner {
                tracker: Tracker::new(cfg.tracker),
                rng,
                cands: Vec::new(),
                rows: Vec::new(),
                counters: RouterCounters::default(),
            }),
            follower,
            cfg,
            tokens: Default::default(),
        }
    }

    /// The follower it routes over.
    pub fn follower(&self) -> &Follower {
        &self.follower
    }

    /// The settings.
    pub fn config(&self) -> &RouterConfig {
        &self.cfg
    }

    /// The policy's name.
    pub fn policy(&self) -> &'static str {
        self.policy.name()
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Chooses the worker for a request given by its block hashes (as the engine computes
    /// them), and counts the request in flight there until [`Router::report`].
    pub fn route(&self, hashes: &[u64]) -> Result<Routed, RouteError> {
        let m = self.follower.matches(hashes, MatchOptions::default());
        let now = Instant::now();
        let blocks = u32::try_from(hashes.len()).unwrap_or(u32::MAX);
        let mut guard = self.lock();
        let inner = &mut *guard;
        inner.tracker.forget(now, false);
        inner.cands.clear();
        inner.rows.clear();
        let mut held = (0u64, 0u64);
        for (i, w) in m.iter().enumerate() {
            let signals = Signals {
                state: w.state,
                engine: w.liveness,
                engine_stopped: w.engine_stopped,
                heard: w.last_seen.is_some(),
            };
            let gate = inner.tracker.gate(w.id, &signals, now);
            if let Gate::Out(_) = gate {
                continue;
            }
            held = (held.0 + w.held_blocks, held.1 + 1);
            let load = w.load.unwrap_or_default();
            inner.cands.push(Candidate {
                matched_blocks: w.matched_blocks,
                device_blocks: w.by_tier.of(TierId::DEVICE),
                running: load.running,
                waiting: load.waiting,
                kv_usage: load.kv_usage,
                in_flight: inner.tracker.in_flight(w.id),
                warming: false,
                probe: gate == Gate::Probe,
            });
            inner.rows.push((i, gate));
        }
        if held.1 > 0 {
            let mean = held.0 as f64 / held.1 as f64;
            if mean >= self.cfg.warm_min_blocks as f64 {
                let below = mean * self.cfg.warm_below;
                for (c, &(i, _)) in inner.cands.iter_mut().zip(&inner.rows) {
                    c.warming = m.get(i).is_some_and(|w| (w.held_blocks as f64) < below);
                }
            }
        }
        let choice = self.policy.choose(RouteInput { blocks }, &inner.cands, &mut inner.rng);
        match choice {
            Choice::Worker { index, reason, expected_wait_us } => {
                let (row, gate) = inner.rows[index];
                let c = inner.cands[index];
                let w = m.get(row).expect("a candidate's row is in the match");
                let request_id = inner.tracker.routed(w.id, gate, now);
                inner.counters.routed[reason as usize] += 1;
                Ok(Routed {
                    request_id,
                    relay: w.relay.clone(),
                    dp_rank: w.dp_rank,
                    engine_url: w.engine_url.cloned(),
                    blocks,
                    matched_blocks: c.matched_blocks,
                    device_blocks: c.device_blocks,
                    reason,
                    policy: self.policy.name(),
                    expected_wait_us,
                })
            }
            Choice::Shed => {
                inner.counters.shed += 1;
                Err(RouteError::Shed)
            }
            Choice::None => {
                inner.counters.no_worker += 1;
                Err(RouteError::NoWorker { known: m.len(), out: m.len() - inner.cands.len() })
            }
        }
    }

    /// [`Router::route`] for a request given by its token ids (and salt, LoRA, ...): the hashes
    /// are computed as the engine computes them.
    pub fn route_tokens(&self, engine: &EngineHashConfig, request: &RequestKeys<'_>) -> Result<Routed, RouteError> {
        let hashes = block_event_hashes(engine, request).map_err(|e| RouteError::Hash(e.to_string()))?;
        self.route(&hashes)
    }

    /// Takes a routed request's end: `Done` or `Failed` (`connect`: before the engine's first
    /// byte, which takes the worker out of routing), with its tokens.
    pub fn report(&self, request_id: u64, outcome: Outcome, tokens: Tokens) -> Result<Reported, ReportError> {
        let now = Instant::now();
        let worker = self.lock().tracker.report(request_id, outcome, now)?;
        if outcome == (Outcome::Failed { connect: true }) {
            self.refused_behind(worker, now);
        }
        for (c, v) in
            self.tokens.iter().zip([tokens.prompt_tokens, tokens.completion_tokens, tokens.cached_tokens.unwrap_or(0)])
        {
            c.fetch_add(v, Ordering::Relaxed);
        }
        let (relay, dp_rank) = self.follower.index().workers().key(worker).unwrap_or_else(|| (Arc::from(""), 0));
        Ok(Reported { relay, dp_rank })
    }

    /// A connection to `worker`'s engine was refused: every other rank behind the same engine
    /// URL (one HTTP server serves all of an engine's DP ranks) leaves routing with it, so the
    /// request's retry goes to another engine.
    fn refused_behind(&self, worker: WorkerId, now: Instant) {
        let workers = self.follower.workers();
        let Some(url) = workers.iter().find(|w| w.id == worker).and_then(|w| w.engine_url.clone()) else {
            return;
        };
        let mut inner = self.lock();
        for w in workers.iter().filter(|w| w.id != worker && w.engine_url.as_deref() == Some(&*url)) {
            inner.tracker.refused(w.id, now);
        }
    }

    /// Every worker known, with its routing state now: each breaker is moved by the worker's
    /// signals as a route would move it, so an idle router reports what its next route sees.
    pub fn workers(&self) -> Vec<RoutedWorker> {
        let workers = self.follower.workers();
        let now = Instant::now();
        let mut inner = self.lock();
        workers
            .into_iter()
            .map(|w| {
                let engine = w.liveness.as_ref().map_or(EngineLiveness::Unknown, |l| l.state);
                let signals = Signals {
                    state: w.state,
                    engine,
                    engine_stopped: w.engine_stopped,
                    heard: w.last_seen_ago.is_some(),
                };
                inner.tracker.gate(w.id, &signals, now);
                RoutedWorker { routing: inner.tracker.state(w.id), worker: w }
            })
            .collect()
    }

    /// The counters.
    pub fn counters(&self) -> RouterCounters {
        let inner = self.lock();
        let mut c = inner.counters;
        c.tracker = inner.tracker.counters();
        [c.prompt_tokens, c.completion_tokens, c.cached_tokens] =
            [0, 1, 2].map(|i| self.tokens[i].load(Ordering::Relaxed));
        c
    }

    /// Routed requests not yet reported.
    pub fn in_flight(&self) -> usize {
        self.lock().tracker.tickets()
    }
}
