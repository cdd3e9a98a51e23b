//! Consistent snapshots of the live blocks, read from memory in chunks.
//!
//! [`super::Store::snapshot`] registers a journal with the live set (`live_set.rs`) under its lock:
//! the snapshot's cursor and the tables it selects. That registration is the only pause commits
//! see ([`Snapshot::pause`]). Each chunk the reader asks for is then copied a few shards at a time
//! under the same lock, with the blocks the commits changed meanwhile put back as they were at the
//! cursor; the reader holds one chunk, and nothing goes to disk. Dropping the snapshot (read to
//! the end or not) closes its journal.

use super::error::StoreError;
use super::live_set::LiveSet;
use crate::model::{Namespace, Tier, TokenLayout};
use crate::sync::Locked;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Which live blocks a snapshot holds.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SnapshotFilter {
    /// Only these ranks (`None`: all).
    pub ranks: Option<Vec<u32>>,
    /// Only these tiers (`None`: all).
    pub tiers: Option<Vec<Tier>>,
    /// Carry each block's token ids (they are most of a snapshot's size).
    pub include_token_ids: bool,
}

impl SnapshotFilter {
    /// Every block, with token ids.
    pub fn all() -> Self {
        SnapshotFilter { ranks: None, tiers: None, include_token_ids: true }
    }

    pub(crate) fn wants_rank(&self, r: u32) -> bool {
        self.ranks.as_ref().is_none_or(|rs| rs.contains(&r))
    }

    pub(crate) fn wants_tier(&self, t: &Tier) -> bool {
        self.tiers.as_ref().is_none_or(|ts| ts.contains(t))
    }
}

/// One live block as of the snapshot's cursor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotBlock {
    pub dp_rank: u32,
    pub tier: Tier,
    pub group: u32,
    pub hash: u64,
    /// The block before it in its sequence, as the latest store of this block said.
    pub parent: Option<u64>,
    pub block_size: u32,
    pub namespace: Namespace,
    /// Physical copies held (at least 1).
    pub copies: u32,
    /// Empty when the filter left them out or the engine sent none.
    pub token_ids: Vec<u32>,
    pub token_layout: TokenLayout,
}

impl Default for SnapshotBlock {
    /// Rank 0, device tier, group 0, hash 0, one copy, nothing else.
    fn default() -> Self {
        SnapshotBlock {
            dp_rank: 0,
            tier: Tier::Device,
            group: 0,
            hash: 0,
            parent: None,
            block_size: 0,
            namespace: Namespace::default(),
            copies: 1,
            token_ids: Vec::new(),
            token_layout: TokenLayout::Single,
        }
    }
}

/// Blocks copied under the live set's lock per step: a step holds commits for well under a
/// millisecond.
const COPY_STEP: usize = 2048;

/// The live blocks at exactly [`Snapshot::cursor`], in (rank, tier, group, hash) order, yielded
/// in chunks of at most [`Snapshot::chunk_blocks`] blocks.
pub struct Snapshot {
    /// Every commit up to and including this cursor is in the snapshot, and none after it.
    pub cursor: u64,
    pub epoch: u64,
    pub incarnation: u32,
    /// Blocks in the snapshot.
    pub blocks: u64,
    /// How long commits waited for the snapshot: while it was registered, not while it is copied.
    pub pause: Duration,
    /// Blocks per chunk (default 1,024).
    pub chunk_blocks: usize,
    /// Removals of absent blocks and stores of held ones up to the cursor (for checkpoints).
    pub(crate) counts: (u64, u64),
    pub(crate) live: Arc<Mutex<LiveSet>>,
    pub(crate) journal: u64,
    pub(crate) copied: VecDeque<SnapshotBlock>,
    pub(crate) done: bool,
    pub(crate) remaining: u64,
}

impl std::fmt::Debug for Snapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Snapshot")
            .field("cursor", &self.cursor)
            .field("epoch", &self.epoch)
            .field("blocks", &self.blocks)
            .field("remaining", &self.remaining)
            .finish()
    }
}

impl Snapshot {
    /// Registers a snapshot of what `filter` selects in `live`, at its cursor.
    pub(crate) fn open(live: &Arc<Mutex<LiveSet>>, filter: &SnapshotFilter, epoch: u64, incarnation: u32) -> Snapshot {
        let started = std::time::Instant::now();
        let mut l = live.locked();
        let (journal, blocks) = l.open_journal(filter);
        let (cursor, counts) = (l.cursor, (l.removed_not_live, l.stored_already_live));
        drop(l);
        Snapshot {
            cursor,
            epoch,
            incarnation,
            blocks,
            pause: started.elapsed(),
            chunk_blocks: 1024,
            counts,
            live: live.clone(),
            journal,
            copied: VecDeque::new(),
            done: false,
            remaining: blocks,
        }
    }

    /// Copies until `want` blocks are ready or the journal is done.
    fn fill(&mut self, want: usize) {
        let mut buf = Vec::new();
        while !self.done && self.copied.len() < want {
            let mut live = self.live.locked();
            self.done = live.copy(self.journal, COPY_STEP, &mut buf);
            drop(live);
            self.copied.extend(buf.drain(..));
        }
    }
}

impl Drop for Snapshot {
    fn drop(&mut self) {
        if self.journal != u64::MAX {
            self.live.locked().close_journal(self.journal);
        }
    }
}

impl Iterator for Snapshot {
    type Item = Result<Vec<SnapshotBlock>, StoreError>;

    fn next(&mut self) -> Option<Self::Item> {
        let n = self.chunk_blocks.max(1);
        self.fill(n);
        if self.done && self.journal != u64::MAX {
            self.live.locked().close_journal(self.journal);
            self.journal = u64::MAX;
        }
        if self.copied.is_empty() {
            return None;
        }
        let chunk: Vec<SnapshotBlock> = self.copied.drain(..n.min(self.copied.len())).collect();
        self.remaining = self.remaining.saturating_sub(chunk.len() as u64);
        Some(Ok(chunk))
    }
}
