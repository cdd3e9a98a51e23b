//! The on-disk format's version, and the upgrade of a format-1 store.
//!
//! Format 1 kept the live set in sled, one key per live block (`l rank rgen tier tgen group
//! hash`), with per-group totals (`s`), per-namespace counts (`n`), rank rows with generations
//! (`r`), sweep markers (`w`) and six counters (`c`); a clear bumped a generation and left the old
//! keys for a background sweep. Format 2 keeps the live set in memory and on disk as checkpoints
//! (`checkpoint.rs`); its history keys (`h cursor`) and records are format 1's.
//!
//! [`upgrade_v1`] converts a format-1 store on its first open by a format-2 build: the live
//! blocks under each rank's current generations become checkpoint 1 at the newest cursor, the
//! rank rows and counters are written again in format 2's keys (`R`, `C`: format 1's stay
//! readable until the switch), the store is flushed, and only then is the format set to 2 and
//! flushed again. A crash before the switch leaves a format-1 store that the next open converts
//! again; after it, format 1's keys are dead and every open removes any left ([`remove_v1`]).
//! Epoch, incarnations, history and rank positions are kept.

use super::checkpoint;
use super::codec::{self, get_namespace, get_tier, Counters, Reader};
use super::error::StoreError;
use super::live::Live;
use super::snapshot::{Snapshot, SnapshotBlock, SnapshotFilter};
use super::RankCursor;
use crate::model::{Tier, TokenLayout};
use serde::Deserialize;
use std::path::Path;
use std::sync::{Arc, Mutex};

/// The on-disk format this build writes and reads; format 1 is upgraded on open, any other is
/// refused.
pub const FORMAT_VERSION: u32 = 2;

const V1_COUNTERS: u8 = b'c';
const V1_LIVE: u8 = b'l';
const V1_NAMESPACE: u8 = b'n';
const V1_RANK: u8 = b'r';
const V1_SUMMARY: u8 = b's';
const V1_SWEEP: u8 = b'w';

/// Keys removed per write when clearing format 1's keys.
const REMOVE_BATCH: usize = 4096;

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
pub(crate) fn upgrade_v1(dir: &Path, db: &sled::Db, meta: &sled::Tree, data: &sled::Tree) -> Result<(), StoreError> {
    let sl = |e| StoreError::sled("upgrade the store from format 1", dir, e);
    let bad = |what: &'static str, detail: String| StoreError::Decode { dir: dir.to_path_buf(), what, detail };
    let started = std::time::Instant::now();
    let c = data.get([V1_COUNTERS]).map_err(sl)?;
    let mut counters = [0u64; 6];
    if let Some(c) = &c {
        let mut r = Reader::new(c);
        for x in &mut counters {
            *x = r.u64_be().ok_or_else(|| bad("format-1 counters", format!("{} bytes", c.len())))?;
        }
    }
    let [newest, oldest, hist_batches, hist_bytes, removed_not_live, stored_already_live] = counters;
    let mut rows = std::collections::BTreeMap::new();
    for kv in data.scan_prefix([V1_RANK]) {
        let (k, v) = kv.map_err(sl)?;
        let rank = k.get(1..5).and_then(|b| b.try_into().ok()).map(u32::from_be_bytes);
        let rank = rank.ok_or_else(|| bad("format-1 rank row", format!("key {k:02x?}")))?;
        rows.insert(rank, codec::decode_named::<RankRowV1>(&v).map_err(|d| bad("format-1 rank row", d))?);
    }
    let mut live = Live::default();
    (live.cursor, live.removed_not_live, live.stored_already_live) = (newest, removed_not_live, stored_already_live);
    let mut b = SnapshotBlock::default();
    let (mut kept, mut dead) = (0u64, 0u64);
    for kv in data.scan_prefix([V1_LIVE]) {
        let (k, v) = kv.map_err(sl)?;
        let (rank, rgen, tier, tgen, group, hash) =
            parse_live_key(&k).ok_or_else(|| bad("format-1 live key", format!("key {k:02x?}")))?;
        // Live only under the rank's and the tier's current generations: older keys were
        // cleared, waiting for a sweep.
        let row = rows.get(&rank);
        let current = row.is_some_and(|r| r.rgen == rgen && r.tiers.iter().any(|(t, g)| *t == tier && *g == tgen));
        if !current {
            dead += 1;
            continue;
        }
        (b.dp_rank, b.tier, b.group, b.hash) = (rank, tier, group, hash);
        decode_live_value(&v, &mut b).ok_or_else(|| bad("format-1 live block", format!("key {k:02x?}")))?;
        live.insert(&b);
        kept += 1;
    }
    // Checkpoint 1 at the newest cursor, written and made durable before anything else changes.
    let live = Arc::new(Mutex::new(live));
    let snap = Snapshot::open(&live, &SnapshotFilter::all(), 0, 0);
    let m = checkpoint::write(snap, &checkpoint::folder(dir), 1, &|| false)?;
    let mut batch = sled::Batch::default();
    // Format 1 kept exactly the history on disk: the log starts where it does.
    batch.insert(
        &[codec::P_COUNTERS],
        Counters { newest, oldest, hist_batches, hist_bytes, kept_from: oldest }.encode(),
    );
    for (rank, row) in &rows {
        let v = codec::encode_named(&row.cursor).map_err(|detail| StoreError::Invalid { what: "rank row", detail })?;
        batch.insert(super::rank_key(*rank), v);
    }
    data.apply_batch(batch).map_err(sl)?;
    db.flush().map_err(sl)?;
    meta.insert("format", &FORMAT_VERSION.to_be_bytes()).map_err(sl)?;
    db.flush().map_err(sl)?;
    tracing::warn!(
        dir = %dir.display(),
        live_blocks = kept,
        cleared_keys = dead,
        checkpoint_bytes = m.bytes,
        newest,
        took_ms = started.elapsed().as_millis() as u64,
        "upgraded the store from format 1 to format 2"
    );
    Ok(())
}

/// Removes whatever format-1 keys are left (after an upgrade), in bounded writes.
pub(crate) fn remove_v1(dir: &Path, data: &sled::Tree) -> Result<u64, StoreError> {
    let sl = |e| StoreError::sled("remove format 1's keys", dir, e);
    let mut removed = 0u64;
    for p in [V1_COUNTERS, V1_LIVE, V1_NAMESPACE, V1_RANK, V1_SUMMARY, V1_SWEEP] {
        loop {
            let mut batch = sled::Batch::default();
            let mut n = 0;
            for kv in data.scan_prefix([p]).keys().take(REMOVE_BATCH) {
                batch.remove(kv.map_err(sl)?);
                n += 1;
            }
            if n == 0 {
                break;
            }
            data.apply_batch(batch).map_err(sl)?;
            removed += n as u64;
        }
    }
    Ok(removed)
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
