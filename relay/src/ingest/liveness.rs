//! The engine's liveness per rank, judged from beside it: its health endpoint, its progress
//! counters and its KV events.
//!
//! [`Judge`] is pure: each tick it takes what was seen (the last health probe's answer, and per
//! rank whether requests run and when the engine last made progress) with the time, and gives
//! each rank's [`Liveness`]. The daemon's loop does the I/O ([`probe`], the metrics scrape) and
//! publishes the result.
//!
//! - `stopped`: nothing listens on the health endpoint (the connection is refused).
//! - `unreachable`: the probe timed out, failed, or the endpoint answered an error (a frozen,
//!   starved or failing engine).
//! - `wedged`: the endpoint answers, the rank has requests running or waiting, and neither its
//!   progress counters nor its KV events moved for the wedge time.
//! - `alive`: otherwise.

use crate::model::{EngineState, Liveness};
use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use super::load::{self, ScrapeError};

/// Each rank's latest liveness, shared by the watch (which writes it) and the committers (which
/// stamp it on every batch). Empty when the engine is not watched.
pub type Livenesses = Arc<RwLock<BTreeMap<u32, Liveness>>>;

/// What the last health probe found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    /// The endpoint answered 200.
    Healthy,
    /// The connection was refused: nothing listens.
    Refused(String),
    /// It timed out, failed, or answered another status.
    Failed(String),
}

/// One rank's signs of progress at a tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Activity {
    /// The engine reports requests running or waiting on the rank.
    pub busy: bool,
    /// Unix milliseconds of the rank's last progress (a progress counter moved, or a KV event
    /// arrived); `None` when none was seen since the relay started.
    pub progressed_at_ms: Option<u64>,
}

/// Turns observations into each rank's liveness, keeping when each state began.
#[derive(Debug, Clone)]
pub struct Judge {
    wedge_after_ms: u64,
    /// When the judge first ran: a rank with no progress seen counts from here.
    started_ms: Option<u64>,
    ranks: BTreeMap<u32, Liveness>,
}

impl Judge {
    pub fn new(wedge_after: Duration) -> Judge {
        Judge { wedge_after_ms: wedge_after.as_millis() as u64, started_ms: None, ranks: BTreeMap::new() }
    }

    /// Judges `rank` at `now_ms`; returns its liveness, and whether its state changed (a reason
    /// that only restates the time, as the wedged one counts its seconds, is no change).
    pub fn judge(&mut self, now_ms: u64, rank: u32, probe: &Probe, activity: Activity) -> (Liveness, bool) {
        let started = *self.started_ms.get_or_insert(now_ms);
        let (state, reason) = match probe {
            Probe::Refused(why) => (EngineState::Stopped, why.clone()),
            Probe::Failed(why) => (EngineState::Unreachable, why.clone()),
            Probe::Healthy => {
                let since = activity.progressed_at_ms.unwrap_or(started).max(started);
                let still = now_ms.saturating_sub(since);
                if activity.busy && still >= self.wedge_after_ms {
                    let secs = still as f64 / 1000.0;
                    (EngineState::Wedged, format!("requests running, no progress for {secs:.1} s"))
                } else {
                    (EngineState::Alive, String::new())
                }
            }
        };
        let prev = self.ranks.get(&rank);
        let changed = prev.is_none_or(|p| p.state != state);
        let since_ms = match prev {
            Some(p) if !changed => p.since_ms,
            _ => now_ms,
        };
        let l = Liveness { state, reason, since_ms, observed_at_ms: now_ms };
        self.ranks.insert(rank, l.clone());
        (l, changed)
    }
}

/// Tracks each rank's progress counter and when it last moved.
#[derive(Debug, Clone, Default)]
pub struct Progress {
    seen: BTreeMap<Option<u32>, (f64, u64)>,
}

impl Progress {
    /// Takes a scrape's counters at `now_ms`.
    pub fn observe(&mut self, now_ms: u64, counters: &BTreeMap<Option<u32>, f64>) {
        for (&rank, &v) in counters {
            match self.seen.get_mut(&rank) {
                Some((last, at)) => {
                    if *last != v {
                        (*last, *at) = (v, now_ms);
                    }
                }
                None => {
                    self.seen.insert(rank, (v, now_ms));
                }
            }
        }
    }

    /// When the rank's counter last moved (its own series, else the unlabelled one).
    pub fn moved_at(&self, rank: u32) -> Option<u64> {
        self.seen.get(&Some(rank)).or_else(|| self.seen.get(&None)).map(|&(_, at)| at)
    }
}

/// One GET of the health endpoint.
pub async fn probe(url: &str, timeout: Duration) -> Probe {
    match load::scrape(url, timeout).await {
        Ok(_) => Probe::Healthy,
        Err(ScrapeError::Connect(_, e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
            Probe::Refused(format!("{url}: connection refused"))
        }
        Err(e) => Probe::Failed(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WEDGE: Duration = Duration::from_secs(3);

    fn busy(at: Option<u64>) -> Activity {
        Activity { busy: true, progressed_at_ms: at }
    }

    #[test]
    fn refused_is_stopped_and_failure_unreachable() {
        let mut j = Judge::new(WEDGE);
        let (l, changed) = j.judge(1_000, 0, &Probe::Refused("refused".into()), Activity::default());
        assert_eq!(
            l,
            Liveness { state: EngineState::Stopped, reason: "refused".into(), since_ms: 1_000, observed_at_ms: 1_000 }
        );
        assert!(changed);
        let (l, changed) = j.judge(2_000, 0, &Probe::Refused("refused".into()), Activity::default());
        assert_eq!((l.state, l.since_ms, l.observed_at_ms, changed), (EngineState::Stopped, 1_000, 2_000, false));
        let (l, changed) = j.judge(3_000, 0, &Probe::Failed("timed out".into()), Activity::default());
        assert_eq!(
            (l.state, l.reason.as_str(), l.since_ms, changed),
            (EngineState::Unreachable, "timed out", 3_000, true)
        );
        let (l, changed) = j.judge(4_000, 0, &Probe::Healthy, Activity::default());
        assert_eq!((l.state, l.reason.as_str(), l.since_ms, changed), (EngineState::Alive, "", 4_000, true));
    }

    #[test]
    fn busy_without_progress_for_the_wedge_time_is_wedged() {
        let mut j = Judge::new(WEDGE);
        assert_eq!(j.judge(9_000, 0, &Probe::Healthy, busy(Some(9_000))).0.state, EngineState::Alive);
        // 2.999 s without progress: still alive.
        assert_eq!(j.judge(11_999, 0, &Probe::Healthy, busy(Some(9_000))).0.state, EngineState::Alive);
        let (l, changed) = j.judge(12_000, 0, &Probe::Healthy, busy(Some(9_000)));
        assert_eq!(l.state, EngineState::Wedged);
        assert_eq!(l.reason, "requests running, no progress for 3.0 s");
        assert_eq!((l.since_ms, changed), (12_000, true));
        // Still wedged a second later: the same state, since unchanged.
        let (l, changed) = j.judge(13_000, 0, &Probe::Healthy, busy(Some(9_000)));
        assert_eq!((l.state, l.since_ms, changed), (EngineState::Wedged, 12_000, false));
        assert_eq!(l.reason, "requests running, no progress for 4.0 s");
        // Progress: alive at once.
        let (l, changed) = j.judge(13_250, 0, &Probe::Healthy, busy(Some(13_100)));
        assert_eq!((l.state, l.since_ms, changed), (EngineState::Alive, 13_250, true));
    }

    #[test]
    fn an_idle_engine_is_alive_however_long_it_rests() {
        let mut j = Judge::new(WEDGE);
        let idle = Activity { busy: false, progressed_at_ms: Some(0) };
        assert_eq!(j.judge(1_000_000, 3, &Probe::Healthy, idle).0.state, EngineState::Alive);
    }

    #[test]
    fn no_progress_seen_counts_from_the_first_judgement() {
        let mut j = Judge::new(WEDGE);
        assert_eq!(j.judge(5_000, 0, &Probe::Healthy, busy(None)).0.state, EngineState::Alive);
        assert_eq!(j.judge(7_999, 0, &Probe::Healthy, busy(None)).0.state, EngineState::Alive);
        assert_eq!(j.judge(8_000, 0, &Probe::Healthy, busy(None)).0.state, EngineState::Wedged);
        // Progress from before the relay started counts from the start.
        let mut j = Judge::new(WEDGE);
        assert_eq!(j.judge(5_000, 1, &Probe::Healthy, busy(Some(100))).0.state, EngineState::Alive);
        assert_eq!(j.judge(8_000, 1, &Probe::Healthy, busy(Some(100))).0.state, EngineState::Wedged);
    }

    #[test]
    fn ranks_are_judged_apart() {
        let mut j = Judge::new(WEDGE);
        j.judge(0, 0, &Probe::Healthy, busy(Some(0)));
        j.judge(0, 1, &Probe::Healthy, busy(Some(0)));
        assert_eq!(j.judge(3_000, 0, &Probe::Healthy, busy(Some(0))).0.state, EngineState::Wedged);
        assert_eq!(j.judge(3_000, 1, &Probe::Healthy, busy(Some(2_900))).0.state, EngineState::Alive);
    }

    #[test]
    fn progress_remembers_when_each_counter_moved() {
        let mut p = Progress::default();
        p.observe(100, &BTreeMap::from([(Some(0), 5.0), (None, 1.0)]));
        p.observe(200, &BTreeMap::from([(Some(0), 5.0), (None, 2.0)]));
        assert_eq!((p.moved_at(0), p.moved_at(7)), (Some(100), Some(200)));
        p.observe(300, &BTreeMap::from([(Some(0), 6.0)]));
        assert_eq!(p.moved_at(0), Some(300));
        assert_eq!(Progress::default().moved_at(0), None);
    }

    #[tokio::test]
    async fn a_closed_port_is_refused() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        drop(l);
        let url = format!("http://{addr}/health");
        assert_eq!(probe(&url, Duration::from_secs(1)).await, Probe::Refused(format!("{url}: connection refused")));
    }
}
