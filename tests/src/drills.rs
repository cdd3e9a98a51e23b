//! The end-to-end fault drills: a mock engine with several DP ranks and steady
//! generated traffic, `kv-relay` as a separate process, and routers following it; each drill
//! injects one fault, measures the recovery, and checks its pass rule. "Equal" means a
//! router's index equals the mock engine's truth for every worker (relay, DP rank), block for
//! block, tier for tier and copy for copy, with nothing missing and nothing extra.
//!
//! The router side is the client library: [`router::Router`] is a `kv-router-client`
//! [`Follower`](kv_router_client::Follower) read through its public surface. Faults between a
//! router and the relay (a partition, a stalled or slow link) go through a [`proxy::Proxy`].
//!
//! Every drill has a short form (seconds: `tests/tests/drills.rs`, run in CI) and a long form
//! (`drills --long`: the soak rows at full length).

mod faults;
pub mod harness;
pub mod proxy;
pub mod router;
pub mod routing;
mod soak;

pub use faults::{
    engine_gone, garbage, oversized, publisher_delay, publisher_restart, relay_kill, replay_gap, router_restart,
    slow_subscriber, stale_cursor, wire_drops,
};
pub use soak::{disk_full, soak};

use harness::*;
use kv_relay_proto::pb;
use kv_router_client::FollowConfig;
use proxy::Proxy;
use router::{size_of_held, truth_held, Router};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

/// One drill's outcome: its rule, what was measured, and every failed assertion.
#[derive(Debug, Clone)]
pub struct Report {
    pub name: &'static str,
    pub rule: &'static str,
    pub measured: Vec<String>,
    pub failures: Vec<String>,
    /// Why the drill could not run here (it did not pass either).
    pub skipped: Option<String>,
}

impl Report {
    fn new(name: &'static str, rule: &'static str) -> Report {
        Report { name, rule, measured: Vec::new(), failures: Vec::new(), skipped: None }
    }

    fn measure(&mut self, s: impl Into<String>) {
        self.measured.push(s.into());
    }

    fn check(&mut self, ok: bool, what: impl Into<String>) -> bool {
        if !ok {
            self.failures.push(what.into());
        }
        ok
    }

    pub fn passed(&self) -> bool {
        self.failures.is_empty() && self.skipped.is_none()
    }

    /// The report as printed by the `drills` binary.
    pub fn text(&self) -> String {
        let mut s = format!("== {}\nrule: {}\n", self.name, self.rule);
        for m in &self.measured {
            s += &format!("  measured: {m}\n");
        }
        for f in &self.failures {
            s += &format!("  FAILED: {f}\n");
        }
        s += &match &self.skipped {
            Some(why) => format!("SKIPPED: {why}\n"),
            None if self.failures.is_empty() => "PASS\n".to_string(),
            None => "FAIL\n".to_string(),
        };
        s
    }
}

/// Short (CI) or long (soak rows at full length) form.
#[derive(Debug, Clone, Copy)]
pub struct Scale {
    pub long: bool,
}

/// A drill: runs at a scale, reports.
pub type Drill = fn(Scale) -> Report;

/// Every drill by name, in the order docs/drills.md lists them.
pub const DRILLS: &[(&str, Drill)] = &[
    ("router_restart", router_restart),
    ("stale_cursor", stale_cursor),
    ("wire_drops", wire_drops),
    ("publisher_delay", publisher_delay),
    ("publisher_restart", publisher_restart),
    ("replay_gap", replay_gap),
    ("relay_kill", relay_kill),
    ("engine_gone", engine_gone),
    ("slow_subscriber", slow_subscriber),
    ("garbage", garbage),
    ("oversized", oversized),
    ("soak", soak),
    ("disk_full", disk_full),
    ("engine_killed", routing::engine_killed),
    ("host_partitioned", routing::host_partitioned),
    ("engine_wedged", routing::engine_wedged),
    ("engine_frozen", routing::engine_frozen),
    ("engine_restarted_empty", routing::engine_restarted_empty),
    ("router_restarted", routing::router_restarted),
    ("route_storm", routing::route_storm),
];

/// What each drill needs: a runtime for the routers, a temp dir for state and logs.
struct Ctx {
    rt: tokio::runtime::Runtime,
    dir: tempfile::TempDir,
}

impl Ctx {
    fn new() -> Ctx {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
        Ctx { rt, dir: tempfile::tempdir().expect("temp dir") }
    }

    fn relay(&self, e: &crate::engine::MockEngine, extra: &[&str]) -> RelayProc {
        let state = self.dir.path().join("state");
        RelayProc::start(e, &state, &self.dir.path().join("relay.log"), extra)
    }

    /// Waits until every rank of the engine holds blocks (traffic reached all of them).
    fn warm(&self, e: &crate::engine::MockEngine) {
        let dp = e.dp_size();
        wait_until(Duration::from_secs(10), || {
            let t = e.truth();
            (0..dp).all(|k| t.blocks.iter().any(|(key, set)| key.rank == k && set.len() >= 8))
        });
    }

    /// A router following `r` with the client's default settings.
    fn router(&self, r: &RelayProc) -> Router {
        Router::start(self.rt.handle(), r.url(), FollowConfig::default())
    }
}

fn ms(d: Duration) -> String {
    format!("{} ms", d.as_millis())
}

fn counter(s: &pb::StatusResponse, name: &str) -> u64 {
    s.counters.get(name).copied().unwrap_or(0)
}

/// Waits (traffic held) for equality; records the result.
fn expect_equal(
    rep: &mut Report,
    e: &crate::engine::MockEngine,
    t: Option<&Traffic>,
    routers: &[&Router],
    what: &str,
    limit: Duration,
) -> bool {
    let start = Instant::now();
    let ok = time_to_equal(e, t, routers, start, limit).is_some();
    if ok {
        let (keys, blocks, copies) = size_of_held(&truth_held(&e.truth()));
        rep.measure(format!("{what}: equal ({keys} worker/tier sets, {blocks} blocks, {copies} copies)"));
    } else {
        let d: Vec<String> = routers.iter().map(|s| diff(e, &s.get())).collect();
        rep.check(false, format!("{what}: not equal within {}: {}", ms(limit), d.join(" | ")));
    }
    ok
}

/// Keeps traffic running until the relay's history no longer holds `cursor + 1`.
fn roll_history_past(rep: &mut Report, r: &RelayProc, cursor: u64) -> bool {
    let rolled =
        wait_until(Duration::from_secs(20), || status(&r.url()).map(|s| s.oldest_cursor > cursor + 1).unwrap_or(false));
    let s = status(&r.url()).unwrap_or_default();
    rep.measure(format!(
        "history rolled: oldest cursor {} > router's {} (newest {})",
        s.oldest_cursor, cursor, s.newest_cursor
    ));
    rep.check(rolled.is_some(), "the history never rolled past the router's cursor")
}
