//! Checkpoints: the live set at one cursor, on disk, so that an open rebuilds it from the
//! newest whole checkpoint and the log after it instead of the whole history.
//!
//! A checkpoint is a snapshot of every live block (`snapshot.rs`: taken beside commits, which
//! wait only while it is registered) written as one file, `checkpoints/<id>.ckpt` in the state
//! directory: a temporary file, written through a buffer, synced, renamed into place, and the
//! directory synced. Only then is the store flushed, and only after that flush are the previous
//! checkpoint and the log records the new one covers removed (`mod.rs`). A checkpoint is whole when
//! its file reads back whole: its manifest (cursor, block count, the counts of removals of absent
//! blocks and stores of held ones at the cursor, each chunk's CRC-32, and a CRC-32 of its own)
//! and every chunk matching its CRC. An open takes the newest whole one, so a crash at any point
//! of a checkpoint's write leaves the previous one and the log after it.
//!
//! Files, not sled: a checkpoint is a large value written once and read only at open. sled's
//! log keeps every value it writes until its segments are cleaned, so chunks rewritten every
//! few thousand records would hold most of the store's memory and disk.
//!
//! File layout: the magic `KVRCKPT1`; per chunk its length (u32 LE) and its bytes; the manifest;
//! its length (u32 LE); the magic `KVRCKEND`. Chunk layout (version byte 1, then the block count
//! as u32 LE, then the blocks): per block a flags byte (1 parent, 2 bigram, 4 table follows, 8
//! namespace follows), the table (rank, tier, group) when it changes, the hash (u64 LE), the parent
//! (u64 LE), copies and block size (LEB128), the namespace when it changes, and the token ids (a
//! LEB128 count, then each LEB128).

use super::codec::{decode_named, encode_named, get_namespace, get_tier, put_namespace, put_tier, Reader};
use super::error::StoreError;
use super::live_set::LiveSet;
use super::record::{get_u32, get_varint, put_varint};
use super::snapshot::{Snapshot, SnapshotBlock};
use super::types::RankCursor;
use crate::model::TokenLayout;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Blocks per chunk: about 300 KB with 16 token ids each.
pub(crate) const CHUNK_BLOCKS: usize = 4096;

const CHUNK_VERSION: u8 = 1;

const F_PARENT: u8 = 1;
const F_BIGRAM: u8 = 2;
const F_TABLE: u8 = 4;
const F_NAMESPACE: u8 = 8;

const MAGIC: &[u8; 8] = b"KVRCKPT1";
const END: &[u8; 8] = b"KVRCKEND";

/// The folder of checkpoint files in a state directory.
pub(crate) const FOLDER: &str = "checkpoints";

pub(crate) fn folder(state_dir: &Path) -> PathBuf {
    state_dir.join(FOLDER)
}

fn file(folder: &Path, id: u64) -> PathBuf {
    folder.join(format!("{id:020}.ckpt"))
}

/// The checkpoint files in `folder` by id, and every other file there (temporary ones a crash
/// left, names it does not know).
pub(crate) fn list(folder: &Path) -> std::io::Result<(Vec<u64>, Vec<PathBuf>)> {
    let (mut ids, mut other) = (Vec::new(), Vec::new());
    for e in std::fs::read_dir(folder)? {
        let e = e?;
        let name = e.file_name();
        match name.to_str().and_then(|n| n.strip_suffix(".ckpt")).and_then(|n| n.parse::<u64>().ok()) {
            Some(id) => ids.push(id),
            None => other.push(e.path()),
        }
    }
    ids.sort_unstable();
    Ok((ids, other))
}

/// Removes checkpoint `id`'s file.
pub(crate) fn remove(folder: &Path, id: u64) -> std::io::Result<()> {
    match std::fs::remove_file(file(folder, id)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// What a checkpoint holds, and how to tell it is whole.
#[derive(Debug, Clone, PartialEq, Default)]
pub(crate) struct Manifest {
    pub id: u64,
    pub cursor: u64,
    pub blocks: u64,
    pub removed_not_live: u64,
    pub stored_already_live: u64,
    /// Bytes of all its chunks.
    pub bytes: u64,
    pub crcs: Vec<u32>,
    /// Where each rank's ingest stood at the cursor.
    pub ranks: BTreeMap<u32, RankCursor>,
}

impl Manifest {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(48 + 4 * self.crcs.len());
        for x in [self.cursor, self.blocks, self.removed_not_live, self.stored_already_live, self.bytes] {
            v.extend_from_slice(&x.to_be_bytes());
        }
        v.extend_from_slice(&(self.crcs.len() as u32).to_be_bytes());
        for c in &self.crcs {
            v.extend_from_slice(&c.to_be_bytes());
        }
        v.extend_from_slice(&(self.ranks.len() as u32).to_be_bytes());
        for (rank, row) in &self.ranks {
            let row = encode_named(row).expect("a rank row encodes");
            v.extend_from_slice(&rank.to_be_bytes());
            v.extend_from_slice(&(row.len() as u32).to_be_bytes());
            v.extend_from_slice(&row);
        }
        let crc = crc32fast::hash(&v);
        v.extend_from_slice(&crc.to_be_bytes());
        v
    }

    pub(crate) fn decode(id: u64, b: &[u8]) -> Option<Manifest> {
        let body = &b[..b.len().checked_sub(4)?];
        if crc32fast::hash(body).to_be_bytes() != b[body.len()..] {
            return None;
        }
        let mut r = Reader::new(body);
        let mut m = Manifest {
            id,
            cursor: r.u64_be()?,
            blocks: r.u64_be()?,
            removed_not_live: r.u64_be()?,
            stored_already_live: r.u64_be()?,
            bytes: r.u64_be()?,
            crcs: Vec::new(),
            ranks: BTreeMap::new(),
        };
        let n = r.u32_be()?;
        for _ in 0..n {
            m.crcs.push(r.u32_be()?);
        }
        for _ in 0..r.u32_be()? {
            let rank = r.u32_be()?;
            let len = r.u32_be()? as usize;
            m.ranks.insert(rank, decode_named(r.take(len)?).ok()?);
        }
        r.is_empty().then_some(m)
    }
}

/// One chunk's bytes.
pub(crate) fn encode_chunk(blocks: &[SnapshotBlock]) -> Result<Vec<u8>, String> {
    let mut v = Vec::with_capacity(16 + blocks.len() * 90);
    v.push(CHUNK_VERSION);
    v.extend_from_slice(&(blocks.len() as u32).to_le_bytes());
    let mut prev: Option<&SnapshotBlock> = None;
    for b in blocks {
        let table = prev.is_none_or(|p| (p.dp_rank, &p.tier, p.group) != (b.dp_rank, &b.tier, b.group));
        let ns = prev.is_none_or(|p| p.namespace != b.namespace);
        let flags = u8::from(b.parent.is_some()) * F_PARENT
            + u8::from(b.token_layout == TokenLayout::Bigram) * F_BIGRAM
            + u8::from(table) * F_TABLE
            + u8::from(ns) * F_NAMESPACE;
        v.push(flags);
        if table {
            put_varint(&mut v, u64::from(b.dp_rank));
            put_tier(&mut v, &b.tier)?;
            put_varint(&mut v, u64::from(b.group));
        }
        v.extend_from_slice(&b.hash.to_le_bytes());
        if let Some(p) = b.parent {
            v.extend_from_slice(&p.to_le_bytes());
        }
        put_varint(&mut v, u64::from(b.copies));
        put_varint(&mut v, u64::from(b.block_size));
        if ns {
            put_namespace(&mut v, &b.namespace);
        }
        put_varint(&mut v, b.token_ids.len() as u64);
        for &t in &b.token_ids {
            put_varint(&mut v, u64::from(t));
        }
        prev = Some(b);
    }
    Ok(v)
}

/// Decodes a chunk into `live`; `None` when it is not a whole chunk of this layout.
pub(crate) fn decode_chunk_into(bytes: &[u8], live: &mut LiveSet) -> Option<u64> {
    let mut r = Reader::new(bytes);
    if r.u8()? != CHUNK_VERSION {
        return None;
    }
    let n = u32::from_le_bytes(r.take(4)?.try_into().ok()?);
    let mut b = SnapshotBlock::default();
    for i in 0..n {
        let flags = r.u8()?;
        if flags & !(F_PARENT | F_BIGRAM | F_TABLE | F_NAMESPACE) != 0 || (i == 0 && flags & F_TABLE == 0) {
            return None;
        }
        if flags & F_TABLE != 0 {
            b.dp_rank = get_u32(&mut r)?;
            b.tier = get_tier(&mut r)?;
            b.group = get_u32(&mut r)?;
        }
        b.hash = r.u64_le()?;
        b.parent = if flags & F_PARENT != 0 { Some(r.u64_le()?) } else { None };
        b.token_layout = if flags & F_BIGRAM != 0 { TokenLayout::Bigram } else { TokenLayout::Single };
        b.copies = get_u32(&mut r)?;
        b.block_size = get_u32(&mut r)?;
        if flags & F_NAMESPACE != 0 {
            b.namespace = get_namespace(&mut r)?;
        } else if i == 0 {
            return None;
        }
        let ntok = get_varint(&mut r)?;
        b.token_ids.clear();
        for _ in 0..ntok {
            b.token_ids.push(get_u32(&mut r)?);
        }
        if b.copies == 0 {
            return None;
        }
        live.insert(&b);
    }
    r.is_empty().then_some(u64::from(n))
}

/// Writes `snap` as checkpoint `id` in `folder` (see the module docs) and returns its manifest.
/// `stop` is asked before each chunk: a checkpoint the store no longer wants (it is closing)
/// ends there, its temporary file removed.
pub(crate) fn write(
    mut snap: Snapshot,
    ranks: BTreeMap<u32, RankCursor>,
    folder: &Path,
    id: u64,
    stop: &dyn Fn() -> bool,
) -> Result<Manifest, StoreError> {
    let io = |e| StoreError::io("write a checkpoint", folder, e);
    std::fs::create_dir_all(folder).map_err(io)?;
    let tmp = folder.join(format!("{id:020}.ckpt.tmp"));
    let out = (|| {
        let mut f = std::io::BufWriter::with_capacity(1 << 20, std::fs::File::create(&tmp).map_err(io)?);
        f.write_all(MAGIC).map_err(io)?;
        snap.chunk_blocks = CHUNK_BLOCKS;
        let mut m = Manifest {
            id,
            cursor: snap.cursor,
            removed_not_live: snap.counts.0,
            stored_already_live: snap.counts.1,
            ranks,
            ..Manifest::default()
        };
        for chunk in &mut snap {
            if stop() {
                return Err(StoreError::Invalid { what: "checkpoint", detail: "the store is closing".into() });
            }
            let chunk = chunk?;
            let bytes =
                encode_chunk(&chunk).map_err(|detail| StoreError::Invalid { what: "checkpoint chunk", detail })?;
            m.blocks += chunk.len() as u64;
            m.bytes += bytes.len() as u64 + 4;
            m.crcs.push(crc32fast::hash(&bytes));
            f.write_all(&(bytes.len() as u32).to_le_bytes()).map_err(io)?;
            f.write_all(&bytes).map_err(io)?;
        }
        let mb = m.encode();
        f.write_all(&mb).map_err(io)?;
        f.write_all(&(mb.len() as u32).to_le_bytes()).map_err(io)?;
        f.write_all(END).map_err(io)?;
        let f = f.into_inner().map_err(|e| io(e.into_error()))?;
        f.sync_all().map_err(io)?;
        drop(f);
        std::fs::rename(&tmp, file(folder, id)).map_err(io)?;
        std::fs::File::open(folder).and_then(|d| d.sync_all()).map_err(io)?;
        Ok(m)
    })();
    if out.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    out
}

/// The newest whole checkpoint in `folder` with a cursor at most `newest`, loaded; `None` when
/// there is none. A checkpoint that is not whole is passed over, with a warning.
pub(crate) fn load_newest(folder: &Path, newest: u64) -> Result<Option<(Manifest, LiveSet)>, StoreError> {
    let ids = match list(folder) {
        Ok((ids, _)) => ids,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(StoreError::io("list the checkpoints", folder, e)),
    };
    for id in ids.into_iter().rev() {
        match load(&file(folder, id), id, newest) {
            Ok(Ok(found)) => return Ok(Some(found)),
            Ok(Err(why)) => {
                tracing::warn!(dir = %folder.display(), checkpoint = id, why, "passing over a checkpoint that is not whole")
            }
            Err(e) => return Err(StoreError::io("read a checkpoint", folder, e)),
        }
    }
    Ok(None)
}

/// Checkpoint file `path` checked and loaded into a live set; `Ok(Err(why))` when it is not whole.
fn load(path: &Path, id: u64, newest: u64) -> std::io::Result<Result<(Manifest, LiveSet), String>> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open(path)?;
    let len = f.metadata()?.len();
    if len < 24 {
        return Ok(Err(format!("{len} bytes, too short")));
    }
    let mut tail = [0u8; 12];
    f.seek(SeekFrom::End(-12))?;
    f.read_exact(&mut tail)?;
    if &tail[4..] != END {
        return Ok(Err("no end marker (the write did not finish)".into()));
    }
    let mlen = u64::from(u32::from_le_bytes(tail[..4].try_into().expect("4 bytes")));
    if mlen + 20 > len {
        return Ok(Err(format!("a manifest of {mlen} bytes in {len}")));
    }
    let mut mb = vec![0u8; mlen as usize];
    f.seek(SeekFrom::Start(len - 12 - mlen))?;
    f.read_exact(&mut mb)?;
    let Some(m) = Manifest::decode(id, &mb) else { return Ok(Err("its manifest does not read back".into())) };
    if m.cursor > newest {
        return Ok(Err(format!("it is at cursor {} and the history ends at {newest}", m.cursor)));
    }
    f.seek(SeekFrom::Start(0))?;
    let mut r = std::io::BufReader::with_capacity(1 << 20, f.take(len - 12 - mlen));
    let mut magic = [0u8; 8];
    r.read_exact(&mut magic)?;
    if &magic != MAGIC {
        return Ok(Err("not a checkpoint file (bad magic)".into()));
    }
    let mut live = LiveSet::default();
    live.cursor = m.cursor;
    let (mut blocks, mut chunk) = (0u64, Vec::new());
    for (n, crc) in m.crcs.iter().enumerate() {
        let mut l = [0u8; 4];
        if r.read_exact(&mut l).is_err() {
            return Ok(Err(format!("chunk {n} of {} is missing", m.crcs.len())));
        }
        chunk.resize(u32::from_le_bytes(l) as usize, 0);
        if r.read_exact(&mut chunk).is_err() {
            return Ok(Err(format!("chunk {n} is cut short")));
        }
        if crc32fast::hash(&chunk) != *crc {
            return Ok(Err(format!("chunk {n} does not match its checksum")));
        }
        match decode_chunk_into(&chunk, &mut live) {
            Some(k) => blocks += k,
            None => return Ok(Err(format!("chunk {n} does not decode"))),
        }
    }
    if r.read(&mut [0u8; 1])? != 0 {
        return Ok(Err("bytes after its last chunk".into()));
    }
    if blocks != m.blocks {
        return Ok(Err(format!("{blocks} blocks where the manifest says {}", m.blocks)));
    }
    live.removed_not_live = m.removed_not_live;
    live.stored_already_live = m.stored_already_live;
    Ok(Ok((m, live)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Namespace, Tier};

    #[test]
    fn chunks_round_trip_and_damage_is_refused() {
        let mk = |dp_rank, tier: Tier, hash, ns: Option<&str>, toks: Vec<u32>| SnapshotBlock {
            dp_rank,
            tier,
            group: 3,
            hash,
            parent: (hash % 2 == 0).then_some(hash / 2),
            block_size: 16,
            namespace: Namespace { lora_name: ns.map(str::to_string), ..Default::default() },
            copies: 1 + (hash % 3) as u32,
            token_ids: toks,
            token_layout: if hash % 5 == 0 { TokenLayout::Bigram } else { TokenLayout::Single },
        };
        let blocks = vec![
            mk(0, Tier::Device, 10, None, vec![1, 2, u32::MAX]),
            mk(0, Tier::Device, u64::MAX, Some("a"), vec![]),
            mk(0, Tier::Other("LMCache".into()), 7, Some("a"), vec![300]),
            mk(2, Tier::Host, 8, None, vec![0; 16]),
        ];
        let bytes = encode_chunk(&blocks).unwrap();
        let mut live = LiveSet::default();
        assert_eq!(decode_chunk_into(&bytes, &mut live), Some(4));
        let (id, n) = live.open_journal(&crate::store::SnapshotFilter::all());
        let mut back = Vec::new();
        assert!(live.copy(id, usize::MAX, &mut back));
        assert_eq!(n, 4);
        assert_eq!(back, blocks);
        for cut in 0..bytes.len() {
            assert_eq!(decode_chunk_into(&bytes[..cut], &mut LiveSet::default()), None, "cut at {cut}");
        }
        let m = Manifest {
            id: 3,
            cursor: 9,
            blocks: 4,
            removed_not_live: 1,
            stored_already_live: 2,
            bytes: 99,
            crcs: vec![7, 8],
            ranks: BTreeMap::from([
                (0, RankCursor { last_seq: Some(5), last_ts: Some(1.5), last_cursor: 9, health: Default::default() }),
                (
                    3,
                    RankCursor {
                        last_seq: None,
                        last_ts: None,
                        last_cursor: 4,
                        health: crate::store::RankHealth::Degraded { reason: "gap".into() },
                    },
                ),
            ]),
        };
        let mb = m.encode();
        assert_eq!(Manifest::decode(3, &mb), Some(m));
        for at in 0..mb.len() {
            let mut bad = mb.clone();
            bad[at] ^= 1;
            assert_eq!(Manifest::decode(3, &bad), None, "flip at {at}");
        }
        for cut in 0..mb.len() {
            assert_eq!(Manifest::decode(3, &mb[..cut]), None, "cut at {cut}");
        }
    }
}
