//! The on-disk format's version, and the upgrade of a format-1 store.
//!
//! Format 1 kept everything in sled: the history, one key per record (`h cursor`), and the live
//! set, one key per live block (`l rank rgen tier tgen group hash`), with per-group totals (`s`),
//! per-namespace counts (`n`), rank rows with generations (`r`), sweep markers (`w`) and six
//! counters (`c`); a clear bumped a generation and left the old keys for a background sweep.
//! Format 2 keeps the history in the log's segment files (`log.rs`; a record's bytes are format
//! 1's), the live set in memory and on disk as checkpoints with the ranks' positions
//! (`checkpoint.rs`), and in sled only the store's format, epoch and incarnations.
//!
//! [`upgrade`] converts a format-1 store on its first open by a format-2 build (after the
//! redo a failed format-1 write may have left is applied): the history is written as the log,
//! the live blocks under each rank's current generations become checkpoint 1 at the newest
//! cursor with the rank rows' positions, both are synced, and only then is the format set to 2
//! and flushed. A crash before the switch leaves a format-1 store that the next open converts
//! again (a log or checkpoints a crashed upgrade left are removed first); after it, format 1's
//! keys are dead and the open clears them. Epoch, incarnations, history and rank positions are
//! kept.

pub(crate) mod record;
pub(crate) mod redo;

use super::codec::{self, get_namespace, get_tier, Reader};
use super::error::StoreError;
use super::live_set::LiveSet;
use super::snapshot::{Snapshot, SnapshotBlock, SnapshotFilter};
use super::types::RankCursor;
use super::{checkpoint, log, FORMAT_VERSION};
use crate::model::{Tier, TokenLayout};
use serde::Deserialize;
use std::path::Path;
use std::sync::{Arc, Mutex};

const V1_COUNTERS: u8 = b'c';
const V1_LIVE: u8 = b'l';
const V1_RANK: u8 = b'r';
const V1_HISTORY: u8 = b'h';

/// Records per frame when format 1's history is written as the log.
const UPGRADE_FRAME_RECORDS: usize = 256;

/// Format 1's history key: `h cursor`.
fn history_key(cursor: u64) -> [u8; 9] {
    let mut k = [V1_HISTORY; 9];
    k[1..].copy_from_slice(&cursor.to_be_bytes());
    k
}

/// A format-1 rank row: its position, and the generations its live keys were under.
#[derive(Debug, Deserialize)]
struct RankRowV1 {
    cursor: RankCursor,
    rgen: u32,
    tiers: Vec<(Tier, u32)>,
}

/// A format-1 live key: `l rank rgen tier tgen group hash`.
fn parse_live_key(key: &[u8]) -> Option<(u32, u32, Tier, u32, u32, u64)> {
    let mut r = Reader::new(key.get(1..)?);
    let key = (r.u32_be()?, r.u32_be()?, get_tier(&mut r)?, r.u32_be()?, r.u32_be()?, r.u64_be()?);
    r.is_empty().then_some(key)
}

/// A format-1 live value: `copies u32le, block_size u32le, flags u8 (1 parent, 2 bigram),
/// [parent u64le], namespace, n u32le, n token ids u32le`, into `b`.
fn decode_live_value(v: &[u8], b: &mut SnapshotBlock) -> Option<()> {
    let mut r = Reader::new(v);
    b.copies = r.u32_le()?;
    b.block_size = r.u32_le()?;
    let flags = r.u8()?;
    if flags & !3 != 0 || b.copies == 0 {
        return None;
    }
    b.parent = if flags & 1 != 0 { Some(r.u64_le()?) } else { None };
    b.token_layout = if flags & 2 != 0 { TokenLayout::Bigram } else { TokenLayout::Single };
    b.namespace = get_namespace(&mut r)?;
    let n = r.u32_le()? as usize;
    b.token_ids =
        r.take(n.checked_mul(4)?)?.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    r.is_empty().then_some(())
}

/// Converts the format-1 store in `data` to format 2 (see the module docs).
pub(crate) fn upgrade(
    dir: &Path,
    db: &sled::Db,
    meta: &sled::Tree,
    data: &sled::Tree,
    segment_bytes: u64,
) -> Result<(), StoreError> {
    let sled_error = |e| StoreError::sled("upgrade the store from format 1", dir, e);
    let decode_error = |what: &'static str, detail: String| StoreError::Decode { dir: dir.to_path_buf(), what, detail };
    let started = std::time::Instant::now();
    let c = data.get([V1_COUNTERS]).map_err(sled_error)?;
    let mut counters = [0u64; 6];
    if let Some(c) = &c {
        let mut r = Reader::new(c);
        for x in &mut counters {
            *x = r.u64_be().ok_or_else(|| decode_error("format-1 counters", format!("{} bytes", c.len())))?;
        }
    }
    let [newest, oldest, _hist_batches, _hist_bytes, removed_not_live, stored_already_live] = counters;
    let mut rows = std::collections::BTreeMap::new();
    for kv in data.scan_prefix([V1_RANK]) {
        let (k, v) = kv.map_err(sled_error)?;
        let rank = k.get(1..5).and_then(|b| b.try_into().ok()).map(u32::from_be_bytes);
        let rank = rank.ok_or_else(|| decode_error("format-1 rank row", format!("key {k:02x?}")))?;
        rows.insert(rank, codec::decode_named::<RankRowV1>(&v).map_err(|d| decode_error("format-1 rank row", d))?);
    }
    let mut live = LiveSet::default();
    (live.cursor, live.removed_not_live, live.stored_already_live) = (newest, removed_not_live, stored_already_live);
    let mut b = SnapshotBlock::default();
    let (mut kept, mut dead) = (0u64, 0u64);
    for kv in data.scan_prefix([V1_LIVE]) {
        let (k, v) = kv.map_err(sled_error)?;
        let (rank, rgen, tier, tgen, group, hash) =
            parse_live_key(&k).ok_or_else(|| decode_error("format-1 live key", format!("key {k:02x?}")))?;
        // Live only under the rank's and the tier's current generations: older keys were
        // cleared, waiting for a sweep.
        let row = rows.get(&rank);
        let current = row.is_some_and(|r| r.rgen == rgen && r.tiers.iter().any(|(t, g)| *t == tier && *g == tgen));
        if !current {
            dead += 1;
            continue;
        }
        (b.dp_rank, b.tier, b.group, b.hash) = (rank, tier, group, hash);
        decode_live_value(&v, &mut b).ok_or_else(|| decode_error("format-1 live block", format!("key {k:02x?}")))?;
        live.insert(&b);
        kept += 1;
    }
    // The history becomes the log, and the live set with the ranks' positions checkpoint 1 at
    // the newest cursor, both on the disk before the format is switched.
    let epoch = meta.get("epoch").map_err(sled_error)?.and_then(|v| <[u8; 8]>::try_from(v.as_ref()).ok());
    let epoch = u64::from_be_bytes(epoch.ok_or_else(|| decode_error("format-1 epoch", "missing".into()))?);
    let io = |e| StoreError::io("upgrade the store from format 1", dir, e);
    for folder in [dir.join(log::LOG_DIR), checkpoint::folder(dir)] {
        // What an upgrade a crash interrupted left.
        match std::fs::remove_dir_all(&folder) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io(e)),
            _ => {}
        }
    }
    let first = if oldest == 0 { newest + 1 } else { oldest };
    let mut opened = log::open(dir, epoch, segment_bytes, first)?;
    let index = std::sync::RwLock::new(opened.index);
    let (mut frame, mut offsets, mut next, mut records) = (Vec::new(), Vec::new(), first, 0u64);
    let mut flush = |frame: &mut Vec<u8>, offsets: &mut Vec<(u64, u32)>, next: u64| -> Result<(), StoreError> {
        if offsets.is_empty() {
            return Ok(());
        }
        log::end_frame(frame);
        let from = next - offsets.len() as u64;
        opened.active.append(frame, from, offsets, &index).map_err(|(e, _)| io(e))?;
        offsets.clear();
        Ok(())
    };
    for kv in data.range(history_key(first)..) {
        let (k, v) = kv.map_err(sled_error)?;
        if k.first() != Some(&V1_HISTORY) {
            break;
        }
        let cursor = k.get(1..9).and_then(|b| b.try_into().ok()).map(u64::from_be_bytes);
        if cursor != Some(next) || next > newest {
            return Err(decode_error("format-1 history", format!("cursor {next} expected, found key {k:02x?}")));
        }
        if offsets.is_empty() {
            log::begin_frame(&mut frame, next);
        }
        offsets.push(log::push_record(&mut frame, &v));
        next += 1;
        records += 1;
        if offsets.len() >= UPGRADE_FRAME_RECORDS {
            flush(&mut frame, &mut offsets, next)?;
        }
    }
    flush(&mut frame, &mut offsets, next)?;
    if oldest != 0 && next != newest + 1 {
        return Err(decode_error(
            "format-1 history",
            format!("it ends at cursor {} and the counters say {newest}", next - 1),
        ));
    }
    let (files, _) = opened.active.take_unsynced();
    for f in files {
        f.sync_all().map_err(io)?;
    }
    std::fs::File::open(dir.join(log::LOG_DIR)).and_then(|d| d.sync_all()).map_err(io)?;
    let live = Arc::new(Mutex::new(live));
    let snap = Snapshot::open(&live, &SnapshotFilter::all(), 0, 0);
    let ranks = rows.iter().map(|(rank, row)| (*rank, row.cursor.clone())).collect();
    let m = checkpoint::write(snap, ranks, &checkpoint::folder(dir), 1, &|| false)?;
    meta.insert("format", &FORMAT_VERSION.to_be_bytes()).map_err(sled_error)?;
    db.flush().map_err(sled_error)?;
    tracing::warn!(
        dir = %dir.display(),
        live_blocks = kept,
        cleared_keys = dead,
        checkpoint_bytes = m.bytes,
        history_records = records,
        newest,
        took_ms = started.elapsed().as_millis() as u64,
        "upgraded the store from format 1 to format 2"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn format_1_live_keys_and_values_are_read() {
        let mut k = vec![V1_LIVE];
        k.extend_from_slice(&1u32.to_be_bytes());
        k.extend_from_slice(&2u32.to_be_bytes());
        codec::put_tier(&mut k, &Tier::Other("x".into())).unwrap();
        k.extend_from_slice(&3u32.to_be_bytes());
        k.extend_from_slice(&4u32.to_be_bytes());
        k.extend_from_slice(&99u64.to_be_bytes());
        assert_eq!(parse_live_key(&k), Some((1, 2, Tier::Other("x".into()), 3, 4, 99)));
        assert_eq!(parse_live_key(&k[..k.len() - 1]), None);
        // copies 3, block size 16, parent 42 and bigram, namespace with a LoRA name, 2 tokens.
        let mut v = Vec::new();
        v.extend_from_slice(&3u32.to_le_bytes());
        v.extend_from_slice(&16u32.to_le_bytes());
        v.push(3);
        v.extend_from_slice(&42u64.to_le_bytes());
        codec::put_namespace(&mut v, &crate::model::Namespace { lora_name: Some("a".into()), ..Default::default() });
        v.extend_from_slice(&2u32.to_le_bytes());
        v.extend_from_slice(&7u32.to_le_bytes());
        v.extend_from_slice(&u32::MAX.to_le_bytes());
        let mut b = SnapshotBlock::default();
        assert_eq!(decode_live_value(&v, &mut b), Some(()));
        assert_eq!(
            (b.copies, b.block_size, b.parent, b.token_layout, b.namespace.lora_name.as_deref(), b.token_ids.clone()),
            (3, 16, Some(42), TokenLayout::Bigram, Some("a"), vec![7, u32::MAX])
        );
        for cut in 0..v.len() {
            assert_eq!(decode_live_value(&v[..cut], &mut b.clone()), None, "cut at {cut}");
        }
    }
}
