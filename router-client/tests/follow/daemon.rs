//! End to end: the mock engine (vLLM 0.32 wire, 2 DP ranks, replay sockets) → the full relay
//! daemon (`kv_relay::daemon::run`) → the follower. The follower's index converges to the
//! engine's own truth, through a wire loss the relay refills and a rank restart.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use kv_relay::model::Tier;
use kv_relay_testkit::engine::{EngineConfig, MockEngine};
use kv_relay_testkit::traffic::{RandomSource, RequestSource};
use kv_relay_testkit::wire::{Engine, WireVersion};
use kv_router_client::index::reference::ReferenceIndex;
use kv_router_client::index::StagedSnapshot;
use kv_router_client::{Follower, WorkerState};

/// Starts a mock engine on a free block of loopback ports (rank r: base + r, replay: base + 50 + r).
fn engine() -> MockEngine {
    let mut seed = std::process::id() as u64 * 104_729 + 17;
    for _ in 0..50 {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let base = 20_000 + (seed >> 33) % 30_000;
        let mut cfg = EngineConfig::new(WireVersion::parse(Engine::Vllm, "0.32").unwrap());
        cfg.dp_size = 2;
        cfg.endpoint = format!("tcp://127.0.0.1:{base}");
        cfg.replay_endpoint = Some(format!("tcp://127.0.0.1:{}", base + 50));
        cfg.topic = "kv".into();
        cfg.block_size = 4;
        cfg.cache_blocks = 64;
        if let Ok(e) = MockEngine::start(cfg) {
            return e;
        }
    }
    panic!("no free loopback ports");
}

/// The engine's truth as a reference index with the follower's ids.
fn truth_index(f: &Follower, url: &str, e: &MockEngine) -> ReferenceIndex {
    let index = f.index();
    let mut per_rank: BTreeMap<u32, StagedSnapshot> = BTreeMap::new();
    for (key, hashes) in &e.truth().blocks {
        let tier = index.tier(Tier::from_medium(key.medium.as_deref()).as_str()).unwrap();
        for (&h, &copies) in hashes {
            per_rank.entry(key.rank).or_default().push(tier, h, copies);
        }
    }
    let mut r = ReferenceIndex::new();
    for rank in 0..e.dp_size() {
        r.replace_worker(index.worker(url, rank).unwrap(), per_rank.get(&rank).unwrap_or(&StagedSnapshot::new()));
    }
    r
}

/// Every hash the engine has announced, alone, and as the chains it served.
fn agrees(f: &Follower, want: &ReferenceIndex, chains: &[Vec<u64>]) -> Result<(), String> {
    if f.index().stats().blocks != want.len() {
        return Err(format!("index holds {} keys, the engine {}", f.index().stats().blocks, want.len()));
    }
    let mut singles: Vec<u64> = chains.iter().flatten().copied().collect();
    singles.sort_unstable();
    singles.dedup();
    for q in chains.iter().cloned().chain(singles.into_iter().map(|h| vec![h])) {
        let (got, exp) = (f.index().lookup(&q), want.lookup(&q));
        if got != exp {
            return Err(format!("lookup {q:?}: index {got:?}, engine {exp:?}"));
        }
    }
    Ok(())
}

async fn converges(f: &Follower, url: &str, e: &MockEngine, chains: &[Vec<u64>]) {
    e.flush().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let r = agrees(f, &truth_index(f, url, e), chains);
        match r {
            Ok(()) => return,
            Err(why) if Instant::now() > deadline => panic!("the follower did not converge: {why}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mock_engine_through_the_daemon_converges_to_the_engines_truth() {
    let e = engine();
    let c = e.config().clone();
    let state = tempfile::tempdir().unwrap();
    let argv: Vec<String> = [
        "kv-relay",
        "--endpoint",
        &c.endpoint,
        "--replay-endpoint",
        c.replay_endpoint.as_deref().unwrap(),
        "--dp-size",
        "2",
        "--topic",
        "kv",
        "--state-dir",
        &state.path().display().to_string(),
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "off",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let daemon = crate::util::Daemon::start(&argv).await;
    let url = daemon.url();

    let f = crate::util::quick_follower();
    f.add_relay(&url).unwrap();

    let mut src = RandomSource::new(9, 4, 12);
    let mut serve = |e: &MockEngine, n: usize| {
        for i in 0..n {
            let req = src.next_request().unwrap();
            e.serve_request((i % 2) as u32, &req, false).unwrap();
        }
    };
    serve(&e, 60);
    // The hashes a lookup uses are the ones the engine announced: take them from its truth.
    let announced = |e: &MockEngine| -> Vec<Vec<u64>> {
        e.truth().blocks.values().map(|m| m.keys().copied().collect::<Vec<u64>>()).collect()
    };
    converges(&f, &url, &e, &announced(&e)).await;

    // The wire loses batches of rank 1: the relay refills them from the replay socket.
    e.drop_on_wire(1, 3).unwrap();
    serve(&e, 40);
    converges(&f, &url, &e, &announced(&e)).await;

    // Rank 0's engine restarts: its blocks are cleared in the index, then rebuilt.
    e.restart(0).unwrap();
    serve(&e, 30);
    converges(&f, &url, &e, &announced(&e)).await;
    let w0 = f.workers().into_iter().find(|w| w.dp_rank == 0).unwrap();
    assert!(w0.resets >= 1, "{w0:?}");
    assert_eq!(f.counters().gaps, 0);
    // Quiet now: the relay's heartbeats keep every rank fresh beyond the staleness bound.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let states: Vec<_> = f.workers().iter().map(|w| (w.dp_rank, w.state)).collect();
    assert_eq!(states, [(0, WorkerState::Fresh), (1, WorkerState::Fresh)]);

    f.shutdown().await;
    daemon.stop().await;
}
