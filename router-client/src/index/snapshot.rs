//! A worker's complete state, staged outside the index before an atomic replace.

use super::ids::TierId;

/// A worker's complete new state: `(tier, hash, copies)` triples, collected (for example from
/// a relay's snapshot chunks) without touching the index, then swapped in whole by
/// [`PrefixIndex::replace_worker`](super::PrefixIndex::replace_worker).
///
/// Triples with the same `(tier, hash)` add up; triples with 0 copies are ignored.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StagedSnapshot {
    pub(super) entries: Vec<(TierId, u64, u32)>,
}

impl StagedSnapshot {
    /// An empty state (replacing with it drops all of the worker's blocks).
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `copies` copies of `hash` in `tier`.
    pub fn push(&mut self, tier: TierId, hash: u64, copies: u32) {
        self.entries.push((tier, hash, copies));
    }

    /// Adds one copy of each hash in `tier`.
    pub fn extend_blocks(&mut self, tier: TierId, hashes: &[u64]) {
        self.entries.extend(hashes.iter().map(|&h| (tier, h, 1)));
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
}
