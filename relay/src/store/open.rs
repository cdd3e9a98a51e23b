//! An open of the store, as the steps of recovery, in order:
//!
//! 1. [`Identity::open`]: sled, with the format checked, a format-1 store upgraded, and a new
//!    store given its epoch.
//! 2. [`log::open`]: the log's segments, cut after their last whole frame (what a power loss
//!    left unsynced is gone from here on).
//! 3. [`Identity::begin_incarnation`]: this open's incarnation, recorded with its first cursor
//!    (the newest durable one plus one), before anything is committed.
//! 4. [`recover`]: the live set and the ranks' positions, from the newest whole checkpoint and
//!    the log after its cursor.
//! 5. [`history_bounds`]: the history's bounds over the log.
//! 6. [`remove_stale_checkpoints`]: older checkpoints, and any a crash left half written.
//! 7. The log no one needs removed, then the checkpoint and sync threads started.

use super::checkpoint::{self, Manifest};
use super::codec::{decode_record, Counters};
use super::commit::{rank_after, rank_of};
use super::error::{count, StoreError};
use super::identity::Identity;
use super::live_set::LiveSet;
use super::log::{self, LogIndex, Writer, SYNC_EVERY};
use super::{
    checkpointer, recent, CheckpointState, Checkpoints, HistoryLimits, Inner, RankCursor, Shared, Store, StoreConfig,
    View,
};
use std::collections::{BTreeMap, VecDeque};
use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::{mpsc, Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::Instant;
use tokio::sync::watch;

impl Store {
    /// Opens the store in `cfg.dir`, creating it (with a new epoch) when there is none. A
    /// format-1 store is upgraded (`store::v1`); one of a newer format is refused; one that
    /// sled cannot read, or without its meta data, is moved aside and a new one (new epoch) is
    /// made. Every open is a new incarnation.
    pub fn open(cfg: StoreConfig) -> Result<Store, StoreError> {
        open(cfg).map_err(|e| count("open", e))
    }
}

fn open(cfg: StoreConfig) -> Result<Store, StoreError> {
    let started = Instant::now();
    let dir = cfg.dir.clone();
    std::fs::create_dir_all(&dir).map_err(|e| StoreError::io("create the state directory", &dir, e))?;
    // Format 1 kept snapshot spill files here; none is ever left (they were unlinked).
    let _ = std::fs::remove_dir(dir.join("spill"));

    let identity = Identity::open(&dir, cfg.cache_bytes, cfg.segment_bytes)?;
    let opened = log::open(&dir, identity.epoch, cfg.segment_bytes, 1)?;
    let newest = opened.newest;
    let (incarnation, incarnations) = identity.begin_incarnation(&dir, newest)?;
    let recovered = recover(&dir, &opened.index, newest)?;
    let (counters, sizes) = history_bounds(&opened.index, newest, cfg.limits);
    let next_id = remove_stale_checkpoints(&dir, recovered.manifest.as_ref())?;

    let Recovered { manifest, live, ranks, replayed } = recovered;
    let floor = manifest.as_ref().map_or(0, |m| m.cursor);
    let writer = Writer {
        counters,
        ranks: ranks.clone(),
        sizes,
        floor,
        appended: 0,
        failed: None,
        log: opened.active,
        frame: Vec::new(),
    };
    let checkpoints = Checkpoints {
        last: manifest.as_ref().map(|m| CheckpointState { id: m.id, cursor: m.cursor, bytes: m.bytes }),
        next_id,
        began: (floor, 0),
        running: false,
    };
    let blocks: u64 = live.summary().iter().map(|s| s.blocks).sum();
    let shared = Arc::new(Shared {
        dir: dir.clone(),
        db: identity.db,
        epoch: identity.epoch,
        incarnation,
        writer: Arc::new(Mutex::new(writer)),
        log: RwLock::new(opened.index),
        live: Arc::new(Mutex::new(live)),
        checkpoints: Mutex::new(checkpoints),
        view: RwLock::new(View { counters, ranks }),
        closing: AtomicBool::new(false),
    });
    shared.prune_log();
    let threads = Threads::start(&shared, &dir)?;

    let took = started.elapsed();
    metrics::histogram!("kv_relay_store_open_seconds").record(took.as_secs_f64());
    tracing::info!(
        dir = %dir.display(), epoch = shared.epoch, incarnation, newest, live_blocks = blocks,
        checkpoint = floor, replayed, cut_bytes = opened.cut, took_ms = took.as_millis() as u64, "store opened"
    );
    let (newest_tx, _) = watch::channel(newest);
    Ok(Store {
        inner: Arc::new(Inner {
            shared,
            limits: cfg.limits,
            policy: cfg.checkpoint,
            incarnations,
            recent: RwLock::new(recent::Recent::new(cfg.recent)),
            newest_tx,
            checkpoint_tx: Mutex::new(Some(threads.checkpoint_tx)),
            sync_tx: Mutex::new(Some(threads.sync_tx)),
            threads: Mutex::new(threads.handles),
        }),
    })
}

/// What recovery rebuilt: the live set and the ranks' positions at the newest cursor.
struct Recovered {
    /// The checkpoint they began from, if any.
    manifest: Option<Manifest>,
    live: LiveSet,
    ranks: BTreeMap<u32, RankCursor>,
    /// Records of the log applied after the checkpoint.
    replayed: u64,
}

/// The newest whole checkpoint, then every record of the log after its cursor. The log must
/// reach back to the record right after the checkpoint: else the live set cannot be rebuilt, and
/// the open fails rather than serve a wrong one.
fn recover(dir: &Path, index: &LogIndex, newest: u64) -> Result<Recovered, StoreError> {
    let decode_error = |what: &'static str, detail: String| StoreError::Decode { dir: dir.to_path_buf(), what, detail };
    let (manifest, mut live) = match checkpoint::load_newest(&checkpoint::folder(dir), newest)? {
        Some((m, live)) => (Some(m), live),
        None => (None, LiveSet::default()),
    };
    let floor = manifest.as_ref().map_or(0, |m| m.cursor);
    let mut ranks = manifest.as_ref().map(|m| m.ranks.clone()).unwrap_or_default();
    let log_oldest = index.oldest();
    if floor < newest && (log_oldest == 0 || log_oldest > floor + 1) {
        return Err(decode_error(
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
        index,
        floor + 1,
        &mut |cursor, bytes| {
            let rec =
                decode_record(bytes).map_err(|d| decode_error("history record", format!("cursor {cursor}: {d}")))?;
            live.apply(cursor, &rec.body);
            rank_after(ranks.entry(rank_of(&rec.body)).or_default(), cursor, &rec.body);
            replayed += 1;
            Ok(())
        },
        dir,
    )?;
    live.cursor = newest;
    Ok(Recovered { manifest, live, ranks, replayed })
}

/// The history: the newest records of the log within `limits`, always the newest one. Returns
/// its totals and its records' sizes, oldest first.
fn history_bounds(index: &LogIndex, newest: u64, limits: HistoryLimits) -> (Counters, VecDeque<u64>) {
    let all_sizes = index.sizes();
    let mut counters = Counters { newest, ..Counters::default() };
    if let Some(&last) = all_sizes.last() {
        counters.hist_batches = 1;
        counters.hist_bytes = last;
        for &size in all_sizes.iter().rev().skip(1) {
            if counters.hist_batches + 1 > limits.max_batches || counters.hist_bytes + size > limits.max_bytes {
                break;
            }
            counters.hist_batches += 1;
            counters.hist_bytes += size;
        }
        counters.oldest = newest + 1 - counters.hist_batches;
    }
    let sizes = all_sizes[all_sizes.len() - counters.hist_batches as usize..].iter().copied().collect();
    (counters, sizes)
}

/// Removes every checkpoint but the one loaded, and any file a crash left half written; returns
/// the id the next checkpoint takes (above every id found).
fn remove_stale_checkpoints(dir: &Path, loaded: Option<&Manifest>) -> Result<u64, StoreError> {
    let folder = checkpoint::folder(dir);
    let mut next_id = loaded.map_or(1, |m| m.id + 1);
    if let Ok((ids, other)) = checkpoint::list(&folder) {
        let io = |e| StoreError::io("remove a stale checkpoint", &folder, e);
        for id in ids {
            next_id = next_id.max(id + 1);
            if loaded.is_none_or(|m| m.id != id) {
                checkpoint::remove(&folder, id).map_err(io)?;
            }
        }
        for f in other {
            std::fs::remove_file(&f).map_err(io)?;
        }
    }
    Ok(next_id)
}

/// The store's two threads, and the senders that wake them (dropping one ends its thread).
struct Threads {
    checkpoint_tx: mpsc::SyncSender<()>,
    sync_tx: mpsc::SyncSender<()>,
    handles: Vec<JoinHandle<()>>,
}

impl Threads {
    /// The checkpoint thread writes a checkpoint each time a commit wakes it; the sync thread
    /// syncs the log every [`SYNC_EVERY`] and removes the log no one needs.
    fn start(shared: &Arc<Shared>, dir: &Path) -> Result<Threads, StoreError> {
        let spawn = |name: &str, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name.into())
                .spawn(f)
                .map_err(|e| StoreError::io("start the store's threads", dir, e))
        };
        let (checkpoint_tx, checkpoint_rx) = mpsc::sync_channel::<()>(1);
        let checkpointer = {
            let shared = shared.clone();
            spawn(
                "kv-relay-store-checkpoint",
                Box::new(move || {
                    while checkpoint_rx.recv().is_ok() {
                        checkpointer::run_checkpoint(&shared);
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
        Ok(Threads { checkpoint_tx, sync_tx, handles: vec![checkpointer, syncer] })
    }
}
