//! The routing decision: a [`Policy`] chooses one of the routable workers for a request, from
//! what the router knows of each ([`Candidate`]). Policies are pure: no sockets, no clock; the
//! randomness they draw (ties, `random`) comes from the generator the caller passes, so a test
//! with a seeded generator sees one answer.
//!
//! [`CacheAware`], the default, scores each worker by its expected wait for the request: the
//! queue ahead of it (the load its relay pushes, and the router's own requests in flight) plus
//! the prefill of the blocks it does not hold (device blocks count whole, blocks held only in
//! host or lower tiers at a discount). Overloaded workers are steered away from; ties within a
//! microsecond are drawn uniformly. [`RoundRobin`], [`LeastLoad`] and [`Random`] are the
//! baselines it is measured against.

use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering};

use rand::{Rng, RngCore};
use serde::Serialize;

/// One routable worker as a policy sees it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Candidate {
    /// Leading blocks of the request the worker holds in any tier.
    pub matched_blocks: u32,
    /// Leading blocks it holds in the device tier alone.
    pub device_blocks: u32,
    /// Requests running on the engine, as its relay last pushed (0 when unknown).
    pub running: f64,
    /// Requests waiting on the engine.
    pub waiting: f64,
    /// The engine's KV-cache usage, 0..1.
    pub kv_usage: f64,
    /// Requests this router sent the worker that have not ended.
    pub in_flight: u32,
    /// The worker is back in routing with an (almost) empty cache: it takes a share of the
    /// requests no worker holds a block of, so that it warms again.
    pub warming: bool,
    /// The worker's circuit breaker is half open: the next request is its probe.
    pub probe: bool,
}

impl Candidate {
    /// The queue ahead of a new request, in requests: what the engine runs and queues, or the
    /// router's own requests in flight when those are more (the engine's gauges lag by a
    /// scrape), plus the waiting ones again (they wait for a slot, then take one).
    pub fn queue(&self) -> f64 {
        (self.running + self.waiting).max(f64::from(self.in_flight)) + self.waiting
    }
}

/// What a policy is told of the request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RouteInput {
    /// The request's blocks (its prompt's full blocks).
    pub blocks: u32,
}

/// Why a worker was chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// The least expected wait, its cached prefix counted (the worker holds a block of it).
    CachedPrefix,
    /// The least expected wait, the worker holding no block of it (the least loaded).
    LeastWait,
    /// Every worker was overloaded: the least loaded one.
    AllOverloaded,
    /// The worker's circuit breaker was half open: this request is its probe.
    Probe,
    /// No worker held a block, and this warming worker took the miss.
    Warming,
    /// `round_robin`: the next in turn.
    RoundRobin,
    /// `least_load`: the fewest requests queued.
    LeastLoad,
    /// `random`: drawn uniformly.
    Random,
}

impl Reason {
    /// The reason's name, as the HTTP API and the metrics spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::CachedPrefix => "cached_prefix",
            Reason::LeastWait => "least_wait",
            Reason::AllOverloaded => "all_overloaded",
            Reason::Probe => "probe",
            Reason::Warming => "warming",
            Reason::RoundRobin => "round_robin",
            Reason::LeastLoad => "least_load",
            Reason::Random => "random",
        }
    }

    /// Every reason, in the order above.
    pub const ALL: [Reason; 8] = [
        Reason::CachedPrefix,
        Reason::LeastWait,
        Reason::AllOverloaded,
        Reason::Probe,
        Reason::Warming,
        Reason::RoundRobin,
        Reason::LeastLoad,
        Reason::Random,
    ];
}

/// A policy's answer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Choice {
    /// Send the request to `candidates[index]`.
    Worker {
        index: usize,
        reason: Reason,
        /// The expected wait the choice was made by, in microseconds (`cache_aware`), else 0.
        expected_wait_us: f64,
    },
    /// Every worker is overloaded and shedding is on: refuse the request (HTTP 503).
    Shed,
    /// No candidate.
    None,
}

/// A routing policy: a pure function of the candidates (and the generator's draws).
pub trait Policy: Send + Sync + fmt::Debug {
    /// The policy's name (`cache_aware`, `round_robin`, ...).
    fn name(&self) -> &'static str;
    /// Chooses among `candidates` (every one routable) for `input`.
    fn choose(&self, input: RouteInput, candidates: &[Candidate], rng: &mut dyn RngCore) -> Choice;
}

/// The policies by name, as `--policy` takes them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyKind {
    #[default]
    CacheAware,
    RoundRobin,
    LeastLoad,
    Random,
}

impl PolicyKind {
    /// The name, as `--policy` spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::CacheAware => "cache_aware",
            PolicyKind::RoundRobin => "round_robin",
            PolicyKind::LeastLoad => "least_load",
            PolicyKind::Random => "random",
        }
    }

    /// The policy, with `cfg` for `cache_aware`.
    pub fn build(self, cfg: CacheAwareConfig) -> Box<dyn Policy> {
        match self {
            PolicyKind::CacheAware => Box::new(CacheAware::new(cfg)),
            PolicyKind::RoundRobin => Box::new(RoundRobin::default()),
            PolicyKind::LeastLoad => Box::new(LeastLoad),
            PolicyKind::Random => Box::new(Random),
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for PolicyKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().replace('-', "_").as_str() {
            "cache_aware" => Ok(PolicyKind::CacheAware),
            "round_robin" => Ok(PolicyKind::RoundRobin),
            "least_load" => Ok(PolicyKind::LeastLoad),
            "random" => Ok(PolicyKind::Random),
            _ => Err(format!("unknown policy {s:?}: one of cache_aware, round_robin, least_load, random")),
        }
    }
}

/// When a worker counts as overloaded, and what happens when every one is.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Overload {
    /// Steer away from overloaded workers (on by default).
    pub enabled: bool,
    /// KV-cache usage at or above this is overloaded.
    pub kv_usage: f64,
    /// This many waiting requests or more is overloaded.
    pub waiting: f64,
    /// When every worker is overloaded, refuse the request ([`Choice::Shed`]) instead of sending
    /// it to the least loaded one. Off by default.
    pub shed: bool,
}

impl Default for Overload {
    fn default() -> Self {
        Overload { enabled: true, kv_usage: 0.8, waiting: 8.0, shed: false }
    }
}

impl Overload {
    /// Whether `c` is overloaded.
    pub fn over(&self, c: &Candidate) -> bool {
        self.enabled && (c.kv_usage >= self.kv_usage || c.waiting >= self.waiting)
    }
}

/// `cache_aware`'s knobs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CacheAwareConfig {
    /// A block held only in a host (or lower) tier saves this share of a device block's
    /// prefill (it still has to be copied back). 0..=1.
    pub host_discount: f64,
    /// The prefill of one block the worker does not hold, in microseconds.
    pub prefill_us_per_block: f64,
    /// What each request queued ahead adds to the wait, in microseconds.
    pub queue_us_per_request: f64,
    /// Expected waits within this many microseconds of the least are a tie, drawn uniformly.
    pub tie_us: f64,
    /// Of the requests no worker holds a block of, this share goes to warming workers (while
    /// any is warming and not overloaded). 0..=1.
    pub warm_share: f64,
    pub overload: Overload,
}

impl Default for CacheAwareConfig {
    fn default() -> Self {
        CacheAwareConfig {
            host_discount: 0.5,
            prefill_us_per_block: 400.0,
            queue_us_per_request: 20_000.0,
            tie_us: 1.0,
            warm_share: 0.25,
            overload: Overload::default(),
        }
    }
}

/// The default policy (see the module docs).
#[derive(Debug, Default)]
pub struct CacheAware {
    cfg: CacheAwareConfig,
}

impl CacheAware {
    pub fn new(cfg: CacheAwareConfig) -> Self {
        CacheAware { cfg }
    }

    /// The blocks of the request `c` does not hold, host-tier blocks counted at the discount.
    pub fn uncached_blocks(&self, input: RouteInput, c: &Candidate) -> f64 {
        let device = f64::from(c.device_blocks.min(input.blocks));
        let lower = f64::from(c.matched_blocks.min(input.blocks)) - device;
        let cached = device + lower.max(0.0) * self.cfg.host_discount.clamp(0.0, 1.0);
        (f64::from(input.blocks) - cached).max(0.0)
    }

    /// `c`'s expected wait for the request, in microseconds.
    pub fn expected_wait_us(&self, input: RouteInput, c: &Candidate) -> f64 {
        c.queue() * self.cfg.queue_us_per_request + self.uncached_blocks(input, c) * self.cfg.prefill_us_per_block
    }
}

impl Policy for CacheAware {
    fn name(&self) -> &'static str {
        "cache_aware"
    }

    fn choose(&self, input: RouteInput, cands: &[Candidate], rng: &mut dyn RngCore) -> Choice {
        if cands.is_empty() {
            return Choice::None;
        }
        let ov = &self.cfg.overload;
        let any_fit = cands.iter().any(|c| !ov.over(c));
        if !any_fit {
            if ov.shed {
                return Choice::Shed;
            }
            let (index, _) = least_by(cands, |_| true, Candidate::queue, 0.0, rng);
            let w = self.expected_wait_us(input, &cands[index]);
            return Choice::Worker { index, reason: Reason::AllOverloaded, expected_wait_us: w };
        }
        let fits = |c: &Candidate| !ov.over(c);
        // A half-open worker takes its one probe request.
        if let Some(index) = cands.iter().position(|c| c.probe && fits(c)) {
            let w = self.expected_wait_us(input, &cands[index]);
            return Choice::Worker { index, reason: Reason::Probe, expected_wait_us: w };
        }
        let hit = cands.iter().any(|c| c.matched_blocks > 0);
        if !hit && cands.iter().any(|c| c.warming && fits(c)) && rng.random_bool(self.cfg.warm_share.clamp(0.0, 1.0)) {
            let (index, w) = least_by(cands, |c| c.warming && fits(c), |c| self.expected_wait_us(input, c), 0.0, rng);
            return Choice::Worker { index, reason: Reason::Warming, expected_wait_us: w };
        }
        let (index, w) = least_by(cands, fits, |c| self.expected_wait_us(input, c), self.cfg.tie_us.max(0.0), rng);
        let reason = if cands[index].matched_blocks > 0 { Reason::CachedPrefix } else { Reason::LeastWait };
        Choice::Worker { index, reason, expected_wait_us: w }
    }
}

/// The candidate with the least `key` among those `keep` passes, ties (within `tie` of the
/// least) drawn uniformly: one pass for the least, one reservoir draw over the tied. `cands`
/// must hold at least one that `keep` passes.
fn least_by(
    cands: &[Candidate],
    keep: impl Fn(&Candidate) -> bool,
    key: impl Fn(&Candidate) -> f64,
    tie: f64,
    rng: &mut dyn RngCore,
) -> (usize, f64) {
    let mut least = f64::INFINITY;
    for c in cands.iter().filter(|c| keep(c)) {
        least = least.min(key(c));
    }
    let mut chosen = (0, least);
    let mut tied = 0u32;
    for (i, c) in cands.iter().enumerate() {
        if !keep(c) {
            continue;
        }
        let k = key(c);
        if k <= least + tie {
            tied += 1;
            if rng.random_range(0..tied) == 0 {
                chosen = (i, k);
            }
        }
    }
    chosen
}

/// Each routable worker in turn (the baseline).
#[derive(Debug, Default)]
pub struct RoundRobin {
    next: AtomicUsize,
}

impl Policy for RoundRobin {
    fn name(&self) -> &'static str {
        "round_robin"
    }

    fn choose(&self, _input: RouteInput, cands: &[Candidate], _rng: &mut dyn RngCore) -> Choice {
        if cands.is_empty() {
            return Choice::None;
        }
        let index = self.next.fetch_add(1, Ordering::Relaxed) % cands.len();
        Choice::Worker { index, reason: Reason::RoundRobin, expected_wait_us: 0.0 }
    }
}

/// The fewest requests queued ([`Candidate::queue`]), ties drawn uniformly (the baseline).
#[derive(Debug, Default)]
pub struct LeastLoad;

impl Policy for LeastLoad {
    fn name(&self) -> &'static str {
        "least_load"
    }

    fn choose(&self, _input: RouteInput, cands: &[Candidate], rng: &mut dyn RngCore) -> Choice {
        if cands.is_empty() {
            return Choice::None;
        }
        let (index, _) = least_by(cands, |_| true, Candidate::queue, 0.0, rng);
        Choice::Worker { index, reason: Reason::LeastLoad, expected_wait_us: 0.0 }
    }
}

/// A worker drawn uniformly (the baseline).
#[derive(Debug, Default)]
pub struct Random;

impl Policy for Random {
    fn name(&self) -> &'static str {
        "random"
    }

    fn choose(&self, _input: RouteInput, cands: &[Candidate], rng: &mut dyn RngCore) -> Choice {
        if cands.is_empty() {
            return Choice::None;
        }
        Choice::Worker { index: rng.random_range(0..cands.len()), reason: Reason::Random, expected_wait_us: 0.0 }
    }
}
