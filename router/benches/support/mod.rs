//! What the router benches share: relays' stores of many ranks, each worker with a chain of its
//! own (and every tenth a part of a shared chain), and the thread clocks they read.

use std::time::Duration;

use kv_relay::model::{Batch, Block, Event, Load, RecordBody, Stored, Tier};
use kv_relay::store::{Store, StoreConfig};
use kv_relay_testkit::fleet::serve_store;
use kv_router_client::{FollowConfig, Follower, WorkerState};

pub const BLOCKS: u64 = 512;
pub const SHARED: u64 = 1 << 62;

/// The blocks of worker `g` (relay, rank in order), and of the shared chain.
pub fn own(g: u64) -> Vec<u64> {
    (0..BLOCKS).map(|n| (g + 1) << 32 | n).collect()
}

pub fn shared() -> Vec<u64> {
    (0..BLOCKS).map(|n| SHARED | n).collect()
}

fn stored(tier: Tier, hashes: &[u64]) -> Event {
    let blocks = hashes.iter().map(|&hash| Block::new(hash, vec![])).collect();
    Event::Stored(Stored::plain(tier, 0, 16, blocks))
}

fn load(running: f64) -> Option<Load> {
    Some(Load { running, waiting: 2.0, kv_usage: 0.4375, scraped_at_ms: 1_764_000_000_000 })
}

/// A relay's store: its ranks' chains (and every tenth worker's part of the shared chain).
pub struct Relay {
    pub store: Store,
    _dir: tempfile::TempDir,
    pub seq: Vec<u64>,
}

impl Relay {
    pub fn new(relay: usize, ranks: usize) -> Relay {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut cfg = StoreConfig::new(dir.path());
        cfg.cache_bytes = 1 << 20;
        cfg.segment_bytes = 1 << 20;
        let store = Store::open(cfg).expect("open the relay's store");
        let mut r = Relay { store, _dir: dir, seq: vec![0; ranks] };
        for rank in 0..ranks {
            let g = (relay * ranks + rank) as u64;
            let mut events = vec![stored(Tier::Device, &own(g))];
            if g.is_multiple_of(10) {
                events.push(stored(Tier::Host, &shared()[..BLOCKS as usize / 2]));
            }
            r.commit(rank, events, 1.0);
        }
        r
    }

    pub fn commit(&mut self, rank: usize, events: Vec<Event>, running: f64) {
        self.seq[rank] += 1;
        let batch = Batch { dp_rank: rank as u32, seq: self.seq[rank], ts: 0.0, events };
        self.store.commit(RecordBody::Batch { batch, load: load(running), liveness: None }).expect("commit");
    }
}

/// This thread's CPU time so far. The kernel brings a running thread's count up to date only
/// at its ticks and when it stops running: a short sleep first makes the count exact.
pub fn thread_cpu() -> Duration {
    std::thread::sleep(Duration::from_micros(20));
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap_or_default();
    Duration::from_nanos(s.split_whitespace().next().and_then(|v| v.parse().ok()).unwrap_or(0))
}

pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// `relays` served by the relay's own server code on loopback, and a follower of all of them
/// whose `workers` workers are all fresh (at most 120 s).
pub struct Followed {
    pub follower: Follower,
    /// From the follower's start to every worker fresh.
    pub took: Duration,
    /// The relays' URLs, in the order of `relays`.
    pub urls: Vec<String>,
    servers: Vec<(tokio::sync::oneshot::Sender<()>, tokio::task::JoinHandle<()>)>,
}

impl Followed {
    pub fn start(rt: &tokio::runtime::Runtime, relays: &[Relay], workers: usize) -> Followed {
        let (urls, servers) = rt.block_on(async {
            let (mut urls, mut servers) = (Vec::new(), Vec::new());
            for r in relays {
                let (addr, stop, task) = serve_store(&r.store, "127.0.0.1:0".parse().expect("address")).await;
                urls.push(format!("http://{addr}"));
                servers.push((stop, task));
            }
            (urls, servers)
        });
        let follower = rt.block_on(async {
            let f = Follower::new(FollowConfig {
                start_jitter: Duration::ZERO,
                // The benches' streams keep every worker heard of; a slow start never makes one stale.
                stale_after: Duration::from_secs(600),
                ..FollowConfig::default()
            });
            for u in &urls {
                f.add_relay(u).expect("add relay");
            }
            f
        });
        let t0 = std::time::Instant::now();
        while !(follower.workers().len() == workers && follower.workers().iter().all(|w| w.state == WorkerState::Fresh))
        {
            assert!(t0.elapsed() < Duration::from_secs(120), "the workers were not all fresh within 120 s");
            std::thread::sleep(Duration::from_millis(20));
        }
        Followed { follower, took: t0.elapsed(), urls, servers }
    }

    /// Shuts the follower down and stops the servers.
    pub fn stop(self, rt: &tokio::runtime::Runtime) {
        rt.block_on(async {
            self.follower.shutdown().await;
            for (stop, task) in self.servers {
                let _ = stop.send(());
                let _ = task.await;
            }
        });
    }
}
