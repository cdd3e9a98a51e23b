//! The store's identity, kept in sled: its format version, its epoch (random, made when the store
//! was created) and its incarnations (one per open, each with the first cursor it could commit).
//!
//! A sled directory that cannot be read, or that has no format or epoch, is set aside with the
//! files that belong to it (`unreadable-<unix ms>`), and a new store with a new epoch is made.
//! A store of a newer format is refused. A format-1 store is upgraded here ([`super::v1`]).

use super::error::StoreError;
use super::{checkpoint, log, v1};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The on-disk format this build writes and reads; format 1 is upgraded on open, any other is
/// refused.
pub const FORMAT_VERSION: u32 = 2;

/// How long an open waits for the store's file lock: a store just closed (in this process, or
/// by a relay still exiting) releases it when sled's background threads have stopped.
const LOCK_WAIT: Duration = Duration::from_secs(5);

/// The store's identity, opened.
pub(super) struct Identity {
    pub db: sled::Db,
    pub meta: sled::Tree,
    pub epoch: u64,
}

impl Identity {
    /// Opens sled in `dir/sled` (setting aside one that cannot be read), refuses a newer format,
    /// upgrades a format-1 store, and gives a new store its format and epoch.
    pub fn open(dir: &Path, cache_bytes: u64, segment_bytes: u64) -> Result<Identity, StoreError> {
        let sled_error = |e| StoreError::sled("open", dir, e);
        let (db, meta, data) = open_readable(dir, cache_bytes)?;
        if meta.get("format").map_err(sled_error)?.as_deref() == Some(&1u32.to_be_bytes()[..]) {
            v1::redo::apply_redo(dir, &db, &data)?;
            v1::upgrade(dir, &db, &meta, &data, segment_bytes)?;
        }
        if !data.is_empty() {
            let keys = data.len();
            data.clear().map_err(sled_error)?;
            db.flush().map_err(sled_error)?;
            tracing::info!(dir = %dir.display(), keys, "removed format 1's keys left after the upgrade");
        }
        let epoch = match meta_u64(&meta, "epoch").map_err(sled_error)? {
            Some(e) => e,
            None => new_epoch(dir, &db, &meta)?,
        };
        Ok(Identity { db, meta, epoch })
    }

    /// Records this open as the next incarnation, whose first cursor is `newest + 1`; returns
    /// it and every incarnation's first cursor.
    pub fn begin_incarnation(&self, dir: &Path, newest: u64) -> Result<(u32, BTreeMap<u32, u64>), StoreError> {
        let sled_error = |e| StoreError::sled("open", dir, e);
        let meta = &self.meta;
        let last = meta.get("incarnation").map_err(sled_error)?.and_then(|v| <[u8; 4]>::try_from(v.as_ref()).ok());
        let incarnation = last.map(u32::from_be_bytes).unwrap_or(0) + 1;
        let mut b = sled::Batch::default();
        b.insert("incarnation", &incarnation.to_be_bytes());
        let mut key = b"i".to_vec();
        key.extend_from_slice(&incarnation.to_be_bytes());
        b.insert(key, &(newest + 1).to_be_bytes());
        meta.apply_batch(b).map_err(sled_error)?;
        self.db.flush().map_err(sled_error)?;
        let mut incarnations = BTreeMap::new();
        for kv in meta.scan_prefix("i") {
            let (k, v) = kv.map_err(sled_error)?;
            if let (Ok(i), Ok(c)) = (<[u8; 4]>::try_from(&k[1..]), <[u8; 8]>::try_from(v.as_ref())) {
                incarnations.insert(u32::from_be_bytes(i), u64::from_be_bytes(c));
            }
        }
        Ok((incarnation, incarnations))
    }
}

/// sled opened with its `meta` and `data` trees, holding a format this build reads (or nothing):
/// a directory sled cannot read, or without a format or epoch, is set aside and made anew.
fn open_readable(dir: &Path, cache_bytes: u64) -> Result<(sled::Db, sled::Tree, sled::Tree), StoreError> {
    let sled_error = |e| StoreError::sled("open", dir, e);
    let sled_dir = dir.join("sled");
    let db = match open_sled(&sled_dir, cache_bytes) {
        Ok(db) => db,
        Err(e @ (sled::Error::Corruption { .. } | sled::Error::ReportableBug(_))) => {
            set_aside(dir, &sled_dir, &e.to_string())?;
            open_sled(&sled_dir, cache_bytes).map_err(sled_error)?
        }
        Err(e) => return Err(sled_error(e)),
    };
    let meta = db.open_tree("meta").map_err(sled_error)?;
    let data = db.open_tree("data").map_err(sled_error)?;
    let format = meta.get("format").map_err(sled_error)?;
    let readable = match &format {
        None => data.is_empty() && meta.is_empty(),
        Some(v) => v.len() == 4 && meta_u64(&meta, "epoch").map_err(sled_error)?.is_some(),
    };
    if let Some(v) = format.as_deref().filter(|v| v.len() == 4) {
        let found = u32::from_be_bytes([v[0], v[1], v[2], v[3]]);
        if found > FORMAT_VERSION || found == 0 {
            return Err(StoreError::IncompatibleFormat { dir: dir.to_path_buf(), found, supported: FORMAT_VERSION });
        }
    }
    if readable {
        return Ok((db, meta, data));
    }
    drop((meta, data, db));
    set_aside(dir, &sled_dir, "no format version or epoch")?;
    let db = open_sled(&sled_dir, cache_bytes).map_err(sled_error)?;
    let meta = db.open_tree("meta").map_err(sled_error)?;
    let data = db.open_tree("data").map_err(sled_error)?;
    Ok((db, meta, data))
}

/// A new store: its format and a random nonzero epoch, flushed. A log or checkpoints found
/// beside it belong to another store, and are set aside first.
fn new_epoch(dir: &Path, db: &sled::Db, meta: &sled::Tree) -> Result<u64, StoreError> {
    let sled_error = |e| StoreError::sled("open", dir, e);
    if [log::LOG_DIR, checkpoint::FOLDER].iter().any(|n| dir.join(n).exists()) {
        let to = aside_dir(dir);
        tracing::warn!(dir = %dir.display(), moved_to = %to.display(),
            "a log or checkpoints without the store they belong to: set aside");
        move_files_aside(dir, &to)?;
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
    meta.apply_batch(b).map_err(sled_error)?;
    db.flush().map_err(sled_error)?;
    Ok(epoch)
}

fn meta_u64(meta: &sled::Tree, key: &str) -> Result<Option<u64>, sled::Error> {
    Ok(meta.get(key)?.and_then(|v| <[u8; 8]>::try_from(v.as_ref()).ok()).map(u64::from_be_bytes))
}

fn open_sled(dir: &Path, cache_bytes: u64) -> Result<sled::Db, sled::Error> {
    let started = Instant::now();
    loop {
        match sled::Config::new().path(dir).cache_capacity(cache_bytes).open() {
            Err(sled::Error::Io(e))
                if e.to_string().contains("could not acquire lock") && started.elapsed() < LOCK_WAIT =>
            {
                std::thread::sleep(Duration::from_millis(20));
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
    for name in [v1::redo::REDO_FILE, log::LOG_DIR, checkpoint::FOLDER] {
        match std::fs::rename(dir.join(name), to.join(name)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(StoreError::io("set aside an unreadable store's files", dir, e))
            }
            _ => {}
        }
    }
    Ok(())
}
