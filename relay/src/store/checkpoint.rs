//! Checkpoints: the live set at one cursor, on disk, so that an open rebuilds it from the
//! newest whole checkpoint and the log after it instead of the whole history.
//!
//! A checkpoint is a snapshot of every live block (`snapshot.rs`: taken beside commits, which
//! wait only while it is registered) written in chunks of [`CHUNK_BLOCKS`] blocks, one sled
//! write each (`k id chunk`), then its manifest (`m id`: cursor, block count, the counts of
//! removals of absent blocks and stores of held ones at the cursor, and each chunk's CRC-32).
//! Only then is the store flushed, and only after that flush are the previous checkpoint and the
//! log records the new one covers removed (`mod.rs`). A checkpoint is whole when its manifest
//! reads back with every chunk matching its CRC: an open takes the newest whole one, so a crash
//! at any point of a checkpoint's write leaves the previous one and the log after it.
//!
//! Chunk layout (version byte 1, then the block count as u32 LE, then the blocks): per block a
//! flags byte (1 parent, 2 bigram, 4 table follows, 8 namespace follows), the table (rank,
//! tier, group) when it changes, the hash (u64 LE), the parent (u64 LE), copies and block size
//! (LEB128), the namespace when it changes, and the token ids (a LEB128 count, then each LEB128).

use super::codec::{get_namespace, get_tier, put_namespace, put_tier, Reader};
use super::error::StoreError;
use super::live::Live;
use super::snapshot::{Snapshot, SnapshotBlock};
use crate::model::TokenLayout;
use std::path::Path;

pub(crate) const P_CHUNK: u8 = b'k';
pub(crate) const P_MANIFEST: u8 = b'm';

/// Blocks per chunk: about 300 KB with 16 token ids each.
pub(crate) const CHUNK_BLOCKS: usize = 4096;

const CHUNK_VERSION: u8 = 1;

const F_PARENT: u8 = 1;
const F_BIGRAM: u8 = 2;
const F_TABLE: u8 = 4;
const F_NAMESPACE: u8 = 8;

pub(crate) fn chunk_key(id: u64, n: u32) -> Vec<u8> {
    let mut k = Vec::with_capacity(13);
    k.push(P_CHUNK);
    k.extend_from_slice(&id.to_be_bytes());
    k.extend_from_slice(&n.to_be_bytes());
    k
}

pub(crate) fn manifest_key(id: u64) -> Vec<u8> {
    let mut k = Vec::with_capacity(9);
    k.push(P_MANIFEST);
    k.extend_from_slice(&id.to_be_bytes());
    k
}

/// What a checkpoint holds, and how to tell it is whole.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Manifest {
    pub id: u64,
    pub cursor: u64,
    pub blocks: u64,
    pub removed_not_live: u64,
    pub stored_already_live: u64,
    /// Bytes of all its chunks.
    pub bytes: u64,
    pub crcs: Vec<u32>,
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
        };
        let n = r.u32_be()?;
        for _ in 0..n {
            m.crcs.push(r.u32_be()?);
        }
        r.is_empty().then_some(m)
    }
}

fn put_varint(out: &mut Vec<u8>, mut x: u64) {
    while x >= 0x80 {
        out.push((x as u8) | 0x80);
        x >>= 7;
    }
    out.push(x as u8);
}

fn get_varint(r: &mut Reader<'_>) -> Option<u64> {
    let mut x = 0u64;
    for shift in (0..64).step_by(7) {
        let b = r.u8()?;
        x |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Some(x);
        }
    }
    None
}

fn get_u32(r: &mut Reader<'_>) -> Option<u32> {
    u32::try_from(get_varint(r)?).ok()
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
pub(crate) fn decode_chunk_into(bytes: &[u8], live: &mut Live) -> Option<u64> {
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

/// Writes `snap` as checkpoint `id`: each chunk through `put` (one sled write each), then its
/// manifest, which is returned. `put` fails the checkpoint (and says why) on the first error.
pub(crate) fn write(
    mut snap: Snapshot,
    id: u64,
    put: &mut dyn FnMut(Vec<u8>, Vec<u8>) -> Result<(), StoreError>,
) -> Result<Manifest, StoreError> {
    snap.chunk_blocks = CHUNK_BLOCKS;
    let mut m = Manifest {
        id,
        cursor: snap.cursor,
        removed_not_live: snap.counts.0,
        stored_already_live: snap.counts.1,
        ..Manifest::default()
    };
    for chunk in &mut snap {
        let chunk = chunk?;
        let bytes = encode_chunk(&chunk).map_err(|detail| StoreError::Invalid { what: "checkpoint chunk", detail })?;
        m.blocks += chunk.len() as u64;
        m.bytes += bytes.len() as u64;
        m.crcs.push(crc32fast::hash(&bytes));
        put(chunk_key(id, m.crcs.len() as u32 - 1), bytes)?;
    }
    put(manifest_key(id), m.encode())?;
    Ok(m)
}

/// The newest whole checkpoint with a cursor at most `newest`, loaded; `None` when there is
/// none. A checkpoint that is not whole (a crash while it was written) is passed over, with a
/// warning when it had a manifest.
pub(crate) fn load_newest(data: &sled::Tree, dir: &Path, newest: u64) -> Result<Option<(Manifest, Live)>, StoreError> {
    let sl = |e| StoreError::sled("load a checkpoint", dir, e);
    let mut manifests = Vec::new();
    for kv in data.scan_prefix([P_MANIFEST]) {
        let (k, v) = kv.map_err(sl)?;
        let Some(id) = k.get(1..9).and_then(|b| b.try_into().ok()).map(u64::from_be_bytes) else { continue };
        manifests.push((id, v));
    }
    for (id, v) in manifests.into_iter().rev() {
        let whole = match Manifest::decode(id, &v) {
            None => Err("its manifest does not read back".to_string()),
            Some(m) if m.cursor > newest => {
                Err(format!("it is at cursor {} and the history ends at {newest}", m.cursor))
            }
            Some(m) => load(data, dir, &m)?.map(|live| (m, live)),
        };
        match whole {
            Ok(found) => return Ok(Some(found)),
            Err(why) => {
                tracing::warn!(dir = %dir.display(), checkpoint = id, why, "passing over a checkpoint that is not whole")
            }
        }
    }
    Ok(None)
}

/// `m`'s chunks, checked against it, into a live set; `Err(why)` when one is missing or damaged.
fn load(data: &sled::Tree, dir: &Path, m: &Manifest) -> Result<Result<Live, String>, StoreError> {
    let mut live = Live::default();
    live.cursor = m.cursor;
    let mut blocks = 0u64;
    for (n, crc) in m.crcs.iter().enumerate() {
        let Some(bytes) =
            data.get(chunk_key(m.id, n as u32)).map_err(|e| StoreError::sled("load a checkpoint", dir, e))?
        else {
            return Ok(Err(format!("chunk {n} of {} is missing", m.crcs.len())));
        };
        if crc32fast::hash(&bytes) != *crc {
            return Ok(Err(format!("chunk {n} does not match its checksum")));
        }
        match decode_chunk_into(&bytes, &mut live) {
            Some(k) => blocks += k,
            None => return Ok(Err(format!("chunk {n} does not decode"))),
        }
    }
    if blocks != m.blocks {
        return Ok(Err(format!("{blocks} blocks where the manifest says {}", m.blocks)));
    }
    live.removed_not_live = m.removed_not_live;
    live.stored_already_live = m.stored_already_live;
    Ok(Ok(live))
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
        let mut live = Live::default();
        assert_eq!(decode_chunk_into(&bytes, &mut live), Some(4));
        let (id, n) = live.open_journal(&super::super::SnapshotFilter::all());
        let mut back = Vec::new();
        assert!(live.copy(id, usize::MAX, &mut back));
        assert_eq!(n, 4);
        assert_eq!(back, blocks);
        for cut in 0..bytes.len() {
            assert_eq!(decode_chunk_into(&bytes[..cut], &mut Live::default()), None, "cut at {cut}");
        }
        let m = Manifest {
            id: 3,
            cursor: 9,
            blocks: 4,
            removed_not_live: 1,
            stored_already_live: 2,
            bytes: 99,
            crcs: vec![7, 8],
        };
        let mb = m.encode();
        assert_eq!(Manifest::decode(3, &mb), Some(m));
        let mut bad = mb.clone();
        bad[5] ^= 1;
        assert_eq!(Manifest::decode(3, &bad), None);
    }
}
