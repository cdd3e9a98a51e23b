//! The index's configuration, what its writes report, and its statistics.

/// Construction parameters of a [`PrefixIndex`](super::PrefixIndex).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexConfig {
    /// Number of shards (rounded up to a power of two). More shards let more writer threads
    /// run at once and make each rebuild smaller.
    pub shards: usize,
    /// Blocks to size the tables for up front (they grow as needed).
    pub initial_capacity: usize,
}

impl Default for IndexConfig {
    fn default() -> Self {
        Self { shards: 16, initial_capacity: 0 }
    }
}

/// What a [`PrefixIndex::remove`](super::PrefixIndex::remove) did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RemoveOutcome {
    /// Copies taken.
    pub removed: usize,
    /// Hashes that had no copy to take (counted no-ops).
    pub missing: usize,
}

/// Counters and sizes of a [`PrefixIndex`](super::PrefixIndex).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IndexStats {
    /// `(worker, tier, hash)` keys with copies > 0.
    pub blocks: usize,
    /// Dead slots (reused after a grace period, freed in place by a sweep, or dropped by a
    /// rebuild).
    pub tombstones: usize,
    /// Slots allocated over all shards.
    pub slots: usize,
    /// Removals of blocks that had no copy.
    pub missing_removes: u64,
    /// Stores that hit the `u32::MAX` copy limit.
    pub saturated_stores: u64,
    /// Completed [`PrefixIndex::replace_worker`](super::PrefixIndex::replace_worker) calls (including clears and removals).
    pub replaces: u64,
    /// Shard tables rebuilt (grown when full, or shrunk after a worker-level removal).
    pub rebuilds: u64,
    /// Full shard tables that freed their dead slots in place instead of being rebuilt.
    pub sweeps: u64,
    /// Pages of the holders' runs: in use, and free (reusable now or after a grace period).
    pub run_pages: (usize, usize),
}

/// Where [`PrefixIndex::memory_bytes`](super::PrefixIndex::memory_bytes) is, by structure (bytes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryBreakdown {
    /// Table slots holding a live `(worker, tier, hash)` key, each with its share of its
    /// group's control word.
    pub live_slots: usize,
    /// Dead slots (waiting for a grace period, a sweep or a rebuild).
    pub dead_slots: usize,
    /// Slots never used, or freed: the tables' load-factor room.
    pub empty_slots: usize,
    /// The tables' version counters and headers.
    pub versions: usize,
    /// Crowd records.
    pub crowds: usize,
    /// Run pages in use: their valid entries (a hash each).
    pub run_entries: usize,
    /// Run pages in use: their entries not valid (not written yet, or dead).
    pub run_slack: usize,
    /// Run pages in use: valid words, stamps and links.
    pub run_headers: usize,
    /// Run pages not in use (free, waiting for a grace period, or not handed out yet in an
    /// allocated chunk).
    pub run_free: usize,
    /// The page pool's directory, free lists and holder cursors.
    pub run_pool: usize,
    /// Generation words, locks, the overflow map of copy counts, and the index itself.
    pub other: usize,
}

impl MemoryBreakdown {
    /// The parts, named, in field order.
    pub fn parts(&self) -> [(&'static str, usize); 11] {
        [
            ("live slots", self.live_slots),
            ("dead slots", self.dead_slots),
            ("empty slots", self.empty_slots),
            ("versions", self.versions),
            ("crowd records", self.crowds),
            ("run entries", self.run_entries),
            ("run slack", self.run_slack),
            ("run headers", self.run_headers),
            ("free pages", self.run_free),
            ("page pool", self.run_pool),
            ("other", self.other),
        ]
    }

    /// The sum of the parts: [`PrefixIndex::memory_bytes`](super::PrefixIndex::memory_bytes).
    pub fn total(&self) -> usize {
        self.parts().iter().map(|&(_, b)| b).sum()
    }
}
