//! The circuit breakers as a pure state machine: each cause takes a worker out, good contact
//! half-opens it, one probe closes it; reports count requests in flight; unreported requests
//! are forgotten within bounds.

use std::time::Duration;

use kv_router::liveness::{Breaker, Cause, Gate, Outcome, ReportError, Signals, Tracker, TrackerConfig};
use kv_router_client::index::WorkerId;
use kv_router_client::{EngineLiveness, WorkerState};
use tokio::time::Instant;

fn w(n: u32) -> WorkerId {
    WorkerId::new(n).unwrap()
}

const GOOD: Signals =
    Signals { state: WorkerState::Fresh, engine: EngineLiveness::Alive, engine_stopped: false, heard: true };

fn with(state: WorkerState, engine: EngineLiveness) -> Signals {
    Signals { state, engine, engine_stopped: false, heard: true }
}

#[test]
fn every_signal_that_fails_takes_the_worker_out_with_its_cause() {
    let cases = [
        (with(WorkerState::RelayUnreachable, EngineLiveness::Alive), Cause::RelayUnreachable),
        (with(WorkerState::Stale, EngineLiveness::Alive), Cause::StreamSilent),
        (with(WorkerState::Fresh, EngineLiveness::Unreachable), Cause::Engine(EngineLiveness::Unreachable)),
        (with(WorkerState::Fresh, EngineLiveness::Wedged), Cause::Engine(EngineLiveness::Wedged)),
        (with(WorkerState::Fresh, EngineLiveness::Stopped), Cause::Engine(EngineLiveness::Stopped)),
        (Signals { engine_stopped: true, ..GOOD }, Cause::RankNotFollowed),
    ];
    let now = Instant::now();
    for (s, cause) in cases {
        let mut t = Tracker::new(TrackerConfig::default());
        assert_eq!(t.gate(w(0), &GOOD, now), Gate::Route);
        assert_eq!(t.gate(w(0), &s, now), Gate::Out(cause), "{s:?}");
        assert_eq!(t.breaker(w(0)), Breaker::Open { cause, since: now });
        assert_eq!(t.counters().outs, 1);
        assert_eq!(t.state(w(0)).routing, "out");
        assert_eq!(t.state(w(0)).cause.map(Cause::as_str), Some(cause.as_str()));
    }
    // Degraded, incomplete and unknown liveness (an old relay) route.
    let mut t = Tracker::new(TrackerConfig::default());
    for s in [
        with(WorkerState::Degraded, EngineLiveness::Alive),
        with(WorkerState::Incomplete, EngineLiveness::Alive),
        with(WorkerState::Fresh, EngineLiveness::Unknown),
    ] {
        assert_eq!(t.gate(w(0), &s, now), Gate::Route, "{s:?}");
    }
}

#[test]
fn good_contact_half_opens_one_probe_closes() {
    let mut t = Tracker::new(TrackerConfig::default());
    let t0 = Instant::now();
    let wedged = with(WorkerState::Fresh, EngineLiveness::Wedged);
    assert_eq!(t.gate(w(1), &wedged, t0), Gate::Out(Cause::Engine(EngineLiveness::Wedged)));
    // Good again: the next request is its probe; while it runs, no other goes there.
    assert_eq!(t.gate(w(1), &GOOD, t0), Gate::Probe);
    let probe = t.routed(w(1), Gate::Probe, t0);
    assert_eq!(t.gate(w(1), &GOOD, t0), Gate::Out(Cause::Probing));
    assert_eq!(t.state(w(1)).routing, "probing");
    assert_eq!(t.report(probe, Outcome::Done, t0), Ok(w(1)));
    assert_eq!(t.gate(w(1), &GOOD, t0), Gate::Route);
    let c = t.counters();
    assert_eq!((c.outs, c.probes, c.returns, c.done), (1, 1, 1, 1));
}

#[test]
fn a_failed_probe_opens_again_and_an_unreported_one_frees_its_slot() {
    let cfg = TrackerConfig { probe_timeout: Duration::from_secs(10), ..TrackerConfig::default() };
    let mut t = Tracker::new(cfg);
    let t0 = Instant::now();
    t.gate(w(0), &with(WorkerState::Stale, EngineLiveness::Alive), t0);
    assert_eq!(t.gate(w(0), &GOOD, t0), Gate::Probe);
    let p = t.routed(w(0), Gate::Probe, t0);
    assert_eq!(t.report(p, Outcome::Failed { connect: true }, t0), Ok(w(0)));
    assert_eq!(t.breaker(w(0)), Breaker::Open { cause: Cause::ConnectFailed, since: t0 });
    // A refused connection waits retry_after (1 s) before the next probe.
    assert_eq!(t.gate(w(0), &GOOD, t0 + Duration::from_millis(999)), Gate::Out(Cause::ConnectFailed));
    assert_eq!(t.gate(w(0), &GOOD, t0 + Duration::from_secs(1)), Gate::Probe);
    let t1 = t0 + Duration::from_secs(1);
    t.routed(w(0), Gate::Probe, t1);
    assert_eq!(t.gate(w(0), &GOOD, t1 + Duration::from_millis(9_999)), Gate::Out(Cause::Probing));
    assert_eq!(t.gate(w(0), &GOOD, t1 + Duration::from_secs(10)), Gate::Probe);
    // An engine error after it answered is the request's: the worker serves.
    let p = t.routed(w(0), Gate::Probe, t1 + Duration::from_secs(10));
    t.report(p, Outcome::Failed { connect: false }, t1).unwrap();
    assert_eq!(t.breaker(w(0)), Breaker::Closed);
}

#[test]
fn a_refused_connection_takes_a_routable_worker_out_at_once() {
    let mut t = Tracker::new(TrackerConfig::default());
    let t0 = Instant::now();
    assert_eq!(t.gate(w(2), &GOOD, t0), Gate::Route);
    let a = t.routed(w(2), Gate::Route, t0);
    let b = t.routed(w(2), Gate::Route, t0);
    assert_eq!(t.in_flight(w(2)), 2);
    t.report(a, Outcome::Failed { connect: true }, t0).unwrap();
    assert_eq!(t.gate(w(2), &GOOD, t0), Gate::Out(Cause::ConnectFailed));
    assert_eq!(t.in_flight(w(2)), 1);
    // The relay then says the engine stopped: the cause follows, the outage keeps its start.
    let stopped = with(WorkerState::Fresh, EngineLiveness::Stopped);
    let later = t0 + Duration::from_secs(3);
    assert_eq!(t.gate(w(2), &stopped, later), Gate::Out(Cause::Engine(EngineLiveness::Stopped)));
    assert_eq!(t.breaker(w(2)), Breaker::Open { cause: Cause::Engine(EngineLiveness::Stopped), since: t0 });
    assert_eq!(t.counters().outs, 1);
    // Reported twice, or never routed: refused.
    assert_eq!(t.report(a, Outcome::Done, t0), Err(ReportError::UnknownRequest(a)));
    assert_eq!(t.report(999, Outcome::Done, t0), Err(ReportError::UnknownRequest(999)));
    t.report(b, Outcome::Done, t0).unwrap();
    assert_eq!(t.in_flight(w(2)), 0);
}

#[test]
fn unreported_requests_are_forgotten_by_age_and_by_bound() {
    let cfg = TrackerConfig { request_timeout: Duration::from_secs(60), max_tickets: 4, ..TrackerConfig::default() };
    let mut t = Tracker::new(cfg);
    let t0 = Instant::now();
    for k in 0..4 {
        t.routed(w(0), Gate::Route, t0 + Duration::from_secs(k));
    }
    assert_eq!((t.tickets(), t.in_flight(w(0))), (4, 4));
    // A fifth: over the bound, the oldest goes.
    let fifth = t.routed(w(1), Gate::Route, t0 + Duration::from_secs(4));
    assert_eq!((t.tickets(), t.in_flight(w(0)), t.in_flight(w(1))), (4, 3, 1));
    // 61 s after the first three: they are forgotten; the fifth stays.
    t.forget(t0 + Duration::from_secs(63), false);
    assert_eq!((t.tickets(), t.in_flight(w(0)), t.in_flight(w(1))), (1, 0, 1));
    assert_eq!(t.counters().forgotten, 4);
    assert_eq!(t.report(fifth, Outcome::Done, t0), Ok(w(1)));
}

#[test]
fn a_worker_not_yet_heard_of_waits_without_a_verdict() {
    let mut t = Tracker::new(TrackerConfig::default());
    let now = Instant::now();
    // Listed by its relay's Status before the stream said anything of it: stale by the rule
    // (never seen), but that is no news of its engine.
    let unheard = Signals { heard: false, ..with(WorkerState::Stale, EngineLiveness::Unknown) };
    assert_eq!(unheard.cause(), Some(Cause::NotYetHeard));
    assert_eq!(t.gate(w(0), &unheard, now), Gate::Out(Cause::NotYetHeard));
    let s = t.state(w(0));
    assert_eq!((s.routing, s.cause.map(Cause::as_str), s.outs), ("out", Some("not_yet_heard"), 0));
    assert_eq!(t.breaker(w(0)), Breaker::Closed);
    // Its first heartbeat: routable at once, no probe owed, no out counted.
    assert_eq!(t.gate(w(0), &GOOD, now), Gate::Route);
    assert_eq!((t.state(w(0)).routing, t.counters().outs, t.counters().probes), ("routable", 0, 0));
    // Heard of once and silent since: that is a stall, and it takes the worker out.
    assert_eq!(t.gate(w(0), &with(WorkerState::Stale, EngineLiveness::Alive), now), Gate::Out(Cause::StreamSilent));
    assert_eq!(t.counters().outs, 1);
    // A worker out for a cause keeps it while its stream says nothing, and owes its probe.
    assert_eq!(t.gate(w(0), &unheard, now), Gate::Out(Cause::NotYetHeard));
    assert_eq!(t.breaker(w(0)), Breaker::Open { cause: Cause::StreamSilent, since: now });
    assert_eq!(t.gate(w(0), &GOOD, now), Gate::Probe);
}

#[test]
fn a_resync_holds_a_worker_without_a_verdict() {
    let mut t = Tracker::new(TrackerConfig::default());
    let now = Instant::now();
    let syncing = with(WorkerState::Syncing, EngineLiveness::Alive);
    // A new worker whose relay is syncing: out while it lasts, routable after, with no probe.
    assert_eq!(t.gate(w(0), &syncing, now), Gate::Out(Cause::Syncing));
    let s = t.state(w(0));
    assert_eq!((s.routing, s.cause.map(Cause::as_str), s.outs), ("out", Some("syncing"), 0));
    assert_eq!(t.gate(w(0), &GOOD, now), Gate::Route);
    assert_eq!((t.state(w(0)).routing, t.counters().outs, t.counters().probes), ("routable", 0, 0));
    // A worker out for its engine keeps its cause through a resync and still owes its probe.
    let wedged = with(WorkerState::Fresh, EngineLiveness::Wedged);
    assert_eq!(t.gate(w(0), &wedged, now), Gate::Out(Cause::Engine(EngineLiveness::Wedged)));
    assert_eq!(t.gate(w(0), &syncing, now), Gate::Out(Cause::Syncing));
    assert_eq!(t.breaker(w(0)), Breaker::Open { cause: Cause::Engine(EngineLiveness::Wedged), since: now });
    assert_eq!(t.gate(w(0), &GOOD, now), Gate::Probe);
    let probe = t.routed(w(0), Gate::Probe, now);
    let other = t.routed(w(0), Gate::Route, now);
    t.report(probe, Outcome::Done, now).unwrap();
    t.report(other, Outcome::Done, now).unwrap();
    let s = t.state(w(0));
    assert_eq!((s.routing, s.outs, s.routed, s.in_flight), ("routable", 1, 2, 0));
}
