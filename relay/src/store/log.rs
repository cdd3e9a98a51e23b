//! The log: the history of committed records, appended to segment files in `log/` in the state
//! directory, each committed group of records one frame written with one `write`; where each
//! record is ([`LogIndex`], shared with readers); and the commit lock's state ([`Writer`]),
//! through which every write of the log goes.
//!
//! # Files
//! A segment is `log/<first cursor, 20 digits>.log`: a header (the magic `KVRLOG02` and the
//! store's epoch, u64 LE), then frames. A frame is a group of records at consecutive cursors:
//! its payload's length (u32 LE), the payload's CRC-32 (u32 LE), and the payload: the first
//! cursor (u64 LE), then per record its length (u32 LE) and its bytes (`codec::encode_record`).
//! A new segment is begun once the active one holds [`super::StoreConfig::segment_bytes`]: the
//! active one is synced first, the new one is written as a temporary file with its header,
//! synced and renamed into place, and the directory synced, so only the last segment can end in
//! a frame that was not written whole.
//!
//! # Durability
//! A frame is in the kernel once its `write` returned: a killed relay loses nothing committed.
//! The kernel writes it to the disk within [`SYNC_EVERY`] (a background thread syncs the active
//! segment), at [`super::Store::flush`], and before a checkpoint counts; a power loss can lose
//! what was not synced yet, and the next open cuts the log at its first frame that does not
//! read back whole (see "Crash protocol" in `mod.rs`).
//!
//! # A failed write
//! When a frame's write fails (a full disk, a read-only remount), the segment is cut back to
//! where the frame began and the commit fails with the error: nothing of it was committed or
//! published, the store stays usable, and the caller retries. Only when the cut fails too, or a
//! sync fails (after which the kernel's copy of the file cannot be trusted), does the store fail:
//! it refuses writes until it is reopened, and the reopen cuts the log after its last whole frame.
//!
//! # Two bounds on the log
//! - The *history* is what subscribers can resume from: the newest records within
//!   [`super::HistoryLimits`] (`Counters::oldest` to `newest`). A record past the bounds leaves
//!   the history at once.
//! - The log on disk (`Counters::kept_from` to `newest`) also keeps every record the newest
//!   durable checkpoint does not cover (after its cursor, [`Writer::floor`]), whatever the bounds
//!   say: recovery is that checkpoint plus the log after it. A segment is removed once every
//!   record in it is before both ([`Writer::prune`]).

use super::codec::Counters;
use super::error::{count, StoreError};
use super::types::{HistoryLimits, RankCursor};
use crate::sync::ReadWrite;
use std::collections::{BTreeMap, VecDeque};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

/// The folder of log segments in a state directory.
pub(crate) const LOG_DIR: &str = "log";
const MAGIC: &[u8; 8] = b"KVRLOG02";
const HEADER: u64 = 16;
/// A frame's length and CRC.
const FRAME_HEAD: usize = 8;
/// The largest frame read back (a group of records is far smaller: see `COMMIT_GROUP`).
const MAX_FRAME: u32 = 1 << 30;

/// How often the background thread syncs the active segment.
pub const SYNC_EVERY: std::time::Duration = std::time::Duration::from_millis(500);

fn segment_path(folder: &Path, first: u64) -> PathBuf {
    folder.join(format!("{first:020}.log"))
}

/// One segment file, shared by the writer and readers (a removed segment stays readable by a
/// reader that holds it).
#[derive(Debug)]
pub(crate) struct Segment {
    pub first: u64,
    pub file: Arc<File>,
}

/// Where each record of the log is, for readers: the segments oldest first, and per cursor
/// from `start` the record's offset and length in its segment.
#[derive(Debug, Default)]
pub(crate) struct LogIndex {
    segments: VecDeque<Segment>,
    start: u64,
    entries: VecDeque<(u64, u32)>,
}

impl LogIndex {
    /// Where records `from..` are, up to `limit` of them: (segment file, offset, length).
    pub(crate) fn locate(&self, from: u64, limit: usize) -> Vec<(Arc<File>, u64, u32)> {
        let Some(skip) = from.checked_sub(self.start) else { return self.locate(self.start, limit) };
        let mut out = Vec::new();
        for (i, &(off, len)) in self.entries.iter().enumerate().skip(skip as usize).take(limit) {
            let cursor = self.start + i as u64;
            let seg = self.segments.partition_point(|s| s.first <= cursor).saturating_sub(1);
            out.push((self.segments[seg].file.clone(), off, len));
        }
        out
    }

    /// Whether a segment can be removed when the log must keep `keep` on.
    pub(crate) fn removable(&self, keep: u64) -> bool {
        self.segments.get(1).is_some_and(|s| s.first <= keep)
    }

    /// The size of each record, oldest first.
    pub(crate) fn sizes(&self) -> Vec<u64> {
        self.entries.iter().map(|&(_, l)| u64::from(l)).collect()
    }

    /// The oldest cursor on disk (0: none).
    pub(crate) fn oldest(&self) -> u64 {
        if self.entries.is_empty() {
            0
        } else {
            self.start
        }
    }
}

/// What [`replay`] calls for each record: its cursor and bytes.
pub(crate) type ReplayFn<'a> = dyn FnMut(u64, &[u8]) -> Result<(), StoreError> + 'a;

/// Reads the log's records from cursor `from` on, oldest first: `each(cursor, record bytes)`.
pub(crate) fn replay(index: &LogIndex, from: u64, each: &mut ReplayFn<'_>, dir: &Path) -> Result<(), StoreError> {
    let from = from.max(index.start);
    let mut b = Vec::new();
    for (i, (f, off, len)) in index.locate(from, usize::MAX).into_iter().enumerate() {
        b.resize(len as usize, 0);
        f.read_exact_at(&mut b, off).map_err(|e| StoreError::io("read the log", dir, e))?;
        each(from + i as u64, &b)?;
    }
    Ok(())
}

/// Reads the records `locate` found.
pub(crate) fn read_located(found: &[(Arc<File>, u64, u32)]) -> std::io::Result<Vec<Vec<u8>>> {
    found
        .iter()
        .map(|(f, off, len)| {
            let mut b = vec![0u8; *len as usize];
            f.read_exact_at(&mut b, *off).map(|()| b)
        })
        .collect()
}

/// The active segment, written under the commit lock.
pub(crate) struct Active {
    folder: PathBuf,
    epoch: u64,
    file: Arc<File>,
    first: u64,
    len: u64,
    segment_bytes: u64,
    /// Written since the last sync.
    pub dirty: bool,
    /// Segments ended since the last sync, not synced yet.
    unsynced: Vec<Arc<File>>,
}

/// What an open found in the log.
pub(crate) struct Opened {
    pub active: Active,
    pub index: LogIndex,
    /// The newest cursor in the log (0: none), and the first a commit may take.
    pub newest: u64,
    /// Bytes cut from the last segment's end: a frame not written whole.
    pub cut: u64,
}

/// A new segment beginning at cursor `first`, with its header. Not synced: the next sync of the
/// log syncs it and the folder (see [`Active::take_unsynced`]); a power loss before that leaves
/// a segment without its header, or none, which an open takes for the log's end.
fn create_segment(folder: &Path, epoch: u64, first: u64) -> std::io::Result<File> {
    let path = segment_path(folder, first);
    let f = std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(&path)?;
    let mut h = MAGIC.to_vec();
    h.extend_from_slice(&epoch.to_le_bytes());
    if let Err(e) = f.write_all_at(&h, 0) {
        let _ = std::fs::remove_file(&path);
        return Err(e);
    }
    Ok(f)
}

/// The segments in `folder` by first cursor; temporary files a crash left are removed.
fn list(folder: &Path) -> std::io::Result<Vec<u64>> {
    let mut firsts = Vec::new();
    for e in std::fs::read_dir(folder)? {
        let e = e?;
        let name = e.file_name();
        let name = name.to_string_lossy();
        match name.strip_suffix(".log").and_then(|n| n.parse::<u64>().ok()) {
            Some(first) => firsts.push(first),
            None if name.ends_with(".log.tmp") => std::fs::remove_file(e.path())?,
            None => {}
        }
    }
    firsts.sort_unstable();
    Ok(firsts)
}

/// Begins a frame at cursor `first` in `out` (cleared): records follow with [`push_record`],
/// and [`end_frame`] ends it.
pub(crate) fn begin_frame(out: &mut Vec<u8>, first: u64) {
    out.clear();
    out.extend_from_slice(&[0u8; FRAME_HEAD]);
    out.extend_from_slice(&first.to_le_bytes());
}

/// Adds a record to the frame in `out`: its offset in the frame and length.
pub(crate) fn push_record(out: &mut Vec<u8>, record: &[u8]) -> (u64, u32) {
    out.extend_from_slice(&(record.len() as u32).to_le_bytes());
    let at = out.len() as u64;
    out.extend_from_slice(record);
    (at, record.len() as u32)
}

/// Sets the frame's length and CRC.
pub(crate) fn end_frame(out: &mut [u8]) {
    let payload = &out[FRAME_HEAD..];
    let (len, crc) = (payload.len() as u32, crc32fast::hash(payload));
    out[..4].copy_from_slice(&len.to_le_bytes());
    out[4..8].copy_from_slice(&crc.to_le_bytes());
}

/// A frame read back: its first cursor, each record's offset (in the bytes read) and length,
/// and the frame's length.
struct Frame {
    first: u64,
    records: Vec<(usize, u32)>,
    len: usize,
}

/// The frame at the start of `b`, or why it is not a whole frame.
fn decode_frame(b: &[u8]) -> Result<Frame, String> {
    if b.len() < FRAME_HEAD {
        return Err(format!("{} bytes, too short for a frame", b.len()));
    }
    let len = u32::from_le_bytes(b[..4].try_into().expect("4 bytes"));
    let crc = u32::from_le_bytes(b[4..8].try_into().expect("4 bytes"));
    if !(8..=MAX_FRAME).contains(&len) {
        return Err(format!("a frame of {len} bytes"));
    }
    let end = FRAME_HEAD + len as usize;
    let Some(payload) = b.get(FRAME_HEAD..end) else {
        return Err(format!("a frame of {len} bytes cut at {}", b.len() - FRAME_HEAD));
    };
    if crc32fast::hash(payload) != crc {
        return Err("a frame that does not match its checksum".into());
    }
    let first = u64::from_le_bytes(payload[..8].try_into().expect("8 bytes"));
    let mut at = 8;
    let mut records = Vec::new();
    while at < payload.len() {
        let l = payload.get(at..at + 4).ok_or("a record length cut short")?;
        let l = u32::from_le_bytes(l.try_into().expect("4 bytes"));
        let from = at + 4;
        if payload.len() - from < l as usize {
            return Err(format!("a record of {l} bytes past its frame's end"));
        }
        records.push((FRAME_HEAD + from, l));
        at = from + l as usize;
    }
    if records.is_empty() {
        return Err("a frame without records".into());
    }
    Ok(Frame { first, records, len: end })
}

/// Opens the log in `state_dir`, creating it when there is none (its first cursor then
/// `next`), and checks every frame of it. The log is cut at its first frame that does not read
/// back whole (a write a crash or a power loss left in part), and the segments after it are
/// removed: what is left is a prefix of the commits. A segment of another store, or one whose
/// cursors do not run on from the one before, is an error. Its records are read with [`replay`].
pub(crate) fn open(state_dir: &Path, epoch: u64, segment_bytes: u64, next: u64) -> Result<Opened, StoreError> {
    let folder = state_dir.join(LOG_DIR);
    let io = |e| StoreError::io("open the log", &folder, e);
    let decode_error = |detail: String| StoreError::Decode { dir: state_dir.to_path_buf(), what: "log", detail };
    std::fs::create_dir_all(&folder).map_err(io)?;
    let mut firsts = list(&folder).map_err(io)?;
    if firsts.is_empty() {
        create_segment(&folder, epoch, next).map_err(io)?;
        firsts.push(next);
    }
    let mut index = LogIndex { start: firsts[0], ..LogIndex::default() };
    let mut expect = firsts[0];
    let mut cut = 0u64;
    let mut last_len = 0;
    for (n, &first) in firsts.iter().enumerate() {
        let path = segment_path(&folder, first);
        let name = path.display();
        if first != expect {
            return Err(decode_error(format!("segment {name} begins at cursor {first}, where {expect} was expected")));
        }
        let file = std::fs::OpenOptions::new().read(true).write(true).open(&path).map_err(io)?;
        let mut b = Vec::new();
        std::io::Read::read_to_end(&mut &file, &mut b).map_err(io)?;
        // A header a power loss left unwritten (the file is made without a sync): no records.
        let torn_header = b.len() < HEADER as usize || b[..HEADER as usize].iter().all(|&x| x == 0);
        if torn_header && n > 0 {
            cut += remove_from(&folder, &firsts[n..]).map_err(io)?;
            tracing::warn!(segment = %name, "the log's last segments were not written: removed");
            break;
        }
        if torn_header {
            let mut h = MAGIC.to_vec();
            h.extend_from_slice(&epoch.to_le_bytes());
            file.set_len(0).and_then(|()| file.write_all_at(&h, 0)).and_then(|()| file.sync_all()).map_err(io)?;
            b = h;
        }
        if &b[..8] != MAGIC {
            return Err(decode_error(format!("segment {name} is not a log segment (bad header)")));
        }
        let theirs = u64::from_le_bytes(b[8..16].try_into().expect("8 bytes"));
        if theirs != epoch {
            return Err(decode_error(format!("segment {name} belongs to the store of epoch {theirs}, not {epoch}")));
        }
        let mut at = HEADER as usize;
        let mut torn = None;
        while at < b.len() {
            match decode_frame(&b[at..]) {
                Ok(f) if f.first == expect => {
                    for (off, l) in f.records {
                        index.entries.push_back(((at + off) as u64, l));
                        expect += 1;
                    }
                    at += f.len;
                }
                Ok(f) => {
                    torn = Some(format!("a frame of cursor {} where {expect} was expected", f.first));
                    break;
                }
                Err(why) => {
                    torn = Some(why);
                    break;
                }
            }
        }
        index.segments.push_back(Segment { first, file: Arc::new(file) });
        last_len = at as u64;
        if let Some(why) = torn {
            let bytes = (b.len() - at) as u64;
            let later = remove_from(&folder, &firsts[n + 1..]).map_err(io)?;
            cut += bytes + later;
            tracing::warn!(segment = %name, at, bytes, later_segments = firsts.len() - n - 1, why,
                "cutting the log after its last whole frame: a write a crash or power loss left in part");
            let f = &index.segments.back().expect("just pushed").file;
            f.set_len(at as u64).and_then(|()| f.sync_all()).map_err(io)?;
            break;
        }
    }
    let newest = expect - 1;
    let seg = index.segments.back().expect("one segment at least");
    let active = Active {
        folder,
        epoch,
        file: seg.file.clone(),
        first: seg.first,
        len: last_len,
        segment_bytes: segment_bytes.max(1),
        dirty: false,
        unsynced: Vec::new(),
    };
    Ok(Opened { active, index, newest, cut })
}

/// Removes the segments beginning at `firsts`; returns their bytes.
fn remove_from(folder: &Path, firsts: &[u64]) -> std::io::Result<u64> {
    let mut bytes = 0;
    for &first in firsts {
        let path = segment_path(folder, first);
        bytes += std::fs::metadata(&path)?.len();
        std::fs::remove_file(&path)?;
    }
    if !firsts.is_empty() {
        File::open(folder)?.sync_all()?;
    }
    Ok(bytes)
}

impl Active {
    /// Appends `frame` (whose first cursor is `first`, `records` records at the offsets in the
    /// frame `offsets`) and records where they are in `index`. See "A failed write": `Err(e,
    /// true)` when the store must fail.
    pub(crate) fn append(
        &mut self,
        frame: &[u8],
        first: u64,
        offsets: &[(u64, u32)],
        index: &RwLock<LogIndex>,
    ) -> Result<(), (std::io::Error, bool)> {
        if self.len >= self.segment_bytes && first > self.first {
            self.rotate(first, index)?;
        }
        if let Err(e) = self.file.write_all_at(frame, self.len) {
            let cut = self.file.set_len(self.len);
            return Err((e, cut.is_err()));
        }
        let base = self.len;
        self.len += frame.len() as u64;
        self.dirty = true;
        let mut ix = index.writing();
        if ix.entries.is_empty() {
            ix.start = first;
        }
        ix.entries.extend(offsets.iter().map(|&(o, l)| (base + o, l)));
        Ok(())
    }

    /// Ends the active segment and begins one at cursor `first` (both synced by the next sync).
    fn rotate(&mut self, first: u64, index: &RwLock<LogIndex>) -> Result<(), (std::io::Error, bool)> {
        let file = Arc::new(create_segment(&self.folder, self.epoch, first).map_err(|e| (e, false))?);
        index.writing().segments.push_back(Segment { first, file: file.clone() });
        let ended = std::mem::replace(&mut self.file, file);
        self.unsynced.push(ended);
        (self.first, self.len, self.dirty) = (first, HEADER, true);
        Ok(())
    }

    /// The files to sync so that every commit so far is on the disk (outside the commit lock):
    /// the segments ended since the last sync, then the active one; and whether the folder
    /// must be synced too (a segment was begun). Empty when nothing was written since.
    pub(crate) fn take_unsynced(&mut self) -> (Vec<Arc<File>>, bool) {
        if !self.dirty {
            return (Vec::new(), false);
        }
        self.dirty = false;
        let mut files = std::mem::take(&mut self.unsynced);
        let begun = !files.is_empty();
        files.push(self.file.clone());
        (files, begun)
    }

    /// The folder of the segments.
    pub(crate) fn folder(&self) -> &Path {
        &self.folder
    }
}

/// Removes the segments whose every record is before `keep` (the active one stays), oldest
/// first; returns how many.
pub(crate) fn remove_before(keep: u64, index: &RwLock<LogIndex>, folder: &Path) -> std::io::Result<usize> {
    let mut removed = 0;
    loop {
        let first = {
            let mut ix = index.writing();
            if !ix.removable(keep) {
                break;
            }
            let next = ix.segments[1].first;
            let first = ix.segments.pop_front().expect("two segments").first;
            let n = (next.saturating_sub(ix.start) as usize).min(ix.entries.len());
            ix.entries.drain(..n);
            ix.start = next;
            first
        };
        std::fs::remove_file(segment_path(folder, first))?;
        removed += 1;
    }
    Ok(removed)
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
    /// Set when a write or a sync failed in a way only a reopen repairs (see "A failed write").
    pub failed: Option<String>,
    pub log: Active,
    /// The frame being written (kept to reuse its allocation).
    pub frame: Vec<u8>,
}

impl Writer {
    /// `Err(Failed)` (counted under `op`) once the store failed.
    pub(crate) fn usable(&self, op: &'static str, dir: &Path) -> Result<(), StoreError> {
        match &self.failed {
            Some(first) => Err(count(op, StoreError::Failed { dir: dir.to_path_buf(), first: first.clone() })),
            None => Ok(()),
        }
    }

    /// Fails the store with `e` (see "A failed write"), counted under `op`.
    pub(crate) fn fail(&mut self, op: &'static str, e: StoreError) -> StoreError {
        if self.failed.is_none() {
            tracing::error!(error = %e, "the store failed: it refuses writes until it is reopened");
            self.failed = Some(e.to_string());
        }
        count(op, e)
    }

    /// The first cursor the log must keep: the history's oldest, or the one after the floor
    /// when that is older.
    pub(crate) fn keep_from(&self) -> u64 {
        let c = self.counters;
        match c.oldest {
            0 => c.newest + 1,
            o => o,
        }
        .min(self.floor + 1)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_every_cut_or_flip_is_refused() {
        let mut b = Vec::new();
        begin_frame(&mut b, 7);
        for r in [&b"one"[..], b"", &[9u8; 300]] {
            push_record(&mut b, r);
        }
        end_frame(&mut b);
        let f = decode_frame(&b).unwrap();
        assert_eq!((f.first, f.len), (7, b.len()));
        let got: Vec<&[u8]> = f.records.iter().map(|&(o, l)| &b[o..o + l as usize]).collect();
        assert_eq!(got, vec![&b"one"[..], b"", &[9u8; 300][..]]);
        for cut in 0..b.len() {
            assert!(decode_frame(&b[..cut]).is_err(), "cut at {cut}");
        }
        for at in 0..b.len() {
            let mut bad = b.clone();
            bad[at] ^= 0x10;
            assert!(decode_frame(&bad).is_err(), "flip at {at}");
        }
    }
}
