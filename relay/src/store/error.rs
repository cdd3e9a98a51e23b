//! The store's errors, and the metric that counts them.

use std::io;
use std::path::{Path, PathBuf};

/// What can go wrong in the durable store. Messages are lowercase and name the directory.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The directory holds a store written in a format this build does not read.
    #[error(
        "store in {dir} has format version {found}, this relay reads versions 1 to {supported} (it upgrades \
         version 1): refusing to open it (move the directory aside to start a new store)"
    )]
    IncompatibleFormat { dir: PathBuf, found: u32, supported: u32 },
    /// Another process (or another `Store` in this one) has the directory open.
    #[error("store in {dir} is in use by another process")]
    Locked { dir: PathBuf },
    /// The disk is full. What the failed write began is undone: the store stays usable, and the
    /// write can be tried again once there is room (see the log's "A failed write").
    #[error(
        "disk full in {dir} during {op}: free space in the state directory (every commit before this one is kept)"
    )]
    DiskFull { op: &'static str, dir: PathBuf },
    /// The directory cannot be written.
    #[error("store directory {dir} is read-only or not writable (during {op}): {source}")]
    ReadOnly {
        op: &'static str,
        dir: PathBuf,
        #[source]
        source: io::Error,
    },
    /// Any other I/O error.
    #[error("i/o error in {dir} during {op}: {source}")]
    Io {
        op: &'static str,
        dir: PathBuf,
        #[source]
        source: io::Error,
    },
    /// A stored value this build cannot decode (never expected within a supported format).
    #[error("store in {dir} holds an undecodable {what}: {detail}")]
    Decode { dir: PathBuf, what: &'static str, detail: String },
    /// A record or event the store cannot hold (for example a tier name longer than 65,535 bytes).
    #[error("cannot store this {what}: {detail}")]
    Invalid { what: &'static str, detail: String },
    /// An earlier write or sync failed in a way only a reopen repairs: the store refuses further
    /// writes (the reopened store holds every commit whose frame is whole on disk).
    #[error("store in {dir} failed earlier ({first}) and must be reopened")]
    Failed { dir: PathBuf, first: String },
    /// sled reported corruption or a bug.
    #[error("store in {dir} failed during {op}: {detail}")]
    Sled { op: &'static str, dir: PathBuf, detail: String },
}

impl StoreError {
    /// Maps an I/O error by its kind.
    pub(crate) fn io(op: &'static str, dir: &Path, e: io::Error) -> StoreError {
        let dir = dir.to_path_buf();
        match e.kind() {
            io::ErrorKind::StorageFull | io::ErrorKind::QuotaExceeded => StoreError::DiskFull { op, dir },
            io::ErrorKind::ReadOnlyFilesystem | io::ErrorKind::PermissionDenied => {
                StoreError::ReadOnly { op, dir, source: e }
            }
            _ if e.raw_os_error() == Some(28) => StoreError::DiskFull { op, dir },
            _ => StoreError::Io { op, dir, source: e },
        }
    }

    /// Maps a sled error.
    pub(crate) fn sled(op: &'static str, dir: &Path, e: sled::Error) -> StoreError {
        match e {
            sled::Error::Io(io) => {
                if io.to_string().contains("could not acquire lock") {
                    StoreError::Locked { dir: dir.to_path_buf() }
                } else {
                    StoreError::io(op, dir, io)
                }
            }
            other => StoreError::Sled { op, dir: dir.to_path_buf(), detail: other.to_string() },
        }
    }

    /// The error's short label (the `kind` of a log line).
    pub fn label(&self) -> &'static str {
        match self {
            StoreError::IncompatibleFormat { .. } => "incompatible_format",
            StoreError::Locked { .. } => "locked",
            StoreError::DiskFull { .. } => "disk_full",
            StoreError::ReadOnly { .. } => "read_only",
            StoreError::Io { .. } => "io",
            StoreError::Decode { .. } => "decode",
            StoreError::Invalid { .. } => "invalid",
            StoreError::Failed { .. } => "failed",
            StoreError::Sled { .. } => "sled",
        }
    }
}

/// Counts one error of an operation in `kv_relay_store_errors_total{op}`.
pub(crate) fn count(op: &'static str, e: StoreError) -> StoreError {
    metrics::counter!("kv_relay_store_errors_total", "op" => op).increment(1);
    tracing::warn!(op, kind = e.label(), error = %e, "store error");
    e
}
