//! Consistent snapshots of the live blocks, read in chunks from a spill file.
//!
//! sled has no point-in-time reads. [`super::Store::snapshot`] takes the cursor and opens a
//! *journal* under the commit lock (the only pause commits see, [`Snapshot::pause`]), then copies
//! the selected live entries, raw, into an anonymous temporary file in `<dir>/spill/` (already
//! unlinked: nothing is left behind by a crash) while commits go on. Each commit meanwhile puts in
//! the journal, before it writes, the value at the cursor of every selected key it changes for the
//! first time (the sweeper does the same for the dead keys it removes). With the journal closed, a
//! second pass merges the copy with it into a second file: the state at exactly the cursor. The
//! journal holds only the keys written during the copy; the copy goes through 1 MiB buffers and
//! the reader holds one chunk.

use super::codec::{parse_group_key, LiveValue, Reader};
use super::error::{count, StoreError};
use crate::model::{Namespace, Tier, TokenLayout};
use sled::IVec;
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::PathBuf;
use std::time::Duration;

/// Which live blocks a snapshot holds.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SnapshotFilter {
    /// Only these ranks (`None`: all).
    pub ranks: Option<Vec<u32>>,
    /// Only these tiers (`None`: all).
    pub tiers: Option<Vec<Tier>>,
    /// Carry each block's token ids (they are most of a snapshot's size).
    pub include_token_ids: bool,
}

impl SnapshotFilter {
    /// Every block, with token ids.
    pub fn all() -> Self {
        SnapshotFilter { ranks: None, tiers: None, include_token_ids: true }
    }

    pub(crate) fn wants_rank(&self, r: u32) -> bool {
        self.ranks.as_ref().is_none_or(|rs| rs.contains(&r))
    }

    pub(crate) fn wants_tier(&self, t: &Tier) -> bool {
        self.tiers.as_ref().is_none_or(|ts| ts.contains(t))
    }
}

/// One live block as of the snapshot's cursor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotBlock {
    pub dp_rank: u32,
    pub tier: Tier,
    pub group: u32,
    pub hash: u64,
    /// The block before it in its sequence, as the latest store of this block said.
    pub parent: Option<u64>,
    pub block_size: u32,
    pub namespace: Namespace,
    /// Physical copies held (at least 1).
    pub copies: u32,
    /// Empty when the filter left them out or the engine sent none.
    pub token_ids: Vec<u32>,
    pub token_layout: TokenLayout,
}

/// The live blocks at exactly [`Snapshot::cursor`], in (rank, tier, group, hash) order, yielded
/// in chunks of at most [`Snapshot::chunk_blocks`] blocks.
pub struct Snapshot {
    /// Every commit up to and including this cursor is in the snapshot, and none after it.
    pub cursor: u64,
    pub epoch: u64,
    pub incarnation: u32,
    /// Blocks in the snapshot.
    pub blocks: u64,
    /// How long commits waited for the snapshot: while its cursor was taken, not while it was copied.
    pub pause: Duration,
    /// Blocks per chunk (default 1,024).
    pub chunk_blocks: usize,
    pub(crate) include_token_ids: bool,
    pub(crate) remaining: u64,
    pub(crate) reader: BufReader<File>,
    pub(crate) dir: PathBuf,
}

impl std::fmt::Debug for Snapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Snapshot")
            .field("cursor", &self.cursor)
            .field("epoch", &self.epoch)
            .field("blocks", &self.blocks)
            .field("remaining", &self.remaining)
            .finish()
    }
}

/// Writes one raw live entry to the spill file: key and value, each with a 4-byte length.
pub(crate) fn spill_entry(w: &mut BufWriter<File>, key: &[u8], value: &[u8]) -> std::io::Result<()> {
    w.write_all(&(key.len() as u32).to_le_bytes())?;
    w.write_all(key)?;
    w.write_all(&(value.len() as u32).to_le_bytes())?;
    w.write_all(value)
}

/// Rewinds the spill file for reading.
pub(crate) fn rewind(w: BufWriter<File>) -> std::io::Result<BufReader<File>> {
    let mut f = w.into_inner().map_err(|e| e.into_error())?;
    f.seek(SeekFrom::Start(0))?;
    Ok(BufReader::with_capacity(1 << 20, f))
}

/// Reads one entry written by [`spill_entry`]; `None` at the end of the file.
fn read_entry(r: &mut BufReader<File>) -> std::io::Result<Option<(Vec<u8>, Vec<u8>)>> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len) {
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        other => other?,
    }
    let mut key = vec![0u8; u32::from_le_bytes(len) as usize];
    r.read_exact(&mut key)?;
    r.read_exact(&mut len)?;
    let mut value = vec![0u8; u32::from_le_bytes(len) as usize];
    r.read_exact(&mut value)?;
    Ok(Some((key, value)))
}

/// The raw copy of a snapshot, read back in order with one entry of look-ahead.
pub(crate) struct SpillReader {
    r: BufReader<File>,
    peeked: Option<(Vec<u8>, Vec<u8>)>,
}

impl SpillReader {
    pub(crate) fn new(r: BufReader<File>) -> Self {
        SpillReader { r, peeked: None }
    }

    /// The next entry's key, if it starts with `prefix`.
    fn next_key_in(&mut self, prefix: &[u8]) -> std::io::Result<Option<&[u8]>> {
        if self.peeked.is_none() {
            self.peeked = read_entry(&mut self.r)?;
        }
        Ok(self.peeked.as_ref().map(|(k, _)| k.as_slice()).filter(|k| k.starts_with(prefix)))
    }

    fn take(&mut self) -> (Vec<u8>, Vec<u8>) {
        self.peeked.take().expect("an entry was peeked")
    }
}

/// Writes the entries of one prefix as they were at the snapshot's cursor: the raw copy's, with
/// the values `before` kept for the keys written while it was made (`None`: the key was not
/// there). Both are in key order; returns the number of entries written.
pub(crate) fn merge_prefix(
    raw: &mut SpillReader,
    before: &BTreeMap<Vec<u8>, Option<IVec>>,
    prefix: &[u8],
    out: &mut BufWriter<File>,
) -> std::io::Result<u64> {
    let mut journal = before.range(prefix.to_vec()..).take_while(|(k, _)| k.starts_with(prefix)).peekable();
    let mut n = 0u64;
    loop {
        let from_raw = match (raw.next_key_in(prefix)?, journal.peek()) {
            (None, None) => return Ok(n),
            (Some(k), Some((jk, _))) => k <= jk.as_slice(),
            (Some(_), None) => true,
            (None, Some(_)) => false,
        };
        if from_raw {
            let (k, v) = raw.take();
            match journal.next_if(|(jk, _)| **jk == k) {
                Some((_, Some(at_cursor))) => spill_entry(out, &k, at_cursor)?,
                Some((_, None)) => continue,
                None => spill_entry(out, &k, &v)?,
            }
        } else {
            match journal.next() {
                Some((k, Some(at_cursor))) => spill_entry(out, k, at_cursor)?,
                _ => continue,
            }
        }
        n += 1;
    }
}

impl Snapshot {
    fn read_one(&mut self) -> Result<SnapshotBlock, StoreError> {
        let io = |e| StoreError::io("snapshot read", &self.dir, e);
        let (key, value) =
            read_entry(&mut self.reader).map_err(io)?.ok_or_else(|| io(std::io::ErrorKind::UnexpectedEof.into()))?;
        let bad =
            || StoreError::Decode { dir: self.dir.clone(), what: "live block", detail: format!("key {key:02x?}") };
        let (g, rest) = parse_group_key(&key).ok_or_else(bad)?;
        let hash = Reader::new(rest).u64_be().ok_or_else(bad)?;
        let v = LiveValue::decode(&value, self.include_token_ids).ok_or_else(bad)?;
        Ok(SnapshotBlock {
            dp_rank: g.dp_rank,
            tier: g.tier,
            group: g.group,
            hash,
            parent: v.parent,
            block_size: v.block_size,
            namespace: v.namespace,
            copies: v.copies,
            token_ids: v.token_ids,
            token_layout: v.layout,
        })
    }
}

impl Iterator for Snapshot {
    type Item = Result<Vec<SnapshotBlock>, StoreError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.remaining == 0 {
            return None;
        }
        let n = (self.chunk_blocks.max(1) as u64).min(self.remaining);
        let mut chunk = Vec::with_capacity(n as usize);
        for _ in 0..n {
            match self.read_one() {
                Ok(b) => chunk.push(b),
                Err(e) => {
                    self.remaining = 0;
                    return Some(Err(count("snapshot", e)));
                }
            }
        }
        self.remaining -= n;
        Some(Ok(chunk))
    }
}
