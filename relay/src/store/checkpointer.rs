//! The checkpoint thread: woken by a commit once a checkpoint is due ([`super::CheckpointPolicy`]),
//! it writes the live set at one cursor beside commits, then lets the previous checkpoint and the
//! log it covers go.

use super::error::{count, StoreError};
use super::{checkpoint, CheckpointState, Shared, Snapshot, SnapshotFilter, Store};
use crate::sync::Locked;
use std::sync::atomic::Ordering;
use std::time::Instant;

impl Store {
    /// Writes a checkpoint now, in this thread, and waits for it (tests, `relayctl`-free tools).
    /// Commits go on meanwhile; a checkpoint already being written by the background thread is
    /// waited for first.
    pub fn checkpoint_now(&self) -> Result<CheckpointState, StoreError> {
        let sh = &*self.inner.shared;
        loop {
            let mut c = sh.checkpoints.locked();
            if !c.running {
                c.running = true;
                break;
            }
            drop(c);
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        checkpoint_once(sh)
    }
}

/// The checkpoint thread's work when woken: one checkpoint, its failure counted and logged.
pub(super) fn run_checkpoint(sh: &Shared) {
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
    sh.checkpoints.locked().running = false;
    out
}

fn write_checkpoint(sh: &Shared) -> Result<CheckpointState, StoreError> {
    let started = Instant::now();
    let dir = &sh.dir;
    // The snapshot is registered under the commit lock, so the log's position, the ranks' and
    // the live set's cursor are the same.
    let (snap, ranks, id) = {
        let w = sh.writer.locked();
        w.usable("checkpoint", dir)?;
        let snap = Snapshot::open(&sh.live, &SnapshotFilter::all(), sh.epoch, sh.incarnation);
        let mut c = sh.checkpoints.locked();
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
        let mut c = sh.checkpoints.locked();
        c.last.replace(CheckpointState { id: m.id, cursor: m.cursor, bytes: m.bytes })
    };
    sh.writer.locked().floor = m.cursor;
    if let Some(old) = previous {
        if let Err(e) = checkpoint::remove(&folder, old.id) {
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
