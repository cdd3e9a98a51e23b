//! The log's record layout: hand-laid, one pass over the record, no field names.
//!
//! A record's bytes begin with [`LAYOUT`] (format 1's records, MessagePack with field names, which
//! a format-1 upgrade copies into the log as they are, begin with `0x92`: `codec.rs` reads both).
//! Then: the cursor and the incarnation (LEB128), the body's tag (0 batch, 1 control, 2 batch
//! with the engine's liveness).
//! - A batch: rank, seq (LEB128), ts (f64 LE), the load (a byte 0, or 1 then running, waiting,
//!   kv usage as f64 LE and the scrape time LEB128), with tag 2 the liveness (the state as a
//!   byte, 0 alive, 1 unreachable, 2 wedged, 3 stopped; the reason; since and observed at as
//!   LEB128), the event count, then each event.
//! - A store (tag 0): a flags byte ([`S_PARENT`] … [`S_EXTRA`]), the tier (`codec::put_tier`), the
//!   group's index (LEB128), its kind and sliding window when flagged, the parent (u64 LE), the
//!   block size (LEB128), the token layout (a byte), the namespace (`codec::put_namespace`), the
//!   session id, ownership, lookahead token ids and multimodal infos when flagged, then the block
//!   count and per block its hash (u64 LE), its token ids (a count, then each LEB128) and, when
//!   flagged, its extra keys (a byte 0, or 1 and a key part).
//! - A removal (tag 1): the tier, the group (LEB128), ownership (a byte 0, or 1 and a string),
//!   the count and each hash (u64 LE). A clear (tag 2): a byte 0, or 1 and the tier.
//! - A control: the rank, the kind (0 reset, 1 degraded, 2 incomplete with their reason; 3
//!   recovered).
//!
//! Strings are a LEB128 length and UTF-8. A key part is a tag byte (0 nil, 1 false, 2 true, 3 int
//! as zigzag LEB128, 4 uint LEB128, 5 f64 LE, 6 string, 7 bytes, 8 list, 9 map) and its payload,
//! nested at most [`MAX_DEPTH`] deep. The decoder never panics: anything short, garbled or left
//! over is an error.

use super::codec::{get_namespace, get_tier, put_namespace, put_tier, Reader};
use crate::model::{
    Batch, Block, Bytes, Cleared, Control, ControlKind, EngineState, Event, Group, KeyPart, Liveness, Load, MapParts,
    Record, RecordBody, Removed, Stored, TokenLayout,
};

/// The first byte of a record in this layout.
pub(crate) const LAYOUT: u8 = 0x02;

const S_PARENT: u8 = 1;
const S_KIND: u8 = 2;
const S_WINDOW: u8 = 4;
const S_SESSION: u8 = 8;
const S_OWNERSHIP: u8 = 16;
const S_LOOKAHEAD: u8 = 32;
const S_MM: u8 = 64;
const S_EXTRA: u8 = 128;

/// Deepest nesting of key parts read back.
const MAX_DEPTH: u32 = 64;

pub(crate) fn put_varint(out: &mut Vec<u8>, mut x: u64) {
    while x >= 0x80 {
        out.push((x as u8) | 0x80);
        x >>= 7;
    }
    out.push(x as u8);
}

pub(crate) fn get_varint(r: &mut Reader<'_>) -> Option<u64> {
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

pub(crate) fn get_u32(r: &mut Reader<'_>) -> Option<u32> {
    u32::try_from(get_varint(r)?).ok()
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    put_varint(out, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
}

fn get_str(r: &mut Reader<'_>) -> Option<String> {
    let n = usize::try_from(get_varint(r)?).ok()?;
    String::from_utf8(r.take(n)?.to_vec()).ok()
}

fn put_f64(out: &mut Vec<u8>, x: f64) {
    out.extend_from_slice(&x.to_le_bytes());
}

fn get_f64(r: &mut Reader<'_>) -> Option<f64> {
    r.u64_le().map(f64::from_bits)
}

/// A count read back, bounded by the bytes left (each element takes at least one byte), so a
/// garbled count cannot ask for a huge allocation.
fn get_count(r: &mut Reader<'_>) -> Option<usize> {
    let n = usize::try_from(get_varint(r)?).ok()?;
    (n <= r.len()).then_some(n)
}

fn put_tokens(out: &mut Vec<u8>, ids: &[u32]) {
    put_varint(out, ids.len() as u64);
    for &t in ids {
        put_varint(out, u64::from(t));
    }
}

fn get_tokens(r: &mut Reader<'_>) -> Option<Vec<u32>> {
    let n = get_count(r)?;
    (0..n).map(|_| get_u32(r)).collect()
}

fn put_part(out: &mut Vec<u8>, k: &KeyPart) {
    match k {
        KeyPart::Nil => out.push(0),
        KeyPart::Bool(b) => out.push(1 + u8::from(*b)),
        KeyPart::Int(i) => {
            out.push(3);
            put_varint(out, ((i << 1) ^ (i >> 63)) as u64);
        }
        KeyPart::UInt(u) => {
            out.push(4);
            put_varint(out, *u);
        }
        KeyPart::Float(f) => {
            out.push(5);
            put_f64(out, *f);
        }
        KeyPart::Str(s) => {
            out.push(6);
            put_str(out, s);
        }
        KeyPart::Bytes(b) => {
            out.push(7);
            put_varint(out, b.0.len() as u64);
            out.extend_from_slice(&b.0);
        }
        KeyPart::List(l) => {
            out.push(8);
            put_varint(out, l.len() as u64);
            l.iter().for_each(|k| put_part(out, k));
        }
        KeyPart::Map(m) => {
            out.push(9);
            put_varint(out, m.map.len() as u64);
            for (k, v) in &m.map {
                put_part(out, k);
                put_part(out, v);
            }
        }
    }
}

fn get_part(r: &mut Reader<'_>, depth: u32) -> Option<KeyPart> {
    if depth > MAX_DEPTH {
        return None;
    }
    Some(match r.u8()? {
        0 => KeyPart::Nil,
        1 => KeyPart::Bool(false),
        2 => KeyPart::Bool(true),
        3 => {
            let z = get_varint(r)?;
            KeyPart::Int(((z >> 1) as i64) ^ -((z & 1) as i64))
        }
        4 => KeyPart::UInt(get_varint(r)?),
        5 => KeyPart::Float(get_f64(r)?),
        6 => KeyPart::Str(get_str(r)?),
        7 => {
            let n = get_count(r)?;
            KeyPart::Bytes(Bytes(r.take(n)?.to_vec()))
        }
        8 => {
            let n = get_count(r)?;
            KeyPart::List((0..n).map(|_| get_part(r, depth + 1)).collect::<Option<_>>()?)
        }
        9 => {
            let n = get_count(r)?;
            let map =
                (0..n).map(|_| Some((get_part(r, depth + 1)?, get_part(r, depth + 1)?))).collect::<Option<_>>()?;
            KeyPart::Map(MapParts { map })
        }
        _ => return None,
    })
}

fn put_opt<T>(out: &mut Vec<u8>, v: &Option<T>, put: impl Fn(&mut Vec<u8>, &T)) {
    match v {
        None => out.push(0),
        Some(v) => {
            out.push(1);
            put(out, v);
        }
    }
}

fn get_opt<T>(r: &mut Reader<'_>, get: impl Fn(&mut Reader<'_>) -> Option<T>) -> Option<Option<T>> {
    match r.u8()? {
        0 => Some(None),
        1 => Some(Some(get(r)?)),
        _ => None,
    }
}

fn put_stored(out: &mut Vec<u8>, s: &Stored) -> Result<(), String> {
    let extra = s.blocks.iter().any(|b| b.extra_keys.is_some());
    let flags = [
        (s.parent.is_some(), S_PARENT),
        (s.group.kind.is_some(), S_KIND),
        (s.group.sliding_window.is_some(), S_WINDOW),
        (s.session_id.is_some(), S_SESSION),
        (s.ownership.is_some(), S_OWNERSHIP),
        (s.lookahead_token_ids.is_some(), S_LOOKAHEAD),
        (s.block_mm_infos.is_some(), S_MM),
        (extra, S_EXTRA),
    ]
    .iter()
    .fold(0u8, |f, &(on, bit)| if on { f | bit } else { f });
    out.push(flags);
    put_tier(out, &s.tier)?;
    put_varint(out, u64::from(s.group.idx));
    if let Some(k) = &s.group.kind {
        put_str(out, k);
    }
    if let Some(w) = s.group.sliding_window {
        put_varint(out, u64::from(w));
    }
    if let Some(p) = s.parent {
        out.extend_from_slice(&p.to_le_bytes());
    }
    put_varint(out, u64::from(s.block_size));
    out.push(match s.token_layout {
        TokenLayout::Single => 0,
        TokenLayout::Bigram => 1,
    });
    put_namespace(out, &s.namespace);
    if let Some(x) = &s.session_id {
        put_str(out, x);
    }
    if let Some(x) = &s.ownership {
        put_str(out, x);
    }
    if let Some(l) = &s.lookahead_token_ids {
        put_varint(out, l.len() as u64);
        l.iter().for_each(|ids| put_tokens(out, ids));
    }
    if let Some(k) = &s.block_mm_infos {
        put_part(out, k);
    }
    put_varint(out, s.blocks.len() as u64);
    for b in &s.blocks {
        out.extend_from_slice(&b.hash.to_le_bytes());
        put_tokens(out, &b.token_ids);
        if extra {
            put_opt(out, &b.extra_keys, put_part);
        }
    }
    Ok(())
}

fn get_stored(r: &mut Reader<'_>) -> Option<Stored> {
    let flags = r.u8()?;
    let on = |bit: u8| flags & bit != 0;
    let tier = get_tier(r)?;
    let idx = get_u32(r)?;
    let kind = if on(S_KIND) { Some(get_str(r)?) } else { None };
    let sliding_window = if on(S_WINDOW) { Some(get_u32(r)?) } else { None };
    let parent = if on(S_PARENT) { Some(r.u64_le()?) } else { None };
    let block_size = get_u32(r)?;
    let token_layout = match r.u8()? {
        0 => TokenLayout::Single,
        1 => TokenLayout::Bigram,
        _ => return None,
    };
    let namespace = get_namespace(r)?;
    let session_id = if on(S_SESSION) { Some(get_str(r)?) } else { None };
    let ownership = if on(S_OWNERSHIP) { Some(get_str(r)?) } else { None };
    let lookahead_token_ids = if on(S_LOOKAHEAD) {
        let n = get_count(r)?;
        Some((0..n).map(|_| get_tokens(r)).collect::<Option<_>>()?)
    } else {
        None
    };
    let block_mm_infos = if on(S_MM) { Some(get_part(r, 0)?) } else { None };
    let n = get_count(r)?;
    let mut blocks = Vec::with_capacity(n);
    for _ in 0..n {
        let hash = r.u64_le()?;
        let token_ids = get_tokens(r)?;
        let extra_keys = if on(S_EXTRA) { get_opt(r, |r| get_part(r, 0))? } else { None };
        blocks.push(Block { hash, token_ids, extra_keys });
    }
    Some(Stored {
        tier,
        group: Group { idx, kind, sliding_window },
        parent,
        block_size,
        token_layout,
        blocks,
        namespace,
        session_id,
        ownership,
        lookahead_token_ids,
        block_mm_infos,
    })
}

/// `r` in this layout, appended to `out`.
pub(crate) fn encode(r: &Record, out: &mut Vec<u8>) -> Result<(), String> {
    out.push(LAYOUT);
    put_varint(out, r.cursor);
    put_varint(out, u64::from(r.incarnation));
    match &r.body {
        RecordBody::Batch { batch, load, liveness } => {
            out.push(if liveness.is_some() { 2 } else { 0 });
            put_varint(out, u64::from(batch.dp_rank));
            put_varint(out, batch.seq);
            put_f64(out, batch.ts);
            put_opt(out, load, |out, l| {
                put_f64(out, l.running);
                put_f64(out, l.waiting);
                put_f64(out, l.kv_usage);
                put_varint(out, l.scraped_at_ms);
            });
            if let Some(l) = liveness {
                out.push(match l.state {
                    EngineState::Alive => 0,
                    EngineState::Unreachable => 1,
                    EngineState::Wedged => 2,
                    EngineState::Stopped => 3,
                });
                put_str(out, &l.reason);
                put_varint(out, l.since_ms);
                put_varint(out, l.observed_at_ms);
            }
            put_varint(out, batch.events.len() as u64);
            for e in &batch.events {
                match e {
                    Event::Stored(s) => {
                        out.push(0);
                        put_stored(out, s)?;
                    }
                    Event::Removed(rm) => {
                        out.push(1);
                        put_tier(out, &rm.tier)?;
                        put_varint(out, u64::from(rm.group));
                        put_opt(out, &rm.ownership, |out, s| put_str(out, s));
                        put_varint(out, rm.block_hashes.len() as u64);
                        rm.block_hashes.iter().for_each(|h| out.extend_from_slice(&h.to_le_bytes()));
                    }
                    Event::Cleared(c) => {
                        out.push(2);
                        match &c.tier {
                            None => out.push(0),
                            Some(t) => {
                                out.push(1);
                                put_tier(out, t)?;
                            }
                        }
                    }
                }
            }
        }
        RecordBody::Control(c) => {
            out.push(1);
            put_varint(out, u64::from(c.dp_rank));
            let (tag, reason) = match &c.kind {
                ControlKind::RankReset { reason } => (0, Some(reason)),
                ControlKind::RankDegraded { reason } => (1, Some(reason)),
                ControlKind::RankIncomplete { reason } => (2, Some(reason)),
                ControlKind::RankRecovered => (3, None),
            };
            out.push(tag);
            if let Some(reason) = reason {
                put_str(out, reason);
            }
        }
    }
    Ok(())
}

/// A record in this layout, or `None` when the bytes are not one whole record.
pub(crate) fn decode(b: &[u8]) -> Option<Record> {
    let mut r = Reader::new(b);
    if r.u8()? != LAYOUT {
        return None;
    }
    let cursor = get_varint(&mut r)?;
    let incarnation = get_u32(&mut r)?;
    let body = match r.u8()? {
        tag @ (0 | 2) => {
            let dp_rank = get_u32(&mut r)?;
            let seq = get_varint(&mut r)?;
            let ts = get_f64(&mut r)?;
            let load = get_opt(&mut r, |r| {
                Some(Load {
                    running: get_f64(r)?,
                    waiting: get_f64(r)?,
                    kv_usage: get_f64(r)?,
                    scraped_at_ms: get_varint(r)?,
                })
            })?;
            let liveness = if tag == 2 {
                let state = match r.u8()? {
                    0 => EngineState::Alive,
                    1 => EngineState::Unreachable,
                    2 => EngineState::Wedged,
                    3 => EngineState::Stopped,
                    _ => return None,
                };
                Some(Liveness {
                    state,
                    reason: get_str(&mut r)?,
                    since_ms: get_varint(&mut r)?,
                    observed_at_ms: get_varint(&mut r)?,
                })
            } else {
                None
            };
            let n = get_count(&mut r)?;
            let mut events = Vec::with_capacity(n);
            for _ in 0..n {
                events.push(match r.u8()? {
                    0 => Event::Stored(get_stored(&mut r)?),
                    1 => {
                        let tier = get_tier(&mut r)?;
                        let group = get_u32(&mut r)?;
                        let ownership = get_opt(&mut r, get_str)?;
                        let n = get_count(&mut r)?;
                        let block_hashes = (0..n).map(|_| r.u64_le()).collect::<Option<_>>()?;
                        Event::Removed(Removed { tier, group, block_hashes, ownership })
                    }
                    2 => Event::Cleared(Cleared { tier: get_opt(&mut r, get_tier)? }),
                    _ => return None,
                });
            }
            RecordBody::Batch { batch: Batch { dp_rank, seq, ts, events }, load, liveness }
        }
        1 => {
            let dp_rank = get_u32(&mut r)?;
            let kind = match r.u8()? {
                0 => ControlKind::RankReset { reason: get_str(&mut r)? },
                1 => ControlKind::RankDegraded { reason: get_str(&mut r)? },
                2 => ControlKind::RankIncomplete { reason: get_str(&mut r)? },
                3 => ControlKind::RankRecovered,
                _ => return None,
            };
            RecordBody::Control(Control { dp_rank, kind })
        }
        _ => return None,
    };
    r.is_empty().then_some(Record { cursor, incarnation, body })
}
