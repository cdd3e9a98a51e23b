//! Shared fixtures: ids, chained hashes, and an index paired with its reference.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use kv_router_client::index::reference::ReferenceIndex;
use kv_router_client::index::{
    IndexConfig, LookupResult, PrefixIndex, RemoveOutcome, StagedSnapshot, TierId, WorkerId,
};

pub fn w(raw: u32) -> WorkerId {
    WorkerId::new(raw).expect("small worker id")
}

pub fn t(raw: u8) -> TierId {
    TierId::new(raw).expect("small tier id")
}

/// A chained hash like an engine's: each block's hash depends on its parent's.
pub fn chain(parent: u64, token_chunk: u64) -> u64 {
    let mut x = parent ^ token_chunk.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    x ^= x >> 31;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^ (x >> 29)
}

/// `n` chained hashes of one request, rooted at `root`.
pub fn seq(root: u64, n: usize) -> Vec<u64> {
    let mut out = Vec::with_capacity(n);
    let mut h = root;
    for i in 0..n {
        h = chain(h, i as u64 + 1);
        out.push(h);
    }
    out
}

/// An index and its reference, driven together; every operation's outcome must agree.
pub struct Pair {
    pub index: PrefixIndex,
    pub reference: ReferenceIndex,
}

impl Pair {
    pub fn new(config: IndexConfig) -> Self {
        Self { index: PrefixIndex::new(config), reference: ReferenceIndex::new() }
    }

    pub fn store(&mut self, worker: WorkerId, tier: TierId, hashes: &[u64]) {
        self.index.store(worker, tier, hashes);
        self.reference.store(worker, tier, hashes);
    }

    /// A store with a parent: the index lays its runs out by it, the reference ignores it.
    pub fn store_after(&mut self, worker: WorkerId, tier: TierId, parent: Option<u64>, hashes: &[u64]) {
        self.index.store_after(worker, tier, parent, hashes);
        self.reference.store(worker, tier, hashes);
    }

    pub fn remove(&mut self, worker: WorkerId, tier: TierId, hashes: &[u64]) -> RemoveOutcome {
        let got = self.index.remove(worker, tier, hashes);
        let want = self.reference.remove(worker, tier, hashes);
        assert_eq!(got, want, "remove outcome");
        got
    }

    pub fn clear(&mut self, worker: WorkerId, tier: Option<TierId>) {
        self.index.clear(worker, tier);
        self.reference.clear(worker, tier);
    }

    pub fn remove_worker(&mut self, worker: WorkerId) {
        self.index.remove_worker(worker);
        self.reference.remove_worker(worker);
    }

    pub fn replace(&mut self, worker: WorkerId, snapshot: &StagedSnapshot) {
        self.index.replace_worker(worker, snapshot);
        self.reference.replace_worker(worker, snapshot);
    }

    /// Looks up on both; panics with both answers side by side when they differ.
    pub fn lookup(&self, hashes: &[u64]) -> LookupResult {
        let got = self.index.lookup(hashes);
        let want = self.reference.lookup(hashes);
        assert_eq!(got, want, "lookup of {hashes:x?}\n  index:     {got:?}\n  reference: {want:?}");
        got
    }

    /// Each worker's whole state (tiers, hashes, copies) agrees, listed both ways.
    pub fn check_blocks(&self, workers: &[WorkerId]) {
        for &wk in workers {
            let (got, want) = (self.index.blocks(wk), self.reference.blocks(wk));
            assert_eq!(got, want, "blocks of worker {}", wk.get());
            for (&tier, hashes) in &want {
                for (&h, &c) in hashes {
                    assert_eq!(self.index.copies(wk, tier, h), c, "copies of {h:x}");
                }
            }
        }
    }

    /// Block counts and missing-remove counters agree.
    pub fn check_counts(&self) {
        let stats = self.index.stats();
        assert_eq!(stats.blocks, self.reference.len(), "live blocks");
        assert_eq!(stats.missing_removes, self.reference.missing_removes());
    }
}

/// An index of two shards in which workers `0..n` hold all of `s` in the device tier.
pub fn held_by(n: u32, s: &[u64]) -> Arc<PrefixIndex> {
    let index = Arc::new(PrefixIndex::new(IndexConfig { shards: 2, initial_capacity: 0 }));
    for k in 0..n {
        index.store(w(k), TierId::DEVICE, s);
    }
    index
}

/// A writer thread calling `write(0)`, `write(1)`, .. until [`Churn::stop`].
pub struct Churn {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<()>,
}

/// Starts a [`Churn`].
pub fn churn(mut write: impl FnMut(u64) + Send + 'static) -> Churn {
    let stop = Arc::new(AtomicBool::new(false));
    let thread = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                write(i);
                i += 1;
            }
        })
    };
    Churn { stop, thread }
}

impl Churn {
    /// Stops the writer and waits for it (a panic in it fails the caller).
    pub fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().expect("writer thread");
    }
}
