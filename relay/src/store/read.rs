//! The readers: the history (from memory when it is the newest, else from the log), snapshots,
//! the ranks' positions, and the store's totals. None waits for the commit lock.

use super::codec::{decode_record, Counters};
use super::error::{count, StoreError};
use super::{checkpoint, log};
use super::{
    CheckpointState, Committed, CursorCheck, HistoryStats, LiveGroupSummary, LiveStats, RankCursor, Snapshot,
    SnapshotFilter, Store, View,
};
use crate::model::Record;
use crate::sync::{Locked, ReadWrite};
use std::collections::BTreeMap;
use std::sync::Arc;
use tokio::sync::watch;

impl Store {
    fn view(&self) -> View {
        self.inner.shared.view.reading().clone()
    }

    fn counters(&self) -> Counters {
        self.inner.shared.view.reading().counters
    }

    /// The newest committed cursor; 0 when nothing was ever committed.
    pub fn newest_cursor(&self) -> u64 {
        self.counters().newest
    }

    /// The oldest cursor still in the history.
    pub fn oldest_cursor(&self) -> Option<u64> {
        Some(self.counters().oldest).filter(|&c| c != 0)
    }

    /// Up to `limit` records with cursors above `after`, ascending. Records older than the
    /// history are gone: the first one returned is then [`Store::oldest_cursor`].
    pub fn history(&self, after: u64, limit: usize) -> Result<Vec<Record>, StoreError> {
        if let Some(v) = self.recent(after, limit) {
            return Ok(v.iter().map(|c| c.record.clone()).collect());
        }
        self.history_from_disk(after, limit)
    }

    /// [`Store::history`], shared: from memory when the records are the newest (see
    /// [`Store::recent`]), else read from the log.
    pub fn history_shared(&self, after: u64, limit: usize) -> Result<Vec<Arc<Committed>>, StoreError> {
        if let Some(v) = self.recent(after, limit) {
            return Ok(v);
        }
        let v = self.history_from_disk(after, limit)?;
        Ok(v.into_iter().map(|r| Arc::new(Committed::new(r, 0))).collect())
    }

    /// [`Store::history`] from memory, without blocking: `None` when some of the records asked
    /// for are older than the tail kept in memory ([`StoreConfig::recent`](super::StoreConfig::recent)).
    pub fn recent(&self, after: u64, limit: usize) -> Option<Vec<Arc<Committed>>> {
        self.inner.recent.reading().after(after, limit)
    }

    pub(super) fn history_from_disk(&self, after: u64, limit: usize) -> Result<Vec<Record>, StoreError> {
        let dir = &self.inner.shared.dir;
        let c = self.counters();
        // The log on disk may reach further back than the history (see `log.rs`): never below it.
        let Some(from) = after.checked_add(1).map(|f| f.max(c.oldest)) else { return Ok(Vec::new()) };
        if c.oldest == 0 || from > c.newest {
            return Ok(Vec::new());
        }
        let limit = limit.min((c.newest - from + 1) as usize);
        let found = self.inner.shared.log.reading().locate(from, limit);
        let bytes = log::read_located(&found).map_err(|e| count("history", StoreError::io("history", dir, e)))?;
        bytes
            .iter()
            .map(|b| {
                decode_record(b).map_err(|detail| {
                    count("history", StoreError::Decode { dir: dir.clone(), what: "history record", detail })
                })
            })
            .collect()
    }

    pub fn history_stats(&self) -> HistoryStats {
        let c = self.counters();
        let log_oldest = self.inner.shared.log.reading().oldest();
        HistoryStats {
            batches: c.hist_batches,
            bytes: c.hist_bytes,
            oldest: Some(c.oldest).filter(|&o| o != 0),
            newest: c.newest,
            log_oldest: Some(log_oldest).filter(|&o| o != 0),
        }
    }

    /// The live blocks the filter selects, as of the newest cursor applied when it is called.
    /// Commits wait only while it is registered ([`Snapshot::pause`]); its blocks are copied
    /// from memory as it is read, beside commits.
    pub fn snapshot(&self, filter: SnapshotFilter) -> Result<Snapshot, StoreError> {
        let sh = &*self.inner.shared;
        let snap = Snapshot::open(&sh.live, &filter, sh.epoch, sh.incarnation);
        metrics::histogram!("kv_relay_store_snapshot_pause_seconds").record(snap.pause.as_secs_f64());
        Ok(snap)
    }

    /// The newest committed cursor, updated after every commit (for live fan-out).
    pub fn watch_newest(&self) -> watch::Receiver<u64> {
        self.inner.newest_tx.subscribe()
    }

    /// Where the rank's ingest stood at its last commit; `None` for a rank never committed.
    pub fn rank_state(&self, dp_rank: u32) -> Option<RankCursor> {
        self.inner.shared.view.reading().ranks.get(&dp_rank).cloned()
    }

    /// Every rank ever committed, with its state.
    pub fn rank_states(&self) -> BTreeMap<u32, RankCursor> {
        self.view().ranks
    }

    /// Totals per (rank, tier, group) of the live blocks, in that order, at the newest cursor
    /// applied.
    pub fn live_summary(&self) -> Vec<LiveGroupSummary> {
        let live = self.inner.shared.live.locked();
        live.summary()
    }

    /// Totals of the whole live set.
    pub fn live_stats(&self) -> LiveStats {
        let live = self.inner.shared.live.locked();
        let (blocks, copies) = live.summary().iter().fold((0, 0), |(b, c), g| (b + g.blocks, c + g.copies));
        LiveStats {
            blocks,
            copies,
            removed_not_live: live.removed_not_live,
            stored_already_live: live.stored_already_live,
        }
    }

    /// The live set's heap bytes (maps, token slabs, namespaces), approximately.
    pub fn live_heap_bytes(&self) -> u64 {
        self.inner.shared.live.locked().heap_bytes()
    }

    /// The newest whole checkpoint: its cursor and bytes; `None` before the first.
    pub fn checkpoint_state(&self) -> Option<CheckpointState> {
        let c = self.inner.shared.checkpoints.locked();
        c.last
    }

    /// Whether `cursor`, as committed by `incarnation` (from a [`Record`] the subscriber saw), is
    /// still that record here. Cursor 0 (nothing seen) is always [`CursorCheck::Same`].
    pub fn cursor_matches(&self, cursor: u64, incarnation: u32) -> CursorCheck {
        if cursor == 0 {
            return CursorCheck::Same;
        }
        let c = self.counters();
        if cursor > c.newest {
            return CursorCheck::Lost;
        }
        // The incarnation that committed a durable cursor is the last one that began at or before
        // it: each incarnation begins right after the newest durable cursor of the ones before.
        let owner = self.inner.incarnations.iter().rev().find(|(_, &first)| first <= cursor).map(|(&i, _)| i);
        if owner != Some(incarnation) {
            CursorCheck::Lost
        } else if c.oldest == 0 || cursor < c.oldest {
            CursorCheck::Trimmed
        } else {
            CursorCheck::Same
        }
    }

    /// The first cursor of every incarnation of this store.
    pub fn incarnations(&self) -> BTreeMap<u32, u64> {
        self.inner.incarnations.clone()
    }

    /// Bytes the store has on disk: sled's (the store's identity), the log's and the
    /// checkpoints'.
    pub fn size_on_disk(&self) -> Result<u64, StoreError> {
        let sh = &*self.inner.shared;
        let sled = sh.db.size_on_disk().map_err(|e| StoreError::sled("size on disk", &sh.dir, e))?;
        let mut files = 0;
        for folder in [sh.dir.join(log::LOG_DIR), checkpoint::folder(&sh.dir)] {
            let entries = std::fs::read_dir(&folder).map_err(|e| StoreError::io("size on disk", &folder, e));
            for e in entries?.flatten() {
                files += e.metadata().map(|m| m.len()).unwrap_or(0);
            }
        }
        Ok(sled + files)
    }
}
