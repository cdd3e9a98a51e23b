//! Compact ids for workers and storage tiers, and the interners that hand them out.
//!
//! The index never sees a relay URL or a tier name: every entry packs a 23-bit worker id
//! and a 6-bit tier id into the upper half of one `u64` (see `table.rs`), so ids are dense
//! small integers handed out here.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

/// Errors of the prefix index. Only id exhaustion can fail: every block operation is total.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IndexError {
    /// More than [`WorkerId::MAX`]` + 1` distinct workers were interned.
    #[error("worker id space exhausted ({0} workers)")]
    TooManyWorkers(usize),
    /// More than [`TierId::LIMIT`] distinct tiers were interned.
    #[error("tier id space exhausted (at most {} tiers)", TierId::LIMIT)]
    TooManyTiers,
}

/// A worker: one DP rank of one engine, as seen through one relay.
///
/// Ids are dense from 0 when handed out by [`WorkerInterner`]; tests may also build them
/// directly with [`WorkerId::new`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WorkerId(u32);

impl WorkerId {
    /// The largest valid raw id (23 bits, the all-ones value is reserved for tombstones).
    pub const MAX: u32 = (1 << 23) - 2;

    /// `Some` when `raw <= WorkerId::MAX`.
    pub const fn new(raw: u32) -> Option<Self> {
        if raw <= Self::MAX {
            Some(Self(raw))
        } else {
            None
        }
    }

    /// The raw id.
    pub const fn get(self) -> u32 {
        self.0
    }
}

/// A storage tier: the four well-known ones, or an interned "other" tier name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TierId(u8);

impl TierId {
    /// GPU memory.
    pub const DEVICE: TierId = TierId(0);
    /// CPU memory (pinned or not).
    pub const HOST: TierId = TierId(1);
    /// Local disk.
    pub const DISK: TierId = TierId(2);
    /// An external store (e.g. a shared KV store).
    pub const EXTERNAL: TierId = TierId(3);
    /// How many tier ids exist (lookups keep one bit per tier in a `u64`).
    pub const LIMIT: usize = 64;

    /// `Some` when `raw < TierId::LIMIT`.
    pub const fn new(raw: u8) -> Option<Self> {
        if (raw as usize) < Self::LIMIT {
            Some(Self(raw))
        } else {
            None
        }
    }

    /// The raw id.
    pub const fn get(self) -> u8 {
        self.0
    }
}

/// Hands out [`WorkerId`]s keyed by `(relay_url, dp_rank)`. Ids are never reused.
///
/// Interning takes a mutex: callers are expected to intern once per worker and keep the id.
#[derive(Debug, Default)]
pub struct WorkerInterner {
    inner: Mutex<WorkerInner>,
}

#[derive(Debug, Default)]
struct WorkerInner {
    ids: HashMap<(Arc<str>, u32), WorkerId>,
    keys: Vec<(Arc<str>, u32)>,
}

impl WorkerInterner {
    /// The id of `(relay_url, dp_rank)`, allocating the next one on first sight.
    pub fn intern(&self, relay_url: &str, dp_rank: u32) -> Result<WorkerId, IndexError> {
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let key: (Arc<str>, u32) = (Arc::from(relay_url), dp_rank);
        if let Some(id) = inner.ids.get(&key) {
            return Ok(*id);
        }
        let raw = u32::try_from(inner.keys.len()).unwrap_or(u32::MAX);
        let id = WorkerId::new(raw).ok_or(IndexError::TooManyWorkers(inner.keys.len()))?;
        inner.keys.push(key.clone());
        inner.ids.insert(key, id);
        Ok(id)
    }

    /// The id of `(relay_url, dp_rank)` if it was interned.
    pub fn get(&self, relay_url: &str, dp_rank: u32) -> Option<WorkerId> {
        let inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        inner.ids.get(&(Arc::from(relay_url), dp_rank)).copied()
    }

    /// The `(relay_url, dp_rank)` an id was handed out for.
    pub fn key(&self, id: WorkerId) -> Option<(Arc<str>, u32)> {
        let inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        inner.keys.get(id.0 as usize).cloned()
    }

    /// How many workers were interned.
    pub fn len(&self) -> usize {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner).keys.len()
    }

    /// True when no worker was interned.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Hands out [`TierId`]s by name. `device`, `host`, `disk` and `external` are the fixed ids
/// 0..=3; any other name (the relay keeps unknown engine tiers as their string) gets the next id.
#[derive(Debug)]
pub struct TierInterner {
    names: Mutex<Vec<Arc<str>>>,
}

impl Default for TierInterner {
    fn default() -> Self {
        let names = ["device", "host", "disk", "external"].into_iter().map(Arc::from).collect();
        Self { names: Mutex::new(names) }
    }
}

impl TierInterner {
    /// The id of tier `name` (exact, case-sensitive), allocating one for a new "other" tier.
    pub fn intern(&self, name: &str) -> Result<TierId, IndexError> {
        let mut names = self.names.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(pos) = names.iter().position(|n| &**n == name) {
            return Ok(TierId(pos as u8));
        }
        if names.len() >= TierId::LIMIT {
            return Err(IndexError::TooManyTiers);
        }
        names.push(Arc::from(name));
        Ok(TierId((names.len() - 1) as u8))
    }

    /// Every tier's name, by id (one lock for all).
    pub fn names(&self) -> Vec<Arc<str>> {
        self.names.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// The name of a tier id, if it exists.
    pub fn name(&self, id: TierId) -> Option<Arc<str>> {
        let names = self.names.lock().unwrap_or_else(PoisonError::into_inner);
        names.get(id.0 as usize).cloned()
    }
}
