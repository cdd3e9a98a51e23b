//! The naive reference index: a `BTreeMap<(worker, tier, hash), copies>` and a plain walk.
//!
//! Obviously correct rather than fast. [`PrefixIndex`](super::PrefixIndex) must answer every
//! lookup exactly as this does; the property tests, the benchmark and the end-to-end tests
//! compare against it.

use std::collections::BTreeMap;
use std::ops::Bound;

use super::ids::{TierId, WorkerId};
use super::result::{LookupResult, TierRun};
use super::snapshot::StagedSnapshot;
use super::RemoveOutcome;

/// The reference index. Same operations and answers as [`PrefixIndex`](super::PrefixIndex).
#[derive(Clone, Debug, Default)]
pub struct ReferenceIndex {
    blocks: BTreeMap<(WorkerId, TierId, u64), u32>,
    missing_removes: u64,
}

impl ReferenceIndex {
    /// An empty index.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one copy of each hash (copies saturate at `u32::MAX`).
    pub fn store(&mut self, worker: WorkerId, tier: TierId, hashes: &[u64]) {
        for &h in hashes {
            let c = self.blocks.entry((worker, tier, h)).or_insert(0);
            *c = c.saturating_add(1);
        }
    }

    /// Takes one copy of each hash; a hash with no copies is counted as missing.
    pub fn remove(&mut self, worker: WorkerId, tier: TierId, hashes: &[u64]) -> RemoveOutcome {
        let mut out = RemoveOutcome::default();
        for &h in hashes {
            match self.blocks.get_mut(&(worker, tier, h)) {
                Some(c) if *c > 1 => {
                    *c -= 1;
                    out.removed += 1;
                }
                Some(_) => {
                    self.blocks.remove(&(worker, tier, h));
                    out.removed += 1;
                }
                None => out.missing += 1,
            }
        }
        self.missing_removes += out.missing as u64;
        out
    }

    /// Drops all of a worker's blocks, or those of one tier.
    pub fn clear(&mut self, worker: WorkerId, tier: Option<TierId>) {
        self.blocks.retain(|&(w, t, _), _| w != worker || tier.is_some_and(|tier| t != tier));
    }

    /// Drops a worker.
    pub fn remove_worker(&mut self, worker: WorkerId) {
        self.clear(worker, None);
    }

    /// Replaces a worker's whole state.
    pub fn replace_worker(&mut self, worker: WorkerId, snapshot: &StagedSnapshot) {
        self.clear(worker, None);
        for &(tier, h, copies) in snapshot.entries() {
            if copies > 0 {
                let c = self.blocks.entry((worker, tier, h)).or_insert(0);
                *c = c.saturating_add(copies);
            }
        }
    }

    /// Copies held of one block.
    pub fn copies(&self, worker: WorkerId, tier: TierId, hash: u64) -> u32 {
        self.blocks.get(&(worker, tier, hash)).copied().unwrap_or(0)
    }

    /// Every block a worker holds: per tier, each hash with its copy count.
    pub fn blocks(&self, worker: WorkerId) -> BTreeMap<TierId, BTreeMap<u64, u32>> {
        let mut out: BTreeMap<TierId, BTreeMap<u64, u32>> = BTreeMap::new();
        let from = (worker, TierId::new(0).expect("tier 0"), 0);
        for (&(w, t, h), &c) in self.blocks.range(from..) {
            if w != worker {
                break;
            }
            out.entry(t).or_default().insert(h, c);
        }
        out
    }

    /// Number of `(worker, tier, hash)` blocks with copies > 0.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// True when nothing is indexed.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Removals of absent blocks so far.
    pub fn missing_removes(&self) -> u64 {
        self.missing_removes
    }

    /// Every `(worker, tier)` pair holding at least one block, in order.
    fn pairs(&self) -> Vec<(WorkerId, TierId)> {
        let mut out = Vec::new();
        let mut from = Bound::Unbounded;
        while let Some((&(w, t, _), _)) = self.blocks.range((from, Bound::Unbounded)).next() {
            out.push((w, t));
            from = Bound::Excluded((w, t, u64::MAX));
        }
        out
    }

    /// For every worker holding `hashes[0]`: leading blocks held in any tier, and per tier.
    pub fn lookup(&self, hashes: &[u64]) -> LookupResult {
        let mut result = LookupResult::default();
        if hashes.is_empty() {
            return result;
        }
        let pairs = self.pairs();
        let mut i = 0;
        while i < pairs.len() {
            let worker = pairs[i].0;
            let tiers: Vec<TierId> = pairs[i..].iter().take_while(|(w, _)| *w == worker).map(|&(_, t)| t).collect();
            i += tiers.len();
            let held = |tier: TierId, h: u64| self.copies(worker, tier, h) > 0;
            let any = hashes.iter().take_while(|&&h| tiers.iter().any(|&t| held(t, h))).count() as u32;
            if any == 0 {
                continue;
            }
            let runs = tiers.iter().filter_map(|&tier| {
                let run = hashes.iter().take_while(|&&h| held(tier, h)).count() as u32;
                (run > 0).then_some(TierRun { tier, blocks: run })
            });
            result.push(worker, any, runs);
        }
        result
    }
}
