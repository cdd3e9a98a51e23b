//! The policies as pure functions of the candidates: exact choices, the tie draw, overload
//! steering, warming and probes, with seeded generators.

use kv_router::policy::{
    CacheAware, CacheAwareConfig, Candidate, Choice, LeastLoad, Overload, Policy, Random, Reason, RoundRobin,
    RouteInput,
};
use rand::rngs::StdRng;
use rand::SeedableRng;

fn rng() -> StdRng {
    StdRng::seed_from_u64(7)
}

fn idle() -> Candidate {
    Candidate::default()
}

fn chose(c: Choice) -> (usize, Reason) {
    match c {
        Choice::Worker { index, reason, .. } => (index, reason),
        other => panic!("expected a worker, got {other:?}"),
    }
}

const REQ: RouteInput = RouteInput { blocks: 10 };

#[test]
fn cache_aware_takes_the_longest_device_prefix_at_equal_load() {
    let p = CacheAware::default();
    let cands = [
        Candidate { matched_blocks: 3, device_blocks: 3, ..idle() },
        Candidate { matched_blocks: 8, device_blocks: 8, ..idle() },
        Candidate { matched_blocks: 5, device_blocks: 5, ..idle() },
    ];
    assert_eq!(chose(p.choose(REQ, &cands, &mut rng())), (1, Reason::CachedPrefix));
    // 10 blocks, 8 cached: 2 x 400 us of prefill, nothing queued.
    assert_eq!(p.expected_wait_us(REQ, &cands[1]), 800.0);
}

#[test]
fn host_blocks_count_at_the_discount() {
    let p = CacheAware::new(CacheAwareConfig { host_discount: 0.5, ..CacheAwareConfig::default() });
    // 6 device + 4 only in host: 6 + 2 = 8 cached; 2 uncached.
    let c = Candidate { matched_blocks: 10, device_blocks: 6, ..idle() };
    assert_eq!(p.uncached_blocks(REQ, &c), 2.0);
    // A worker with 7 device blocks (3 uncached) loses to it.
    let cands = [Candidate { matched_blocks: 7, device_blocks: 7, ..idle() }, c];
    assert_eq!(chose(p.choose(REQ, &cands, &mut rng())), (1, Reason::CachedPrefix));
    // With no discount credit, the device prefix wins.
    let p0 = CacheAware::new(CacheAwareConfig { host_discount: 0.0, ..CacheAwareConfig::default() });
    assert_eq!(chose(p0.choose(REQ, &cands, &mut rng())), (0, Reason::CachedPrefix));
}

#[test]
fn the_wait_counts_pushed_load_and_the_routers_own_in_flight() {
    let p = CacheAware::default();
    // The cached worker has 2 running + 1 waiting: queue 3 + 1 = 4 requests = 80 ms, which
    // outweighs 10 blocks of prefill (4 ms) on the idle one.
    let busy = Candidate { matched_blocks: 10, device_blocks: 10, running: 2.0, waiting: 1.0, ..idle() };
    assert_eq!(busy.queue(), 4.0);
    assert_eq!(chose(p.choose(REQ, &[busy, idle()], &mut rng())), (1, Reason::LeastWait));
    // The router's own 3 in flight count when the engine's gauges show fewer.
    let pending = Candidate { in_flight: 3, ..idle() };
    assert_eq!(pending.queue(), 3.0);
    assert_eq!(p.expected_wait_us(REQ, &pending), 3.0 * 20_000.0 + 10.0 * 400.0);
}

#[test]
fn overloaded_workers_are_steered_away_from_and_the_least_loaded_wins_when_all_are() {
    let p = CacheAware::default();
    let hot = Candidate { matched_blocks: 10, device_blocks: 10, kv_usage: 0.8, ..idle() };
    let queued = Candidate { matched_blocks: 10, device_blocks: 10, waiting: 8.0, ..idle() };
    let cold = Candidate { running: 1.0, ..idle() };
    assert_eq!(chose(p.choose(REQ, &[hot, queued, cold], &mut rng())), (2, Reason::LeastWait));
    // All over: the least queue (hot: 0, queued: 16).
    assert_eq!(chose(p.choose(REQ, &[queued, hot], &mut rng())), (1, Reason::AllOverloaded));
    // Shedding, opt-in.
    let shed = CacheAware::new(CacheAwareConfig {
        overload: Overload { shed: true, ..Overload::default() },
        ..CacheAwareConfig::default()
    });
    assert_eq!(shed.choose(REQ, &[queued, hot], &mut rng()), Choice::Shed);
    // Off: the cached one wins regardless.
    let off = CacheAware::new(CacheAwareConfig {
        overload: Overload { enabled: false, ..Overload::default() },
        ..CacheAwareConfig::default()
    });
    assert_eq!(chose(off.choose(REQ, &[cold, hot], &mut rng())), (1, Reason::CachedPrefix));
}

#[test]
fn ties_are_drawn_uniformly() {
    let p = CacheAware::default();
    let cands = [idle(); 4];
    let mut r = rng();
    let mut got = [0u32; 4];
    for _ in 0..4000 {
        got[chose(p.choose(REQ, &cands, &mut r)).0] += 1;
    }
    // Each of 4 tied workers takes about 1,000 of 4,000 (binomial sd 27): none under 850.
    assert!(got.iter().all(|&n| (850..=1150).contains(&n)), "{got:?}");
    // A worker 2 us worse is not tied (tie_us 1).
    let mut worse = idle();
    worse.device_blocks = 0;
    let p2 = CacheAware::new(CacheAwareConfig { prefill_us_per_block: 2.0, ..CacheAwareConfig::default() });
    let cands = [Candidate { matched_blocks: 1, device_blocks: 1, ..idle() }, worse];
    for _ in 0..100 {
        assert_eq!(chose(p2.choose(REQ, &cands, &mut r)).0, 0);
    }
    // Within 1 us is a tie: half a microsecond apart, both are drawn.
    let p3 = CacheAware::new(CacheAwareConfig { prefill_us_per_block: 0.5, ..CacheAwareConfig::default() });
    let mut seen = [false; 2];
    for _ in 0..200 {
        seen[chose(p3.choose(REQ, &cands, &mut r)).0] = true;
    }
    assert_eq!(seen, [true, true]);
}

#[test]
fn a_half_open_worker_takes_the_next_request_as_its_probe() {
    let p = CacheAware::default();
    let cands = [Candidate { matched_blocks: 10, device_blocks: 10, ..idle() }, Candidate { probe: true, ..idle() }];
    assert_eq!(chose(p.choose(REQ, &cands, &mut rng())), (1, Reason::Probe));
    // Not when it is overloaded.
    let cands = [cands[0], Candidate { probe: true, kv_usage: 0.9, ..idle() }];
    assert_eq!(chose(p.choose(REQ, &cands, &mut rng())), (0, Reason::CachedPrefix));
}

#[test]
fn warming_workers_take_their_share_of_misses_only() {
    let p = CacheAware::new(CacheAwareConfig { warm_share: 0.25, ..CacheAwareConfig::default() });
    // A busier warming worker: by wait alone it would never win.
    let warm = Candidate { warming: true, running: 3.0, ..idle() };
    let cands = [idle(), idle(), warm];
    let mut r = rng();
    let mut to_warm = 0;
    for _ in 0..4000 {
        let (i, reason) = chose(p.choose(REQ, &cands, &mut r));
        if i == 2 {
            assert_eq!(reason, Reason::Warming);
            to_warm += 1;
        }
    }
    // A quarter of 4,000 misses (sd 27).
    assert!((880..=1120).contains(&to_warm), "{to_warm}");
    // A request some worker holds a block of is never a warming miss.
    let cands = [Candidate { matched_blocks: 1, device_blocks: 1, ..idle() }, warm];
    for _ in 0..200 {
        assert_eq!(chose(p.choose(REQ, &cands, &mut r)), (0, Reason::CachedPrefix));
    }
}

#[test]
fn the_baselines() {
    let rr = RoundRobin::default();
    let cands = [idle(); 3];
    let got: Vec<usize> = (0..6).map(|_| chose(rr.choose(REQ, &cands, &mut rng())).0).collect();
    assert_eq!(got, [0, 1, 2, 0, 1, 2]);
    let ll = LeastLoad;
    let cands = [
        Candidate { running: 2.0, ..idle() },
        Candidate { waiting: 1.0, ..idle() },
        Candidate { running: 1.0, ..idle() },
    ];
    // Queues 2, 2, 1.
    assert_eq!(chose(ll.choose(REQ, &cands, &mut rng())), (2, Reason::LeastLoad));
    let mut r = rng();
    let mut seen = [0u32; 3];
    for _ in 0..300 {
        let (i, reason) = chose(Random.choose(REQ, &cands, &mut r));
        assert_eq!(reason, Reason::Random);
        seen[i] += 1;
    }
    assert!(seen.iter().all(|&n| n > 60), "{seen:?}");
    for p in [&CacheAware::default() as &dyn Policy, &rr, &ll, &Random] {
        assert_eq!(p.choose(REQ, &[], &mut rng()), Choice::None, "{}", p.name());
    }
}

#[test]
fn a_thousand_misses_over_128_idle_workers_spread_within_3x_of_the_mean() {
    let p = CacheAware::default();
    let mut cands = vec![idle(); 128];
    let mut r = rng();
    let mut got = vec![0u32; 128];
    for _ in 0..1000 {
        let (i, _) = chose(p.choose(REQ, &cands, &mut r));
        got[i] += 1;
        // Each routed miss stays in flight (no report): the router's own count steers.
        cands[i].in_flight += 1;
    }
    let mean = 1000.0 / 128.0;
    assert!(got.iter().all(|&n| n > 0 && f64::from(n) <= 3.0 * mean), "{got:?}");
    // And with every request reported at once (nothing in flight), ties alone spread them.
    let cands = vec![idle(); 128];
    let mut got = vec![0u32; 128];
    for _ in 0..1000 {
        got[chose(p.choose(REQ, &cands, &mut r)).0] += 1;
    }
    assert!(got.iter().all(|&n| n > 0 && f64::from(n) <= 3.0 * mean), "{got:?}");
}
