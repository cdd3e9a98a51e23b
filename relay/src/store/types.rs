//! The store's configuration and the values its readers return.

use super::recent::RecentLimits;
use crate::model::{RankHealth, Tier};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// When the live set is checkpointed: once either much of the log has been appended since the
/// last checkpoint began. Recovery replays at most about that much log after the checkpoint, and
/// the log on disk holds at most about that much past the history's bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckpointPolicy {
    /// Records.
    pub every_records: u64,
    /// Bytes of records; at least the last checkpoint's own size is used (a checkpoint costs
    /// about what it holds, so it is written at most once per that much log).
    pub every_bytes: u64,
}

impl Default for CheckpointPolicy {
    /// 50,000 records or 32 MiB. Past a checkpoint larger than 32 MiB, the next waits for as many
    /// bytes of log as it holds, so replay after it is bounded by its own size (what checkpoints
    /// cost ingest is in `docs/benchmarks.md`).
    fn default() -> Self {
        CheckpointPolicy { every_records: 50_000, every_bytes: 32 << 20 }
    }
}

/// How much history is kept: the oldest records go first when either bound is passed. The newest
/// record is always kept, even when it alone is larger than `max_bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HistoryLimits {
    pub max_batches: u64,
    /// Sum of the records' encoded sizes.
    pub max_bytes: u64,
}

impl Default for HistoryLimits {
    fn default() -> Self {
        HistoryLimits { max_batches: 10_000, max_bytes: 256 << 20 }
    }
}

/// Where and how the store lives.
#[derive(Debug, Clone, PartialEq)]
pub struct StoreConfig {
    /// The state directory: sled's files are in `sled/`.
    pub dir: PathBuf,
    pub limits: HistoryLimits,
    /// sled's page cache, bytes (default 64 MiB).
    pub cache_bytes: u64,
    /// The history's tail kept in memory for subscribers ([`super::Store::recent`]).
    pub recent: RecentLimits,
    /// When the live set is checkpointed.
    pub checkpoint: CheckpointPolicy,
    /// The log's segment size: a new segment file is begun once the active one holds this many
    /// bytes (default 8 MiB). The log is removed a whole segment at a time.
    pub segment_bytes: u64,
}

impl StoreConfig {
    /// Default limits and cache in `dir`.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        StoreConfig {
            dir: dir.into(),
            limits: HistoryLimits::default(),
            cache_bytes: 64 << 20,
            recent: RecentLimits::default(),
            checkpoint: CheckpointPolicy::default(),
            segment_bytes: 8 << 20,
        }
    }
}

/// The history's size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HistoryStats {
    pub batches: u64,
    pub bytes: u64,
    pub oldest: Option<u64>,
    pub newest: u64,
    /// The oldest record still on disk: before `oldest` while the newest checkpoint does not
    /// cover the records the history's bounds let go (recovery replays the log after it).
    pub log_oldest: Option<u64>,
}

/// What became of a cursor a subscriber holds (see [`super::Store::cursor_matches`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CursorCheck {
    /// The record at this cursor is the one that incarnation committed, and it is in the history:
    /// resume after it.
    Same,
    /// That incarnation's record at this cursor was lost in a crash (another incarnation holds the
    /// cursor now, or it is beyond the newest): the subscriber's state is not the store's, resync
    /// from a snapshot.
    Lost,
    /// The record is durable but older than the history: resync from a snapshot.
    Trimmed,
}

/// Where a rank's ingest stood at its last commit: what a restarted relay resumes from.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct RankCursor {
    /// Engine `seq` of the rank's last committed batch; `None` when no batch was committed since
    /// the rank's last [`crate::model::ControlKind::RankReset`] (the publisher restarted: refill from seq 0).
    pub last_seq: Option<u64>,
    /// Engine timestamp of that batch (tells the same publisher from a restarted one).
    pub last_ts: Option<f64>,
    /// Relay cursor of the rank's last record (batch or control).
    pub last_cursor: u64,
    pub health: RankHealth,
}

/// Totals of one (rank, tier, group) of the live set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveGroupSummary {
    pub dp_rank: u32,
    pub tier: Tier,
    pub group: u32,
    /// Distinct live blocks.
    pub blocks: u64,
    /// Physical copies (at least `blocks`).
    pub copies: u64,
    /// Distinct namespaces among the blocks.
    pub namespaces: u64,
}

/// Totals of the whole live set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LiveStats {
    pub blocks: u64,
    pub copies: u64,
    /// Removals of a block with no copy (counted, not an error), since the store was created.
    pub removed_not_live: u64,
    /// Stores of a block already held (a further copy), since the store was created.
    pub stored_already_live: u64,
}

/// The newest whole checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckpointState {
    pub id: u64,
    /// Every commit up to this cursor is in it.
    pub cursor: u64,
    /// Bytes of its chunks.
    pub bytes: u64,
}
