//! The log: the history of committed records in sled, one key per record (`h cursor`), each
//! group of records one sled write with the ranks' positions and the counters; and the commit
//! lock's state ([`Writer`]), through which every write of the store goes.
//!
//! # Two bounds on the log
//! - The *history* is what subscribers can resume from: the newest records within
//!   [`super::HistoryLimits`] (`Counters::oldest` to `newest`). A record past the bounds leaves
//!   the history at once.
//! - The log on disk (`Counters::kept_from` to `newest`) also keeps every record the newest
//!   durable checkpoint does not cover (after its cursor, [`Writer::floor`]), whatever the bounds
//!   say: recovery is that checkpoint plus the log after it. Records before both are removed, a
//!   bounded number per write ([`Writer::prune`]).

use super::codec::{Counters, P_HISTORY, P_RANK};
use super::error::{count, StoreError};
use super::redo::{sled_batch, write_redo, Writes};
use super::{HistoryLimits, RankCursor, KEEP_WRITES};
use std::collections::{BTreeMap, VecDeque};
use std::path::Path;
use std::time::Instant;

pub(crate) fn history_key(cursor: u64) -> Vec<u8> {
    let mut k = Vec::with_capacity(9);
    k.push(P_HISTORY);
    k.extend_from_slice(&cursor.to_be_bytes());
    k
}

pub(crate) fn rank_key(rank: u32) -> Vec<u8> {
    let mut k = Vec::with_capacity(5);
    k.push(P_RANK);
    k.extend_from_slice(&rank.to_be_bytes());
    k
}

/// What the commit lock guards.
pub(crate) struct Writer {
    pub counters: Counters,
    pub ranks: BTreeMap<u32, RankCursor>,
    /// The encoded size of each record of the history (`oldest` to `newest`), oldest first.
    pub sizes: VecDeque<u64>,
    /// The cursor of the newest durable checkpoint (0: none): the log after it is kept.
    pub floor: u64,
    /// Bytes of records appended since the store was opened (for the checkpoint policy).
    pub appended: u64,
    /// Set by a failed write: sled refuses writes after an I/O error, so the store must be reopened.
    pub failed: Option<String>,
    /// The batches written in the last [`KEEP_WRITES`] (see "A failed write" in `mod.rs`),
    /// oldest first, with when each was written.
    pub recent_writes: VecDeque<(Instant, Writes)>,
    /// Set with `failed`: the batches to apply again at the next open, until saved.
    pub redo: Option<Vec<Writes>>,
}

impl Writer {
    /// `Err(Failed)` (counted under `op`) once a write of the store failed.
    pub(crate) fn usable(&self, op: &'static str, dir: &Path) -> Result<(), StoreError> {
        match &self.failed {
            Some(first) => Err(count(op, StoreError::Failed { dir: dir.to_path_buf(), first: first.clone() })),
            None => Ok(()),
        }
    }

    /// Counts `e` under `op`, and fails the store on an error from the disk or sled
    /// ([`Writer::mark_failed`]).
    pub(crate) fn fail(&mut self, op: &'static str, dir: &Path, e: StoreError) -> StoreError {
        self.mark_failed(dir, &e);
        count(op, e)
    }

    /// After an I/O error sled refuses further writes, and fails reads too, until it is
    /// reopened: the store fails. The batches kept become the redo, saved now if there is room.
    pub(crate) fn mark_failed(&mut self, dir: &Path, e: &StoreError) {
        if self.failed.is_none()
            && matches!(
                e,
                StoreError::DiskFull { .. }
                    | StoreError::ReadOnly { .. }
                    | StoreError::Io { .. }
                    | StoreError::Sled { .. }
            )
        {
            self.failed = Some(e.to_string());
            self.redo = Some(std::mem::take(&mut self.recent_writes).into_iter().map(|(_, w)| w).collect());
            if let Err(save) = self.save_redo(dir) {
                tracing::warn!(error = %save, "the failed store's redo is not saved yet; retrying at the next write");
            }
        }
    }

    /// Writes `writes` as one sled batch, keeping them for a redo.
    pub(crate) fn write(&mut self, data: &sled::Tree, writes: Writes) -> Result<(), sled::Error> {
        let batch = sled_batch(&writes);
        let now = Instant::now();
        self.recent_writes.push_back((now, writes));
        data.apply_batch(batch)?;
        // This write succeeded, so no log write failed before it: what was written long enough
        // ago has been written out.
        while self.recent_writes.front().is_some_and(|(t, _)| now.duration_since(*t) > KEEP_WRITES) {
            self.recent_writes.pop_front();
        }
        Ok(())
    }

    /// Saves the redo to `dir` (see [`super::Store::save_redo`]).
    pub(crate) fn save_redo(&mut self, dir: &Path) -> Result<(), StoreError> {
        let Some(redo) = &self.redo else { return Ok(()) };
        if !redo.is_empty() {
            write_redo(dir, redo)?;
            let writes: usize = redo.iter().map(|b| b.len()).sum();
            tracing::warn!(dir = %dir.display(), batches = redo.len(), writes, "saved the failed store's last writes as its redo; the next open applies them");
        }
        self.redo = Some(Vec::new());
        Ok(())
    }

    /// Adds removals to `writes` of at most `max` records before both the history and the
    /// floor's next cursor, oldest first; returns how many.
    pub(crate) fn prune(&self, counters: &mut Counters, max: usize, writes: &mut Writes) -> usize {
        let keep = match counters.oldest {
            0 => counters.newest + 1,
            o => o,
        }
        .min(self.floor + 1);
        let mut n = 0;
        while counters.kept_from != 0 && counters.kept_from < keep && n < max {
            writes.push((history_key(counters.kept_from).into(), None));
            counters.kept_from += 1;
            n += 1;
        }
        if counters.kept_from > counters.newest {
            counters.kept_from = 0;
        }
        n
    }
}

/// The history's bounds applied to a commit in the making: `sizes` are the history's before it
/// (oldest first), `added` the sizes of the records it appends. Advances `counters.oldest` (and
/// the totals) past what the bounds no longer hold, always keeping the newest record; returns
/// how many of `sizes` left the history.
pub(crate) fn trim(counters: &mut Counters, limits: HistoryLimits, sizes: &VecDeque<u64>, added: &[u64]) -> usize {
    let mut gone = 0;
    while counters.hist_batches > 1
        && (counters.hist_batches > limits.max_batches || counters.hist_bytes > limits.max_bytes)
    {
        let size = sizes.get(gone).copied().unwrap_or_else(|| added[gone - sizes.len()]);
        counters.hist_batches -= 1;
        counters.hist_bytes -= size;
        counters.oldest += 1;
        gone += 1;
    }
    gone
}
