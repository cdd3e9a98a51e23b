//! A worker's complete state, staged outside the index before an atomic replace.

use std::collections::HashMap;
use std::hash::BuildHasherDefault;

use super::ids::TierId;
use super::runs::WordHasher;

/// A worker's complete new state: `(tier, hash, copies)` triples, collected (for example from
/// a relay's snapshot chunks) without touching the index, then swapped in whole by
/// [`PrefixIndex::replace_worker`](super::PrefixIndex::replace_worker).
///
/// Triples with the same `(tier, hash)` add up; triples with 0 copies are ignored.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StagedSnapshot {
    pub(super) entries: Vec<(TierId, u64, u32)>,
    /// Per entry, the hash it was stored after (`NO_PARENT` if none), or empty when no entry
    /// came with one.
    pub(super) parents: Vec<u64>,
}

/// No parent (see [`StagedSnapshot::push_after`]). A parent equal to it is taken as none.
pub(super) const NO_PARENT: u64 = u64::MAX;

impl StagedSnapshot {
    /// An empty state (replacing with it drops all of the worker's blocks).
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `copies` copies of `hash` in `tier`.
    pub fn push(&mut self, tier: TierId, hash: u64, copies: u32) {
        self.push_after(tier, hash, copies, None);
    }

    /// [`push`](Self::push) of a block the engine stored after `parent` (a relay's snapshot
    /// says so per block). The parents only guide how the replace lays the worker's blocks
    /// out, as with [`PrefixIndex::store_after`](super::PrefixIndex::store_after): a block
    /// follows its parent, so that lookups of the resynced worker follow runs instead of
    /// probing every block. Absent, wrong, or not staged, the worker's state is the same.
    pub fn push_after(&mut self, tier: TierId, hash: u64, copies: u32, parent: Option<u64>) {
        let parent = parent.unwrap_or(NO_PARENT);
        if parent != NO_PARENT && self.parents.len() < self.entries.len() {
            self.parents.resize(self.entries.len(), NO_PARENT);
        }
        if parent != NO_PARENT || !self.parents.is_empty() {
            self.parents.push(parent);
        }
        self.entries.push((tier, hash, copies));
    }

    /// Adds one copy of each hash in `tier`.
    pub fn extend_blocks(&mut self, tier: TierId, hashes: &[u64]) {
        for &h in hashes {
            self.push(tier, h, 1);
        }
    }

    /// Number of staged triples.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when nothing is staged.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The staged triples, in insertion order.
    pub fn entries(&self) -> &[(TierId, u64, u32)] {
        &self.entries
    }

    /// The order to write the entries in, each with the index of its parent's entry when that
    /// was written before it (same tier): every staged chain in order, from its first block
    /// (one without a staged parent), each block right after its parent where it can be (its
    /// parent's first child), then any entries left (parents that form a cycle), in order.
    pub(super) fn layout(&self) -> Vec<(usize, Option<usize>)> {
        let n = self.entries.len();
        if self.parents.is_empty() {
            return (0..n).map(|i| (i, None)).collect();
        }
        let mut first: HashMap<(TierId, u64), usize, BuildHasherDefault<WordHasher>> =
            HashMap::with_capacity_and_hasher(n, Default::default());
        for (i, &(tier, h, _)) in self.entries.iter().enumerate() {
            first.entry((tier, h)).or_insert(i);
        }
        // Children of each entry, as linked lists from the last staged to the first.
        let (mut head, mut next) = (vec![usize::MAX; n], vec![usize::MAX; n]);
        let mut has_parent = vec![false; n];
        for i in 0..n {
            let (tier, h, _) = self.entries[i];
            let parent = self.parents.get(i).copied().unwrap_or(NO_PARENT);
            if let Some(&p) = (parent != NO_PARENT && parent != h).then(|| first.get(&(tier, parent))).flatten() {
                next[i] = head[p];
                head[p] = i;
                has_parent[i] = true;
            }
        }
        let mut order = Vec::with_capacity(n);
        let mut done = vec![false; n];
        let mut stack = Vec::new();
        let roots: Vec<usize> = (0..n).filter(|&i| !has_parent[i]).collect();
        for start in roots.into_iter().chain(0..n) {
            if done[start] {
                continue;
            }
            stack.push((start, None));
            while let Some((i, parent)) = stack.pop() {
                if done[i] {
                    continue;
                }
                done[i] = true;
                order.push((i, parent));
                // Children pushed last-staged first, so that the first is written next.
                let mut c = head[i];
                while c != usize::MAX {
                    stack.push((c, Some(i)));
                    c = next[c];
                }
            }
        }
        order
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chains_are_laid_out_parent_first_then_what_is_left_in_order() {
        let d = TierId::DEVICE;
        let h = TierId::HOST;
        let mut s = StagedSnapshot::new();
        s.push_after(d, 3, 1, Some(2)); // 0: child of 2
        s.push(d, 1, 1); // 1: a first block
        s.push_after(d, 2, 1, Some(1)); // 2: child of 1
        s.push_after(d, 4, 1, Some(1)); // 3: second child of 1
        s.push_after(d, 9, 1, Some(8)); // 4: parent not staged: a first block
        s.push_after(d, 6, 1, Some(7)); // 5: a cycle, 6 <-> 7
        s.push_after(d, 7, 1, Some(6)); // 6
        s.push_after(h, 5, 1, Some(1)); // 7: parent staged only in another tier
        s.push_after(d, 2, 2, Some(1)); // 8: the same block again: a child of 1 too
        let order: Vec<(usize, Option<usize>)> = s.layout();
        assert_eq!(
            order,
            vec![
                (1, None),
                (2, Some(1)),
                (0, Some(2)),
                (3, Some(1)),
                (8, Some(1)),
                (4, None),
                (7, None),
                (5, None),
                (6, Some(5)),
            ]
        );
        // Without parents, the staging order.
        let mut plain = StagedSnapshot::new();
        plain.extend_blocks(d, &[5, 4, 3]);
        assert_eq!(plain.layout(), vec![(0, None), (1, None), (2, None)]);
        // Parents given for some entries only: the others have none.
        let mut some = StagedSnapshot::new();
        some.push(d, 1, 1);
        some.push_after(d, 2, 1, Some(1));
        assert_eq!(some.parents, vec![NO_PARENT, 1]);
        assert_eq!(some.layout(), vec![(0, None), (1, Some(0))]);
    }
}
