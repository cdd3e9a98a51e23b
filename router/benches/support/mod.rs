//! What the router benches share: relays' stores of many ranks, each worker with a chain of its
//! own (and every tenth a part of a shared chain), and the thread clocks they read.

use std::time::Duration;

use kv_relay::model::{Batch, Block, Event, Load, RecordBody, Stored, Tier};
use kv_relay::store::{Store, StoreConfig};

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
    let blocks = hashes.iter().map(|&hash| Block { hash, token_ids: vec![], extra_keys: None }).collect();
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
