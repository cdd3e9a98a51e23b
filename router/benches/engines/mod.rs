//! What the front benches share: relays beside mock engines, a follower of them, the wait
//! until the router can route to every worker, and reading an answer's headers.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_relay_testkit::daemon::{start_relay, Daemon};
use kv_relay_testkit::engine::MockEngine;
use kv_router::Router;
use kv_router_client::{FollowConfig, Follower, WorkerState};

/// A relay beside each engine, and a follower of them all (no start jitter). Call inside `rt`.
pub fn follow(rt: &tokio::runtime::Runtime, engines: &[Arc<MockEngine>]) -> (Vec<Daemon>, Follower) {
    let relays: Vec<Daemon> = engines.iter().map(|e| rt.block_on(start_relay(e, &[]))).collect();
    let _in_rt = rt.enter();
    let follower = Follower::new(FollowConfig { start_jitter: Duration::ZERO, ..FollowConfig::default() });
    for r in &relays {
        follower.add_relay(&r.url).expect("relay URL");
    }
    (relays, follower)
}

/// Waits until the router holds `workers` workers, each routable, fresh and with its engine's
/// URL; panics after `within`.
pub fn wait_routable(router: &Router, workers: usize, within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        let w = router.workers();
        let ready = |w: &kv_router::RoutedWorker| {
            w.routing.routing == "routable" && w.worker.state == WorkerState::Fresh && w.worker.engine_url.is_some()
        };
        if w.len() == workers && w.iter().all(ready) {
            return;
        }
        assert!(Instant::now() < deadline, "the fleet never became routable: {w:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The value of header `name` (any case) in an HTTP answer's `head`.
pub fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim().eq_ignore_ascii_case(name).then(|| v.trim())
    })
}
