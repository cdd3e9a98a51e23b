//! What a lookup returns, in one canonical form shared by the index and the reference.

use std::fmt;

use super::ids::{TierId, WorkerId};

/// The leading run of a request's blocks that one worker holds within one tier alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TierRun {
    /// The tier.
    pub tier: TierId,
    /// Leading blocks held in this tier (always > 0 in a result).
    pub blocks: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Entry {
    worker: WorkerId,
    blocks: u32,
    runs_end: u32,
}

/// One worker's match: leading blocks held in any tier, and per tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkerMatch<'a> {
    /// The worker.
    pub worker: WorkerId,
    /// Leading blocks held in at least one tier each (always > 0 in a result).
    pub blocks: u32,
    /// Per-tier leading runs, sorted by tier; tiers with a run of 0 are left out.
    pub tiers: &'a [TierRun],
}

impl WorkerMatch<'_> {
    /// The leading run within `tier` (0 if absent).
    pub fn tier(&self, tier: TierId) -> u32 {
        self.tiers.iter().find(|r| r.tier == tier).map_or(0, |r| r.blocks)
    }
}

/// The answer to a lookup: every worker holding the request's first block, sorted by worker
/// id. Workers with 0 matched blocks (those not holding the first block in any tier) are
/// omitted, and so are tiers with a run of 0. Two results are equal exactly when they say the
/// same thing.
///
/// Stored flat (two vectors) so a result can be reused across lookups without allocating.
#[derive(Default, PartialEq, Eq)]
pub struct LookupResult {
    entries: Vec<Entry>,
    runs: Vec<TierRun>,
}

impl Clone for LookupResult {
    fn clone(&self) -> Self {
        Self { entries: self.entries.clone(), runs: self.runs.clone() }
    }

    /// Into `self`'s buffers (a derived `Clone` would allocate new ones and free the old):
    /// a lookup from kept first-block candidates starts by copying their result.
    fn clone_from(&mut self, source: &Self) {
        self.entries.clone_from(&source.entries);
        self.runs.clone_from(&source.runs);
    }
}

impl LookupResult {
    /// Empties the result, keeping its buffers.
    pub fn clear(&mut self) {
        self.entries.clear();
        self.runs.clear();
    }

    /// Number of workers with at least one matched block.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when no worker holds the first block.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The matches, sorted by worker id.
    pub fn iter(&self) -> impl Iterator<Item = WorkerMatch<'_>> + '_ {
        let mut start = 0usize;
        self.entries.iter().map(move |e| {
            let end = e.runs_end as usize;
            let m = WorkerMatch { worker: e.worker, blocks: e.blocks, tiers: &self.runs[start..end] };
            start = end;
            m
        })
    }

    /// The match of one worker, if it holds the first block (a binary search).
    pub fn get(&self, worker: WorkerId) -> Option<WorkerMatch<'_>> {
        self.position(worker).map(|k| self.at(k))
    }

    /// Where `worker`'s match stands in [`LookupResult::iter`]'s order, if it holds the first
    /// block (a binary search).
    pub fn position(&self, worker: WorkerId) -> Option<usize> {
        self.entries.binary_search_by_key(&worker, |e| e.worker).ok()
    }

    /// The `k`th match in [`LookupResult::iter`]'s order; panics when `k >= len()`.
    pub fn at(&self, k: usize) -> WorkerMatch<'_> {
        let e = self.entries[k];
        let start = if k == 0 { 0 } else { self.entries[k - 1].runs_end as usize };
        WorkerMatch { worker: e.worker, blocks: e.blocks, tiers: &self.runs[start..e.runs_end as usize] }
    }

    /// Leading blocks of `worker` in any tier (0 if absent).
    pub fn blocks(&self, worker: WorkerId) -> u32 {
        self.get(worker).map_or(0, |m| m.blocks)
    }

    /// Appends a worker. Callers push workers in increasing id order, with runs sorted by tier
    /// and all > 0, and `blocks > 0`.
    pub(crate) fn push(&mut self, worker: WorkerId, blocks: u32, runs: impl Iterator<Item = TierRun>) {
        debug_assert!(blocks > 0);
        debug_assert!(self.entries.last().is_none_or(|e| e.worker < worker));
        let start = self.runs.len();
        self.runs.extend(runs);
        debug_assert!(self.runs[start..].windows(2).all(|w| w[0].tier < w[1].tier));
        debug_assert!(self.runs[start..].iter().all(|r| r.blocks > 0 && r.blocks <= blocks));
        self.entries.push(Entry { worker, blocks, runs_end: self.runs.len() as u32 });
    }
}

impl LookupResult {
    /// Writes over the entry of `worker` (which the result lists, with as many tier runs, of
    /// the same tiers, as `runs` gives).
    pub(crate) fn patch(&mut self, worker: WorkerId, blocks: u32, runs: impl Iterator<Item = TierRun>) {
        let k = self.entries.binary_search_by_key(&worker, |e| e.worker).expect("a patched worker is listed");
        let start = if k == 0 { 0 } else { self.entries[k - 1].runs_end as usize };
        let end = self.entries[k].runs_end as usize;
        self.entries[k].blocks = blocks;
        let mut n = 0;
        for (slot, run) in self.runs[start..end].iter_mut().zip(runs) {
            debug_assert!(slot.tier == run.tier && run.blocks > 0 && run.blocks <= blocks);
            *slot = run;
            n += 1;
        }
        debug_assert_eq!(n, end - start, "a patch keeps the entry's tiers");
    }
}

impl fmt::Debug for LookupResult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut list = f.debug_list();
        for m in self.iter() {
            list.entry(&format_args!(
                "w{} blocks={} tiers={:?}",
                m.worker.get(),
                m.blocks,
                m.tiers.iter().map(|r| (r.tier.get(), r.blocks)).collect::<Vec<_>>()
            ));
        }
        list.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (worker, blocks, [(tier, blocks)]) per match.
    type Matches<'a> = &'a [(u32, u32, &'a [(u8, u32)])];

    fn result(workers: Matches) -> LookupResult {
        let mut r = LookupResult::default();
        for &(w, blocks, runs) in workers {
            let runs = runs.iter().map(|&(t, b)| TierRun { tier: TierId::new(t).unwrap(), blocks: b });
            r.push(WorkerId::new(w).unwrap(), blocks, runs);
        }
        r
    }

    #[test]
    fn clone_from_gives_the_source_over_a_longer_or_shorter_result() {
        let small = result(&[(1, 2, &[(0, 2)])]);
        let big = result(&[(0, 5, &[(0, 5), (1, 3)]), (2, 1, &[(1, 1)]), (7, 4, &[(0, 4)])]);
        let mut r = big.clone();
        r.clone_from(&small);
        assert_eq!(r, small);
        assert_eq!(format!("{r:?}"), "[w1 blocks=2 tiers=[(0, 2)]]");
        r.clone_from(&big);
        assert_eq!(r, big);
        assert_eq!(r.position(WorkerId::new(2).unwrap()), Some(1));
        assert_eq!(r.position(WorkerId::new(3).unwrap()), None);
        assert_eq!(r.at(2), r.iter().nth(2).unwrap());
        assert_eq!(r.at(1).tiers, &[TierRun { tier: TierId::new(1).unwrap(), blocks: 1 }]);
        assert_eq!(r.blocks(WorkerId::new(0).unwrap()), 5);
        assert_eq!(r.get(WorkerId::new(0).unwrap()).unwrap().tier(TierId::new(1).unwrap()), 3);
        assert_eq!(r.blocks(WorkerId::new(7).unwrap()), 4);
        assert_eq!(r.len(), 3);
    }
}
