//! The live-block set of an engine, with physical copies counted: the semantics the relay's
//! snapshot keeps, as a small in-memory reference (tests, `relayctl decode --live`, and the
//! yardstick the durable snapshot is checked against).
//!
//! A store adds one copy of each hash, a removal takes one (a removal of a hash with no copies
//! is counted in [`LiveBlocks::removed_not_live`] and changes nothing), `AllBlocksCleared` drops
//! the rank's blocks (of one tier where the event names it), and a rank reset drops the rank.

use crate::model::{Batch, BlockHash, Event, Tier};
use std::collections::BTreeMap;

/// Where a live block is held.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LiveKey {
    pub dp_rank: u32,
    pub tier: Tier,
    pub group: u32,
}

/// Live blocks with their copy counts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LiveBlocks {
    pub blocks: BTreeMap<LiveKey, BTreeMap<BlockHash, u32>>,
    /// Removals of a hash that had no copy.
    pub removed_not_live: u64,
    /// Stores of a hash that already had a copy (a second physical copy).
    pub stored_already_live: u64,
}

impl LiveBlocks {
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies every event of a normalized batch.
    pub fn apply(&mut self, batch: &Batch) {
        for e in &batch.events {
            self.apply_event(batch.dp_rank, e);
        }
    }

    pub fn apply_event(&mut self, dp_rank: u32, e: &Event) {
        match e {
            Event::Stored(s) => {
                let key = LiveKey { dp_rank, tier: s.tier.clone(), group: s.group.idx };
                let set = self.blocks.entry(key).or_default();
                for b in &s.blocks {
                    let c = set.entry(b.hash).or_default();
                    if *c > 0 {
                        self.stored_already_live += 1;
                    }
                    *c += 1;
                }
            }
            Event::Removed(r) => {
                let key = LiveKey { dp_rank, tier: r.tier.clone(), group: r.group };
                let mut now_empty = false;
                match self.blocks.get_mut(&key) {
                    Some(set) => {
                        for h in &r.block_hashes {
                            match set.get_mut(h) {
                                Some(c) if *c > 1 => *c -= 1,
                                Some(_) => {
                                    set.remove(h);
                                }
                                None => self.removed_not_live += 1,
                            }
                        }
                        now_empty = set.is_empty();
                    }
                    None => self.removed_not_live += r.block_hashes.len() as u64,
                }
                if now_empty {
                    self.blocks.remove(&key);
                }
            }
            Event::Cleared(c) => match &c.tier {
                None => self.reset_rank(dp_rank),
                Some(t) => self.blocks.retain(|k, _| !(k.dp_rank == dp_rank && &k.tier == t)),
            },
        }
    }

    /// Drops every block of a rank.
    pub fn reset_rank(&mut self, dp_rank: u32) {
        self.blocks.retain(|k, _| k.dp_rank != dp_rank);
    }

    /// Number of distinct live (key, hash) entries.
    pub fn len(&self) -> usize {
        self.blocks.values().map(BTreeMap::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }
}
