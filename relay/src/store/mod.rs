//! The durable store: the log of committed records in segment files, the live-block set in
//! memory, and checkpoints of the live set beside the log. sled keeps the store's identity: its
//! format version, epoch and incarnations.
//!
//! # Layout
//! - `log.rs`: the history, appended to segment files (`log/`), each committed group of records
//!   one frame written with one `write`; its two bounds (what subscribers resume from, what
//!   recovery needs); the commit lock; a failed write.
//! - `identity.rs`: sled, which keeps the store's format, epoch and incarnations.
//! - `open.rs`: an open, as the named steps of recovery.
//! - `commit.rs`: commits, and a rank's position after each record.
//! - `read.rs`: the readers (history, snapshots, the ranks' positions, totals).
//! - `checkpointer.rs`: the checkpoint thread.
//! - `live_set.rs`: the live set in memory, and the journals that let snapshots copy it beside
//!   commits.
//! - `snapshot.rs`: snapshots of the live set at one cursor, read in chunks.
//! - `checkpoint.rs`: the live set and the ranks' positions at a cursor, written to a file beside
//!   commits; loading the newest whole one.
//! - `v1/`: format 1 (its upgrade, its record layout, its redo file).
//! - `types.rs`: the configuration and the values readers return.
//! - `codec.rs`, `record.rs`, `recent.rs`, `error.rs`: byte layouts, the history's tail in
//!   memory, errors.
//!
//! # Commit
//! Commits are serialized by one lock (`log::Writer`). [`Store::commit_many`] encodes its
//! records into one frame and appends it to the log's active segment with one `write`: nothing is
//! written per block, and no other file is written. Only once the write returned are the records
//! applied to the live set in memory (under its own lock, taken inside the commit lock), then
//! published to readers. The cost of a commit is its records' bytes, not its block operations.
//!
//! # Checkpoints and recovery
//! A background thread writes the live set, with the ranks' positions, as a checkpoint once
//! enough log has passed since the last ([`CheckpointPolicy`]): a snapshot at cursor C (commits
//! pause only to register it) written as a file (`checkpoints/<id>.ckpt`: chunks, a manifest,
//! synced and renamed), then the log synced; only then is the previous checkpoint removed, and
//! the log's segments whose records are all at or before C and out of the history's bounds may
//! go. An open rebuilds the live set from the newest whole checkpoint and replays the log after
//! its cursor. A crash at any point of a checkpoint's write leaves the previous checkpoint, whose
//! log was not removed.
//!
//! # Crash protocol
//! Every open is a new *incarnation*, kept with the first cursor it could commit. A killed relay
//! loses no commit (each frame is in the kernel once its write returned), but a power loss can
//! lose what was not synced yet (at most [`log::SYNC_EVERY`], or since the last
//! [`Store::flush`]): the next open cuts the log after its last whole frame, and the next
//! incarnation commits *different* records under the cursors lost. Each [`Record`](crate::model::Record) says which
//! incarnation committed it; [`Store::cursor_matches`] tells a subscriber whether the cursor it
//! holds is still the record it saw. The steps of an open are in `open.rs`; see
//! `docs/architecture.md`.

mod checkpoint;
mod checkpointer;
mod codec;
#[cfg(test)]
pub(crate) use codec::tests::record as any_record;
mod commit;
mod error;
mod identity;
mod live_set;
mod log;
mod open;
mod read;
mod recent;
mod record;
mod snapshot;
mod types;
mod v1;

pub use crate::model::RankHealth;
pub use error::StoreError;
pub use identity::FORMAT_VERSION;
pub use log::SYNC_EVERY;
pub use recent::{Committed, RecentLimits};
pub use snapshot::{Snapshot, SnapshotBlock, SnapshotFilter};
pub use types::{
    CheckpointPolicy, CheckpointState, CursorCheck, HistoryLimits, HistoryStats, LiveGroupSummary, LiveStats,
    RankCursor, StoreConfig,
};

use crate::sync::Locked;
use codec::Counters;
use error::count;
use live_set::LiveSet;
use log::{LogIndex, Writer};
use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use tokio::sync::watch;

#[derive(Clone)]
struct View {
    counters: Counters,
    ranks: BTreeMap<u32, RankCursor>,
}

/// The checkpoints' state, shared by the commits (which start them) and the checkpoint thread.
#[derive(Debug, Default)]
struct Checkpoints {
    /// The newest whole checkpoint.
    last: Option<CheckpointState>,
    /// The id the next checkpoint takes.
    next_id: u64,
    /// Where the log stood when the running (or last) checkpoint began: (cursor, appended bytes).
    began: (u64, u64),
    running: bool,
}

/// What the checkpoint and sync threads share with the store.
struct Shared {
    dir: PathBuf,
    /// The store's identity (format, epoch, incarnations); written only at open.
    db: sled::Db,
    epoch: u64,
    incarnation: u32,
    /// The commit lock: every write (and sync) of the log goes through it, one at a time.
    writer: Arc<Mutex<Writer>>,
    /// Where each record of the log is, for readers; written under the commit lock (and by
    /// removals of whole segments).
    log: RwLock<LogIndex>,
    /// The live set, and the snapshots being copied from it. Taken inside the commit lock, never
    /// the other way round.
    live: Arc<Mutex<LiveSet>>,
    checkpoints: Mutex<Checkpoints>,
    /// What readers see; written under the commit lock.
    view: RwLock<View>,
    /// Set when the store closes: a checkpoint being written stops at its next chunk.
    closing: AtomicBool,
}

impl Shared {
    fn failed(&self) -> bool {
        self.writer.locked().failed.is_some()
    }

    /// Syncs the log's active segment (the older ones were synced when they ended): every commit
    /// so far is on the disk. Commits go on meanwhile. A failed sync fails the store.
    fn sync_log(&self, op: &'static str) -> Result<(), StoreError> {
        let (files, folder) = {
            let mut w = self.writer.locked();
            w.usable(op, &self.dir)?;
            let (files, begun) = w.log.take_unsynced();
            (files, begun.then(|| w.log.folder().to_path_buf()))
        };
        let synced = files.iter().try_for_each(|f| f.sync_data()).and_then(|()| match &folder {
            Some(folder) => File::open(folder).and_then(|d| d.sync_all()),
            None => Ok(()),
        });
        synced.map_err(|e| {
            let e = StoreError::io(op, &self.dir, e);
            self.writer.locked().fail(op, e)
        })
    }

    /// Removes the log's segments that neither the history nor recovery needs.
    fn prune_log(&self) {
        let keep = self.writer.locked().keep_from();
        self.prune_log_before(keep);
    }

    /// Removes the log's segments whose every record is before `keep`.
    fn prune_log_before(&self, keep: u64) {
        let folder = self.dir.join(log::LOG_DIR);
        if let Err(e) = log::remove_before(keep, &self.log, &folder) {
            // Harmless but for its space: the next open finds it and removes it then.
            count("prune", StoreError::io("remove a log segment", &folder, e));
        }
    }
}

struct Inner {
    shared: Arc<Shared>,
    limits: HistoryLimits,
    policy: CheckpointPolicy,
    /// Each incarnation's first cursor (fixed at open).
    incarnations: BTreeMap<u32, u64>,
    /// The history's tail in memory; written under the commit lock, before `newest_tx`.
    recent: RwLock<recent::Recent>,
    newest_tx: watch::Sender<u64>,
    /// Wakes the checkpoint thread; dropped first in `Drop` so that it ends.
    checkpoint_tx: Mutex<Option<mpsc::SyncSender<()>>>,
    /// Dropped in `Drop` so that the sync thread ends.
    sync_tx: Mutex<Option<mpsc::SyncSender<()>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        let sh = &self.shared;
        sh.closing.store(true, Ordering::Relaxed);
        drop(self.checkpoint_tx.locked().take());
        drop(self.sync_tx.locked().take());
        for h in self.threads.locked().drain(..) {
            let _ = h.join();
        }
        if !sh.failed() {
            if let Err(e) = sh.sync_log("close") {
                tracing::error!(error = %e, "closing the store: its last commits may not be on the disk");
            }
        }
        let _ = sh.db.flush();
    }
}

/// The durable store. Cheap to clone: every clone is the same store.
#[derive(Clone)]
pub struct Store {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("dir", &self.inner.shared.dir)
            .field("epoch", &self.inner.shared.epoch)
            .field("incarnation", &self.inner.shared.incarnation)
            .finish()
    }
}

impl Store {
    /// The relay epoch: random, made when the store was created, kept across opens.
    pub fn epoch(&self) -> u64 {
        self.inner.shared.epoch
    }

    /// This open's incarnation (1 for the first open of a new store).
    pub fn incarnation(&self) -> u32 {
        self.inner.shared.incarnation
    }

    pub fn dir(&self) -> &Path {
        &self.inner.shared.dir
    }

    pub fn limits(&self) -> HistoryLimits {
        self.inner.limits
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Batch, Block, Cleared, Event, Record, RecordBody, Removed, Stored, Tier};

    fn stored(hashes: &[u64]) -> Event {
        let blocks = hashes.iter().map(|&hash| Block::new(hash, vec![1, 2, 3, 4])).collect();
        Event::Stored(Stored::plain(Tier::Device, 0, 4, blocks))
    }

    fn batch(seq: u64, events: Vec<Event>) -> RecordBody {
        RecordBody::Batch { batch: Batch { dp_rank: 0, seq, ts: 0.0, events }, load: None, liveness: None }
    }

    #[test]
    fn history_from_memory_is_the_history_on_disk() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::open(StoreConfig {
            limits: HistoryLimits { max_batches: 20, max_bytes: 1 << 20 },
            recent: RecentLimits { max_records: 8, max_bytes: 1 << 20 },
            ..StoreConfig::new(dir.path())
        })
        .unwrap();
        for seq in 0..50 {
            // Groups of 1 to 3 records, as the committer makes them.
            let n = 1 + (seq % 3) as usize;
            s.commit_many((0..n as u64).map(|k| batch(seq * 3 + k, vec![stored(&[seq * 3 + k])])).collect()).unwrap();
        }
        let (oldest, newest) = (s.oldest_cursor().unwrap(), s.newest_cursor());
        assert_eq!((oldest, newest), (newest - 19, 99));
        let cursors = |v: Vec<Record>| v.iter().map(|r| r.cursor).collect::<Vec<_>>();
        for after in 0..=newest + 2 {
            for limit in [1, 3, 100] {
                let disk = s.history_from_disk(after, limit).unwrap();
                let want: Vec<u64> = (after.max(oldest - 1) + 1..=newest).take(limit).collect();
                assert_eq!(cursors(disk.clone()), want, "after {after} limit {limit}");
                assert_eq!(s.history(after, limit).unwrap(), disk, "after {after} limit {limit}");
                let shared: Vec<Record> =
                    s.history_shared(after, limit).unwrap().iter().map(|c| c.record.clone()).collect();
                assert_eq!(shared, disk, "after {after} limit {limit}");
                // Memory answers exactly the last 8 records' reads.
                let in_memory = after + 1 >= newest - 7;
                assert_eq!(s.recent(after, limit).is_some(), in_memory, "after {after}");
            }
        }
    }

    fn blocks_of(snap: Snapshot) -> Vec<(u64, u32)> {
        snap.flat_map(|c| c.unwrap()).map(|b| (b.hash, b.copies)).collect()
    }

    #[test]
    fn a_snapshot_is_the_state_at_its_cursor_whatever_is_committed_while_it_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::open(StoreConfig::new(dir.path())).unwrap();
        s.commit(batch(0, vec![stored(&[1, 2, 3])])).unwrap();
        let removed = |seq, h| {
            batch(
                seq,
                vec![Event::Removed(Removed { tier: Tier::Device, group: 0, block_hashes: vec![h], ownership: None })],
            )
        };
        let mut snap = s.snapshot(SnapshotFilter::all()).unwrap();
        snap.chunk_blocks = 1;
        // Removed (comes back), stored again (one copy at the cursor), new (left out), then the
        // whole rank cleared.
        s.commit(removed(1, 1)).unwrap();
        s.commit(batch(2, vec![stored(&[2, 9])])).unwrap();
        let first = snap.next().unwrap().unwrap();
        s.commit(removed(3, 9)).unwrap();
        s.commit(batch(4, vec![stored(&[8])])).unwrap();
        s.commit(batch(5, vec![Event::Cleared(Cleared { tier: None }), stored(&[7])])).unwrap();
        assert_eq!((snap.cursor, snap.blocks), (1, 3));
        let rest: Vec<(u64, u32)> = blocks_of(snap);
        let mut all: Vec<(u64, u32)> = first.iter().map(|b| (b.hash, b.copies)).collect();
        all.extend(rest);
        assert_eq!(all, vec![(1, 1), (2, 1), (3, 1)]);
        // The journal is gone with the snapshot: the next one is the state now.
        assert_eq!(s.inner.shared.live.lock().unwrap().journals(), 0);
        let now = s.snapshot(SnapshotFilter::all()).unwrap();
        assert_eq!(now.cursor, 6);
        assert_eq!(blocks_of(now), vec![(7, 1)]);
    }

    #[test]
    fn a_snapshot_dropped_unread_closes_its_journal() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::open(StoreConfig::new(dir.path())).unwrap();
        s.commit(batch(0, vec![stored(&[1])])).unwrap();
        let snap = s.snapshot(SnapshotFilter::all()).unwrap();
        assert_eq!(s.inner.shared.live.lock().unwrap().journals(), 1);
        drop(snap);
        assert_eq!(s.inner.shared.live.lock().unwrap().journals(), 0);
    }
}
