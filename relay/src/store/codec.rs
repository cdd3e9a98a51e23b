//! Byte layouts of the store's keys and values (format version [`super::FORMAT_VERSION`]).
//!
//! Every integer in a key is big-endian, so sled's byte order is numeric order and a key prefix
//! selects a range. Values are little-endian where hand-laid. Decoders never panic on short or
//! garbled input: they return `None`, which the store reports as [`super::StoreError::Decode`].

use crate::model::{Bytes, Event, KeyPart, MapParts, Namespace, Record, RecordBody, Stored, Tier, TokenLayout};
use serde::{Deserialize, Serialize};

/// Key prefixes of the `data` tree.
pub(crate) const P_COUNTERS: u8 = b'c';
pub(crate) const P_HISTORY: u8 = b'h';
pub(crate) const P_LIVE: u8 = b'l';
pub(crate) const P_NAMESPACE: u8 = b'n';
pub(crate) const P_RANK: u8 = b'r';
pub(crate) const P_SUMMARY: u8 = b's';
pub(crate) const P_SWEEP: u8 = b'w';

/// A small reader over a byte slice.
pub(crate) struct Reader<'a> {
    b: &'a [u8],
}

impl<'a> Reader<'a> {
    pub(crate) fn new(b: &'a [u8]) -> Self {
        Reader { b }
    }
    pub(crate) fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.b.len() < n {
            return None;
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Some(h)
    }
    pub(crate) fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    pub(crate) fn u16_be(&mut self) -> Option<u16> {
        self.take(2).map(|b| u16::from_be_bytes([b[0], b[1]]))
    }
    pub(crate) fn u32_be(&mut self) -> Option<u32> {
        self.take(4).and_then(|b| b.try_into().ok()).map(u32::from_be_bytes)
    }
    pub(crate) fn u64_be(&mut self) -> Option<u64> {
        self.take(8).and_then(|b| b.try_into().ok()).map(u64::from_be_bytes)
    }
    pub(crate) fn u32_le(&mut self) -> Option<u32> {
        self.take(4).and_then(|b| b.try_into().ok()).map(u32::from_le_bytes)
    }
    pub(crate) fn u64_le(&mut self) -> Option<u64> {
        self.take(8).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes)
    }
    pub(crate) fn is_empty(&self) -> bool {
        self.b.is_empty()
    }
}

/// Tier in a key: one byte for the named tiers, `4` then a 2-byte length and the bytes for
/// [`Tier::Other`] (length-prefixed, so no tier's encoding is a prefix of another's).
pub(crate) fn put_tier(out: &mut Vec<u8>, t: &Tier) -> Result<(), String> {
    match t {
        Tier::Device => out.push(0),
        Tier::Host => out.push(1),
        Tier::Disk => out.push(2),
        Tier::External => out.push(3),
        Tier::Other(s) => {
            let len = u16::try_from(s.len()).map_err(|_| format!("tier name of {} bytes", s.len()))?;
            out.push(4);
            out.extend_from_slice(&len.to_be_bytes());
            out.extend_from_slice(s.as_bytes());
        }
    }
    Ok(())
}

pub(crate) fn get_tier(r: &mut Reader<'_>) -> Option<Tier> {
    Some(match r.u8()? {
        0 => Tier::Device,
        1 => Tier::Host,
        2 => Tier::Disk,
        3 => Tier::External,
        4 => {
            let n = r.u16_be()? as usize;
            Tier::Other(String::from_utf8(r.take(n)?.to_vec()).ok()?)
        }
        _ => return None,
    })
}

/// Namespace: a flags byte (1 LoRA name, 2 LoRA id, 4 cache salt), then the present fields in
/// that order (strings as a 4-byte big-endian length and UTF-8, the id as 8 bytes).
pub(crate) fn put_namespace(out: &mut Vec<u8>, ns: &Namespace) {
    let flags = u8::from(ns.lora_name.is_some())
        | (u8::from(ns.lora_id.is_some()) << 1)
        | (u8::from(ns.cache_salt.is_some()) << 2);
    out.push(flags);
    if let Some(s) = &ns.lora_name {
        out.extend_from_slice(&(s.len() as u32).to_be_bytes());
        out.extend_from_slice(s.as_bytes());
    }
    if let Some(id) = ns.lora_id {
        out.extend_from_slice(&id.to_be_bytes());
    }
    if let Some(s) = &ns.cache_salt {
        out.extend_from_slice(&(s.len() as u32).to_be_bytes());
        out.extend_from_slice(s.as_bytes());
    }
}

pub(crate) fn get_namespace(r: &mut Reader<'_>) -> Option<Namespace> {
    let flags = r.u8()?;
    if flags & !7 != 0 {
        return None;
    }
    let string = |r: &mut Reader<'_>| -> Option<String> {
        let n = r.u32_be()? as usize;
        String::from_utf8(r.take(n)?.to_vec()).ok()
    };
    let lora_name = if flags & 1 != 0 { Some(string(r)?) } else { None };
    let lora_id = if flags & 2 != 0 { Some(r.u64_be()? as i64) } else { None };
    let cache_salt = if flags & 4 != 0 { Some(string(r)?) } else { None };
    Some(Namespace { lora_name, lora_id, cache_salt })
}

/// Where a group of live blocks sits in the keyspace: rank, rank generation, tier, tier
/// generation, group. A clear bumps a generation, so every key written under the old one is dead
/// at once (and swept later) without touching it in the commit.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct GroupAt {
    pub dp_rank: u32,
    pub rgen: u32,
    pub tier: Tier,
    pub tgen: u32,
    pub group: u32,
}

/// The generations part of a key: `rank rgen tier tgen` (the prefix of a tier's blocks).
pub(crate) fn tier_prefix(p: u8, dp_rank: u32, rgen: u32, tier: &Tier, tgen: u32) -> Result<Vec<u8>, String> {
    let mut k = Vec::with_capacity(32);
    k.push(p);
    k.extend_from_slice(&dp_rank.to_be_bytes());
    k.extend_from_slice(&rgen.to_be_bytes());
    put_tier(&mut k, tier)?;
    k.extend_from_slice(&tgen.to_be_bytes());
    Ok(k)
}

pub(crate) fn group_key(p: u8, g: &GroupAt) -> Result<Vec<u8>, String> {
    let mut k = tier_prefix(p, g.dp_rank, g.rgen, &g.tier, g.tgen)?;
    k.extend_from_slice(&g.group.to_be_bytes());
    Ok(k)
}

/// `l rank rgen tier tgen group hash`.
pub(crate) fn live_key(g: &GroupAt, hash: u64) -> Result<Vec<u8>, String> {
    let mut k = group_key(P_LIVE, g)?;
    k.extend_from_slice(&hash.to_be_bytes());
    Ok(k)
}

/// Parses the part of a `l`, `s` or `n` key after the prefix byte: the group, and the rest.
pub(crate) fn parse_group_key(key: &[u8]) -> Option<(GroupAt, &[u8])> {
    let mut r = Reader::new(key.get(1..)?);
    let dp_rank = r.u32_be()?;
    let rgen = r.u32_be()?;
    let tier = get_tier(&mut r)?;
    let tgen = r.u32_be()?;
    let group = r.u32_be()?;
    Some((GroupAt { dp_rank, rgen, tier, tgen, group }, r.b))
}

/// One live block's value: `copies u32le, block_size u32le, flags u8 (1 parent, 2 bigram),
/// [parent u64le], namespace, n u32le, n token ids u32le`. The copy count comes first so a store
/// or removal of a held block patches 4 bytes.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct LiveValue {
    pub copies: u32,
    pub block_size: u32,
    pub parent: Option<u64>,
    pub layout: TokenLayout,
    pub namespace: Namespace,
    pub token_ids: Vec<u32>,
}

impl LiveValue {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(24 + 4 * self.token_ids.len());
        v.extend_from_slice(&self.copies.to_le_bytes());
        v.extend_from_slice(&self.block_size.to_le_bytes());
        let flags = u8::from(self.parent.is_some()) | (u8::from(self.layout == TokenLayout::Bigram) << 1);
        v.push(flags);
        if let Some(p) = self.parent {
            v.extend_from_slice(&p.to_le_bytes());
        }
        put_namespace(&mut v, &self.namespace);
        v.extend_from_slice(&(self.token_ids.len() as u32).to_le_bytes());
        for t in &self.token_ids {
            v.extend_from_slice(&t.to_le_bytes());
        }
        v
    }

    /// Decodes; token ids only when asked (a snapshot without token ids skips them).
    pub(crate) fn decode(b: &[u8], with_tokens: bool) -> Option<LiveValue> {
        let mut r = Reader::new(b);
        let copies = r.u32_le()?;
        let block_size = r.u32_le()?;
        let flags = r.u8()?;
        if flags & !3 != 0 {
            return None;
        }
        let parent = if flags & 1 != 0 { Some(r.u64_le()?) } else { None };
        let layout = if flags & 2 != 0 { TokenLayout::Bigram } else { TokenLayout::Single };
        let namespace = get_namespace(&mut r)?;
        let n = r.u32_le()? as usize;
        let raw = r.take(n.checked_mul(4)?)?;
        if !r.is_empty() {
            return None;
        }
        let token_ids = if with_tokens {
            raw.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
        } else {
            Vec::new()
        };
        Some(LiveValue { copies, block_size, parent, layout, namespace, token_ids })
    }

    pub(crate) fn copies_of(b: &[u8]) -> Option<u32> {
        Reader::new(b).u32_le()
    }

    pub(crate) fn with_copies(b: &[u8], copies: u32) -> Vec<u8> {
        let mut v = b.to_vec();
        v[..4].copy_from_slice(&copies.to_le_bytes());
        v
    }
}

/// The store's running totals, one key `c`: six big-endian u64s.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Counters {
    /// Newest committed cursor (0: none yet).
    pub newest: u64,
    /// Oldest cursor still in the history (0: the history is empty).
    pub oldest: u64,
    pub hist_batches: u64,
    pub hist_bytes: u64,
    pub removed_not_live: u64,
    pub stored_already_live: u64,
}

impl Counters {
    pub(crate) fn encode(&self) -> Vec<u8> {
        [self.newest, self.oldest, self.hist_batches, self.hist_bytes, self.removed_not_live, self.stored_already_live]
            .iter()
            .flat_map(|x| x.to_be_bytes())
            .collect()
    }
    pub(crate) fn decode(b: &[u8]) -> Option<Counters> {
        let mut r = Reader::new(b);
        let c = Counters {
            newest: r.u64_be()?,
            oldest: r.u64_be()?,
            hist_batches: r.u64_be()?,
            hist_bytes: r.u64_be()?,
            removed_not_live: r.u64_be()?,
            stored_already_live: r.u64_be()?,
        };
        r.is_empty().then_some(c)
    }
}

/// A live group's totals (`s` key): blocks and copies, two big-endian u64s. The `n` keys hold
/// the number of blocks per namespace, one big-endian u64.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct GroupTotals {
    pub blocks: u64,
    pub copies: u64,
}

impl GroupTotals {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut v = self.blocks.to_be_bytes().to_vec();
        v.extend_from_slice(&self.copies.to_be_bytes());
        v
    }
    pub(crate) fn decode(b: &[u8]) -> Option<GroupTotals> {
        let mut r = Reader::new(b);
        Some(GroupTotals { blocks: r.u64_be()?, copies: r.u64_be()? })
    }
}

/// History records: a MessagePack array `[record, keyparts]`, both with named fields
/// (`rmp_serde::to_vec_named`). `record` is the [`Record`] with every opaque engine value
/// ([`Stored::block_mm_infos`], then each [`crate::model::Block::extra_keys`], event by event)
/// taken out, and `keyparts` lists those values in that order in an externally tagged form.
///
/// Why: the model's [`KeyPart`] is an untagged enum, and its `Bytes` variant (a struct) also reads
/// from a one-element sequence, so `List([Str("ab")])` would read back as `Bytes([0xab])` in any
/// serde format. The tagged form here round-trips every value.
pub(crate) fn encode_record(r: &Record) -> Result<Vec<u8>, String> {
    let mut parts = Vec::new();
    let mut stripped = None;
    if let RecordBody::Batch { batch, .. } = &r.body {
        if batch.events.iter().any(|e| matches!(e, Event::Stored(s) if has_parts(s))) {
            let mut r = r.clone();
            if let RecordBody::Batch { batch, .. } = &mut r.body {
                for e in &mut batch.events {
                    if let Event::Stored(s) = e {
                        parts.push(s.block_mm_infos.take().map(|k| TaggedPart::from(&k)));
                        for b in &mut s.blocks {
                            parts.push(b.extra_keys.take().map(|k| TaggedPart::from(&k)));
                        }
                    }
                }
            }
            stripped = Some(r);
        }
    }
    rmp_serde::to_vec_named(&(stripped.as_ref().unwrap_or(r), parts)).map_err(|e| e.to_string())
}

pub(crate) fn decode_record(b: &[u8]) -> Result<Record, String> {
    let (mut r, parts): (Record, Vec<Option<TaggedPart>>) = rmp_serde::from_slice(b).map_err(|e| e.to_string())?;
    if parts.is_empty() {
        return Ok(r);
    }
    let mut it = parts.into_iter();
    if let RecordBody::Batch { batch, .. } = &mut r.body {
        for e in &mut batch.events {
            if let Event::Stored(s) = e {
                s.block_mm_infos = it.next().ok_or("too few key parts")?.map(KeyPart::from);
                for b in &mut s.blocks {
                    b.extra_keys = it.next().ok_or("too few key parts")?.map(KeyPart::from);
                }
            }
        }
    }
    match it.next() {
        None => Ok(r),
        Some(_) => Err("too many key parts".into()),
    }
}

fn has_parts(s: &Stored) -> bool {
    s.block_mm_infos.is_some() || s.blocks.iter().any(|b| b.extra_keys.is_some())
}

/// [`KeyPart`] with an explicit tag per variant.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum TaggedPart {
    N,
    B(bool),
    I(i64),
    U(u64),
    F(f64),
    S(String),
    Y(Vec<u8>),
    L(Vec<TaggedPart>),
    M(Vec<(TaggedPart, TaggedPart)>),
}

impl From<&KeyPart> for TaggedPart {
    fn from(k: &KeyPart) -> Self {
        match k {
            KeyPart::Nil => TaggedPart::N,
            KeyPart::Bool(b) => TaggedPart::B(*b),
            KeyPart::Int(i) => TaggedPart::I(*i),
            KeyPart::UInt(u) => TaggedPart::U(*u),
            KeyPart::Float(f) => TaggedPart::F(*f),
            KeyPart::Str(s) => TaggedPart::S(s.clone()),
            KeyPart::Bytes(b) => TaggedPart::Y(b.0.clone()),
            KeyPart::List(l) => TaggedPart::L(l.iter().map(TaggedPart::from).collect()),
            KeyPart::Map(m) => TaggedPart::M(m.map.iter().map(|(k, v)| (k.into(), v.into())).collect()),
        }
    }
}

impl From<TaggedPart> for KeyPart {
    fn from(t: TaggedPart) -> Self {
        match t {
            TaggedPart::N => KeyPart::Nil,
            TaggedPart::B(b) => KeyPart::Bool(b),
            TaggedPart::I(i) => KeyPart::Int(i),
            TaggedPart::U(u) => KeyPart::UInt(u),
            TaggedPart::F(f) => KeyPart::Float(f),
            TaggedPart::S(s) => KeyPart::Str(s),
            TaggedPart::Y(b) => KeyPart::Bytes(Bytes(b)),
            TaggedPart::L(l) => KeyPart::List(l.into_iter().map(KeyPart::from).collect()),
            TaggedPart::M(m) => {
                KeyPart::Map(MapParts { map: m.into_iter().map(|(k, v)| (k.into(), v.into())).collect() })
            }
        }
    }
}

/// Anything serde-shaped kept in the store (rank rows): MessagePack, named fields.
pub(crate) fn encode_named<T: Serialize>(v: &T) -> Result<Vec<u8>, String> {
    rmp_serde::to_vec_named(v).map_err(|e| e.to_string())
}

pub(crate) fn decode_named<'a, T: Deserialize<'a>>(b: &'a [u8]) -> Result<T, String> {
    rmp_serde::from_slice(b).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::*;

    #[test]
    fn key_parts_round_trip_through_the_record_encoding() {
        let parts = KeyPart::List(vec![
            KeyPart::Nil,
            KeyPart::Bool(true),
            KeyPart::Int(-5),
            KeyPart::Int(7),
            KeyPart::UInt(u64::MAX),
            KeyPart::Float(1.0),
            KeyPart::Float(-2.5),
            KeyPart::Str("ab".into()),
            KeyPart::List(vec![KeyPart::Str("ab".into())]),
            KeyPart::Bytes(Bytes(vec![0, 0xff, 7])),
            KeyPart::Bytes(Bytes(vec![])),
            KeyPart::Map(MapParts { map: vec![(KeyPart::Str("k".into()), KeyPart::List(vec![]))] }),
            KeyPart::List(vec![]),
        ]);
        let rec = Record {
            cursor: 9,
            incarnation: 3,
            body: RecordBody::Batch {
                batch: Batch {
                    dp_rank: 2,
                    seq: 77,
                    ts: 1.5,
                    events: vec![
                        Event::Stored(Stored {
                            tier: Tier::Other("LMCache".into()),
                            group: Group { idx: 1, kind: Some("full_attention".into()), sliding_window: Some(128) },
                            parent: Some(u64::MAX),
                            block_size: 16,
                            token_layout: TokenLayout::Bigram,
                            blocks: vec![Block { hash: 1, token_ids: vec![1, 2], extra_keys: Some(parts.clone()) }],
                            namespace: Namespace { lora_name: Some("l".into()), lora_id: Some(-1), cache_salt: None },
                            session_id: Some("s".into()),
                            ownership: None,
                            lookahead_token_ids: Some(vec![vec![3]]),
                            block_mm_infos: Some(parts),
                        }),
                        Event::Removed(Removed {
                            tier: Tier::Host,
                            group: 0,
                            block_hashes: vec![4, 5],
                            ownership: None,
                        }),
                        Event::Cleared(Cleared { tier: None }),
                        Event::Cleared(Cleared { tier: Some(Tier::Disk) }),
                    ],
                },
                load: Some(Load { running: 1.0, waiting: 2.0, kv_usage: 0.5, scraped_at_ms: 10 }),
            },
        };
        let b = encode_record(&rec).unwrap();
        assert_eq!(decode_record(&b).unwrap(), rec);
        // The key parts were tagged because plain serde once read a one-string list back as
        // bytes; the model no longer does, and the tagged form stays as format version 1 wrote it.
        let list = KeyPart::List(vec![KeyPart::Str("ab".into())]);
        let naive: KeyPart = rmp_serde::from_slice(&rmp_serde::to_vec_named(&list).unwrap()).unwrap();
        assert_eq!(naive, list);
        for kind in [
            ControlKind::RankReset { reason: "r".into() },
            ControlKind::RankDegraded { reason: "d".into() },
            ControlKind::RankIncomplete { reason: "i".into() },
            ControlKind::RankRecovered,
        ] {
            let rec = Record { cursor: 1, incarnation: 1, body: RecordBody::Control(Control { dp_rank: 3, kind }) };
            assert_eq!(decode_record(&encode_record(&rec).unwrap()).unwrap(), rec);
        }
    }

    #[test]
    fn live_values_and_tiers_round_trip() {
        let v = LiveValue {
            copies: 3,
            block_size: 16,
            parent: Some(42),
            layout: TokenLayout::Bigram,
            namespace: Namespace { lora_name: Some("a".into()), lora_id: Some(5), cache_salt: Some("s".into()) },
            token_ids: vec![1, 2, u32::MAX],
        };
        let b = v.encode();
        assert_eq!(LiveValue::decode(&b, true).unwrap(), v);
        assert_eq!(LiveValue::decode(&b, false).unwrap().token_ids, Vec::<u32>::new());
        assert_eq!(LiveValue::decode(&LiveValue::with_copies(&b, 9), true).unwrap().copies, 9);
        assert!(LiveValue::decode(&b[..b.len() - 1], true).is_none());
        let g = GroupAt { dp_rank: 1, rgen: 2, tier: Tier::Other("x".into()), tgen: 3, group: 4 };
        let k = live_key(&g, 99).unwrap();
        let (back, rest) = parse_group_key(&k).unwrap();
        assert_eq!(back, g);
        assert_eq!(rest, 99u64.to_be_bytes());
    }
}
