//! The durable store: the log of committed records in segment files, the live-block set in
//! memory, and checkpoints of the live set beside the log. sled keeps the store's identity: its
//! format version, epoch and incarnations.
//!
//! # Layout
//! - `log.rs`: the history, appended to segment files (`log/`), each committed group of records
//!   one frame written with one `write`; its two bounds (what subscribers resume from, what
//!   recovery needs); the commit lock; a failed write.
//! - `live.rs`: the live set in memory, and the journals that let snapshots copy it beside commits.
//! - `snapshot.rs`: snapshots of the live set at one cursor, read in chunks.
//! - `checkpoint.rs`: the live set and the ranks' positions at a cursor, written to a file beside
//!   commits; loading the newest whole one.
//! - `format.rs`: the on-disk format's version, and the upgrade of a format-1 store.
//! - `redo.rs`: format 1's redo file, applied before that store is upgraded.
//! - `codec.rs`, `recent.rs`, `error.rs`: byte layouts, the history's tail in memory, errors.
//!
//! # Commit
//! Commits are serialized by one lock ([`log::Writer`]). [`Store::commit_many`] encodes its
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
//! incarnation commits *different* records under the cursors lost. Each [`Record`] says which
//! incarnation committed it; [`Store::cursor_matches`] tells a subscriber whether the cursor it
//! holds is still the record it saw. See `docs/architecture.md`.

mod checkpoint;
mod codec;
/// Any record the model can hold, for property tests outside the store.
#[cfg(test)]
pub(crate) use codec::tests::record as any_record;
mod error;
mod format;
mod live;
mod log;
mod recent;
mod record;
mod redo;
mod snapshot;

pub use error::StoreError;
pub use format::FORMAT_VERSION;
pub use recent::{Committed, RecentLimits};
pub use snapshot::{Snapshot, SnapshotBlock, SnapshotFilter};

use crate::model::{Event, Record, RecordBody, Tier};
use codec::{decode_record, encode_record, Counters};
use error::count;
use live::Live;
use log::{LogIndex, Writer};
use redo::{apply_redo, REDO_FILE};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, VecDeque};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::Instant;
use tokio::sync::watch;

pub use log::SYNC_EVERY;

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
    /// 50,000 records or 32 MiB: at a million live blocks (a checkpoint of about 100 MiB), the
    /// worst replay after it is about 100 MiB of records, and checkpoints cost ingest a few
    /// percent of a core at 1,000 batches a second (`docs/benchmarks.md`).
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
    /// The history's tail kept in memory for subscribers ([`Store::recent`]).
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

/// What became of a cursor a subscriber holds (see [`Store::cursor_matches`]).
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

/// A rank's condition as the last control record left it.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(tag = "health", rename_all = "snake_case")]
pub enum RankHealth {
    #[default]
    Ok,
    Degraded {
        reason: String,
    },
    Incomplete {
        reason: String,
    },
}

/// Where a rank's ingest stood at its last commit: what a restarted relay resumes from.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct RankCursor {
    /// Engine `seq` of the rank's last committed batch; `None` when no batch was committed since
    /// the rank's last [`ControlKind::RankReset`] (the publisher restarted: refill from seq 0).
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
/// What readers see: a copy made after each commit, so reads never wait for the commit lock.
#[derive(Clone)]
struct View {
    counters: Counters,
    ranks: BTreeMap<u32, RankCursor>,
}

/// The checkpoints' state, shared by the commits (which start them) and the checkpoint thread.
#[derive(Debug, Default)]
struct Checkpoints {
    /// The newest whole checkpoint: (id, cursor, bytes).
    last: Option<(u64, u64, u64)>,
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
    live: Arc<Mutex<Live>>,
    checkpoints: Mutex<Checkpoints>,
    /// What readers see; written under the commit lock.
    view: RwLock<View>,
    /// Set when the store closes: a checkpoint being written stops at its next chunk.
    closing: AtomicBool,
}

impl Shared {
    fn failed(&self) -> bool {
        self.writer.lock().unwrap_or_else(|p| p.into_inner()).failed.is_some()
    }

    /// Syncs the log's active segment (the older ones were synced when they ended): every commit
    /// so far is on the disk. Commits go on meanwhile. A failed sync fails the store.
    fn sync_log(&self, op: &'static str) -> Result<(), StoreError> {
        let (files, folder) = {
            let mut w = self.writer.lock().unwrap_or_else(|p| p.into_inner());
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
            self.writer.lock().unwrap_or_else(|p| p.into_inner()).fail(op, e)
        })
    }

    /// Removes the log's segments that neither the history nor recovery needs.
    fn prune_log(&self) {
        let keep = self.writer.lock().unwrap_or_else(|p| p.into_inner()).keep_from();
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
        drop(self.checkpoint_tx.lock().unwrap_or_else(|p| p.into_inner()).take());
        drop(self.sync_tx.lock().unwrap_or_else(|p| p.into_inner()).take());
        for h in self.threads.lock().unwrap_or_else(|p| p.into_inner()).drain(..) {
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

fn meta_u64(meta: &sled::Tree, key: &str) -> Result<Option<u64>, sled::Error> {
    Ok(meta.get(key)?.and_then(|v| <[u8; 8]>::try_from(v.as_ref()).ok()).map(u64::from_be_bytes))
}

/// How long an open waits for the store's file lock: a store just closed (in this process, or
/// by a relay still exiting) releases it when sled's background threads have stopped.
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

fn open_sled(dir: &Path, cache_bytes: u64) -> Result<sled::Db, sled::Error> {
    let started = Instant::now();
    loop {
        match sled::Config::new().path(dir).cache_capacity(cache_bytes).open() {
            Err(sled::Error::Io(e))
                if e.to_string().contains("could not acquire lock") && started.elapsed() < LOCK_WAIT =>
            {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            other => return other,
        }
    }
}

/// Moves an unreadable sled directory aside (`unreadable-<unix ms>`), with the log and the
/// checkpoints that belong to it, keeping them for inspection.
fn set_aside(dir: &Path, sled_dir: &Path, why: &str) -> Result<(), StoreError> {
    let to = aside_dir(dir);
    tracing::warn!(dir = %dir.display(), moved_to = %to.display(), why, "store unreadable: starting a new one with a new epoch");
    std::fs::rename(sled_dir, &to).map_err(|e| StoreError::io("set aside an unreadable store", dir, e))?;
    move_files_aside(dir, &to)
}

/// Where a store's files are set aside: `unreadable-<unix ms>` in the state directory.
fn aside_dir(dir: &Path) -> PathBuf {
    let ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis()).unwrap_or(0);
    dir.join(format!("unreadable-{ms}"))
}

/// Moves the files of a store other than sled's (the log, the checkpoints, a redo) into `to`.
fn move_files_aside(dir: &Path, to: &Path) -> Result<(), StoreError> {
    std::fs::create_dir_all(to).map_err(|e| StoreError::io("set aside an unreadable store", dir, e))?;
    for name in [REDO_FILE, log::LOG_DIR, checkpoint::FOLDER] {
        match std::fs::rename(dir.join(name), to.join(name)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(StoreError::io("set aside an unreadable store's files", dir, e))
            }
            _ => {}
        }
    }
    Ok(())
}

/// A tier name the checkpoints' layout cannot hold (over 65,535 bytes) is refused at commit.
fn check_tiers(body: &RecordBody) -> Result<(), StoreError> {
    let RecordBody::Batch { batch, .. } = body else { return Ok(()) };
    for e in &batch.events {
        let tier = match e {
            Event::Stored(s) => Some(&s.tier),
            Event::Removed(r) => Some(&r.tier),
            Event::Cleared(c) => c.tier.as_ref(),
        };
        if let Some(Tier::Other(name)) = tier {
            if name.len() > usize::from(u16::MAX) {
                return Err(StoreError::Invalid { what: "tier", detail: format!("tier name of {} bytes", name.len()) });
            }
        }
    }
    Ok(())
}

/// The rank a record is of.
fn rank_of(body: &RecordBody) -> u32 {
    match body {
        RecordBody::Batch { batch, .. } => batch.dp_rank,
        RecordBody::Control(c) => c.dp_rank,
    }
}

/// A rank's position after its record at `cursor`.
fn rank_after(row: &mut RankCursor, cursor: u64, body: &RecordBody) {
    use crate::model::ControlKind;
    row.last_cursor = cursor;
    match body {
        RecordBody::Batch { batch, .. } => (row.last_seq, row.last_ts) = (Some(batch.seq), Some(batch.ts)),
        RecordBody::Control(c) => match &c.kind {
            ControlKind::RankReset { .. } => (row.last_seq, row.last_ts) = (None, None),
            ControlKind::RankDegraded { reason } => row.health = RankHealth::Degraded { reason: reason.clone() },
            ControlKind::RankIncomplete { reason } => row.health = RankHealth::Incomplete { reason: reason.clone() },
            ControlKind::RankRecovered => row.health = RankHealth::Ok,
        },
    }
}

impl Store {
    /// Opens the store in `cfg.dir`, creating it (with a new epoch) when there is none. A
    /// format-1 store is upgraded ([`format`]); one of a newer format is refused; one that sled
    /// cannot read, or without its meta data, is moved aside and a new one (new epoch) is made.
    /// Every open is a new incarnation.
    pub fn open(cfg: StoreConfig) -> Result<Store, StoreError> {
        Self::open_inner(cfg).map_err(|e| count("open", e))
    }

    fn open_inner(cfg: StoreConfig) -> Result<Store, StoreError> {
        let started = Instant::now();
        let dir = cfg.dir.clone();
        let sl = |e| StoreError::sled("open", &dir, e);
        std::fs::create_dir_all(&dir).map_err(|e| StoreError::io("create the state directory", &dir, e))?;
        // Format 1 kept snapshot spill files here; none is ever left (they were unlinked).
        let _ = std::fs::remove_dir(dir.join("spill"));
        let sled_dir = dir.join("sled");
        let db = match open_sled(&sled_dir, cfg.cache_bytes) {
            Ok(db) => db,
            Err(e @ (sled::Error::Corruption { .. } | sled::Error::ReportableBug(_))) => {
                set_aside(&dir, &sled_dir, &e.to_string())?;
                open_sled(&sled_dir, cfg.cache_bytes).map_err(sl)?
            }
            Err(e) => return Err(sl(e)),
        };
        let (db, meta, data) = {
            let meta = db.open_tree("meta").map_err(sl)?;
            let data = db.open_tree("data").map_err(sl)?;
            let format = meta.get("format").map_err(sl)?;
            let readable = match &format {
                None => data.is_empty() && meta.is_empty(),
                Some(v) => v.len() == 4 && meta_u64(&meta, "epoch").map_err(sl)?.is_some(),
            };
            if let Some(v) = format.as_deref().filter(|v| v.len() == 4) {
                let found = u32::from_be_bytes([v[0], v[1], v[2], v[3]]);
                if found > FORMAT_VERSION || found == 0 {
                    return Err(StoreError::IncompatibleFormat { dir, found, supported: FORMAT_VERSION });
                }
            }
            if readable {
                (db, meta, data)
            } else {
                drop((meta, data, db));
                set_aside(&dir, &sled_dir, "no format version or epoch")?;
                let db = open_sled(&sled_dir, cfg.cache_bytes).map_err(sl)?;
                let meta = db.open_tree("meta").map_err(sl)?;
                let data = db.open_tree("data").map_err(sl)?;
                (db, meta, data)
            }
        };
        if meta.get("format").map_err(sl)?.as_deref() == Some(&1u32.to_be_bytes()[..]) {
            apply_redo(&dir, &db, &data)?;
            format::upgrade_v1(&dir, &db, &meta, &data, cfg.segment_bytes)?;
        }
        if !data.is_empty() {
            let keys = data.len();
            data.clear().map_err(sl)?;
            db.flush().map_err(sl)?;
            tracing::info!(dir = %dir.display(), keys, "removed format 1's keys left after the upgrade");
        }
        let epoch = match meta_u64(&meta, "epoch").map_err(sl)? {
            Some(e) => e,
            None => {
                // A new store: a log or checkpoints found here belong to another one.
                if [log::LOG_DIR, checkpoint::FOLDER].iter().any(|n| dir.join(n).exists()) {
                    let to = aside_dir(&dir);
                    tracing::warn!(dir = %dir.display(), moved_to = %to.display(),
                        "a log or checkpoints without the store they belong to: set aside");
                    move_files_aside(&dir, &to)?;
                }
                let epoch = loop {
                    let e: u64 = rand::random();
                    if e != 0 {
                        break e;
                    }
                };
                let mut b = sled::Batch::default();
                b.insert("format", &FORMAT_VERSION.to_be_bytes());
                b.insert("epoch", &epoch.to_be_bytes());
                meta.apply_batch(b).map_err(sl)?;
                db.flush().map_err(sl)?;
                epoch
            }
        };
        drop(data);
        let bad = |what: &'static str, detail: String| StoreError::Decode { dir: dir.clone(), what, detail };
        let opened = log::open(&dir, epoch, cfg.segment_bytes, 1)?;
        let newest = opened.newest;
        let incarnation = meta.get("incarnation").map_err(sl)?.and_then(|v| <[u8; 4]>::try_from(v.as_ref()).ok());
        let incarnation = incarnation.map(u32::from_be_bytes).unwrap_or(0) + 1;
        let mut b = sled::Batch::default();
        b.insert("incarnation", &incarnation.to_be_bytes());
        let mut ikey = b"i".to_vec();
        ikey.extend_from_slice(&incarnation.to_be_bytes());
        b.insert(ikey, &(newest + 1).to_be_bytes());
        meta.apply_batch(b).map_err(sl)?;
        db.flush().map_err(sl)?;
        let mut incarnations = BTreeMap::new();
        for kv in meta.scan_prefix("i") {
            let (k, v) = kv.map_err(sl)?;
            if let (Ok(i), Ok(c)) = (<[u8; 4]>::try_from(&k[1..]), <[u8; 8]>::try_from(v.as_ref())) {
                incarnations.insert(u32::from_be_bytes(i), u64::from_be_bytes(c));
            }
        }
        // The live set and the ranks' positions: the newest whole checkpoint, then the log after it.
        let ckpt_dir = checkpoint::folder(&dir);
        let (manifest, mut live) = match checkpoint::load_newest(&ckpt_dir, newest)? {
            Some((m, live)) => (Some(m), live),
            None => (None, Live::default()),
        };
        let floor = manifest.as_ref().map_or(0, |m| m.cursor);
        let mut ranks = manifest.as_ref().map(|m| m.ranks.clone()).unwrap_or_default();
        let index = opened.index;
        let log_oldest = index.oldest();
        if floor < newest && (log_oldest == 0 || log_oldest > floor + 1) {
            return Err(bad(
                "log",
                format!(
                    "the live set needs the log from cursor {} (after {}), and it starts at {log_oldest}",
                    floor + 1,
                    manifest.as_ref().map_or("no checkpoint".to_string(), |m| format!("checkpoint {}", m.id)),
                ),
            ));
        }
        let mut replayed = 0u64;
        log::replay(
            &index,
            floor + 1,
            &mut |cursor, bytes| {
                let rec = decode_record(bytes).map_err(|d| bad("history record", format!("cursor {cursor}: {d}")))?;
                live.apply(cursor, &rec.body);
                rank_after(ranks.entry(rank_of(&rec.body)).or_default(), cursor, &rec.body);
                replayed += 1;
                Ok(())
            },
            &dir,
        )?;
        live.cursor = newest;
        // The history: the newest records of the log within the bounds (always the newest one).
        let all_sizes = index.sizes();
        let mut counters = Counters { newest, ..Counters::default() };
        if let Some(&last) = all_sizes.last() {
            counters.hist_batches = 1;
            counters.hist_bytes = last;
            for &size in all_sizes.iter().rev().skip(1) {
                if counters.hist_batches + 1 > cfg.limits.max_batches
                    || counters.hist_bytes + size > cfg.limits.max_bytes
                {
                    break;
                }
                counters.hist_batches += 1;
                counters.hist_bytes += size;
            }
            counters.oldest = newest + 1 - counters.hist_batches;
        }
        let sizes: VecDeque<u64> =
            all_sizes[all_sizes.len() - counters.hist_batches as usize..].iter().copied().collect();
        // Checkpoints other than the one loaded: older ones, and any a crash left half written.
        let mut next_id = manifest.as_ref().map_or(1, |m| m.id + 1);
        if let Ok((ids, other)) = checkpoint::list(&ckpt_dir) {
            let io = |e| StoreError::io("remove a stale checkpoint", &ckpt_dir, e);
            for id in ids {
                next_id = next_id.max(id + 1);
                if manifest.as_ref().is_none_or(|m| m.id != id) {
                    checkpoint::remove(&ckpt_dir, id).map_err(io)?;
                }
            }
            for f in other {
                std::fs::remove_file(&f).map_err(io)?;
            }
        }
        let writer = Arc::new(Mutex::new(Writer {
            counters,
            ranks: ranks.clone(),
            sizes,
            floor,
            appended: 0,
            failed: None,
            log: opened.active,
            frame: Vec::new(),
        }));
        let checkpoints = Checkpoints {
            last: manifest.as_ref().map(|m| (m.id, m.cursor, m.bytes)),
            next_id,
            began: (floor, 0),
            running: false,
        };
        let blocks: u64 = live.summary().iter().map(|s| s.1).sum();
        let shared = Arc::new(Shared {
            dir: dir.clone(),
            db,
            epoch,
            incarnation,
            writer,
            log: RwLock::new(index),
            live: Arc::new(Mutex::new(live)),
            checkpoints: Mutex::new(checkpoints),
            view: RwLock::new(View { counters, ranks }),
            closing: AtomicBool::new(false),
        });
        shared.prune_log();
        let spawn = |name: &str, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name.into())
                .spawn(f)
                .map_err(|e| StoreError::io("start the store's threads", &dir, e))
        };
        let (tx, rx) = mpsc::sync_channel::<()>(1);
        let checkpointer = {
            let shared = shared.clone();
            spawn(
                "kv-relay-store-checkpoint",
                Box::new(move || {
                    while rx.recv().is_ok() {
                        run_checkpoint(&shared);
                    }
                }),
            )?
        };
        let (sync_tx, sync_rx) = mpsc::sync_channel::<()>(1);
        let syncer = {
            let shared = shared.clone();
            spawn(
                "kv-relay-store-sync",
                Box::new(move || {
                    while let Err(mpsc::RecvTimeoutError::Timeout) = sync_rx.recv_timeout(SYNC_EVERY) {
                        if !shared.failed() {
                            // A failure is counted, and fails the store (see "A failed write").
                            let _ = shared.sync_log("sync");
                            shared.prune_log();
                        }
                    }
                }),
            )?
        };
        let (newest_tx, _) = watch::channel(counters.newest);
        let took = started.elapsed();
        metrics::histogram!("kv_relay_store_open_seconds").record(took.as_secs_f64());
        tracing::info!(
            dir = %dir.display(), epoch, incarnation, newest = counters.newest, live_blocks = blocks,
            checkpoint = floor, replayed, cut_bytes = opened.cut, took_ms = took.as_millis() as u64, "store opened"
        );
        Ok(Store {
            inner: Arc::new(Inner {
                shared,
                limits: cfg.limits,
                policy: cfg.checkpoint,
                incarnations,
                recent: RwLock::new(recent::Recent::new(cfg.recent)),
                newest_tx,
                checkpoint_tx: Mutex::new(Some(tx)),
                sync_tx: Mutex::new(Some(sync_tx)),
                threads: Mutex::new(vec![checkpointer, syncer]),
            }),
        })
    }

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

    /// Commits one record at the next cursor.
    pub fn commit(&self, body: RecordBody) -> Result<Record, StoreError> {
        let mut v = self.commit_many(vec![body])?;
        Ok(v.pop().expect("one record for one body").record.clone())
    }

    /// Commits records at consecutive cursors, all in one atomic write.
    pub fn commit_many(&self, mut bodies: Vec<RecordBody>) -> Result<Vec<Arc<Committed>>, StoreError> {
        self.commit_group(&mut bodies)
    }

    /// [`Store::commit_many`] of the bodies in `group`, taken from it; when the commit fails
    /// they are all put back, in order, for a retry, so a caller that must not lose them need
    /// not copy them first.
    pub fn commit_group(&self, group: &mut Vec<RecordBody>) -> Result<Vec<Arc<Committed>>, StoreError> {
        if group.is_empty() {
            return Ok(Vec::new());
        }
        let mut committed = Vec::with_capacity(group.len());
        let mut rest = std::mem::take(group).into_iter();
        let out = self.commit_into(&mut rest, &mut committed);
        if out.is_err() {
            // Nothing was published: each record is still only here.
            group.extend(committed.into_iter().map(|c| Arc::into_inner(c).expect("an unpublished record").record.body));
            group.extend(rest);
            return out.map(|()| Vec::new());
        }
        Ok(committed)
    }

    /// Encodes `bodies` into `committed` and writes them; on an error the bodies not taken yet
    /// stay in `bodies`, and those taken are in `committed`, none published.
    fn commit_into(
        &self,
        bodies: &mut impl Iterator<Item = RecordBody>,
        committed: &mut Vec<Arc<Committed>>,
    ) -> Result<(), StoreError> {
        let inner = &*self.inner;
        let sh = &*inner.shared;
        let mut guard = sh.writer.lock().unwrap_or_else(|p| p.into_inner());
        let w = &mut *guard;
        w.usable("commit", &sh.dir)?;
        let mut counters = w.counters;
        let mut ranks: BTreeMap<u32, RankCursor> = BTreeMap::new();
        let mut added: Vec<u64> = Vec::new();
        let mut offsets: Vec<(u64, u32)> = Vec::new();
        let mut frame = std::mem::take(&mut w.frame);
        log::begin_frame(&mut frame, counters.newest + 1);
        for body in bodies {
            let record = Record { cursor: counters.newest + 1, incarnation: sh.incarnation, body };
            let bytes = check_tiers(&record.body)
                .and_then(|()| encode_record(&record).map_err(|detail| StoreError::Invalid { what: "record", detail }));
            let size = bytes.as_ref().map_or(0, |b| b.len() as u64);
            let cursor = record.cursor;
            // Taken either way: on an error it goes back with the others.
            committed.push(Arc::new(Committed::new(record, size)));
            let bytes = match bytes {
                Ok(b) => b,
                Err(e) => {
                    w.frame = frame;
                    return Err(count("commit", e));
                }
            };
            let body = &committed.last().expect("just pushed").record.body;
            let rank = rank_of(body);
            let row = ranks.entry(rank).or_insert_with(|| w.ranks.get(&rank).cloned().unwrap_or_default());
            rank_after(row, cursor, body);
            counters.newest = cursor;
            counters.hist_batches += 1;
            counters.hist_bytes += size;
            if counters.oldest == 0 {
                counters.oldest = cursor;
            }
            added.push(size);
            offsets.push(log::push_record(&mut frame, &bytes));
        }
        log::end_frame(&mut frame);
        let written = w.log.append(&frame, w.counters.newest + 1, &offsets, &sh.log);
        w.frame = frame;
        if let Err((e, fatal)) = written {
            let e = StoreError::io("commit", &sh.dir, e);
            return Err(if fatal { w.fail("commit", e) } else { count("commit", e) });
        }
        let trimmed = log::trim(&mut counters, inner.limits, &w.sizes, &added);
        // Written: apply to the live set, then publish.
        {
            let mut live = sh.live.lock().unwrap_or_else(|p| p.into_inner());
            for c in committed.iter() {
                live.apply(c.record.cursor, &c.record.body);
            }
        }
        let drop_sizes = trimmed.min(w.sizes.len());
        w.sizes.drain(..drop_sizes);
        let skip_added = trimmed - drop_sizes;
        w.sizes.extend(added.iter().skip(skip_added));
        w.appended += added.iter().sum::<u64>();
        w.counters = counters;
        w.ranks.extend(ranks);
        inner.recent.write().unwrap_or_else(|p| p.into_inner()).push(committed.iter().cloned(), counters.oldest);
        *inner.shared.view.write().unwrap_or_else(|p| p.into_inner()) = View { counters, ranks: w.ranks.clone() };
        let due = self.checkpoint_due(w);
        let keep = w.keep_from();
        drop(guard);
        if sh.log.read().unwrap_or_else(|p| p.into_inner()).removable(keep) {
            sh.prune_log_before(keep);
        }
        inner.newest_tx.send_replace(counters.newest);
        if due {
            if let Some(tx) = &*inner.checkpoint_tx.lock().unwrap_or_else(|p| p.into_inner()) {
                let _ = tx.try_send(());
            }
        }
        Ok(())
    }

    /// Whether a checkpoint should begin now ([`CheckpointPolicy`]); marks it running if so.
    fn checkpoint_due(&self, w: &Writer) -> bool {
        let inner = &*self.inner;
        let mut c = inner.shared.checkpoints.lock().unwrap_or_else(|p| p.into_inner());
        if c.running {
            return false;
        }
        let every_records = inner.policy.every_records;
        let every_bytes = inner.policy.every_bytes.max(c.last.map_or(0, |l| l.2));
        let due = w.counters.newest - c.began.0 >= every_records || w.appended - c.began.1 >= every_bytes;
        c.running = due;
        due
    }

    fn view(&self) -> View {
        self.inner.shared.view.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn counters(&self) -> Counters {
        self.inner.shared.view.read().unwrap_or_else(|p| p.into_inner()).counters
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
    /// for are older than the tail kept in memory ([`StoreConfig::recent`]).
    pub fn recent(&self, after: u64, limit: usize) -> Option<Vec<Arc<Committed>>> {
        self.inner.recent.read().unwrap_or_else(|p| p.into_inner()).after(after, limit)
    }

    fn history_from_disk(&self, after: u64, limit: usize) -> Result<Vec<Record>, StoreError> {
        let dir = &self.inner.shared.dir;
        let c = self.counters();
        // The log on disk may reach further back than the history (see `log.rs`): never below it.
        let Some(from) = after.checked_add(1).map(|f| f.max(c.oldest)) else { return Ok(Vec::new()) };
        if c.oldest == 0 || from > c.newest {
            return Ok(Vec::new());
        }
        let limit = limit.min((c.newest - from + 1) as usize);
        let found = self.inner.shared.log.read().unwrap_or_else(|p| p.into_inner()).locate(from, limit);
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
        let log_oldest = self.inner.shared.log.read().unwrap_or_else(|p| p.into_inner()).oldest();
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
        self.inner.shared.view.read().unwrap_or_else(|p| p.into_inner()).ranks.get(&dp_rank).cloned()
    }

    /// Every rank ever committed, with its state.
    pub fn rank_states(&self) -> BTreeMap<u32, RankCursor> {
        self.view().ranks
    }

    /// Totals per (rank, tier, group) of the live blocks, in that order, at the newest cursor
    /// applied.
    pub fn live_summary(&self) -> Vec<LiveGroupSummary> {
        let live = self.inner.shared.live.lock().unwrap_or_else(|p| p.into_inner());
        live.summary()
            .into_iter()
            .map(|(k, blocks, copies, namespaces)| LiveGroupSummary {
                dp_rank: k.dp_rank,
                tier: k.tier,
                group: k.group,
                blocks,
                copies,
                namespaces,
            })
            .collect()
    }

    /// Totals of the whole live set.
    pub fn live_stats(&self) -> LiveStats {
        let live = self.inner.shared.live.lock().unwrap_or_else(|p| p.into_inner());
        let (blocks, copies) = live.summary().iter().fold((0, 0), |(b, c), g| (b + g.1, c + g.2));
        LiveStats {
            blocks,
            copies,
            removed_not_live: live.removed_not_live,
            stored_already_live: live.stored_already_live,
        }
    }

    /// The live set's heap bytes (maps, token slabs, namespaces), approximately.
    pub fn live_heap_bytes(&self) -> u64 {
        self.inner.shared.live.lock().unwrap_or_else(|p| p.into_inner()).heap_bytes()
    }

    /// The newest whole checkpoint: its cursor and bytes; `None` before the first.
    pub fn checkpoint_state(&self) -> Option<CheckpointState> {
        let c = self.inner.shared.checkpoints.lock().unwrap_or_else(|p| p.into_inner());
        c.last.map(|(id, cursor, bytes)| CheckpointState { id, cursor, bytes })
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

    /// Makes every commit so far durable (a background thread otherwise does it every
    /// [`SYNC_EVERY`]). Commits go on meanwhile. A failed sync fails the store: nothing more is
    /// written until it is reopened (see `log.rs`, "A failed write").
    pub fn flush(&self) -> Result<(), StoreError> {
        self.inner.shared.sync_log("flush")
    }

    /// Writes a checkpoint now, in this thread, and waits for it (tests, `relayctl`-free tools).
    /// Commits go on meanwhile; a checkpoint already being written by the background thread is
    /// waited for first.
    pub fn checkpoint_now(&self) -> Result<CheckpointState, StoreError> {
        let sh = &*self.inner.shared;
        loop {
            let mut c = sh.checkpoints.lock().unwrap_or_else(|p| p.into_inner());
            if !c.running {
                c.running = true;
                break;
            }
            drop(c);
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        checkpoint_once(sh)
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

/// The newest whole checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckpointState {
    pub id: u64,
    /// Every commit up to this cursor is in it.
    pub cursor: u64,
    /// Bytes of its chunks.
    pub bytes: u64,
}

/// The checkpoint thread's work when woken: one checkpoint, its failure counted and logged.
fn run_checkpoint(sh: &Shared) {
    if let Err(e) = checkpoint_once(sh) {
        if !sh.closing.load(Ordering::Relaxed) {
            count("checkpoint", e);
        }
    }
}

/// Writes one checkpoint (the caller marked it running), then removes the previous one and lets
/// the log it covers go. See "Checkpoints and recovery".
fn checkpoint_once(sh: &Shared) -> Result<CheckpointState, StoreError> {
    let out = write_checkpoint(sh);
    sh.checkpoints.lock().unwrap_or_else(|p| p.into_inner()).running = false;
    out
}

fn write_checkpoint(sh: &Shared) -> Result<CheckpointState, StoreError> {
    let started = Instant::now();
    let dir = &sh.dir;
    // The snapshot is registered under the commit lock, so the log's position, the ranks' and
    // the live set's cursor are the same.
    let (snap, ranks, id) = {
        let w = sh.writer.lock().unwrap_or_else(|p| p.into_inner());
        w.usable("checkpoint", dir)?;
        let snap = Snapshot::open(&sh.live, &SnapshotFilter::all(), sh.epoch, sh.incarnation);
        let mut c = sh.checkpoints.lock().unwrap_or_else(|p| p.into_inner());
        c.began = (snap.cursor, w.appended);
        let id = c.next_id;
        c.next_id += 1;
        (snap, w.ranks.clone(), id)
    };
    let pause = snap.pause;
    let folder = checkpoint::folder(dir);
    let m = checkpoint::write(snap, ranks, &folder, id, &|| sh.closing.load(Ordering::Relaxed))?;
    // The log up to the checkpoint's cursor on the disk too: then it counts.
    sh.sync_log("checkpoint")?;
    // Durable: the previous checkpoint and the log this one covers may go.
    let previous = {
        let mut c = sh.checkpoints.lock().unwrap_or_else(|p| p.into_inner());
        c.last.replace((m.id, m.cursor, m.bytes))
    };
    sh.writer.lock().unwrap_or_else(|p| p.into_inner()).floor = m.cursor;
    if let Some((old, ..)) = previous {
        if let Err(e) = checkpoint::remove(&folder, old) {
            // Harmless but for its space: the next open removes it.
            count("checkpoint", StoreError::io("remove the previous checkpoint", &folder, e));
        }
    }
    sh.prune_log();
    let took = started.elapsed();
    metrics::histogram!("kv_relay_store_checkpoint_seconds").record(took.as_secs_f64());
    metrics::histogram!("kv_relay_store_snapshot_pause_seconds").record(pause.as_secs_f64());
    metrics::gauge!("kv_relay_store_checkpoint_bytes").set(m.bytes as f64);
    metrics::gauge!("kv_relay_store_checkpoint_cursor").set(m.cursor as f64);
    tracing::debug!(
        id = m.id,
        cursor = m.cursor,
        blocks = m.blocks,
        bytes = m.bytes,
        took_ms = took.as_millis() as u64,
        "checkpoint written"
    );
    Ok(CheckpointState { id: m.id, cursor: m.cursor, bytes: m.bytes })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Batch, Block, Cleared, Group, Namespace, Removed, Stored, TokenLayout};

    fn stored(hashes: &[u64]) -> Event {
        Event::Stored(Stored {
            tier: Tier::Device,
            group: Group::default(),
            parent: None,
            block_size: 4,
            token_layout: TokenLayout::Single,
            blocks: hashes.iter().map(|&hash| Block { hash, token_ids: vec![1, 2, 3, 4], extra_keys: None }).collect(),
            namespace: Namespace::default(),
            session_id: None,
            ownership: None,
            lookahead_token_ids: None,
            block_mm_infos: None,
        })
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
