//! A record's Subscribe message, written straight from the model: exactly the bytes prost writes
//! for `record_to_pb(r).into_subscribe()` (the test below compares them on any record), without
//! building the contract's structs on the way.
//!
//! Building them cost a copy of every block's token ids and strings, the structs' allocations and
//! their drop, on the server thread, for each record (the profile at SGLang page size 1 with 8
//! subscribers: `event_to_pb`, its iterators and the pb structs' drop, about a tenth of the
//! relay's CPU). Here each message's length is computed from the model, then its fields are
//! written in prost's order (by tag), with prost's rules: a proto3 scalar, string or list is left
//! out when it is the default, an `optional` field or a message is written whenever it is set,
//! and repeated scalars are packed. Key parts (`extra_keys`, `block_mm_infos`: rare, and nested)
//! and control records are converted and written by prost itself.

use super::convert::{key_part_to_pb, record_to_pb, tier_to_pb};
use crate::model::{
    Batch, Block, Cleared, EngineState, Event, Liveness, Load, Namespace, Record, RecordBody, Removed, Stored,
    TokenLayout,
};
use bytes::Bytes;
use kv_relay_proto::pb;
use prost::encoding::{encode_key, encode_varint, encoded_len_varint, key_len, WireType};
use prost::Message;

/// Which Subscribe message of a record: every field, or what an index needs
/// (`SubscribeRequest.omit_token_ids`: no token ids, key parts, lookahead or multimodal infos).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    Full,
    Lean,
}

/// The encoding of `SubscribeResponse { message: Some(Batch(..)) }` or `Control(..)` for `r`,
/// in `shape`.
pub fn subscribe_bytes(r: &Record, shape: Shape) -> Bytes {
    let RecordBody::Batch { batch, load, liveness } = &r.body else {
        return Bytes::from(record_to_pb(r).into_subscribe().encode_to_vec());
    };
    let (load, liveness) = (load.as_ref(), liveness.as_ref());
    let len = batch_len(r.cursor, r.incarnation, batch, load, liveness, shape);
    let mut out = Vec::with_capacity(key_len(1) + encoded_len_varint(len as u64) + len);
    // SubscribeResponse.batch = 1.
    nested(&mut out, 1, len);
    put_batch(&mut out, r.cursor, r.incarnation, batch, load, liveness, shape);
    debug_assert_eq!(out.len(), out.capacity());
    Bytes::from(out)
}

// ---- lengths and writers, one pair per message, fields in tag order ----------------------------

/// A length-delimited field's key and length; its body follows.
fn nested(out: &mut Vec<u8>, tag: u32, len: usize) {
    encode_key(tag, WireType::LengthDelimited, out);
    encode_varint(len as u64, out);
}

/// What a length-delimited field of `len` bytes takes, key and length included.
fn nested_len(tag: u32, len: usize) -> usize {
    key_len(tag) + encoded_len_varint(len as u64) + len
}

fn varint_field_len(tag: u32, v: u64) -> usize {
    if v == 0 {
        0
    } else {
        key_len(tag) + encoded_len_varint(v)
    }
}

fn put_varint_field(out: &mut Vec<u8>, tag: u32, v: u64) {
    if v != 0 {
        encode_key(tag, WireType::Varint, out);
        encode_varint(v, out);
    }
}

fn double_field_len(tag: u32, v: f64) -> usize {
    if v != 0.0 {
        key_len(tag) + 8
    } else {
        0
    }
}

fn put_double_field(out: &mut Vec<u8>, tag: u32, v: f64) {
    if v != 0.0 {
        encode_key(tag, WireType::SixtyFourBit, out);
        out.extend_from_slice(&v.to_le_bytes());
    }
}

/// A proto3 `string`: left out when empty.
fn string_field_len(tag: u32, s: &str) -> usize {
    if s.is_empty() {
        0
    } else {
        nested_len(tag, s.len())
    }
}

fn put_string_field(out: &mut Vec<u8>, tag: u32, s: &str) {
    if !s.is_empty() {
        nested(out, tag, s.len());
        out.extend_from_slice(s.as_bytes());
    }
}

/// An `optional string`: written whenever set.
fn opt_string_len(tag: u32, s: &Option<String>) -> usize {
    s.as_ref().map_or(0, |s| nested_len(tag, s.len()))
}

fn put_opt_string(out: &mut Vec<u8>, tag: u32, s: &Option<String>) {
    if let Some(s) = s {
        nested(out, tag, s.len());
        out.extend_from_slice(s.as_bytes());
    }
}

/// The body of a packed `repeated uint32`.
fn packed_u32_body(ids: &[u32]) -> usize {
    ids.iter().map(|&i| encoded_len_varint(u64::from(i))).sum()
}

fn packed_u32_len(tag: u32, ids: &[u32]) -> usize {
    if ids.is_empty() {
        0
    } else {
        nested_len(tag, packed_u32_body(ids))
    }
}

fn put_packed_u32(out: &mut Vec<u8>, tag: u32, ids: &[u32]) {
    if !ids.is_empty() {
        nested(out, tag, packed_u32_body(ids));
        for &i in ids {
            encode_varint(u64::from(i), out);
        }
    }
}

fn packed_fixed64_len(tag: u32, v: &[u64]) -> usize {
    if v.is_empty() {
        0
    } else {
        nested_len(tag, 8 * v.len())
    }
}

fn put_packed_fixed64(out: &mut Vec<u8>, tag: u32, v: &[u64]) {
    if !v.is_empty() {
        nested(out, tag, 8 * v.len());
        for x in v {
            out.extend_from_slice(&x.to_le_bytes());
        }
    }
}

/// An enum (`int32`): left out when 0; the contract's values are not negative.
fn enum_len(tag: u32, v: i32) -> usize {
    varint_field_len(tag, v as i64 as u64)
}

fn put_enum(out: &mut Vec<u8>, tag: u32, v: i32) {
    put_varint_field(out, tag, v as i64 as u64);
}

/// A message field written by prost.
fn prost_len(tag: u32, m: &impl Message) -> usize {
    nested_len(tag, m.encoded_len())
}

fn put_prost(out: &mut Vec<u8>, tag: u32, m: &impl Message) {
    nested(out, tag, m.encoded_len());
    m.encode_raw(out);
}

fn load_len(l: &Load) -> usize {
    double_field_len(1, l.running)
        + double_field_len(2, l.waiting)
        + double_field_len(3, l.kv_usage)
        + varint_field_len(4, l.scraped_at_ms)
}

fn put_load(out: &mut Vec<u8>, l: &Load) {
    put_double_field(out, 1, l.running);
    put_double_field(out, 2, l.waiting);
    put_double_field(out, 3, l.kv_usage);
    put_varint_field(out, 4, l.scraped_at_ms);
}

/// `EngineLiveness`'s value for a state.
fn engine_liveness(s: EngineState) -> i32 {
    match s {
        EngineState::Alive => pb::EngineLiveness::Alive as i32,
        EngineState::Unreachable => pb::EngineLiveness::Unreachable as i32,
        EngineState::Wedged => pb::EngineLiveness::Wedged as i32,
        EngineState::Stopped => pb::EngineLiveness::Stopped as i32,
    }
}

fn liveness_len(l: &Liveness) -> usize {
    enum_len(1, engine_liveness(l.state))
        + string_field_len(2, &l.reason)
        + varint_field_len(3, l.since_ms)
        + varint_field_len(4, l.observed_at_ms)
}

fn put_liveness(out: &mut Vec<u8>, l: &Liveness) {
    put_enum(out, 1, engine_liveness(l.state));
    put_string_field(out, 2, &l.reason);
    put_varint_field(out, 3, l.since_ms);
    put_varint_field(out, 4, l.observed_at_ms);
}

fn batch_len(
    cursor: u64,
    incarnation: u32,
    b: &Batch,
    load: Option<&Load>,
    liveness: Option<&Liveness>,
    shape: Shape,
) -> usize {
    varint_field_len(1, cursor)
        + varint_field_len(2, u64::from(incarnation))
        + varint_field_len(3, u64::from(b.dp_rank))
        + varint_field_len(4, b.seq)
        + double_field_len(5, b.ts)
        + b.events
            .iter()
            .map(|e| {
                let (tag, len) = event_field(e, shape);
                nested_len(6, nested_len(tag, len))
            })
            .sum::<usize>()
        + load.map_or(0, |l| nested_len(7, load_len(l)))
        + liveness.map_or(0, |l| nested_len(8, liveness_len(l)))
}

fn put_batch(
    out: &mut Vec<u8>,
    cursor: u64,
    incarnation: u32,
    b: &Batch,
    load: Option<&Load>,
    liveness: Option<&Liveness>,
    shape: Shape,
) {
    put_varint_field(out, 1, cursor);
    put_varint_field(out, 2, u64::from(incarnation));
    put_varint_field(out, 3, u64::from(b.dp_rank));
    put_varint_field(out, 4, b.seq);
    put_double_field(out, 5, b.ts);
    for e in &b.events {
        put_event(out, e, shape);
    }
    if let Some(l) = load {
        nested(out, 7, load_len(l));
        put_load(out, l);
    }
    if let Some(l) = liveness {
        nested(out, 8, liveness_len(l));
        put_liveness(out, l);
    }
}

/// An `Event`: its one field of the `event` oneof (stored 1, removed 2, cleared 3), always
/// written; the field's tag and its body's length.
fn event_field(e: &Event, shape: Shape) -> (u32, usize) {
    match e {
        Event::Stored(s) => (1, stored_len(s, shape)),
        Event::Removed(r) => (2, removed_len(r)),
        Event::Cleared(c) => {
            let (tier, name) = cleared_tier(c);
            (3, enum_len(1, tier) + string_field_len(2, &name))
        }
    }
}

/// An event as `Batch.events = 6`: its length is computed once for both length prefixes.
fn put_event(out: &mut Vec<u8>, e: &Event, shape: Shape) {
    let (tag, len) = event_field(e, shape);
    nested(out, 6, nested_len(tag, len));
    nested(out, tag, len);
    match e {
        Event::Stored(s) => put_stored(out, s, shape),
        Event::Removed(r) => put_removed(out, r),
        Event::Cleared(c) => {
            let (tier, name) = cleared_tier(c);
            put_enum(out, 1, tier);
            put_string_field(out, 2, &name);
        }
    }
}

/// A clear's tier as the contract's enum value (`TIER_UNSPECIFIED`: every tier) and name.
fn cleared_tier(c: &Cleared) -> (i32, String) {
    c.tier.as_ref().map_or((pb::Tier::Unspecified as i32, String::new()), |t| {
        let (tier, name) = tier_to_pb(t);
        (tier as i32, name)
    })
}

fn removed_len(r: &Removed) -> usize {
    let (tier, name) = tier_to_pb(&r.tier);
    enum_len(1, tier as i32)
        + string_field_len(2, &name)
        + varint_field_len(3, u64::from(r.group))
        + packed_fixed64_len(4, &r.block_hashes)
        + opt_string_len(5, &r.ownership)
}

fn put_removed(out: &mut Vec<u8>, r: &Removed) {
    let (tier, name) = tier_to_pb(&r.tier);
    put_enum(out, 1, tier as i32);
    put_string_field(out, 2, &name);
    put_varint_field(out, 3, u64::from(r.group));
    put_packed_fixed64(out, 4, &r.block_hashes);
    put_opt_string(out, 5, &r.ownership);
}

fn group_len(s: &Stored) -> usize {
    varint_field_len(1, u64::from(s.group.idx))
        + opt_string_len(2, &s.group.kind)
        + s.group.sliding_window.map_or(0, |w| key_len(3) + encoded_len_varint(u64::from(w)))
}

fn namespace_len(n: &Namespace) -> usize {
    opt_string_len(1, &n.lora_name)
        + n.lora_id.map_or(0, |id| key_len(2) + encoded_len_varint(id as u64))
        + opt_string_len(3, &n.cache_salt)
}

fn block_len(b: &Block, shape: Shape) -> usize {
    let hash = if b.hash != 0 { key_len(1) + 8 } else { 0 };
    match shape {
        Shape::Lean => hash,
        Shape::Full => {
            hash + packed_u32_len(2, &b.token_ids)
                + b.extra_keys.as_ref().map_or(0, |k| prost_len(3, &key_part_to_pb(k)))
        }
    }
}

fn token_layout(s: &Stored) -> i32 {
    match s.token_layout {
        TokenLayout::Single => 0,
        TokenLayout::Bigram => 1,
    }
}

fn stored_len(s: &Stored, shape: Shape) -> usize {
    let (tier, name) = tier_to_pb(&s.tier);
    enum_len(1, tier as i32)
        + string_field_len(2, &name)
        + nested_len(3, group_len(s))
        + s.parent.map_or(0, |_| key_len(4) + 8)
        + varint_field_len(5, u64::from(s.block_size))
        + enum_len(6, token_layout(s))
        + s.blocks.iter().map(|b| nested_len(7, block_len(b, shape))).sum::<usize>()
        + nested_len(8, namespace_len(&s.namespace))
        + opt_string_len(9, &s.session_id)
        + opt_string_len(10, &s.ownership)
        + match shape {
            Shape::Lean => 0,
            Shape::Full => {
                s.lookahead_token_ids.iter().flatten().map(|ids| nested_len(11, packed_u32_len(1, ids))).sum::<usize>()
                    + (if s.lookahead_token_ids.is_some() { key_len(12) + 1 } else { 0 })
                    + s.block_mm_infos.as_ref().map_or(0, |k| prost_len(13, &key_part_to_pb(k)))
            }
        }
}

fn put_stored(out: &mut Vec<u8>, s: &Stored, shape: Shape) {
    let (tier, name) = tier_to_pb(&s.tier);
    put_enum(out, 1, tier as i32);
    put_string_field(out, 2, &name);
    nested(out, 3, group_len(s));
    put_varint_field(out, 1, u64::from(s.group.idx));
    put_opt_string(out, 2, &s.group.kind);
    if let Some(w) = s.group.sliding_window {
        encode_key(3, WireType::Varint, out);
        encode_varint(u64::from(w), out);
    }
    if let Some(p) = s.parent {
        encode_key(4, WireType::SixtyFourBit, out);
        out.extend_from_slice(&p.to_le_bytes());
    }
    put_varint_field(out, 5, u64::from(s.block_size));
    put_enum(out, 6, token_layout(s));
    for b in &s.blocks {
        nested(out, 7, block_len(b, shape));
        if b.hash != 0 {
            encode_key(1, WireType::SixtyFourBit, out);
            out.extend_from_slice(&b.hash.to_le_bytes());
        }
        if shape == Shape::Full {
            put_packed_u32(out, 2, &b.token_ids);
            if let Some(k) = &b.extra_keys {
                put_prost(out, 3, &key_part_to_pb(k));
            }
        }
    }
    nested(out, 8, namespace_len(&s.namespace));
    put_opt_string(out, 1, &s.namespace.lora_name);
    if let Some(id) = s.namespace.lora_id {
        encode_key(2, WireType::Varint, out);
        encode_varint(id as u64, out);
    }
    put_opt_string(out, 3, &s.namespace.cache_salt);
    put_opt_string(out, 9, &s.session_id);
    put_opt_string(out, 10, &s.ownership);
    if shape == Shape::Lean {
        return;
    }
    for ids in s.lookahead_token_ids.iter().flatten() {
        nested(out, 11, packed_u32_len(1, ids));
        put_packed_u32(out, 1, ids);
    }
    if s.lookahead_token_ids.is_some() {
        encode_key(12, WireType::Varint, out);
        out.push(1);
    }
    if let Some(k) = &s.block_mm_infos {
        put_prost(out, 13, &key_part_to_pb(k));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Control, ControlKind, Group, KeyPart, Tier};

    fn prost_bytes(r: &Record) -> Vec<u8> {
        record_to_pb(r).into_subscribe().encode_to_vec()
    }

    /// What prost writes for the lean shape: the full message with the fields it leaves out
    /// cleared.
    fn prost_lean_bytes(r: &Record) -> Vec<u8> {
        let mut m = record_to_pb(r).into_subscribe();
        if let Some(pb::subscribe_response::Message::Batch(b)) = &mut m.message {
            for e in &mut b.events {
                if let Some(pb::event::Event::Stored(s)) = &mut e.event {
                    for b in &mut s.blocks {
                        b.token_ids.clear();
                        b.extra_keys = None;
                    }
                    s.lookahead_token_ids.clear();
                    s.has_lookahead_token_ids = false;
                    s.block_mm_infos = None;
                }
            }
        }
        m.encode_to_vec()
    }

    /// Both shapes of `r`, each checked against prost.
    fn check(r: &Record) {
        assert_eq!(subscribe_bytes(r, Shape::Full).to_vec(), prost_bytes(r), "full");
        assert_eq!(subscribe_bytes(r, Shape::Lean).to_vec(), prost_lean_bytes(r), "lean");
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]
        #[test]
        fn any_record_is_written_as_prost_writes_it(r in crate::store::any_record()) {
            proptest::prop_assert_eq!(subscribe_bytes(&r, Shape::Full).to_vec(), prost_bytes(&r));
            proptest::prop_assert_eq!(subscribe_bytes(&r, Shape::Lean).to_vec(), prost_lean_bytes(&r));
        }
    }

    /// Defaults and edges the strategy may rarely draw: zeros left out, set optionals written
    /// even when zero or empty, -0.0 and NaN, the largest values, a control record.
    #[test]
    fn edges_are_written_as_prost_writes_them() {
        let stored = |f: &dyn Fn(&mut Stored)| {
            let mut s = Stored::plain(Tier::Device, 0, 0, vec![]);
            f(&mut s);
            Event::Stored(s)
        };
        let events = vec![
            stored(&|_| {}),
            stored(&|s| s.parent = Some(0)),
            stored(&|s| {
                s.tier = Tier::Other(String::new());
                s.group = Group { idx: 0, kind: Some(String::new()), sliding_window: Some(0) };
                s.namespace = Namespace { lora_name: Some(String::new()), lora_id: Some(-1), cache_salt: None };
                s.session_id = Some(String::new());
                s.lookahead_token_ids = Some(vec![]);
            }),
            stored(&|s| {
                s.token_layout = TokenLayout::Bigram;
                s.block_size = u32::MAX;
                s.blocks = vec![
                    Block { hash: 0, token_ids: vec![0, u32::MAX], extra_keys: Some(KeyPart::Nil) },
                    Block { hash: u64::MAX, token_ids: vec![], extra_keys: None },
                ];
                s.lookahead_token_ids = Some(vec![vec![], vec![7]]);
                s.block_mm_infos = Some(KeyPart::Int(0));
            }),
            Event::Removed(Removed {
                tier: Tier::Host,
                group: 0,
                block_hashes: vec![],
                ownership: Some(String::new()),
            }),
            Event::Removed(Removed { tier: Tier::Disk, group: u32::MAX, block_hashes: vec![0, 1], ownership: None }),
            Event::Cleared(Cleared { tier: None }),
            Event::Cleared(Cleared { tier: Some(Tier::Other("x".into())) }),
        ];
        let live = |state, reason: &str, since_ms, observed_at_ms| {
            Some(Liveness { state, reason: reason.into(), since_ms, observed_at_ms })
        };
        for (ts, load, liveness) in [
            (0.0, None, None),
            (
                -0.0,
                Some(Load { running: -0.0, waiting: f64::NAN, kv_usage: 1.0, scraped_at_ms: 0 }),
                live(EngineState::Alive, "", 0, 0),
            ),
            (
                f64::NAN,
                Some(Load { running: 0.0, waiting: 0.0, kv_usage: 0.0, scraped_at_ms: u64::MAX }),
                live(EngineState::Stopped, "connection refused", u64::MAX, 1),
            ),
            (1.0, None, live(EngineState::Wedged, "x", 1, u64::MAX)),
        ] {
            for (cursor, incarnation) in [(0, 0), (u64::MAX, u32::MAX)] {
                let batch = Batch { dp_rank: 3, seq: 0, ts, events: events.clone() };
                let r =
                    Record { cursor, incarnation, body: RecordBody::Batch { batch, load, liveness: liveness.clone() } };
                check(&r);
                let empty = Batch { dp_rank: 0, seq: u64::MAX, ts, events: vec![] };
                let r = Record {
                    cursor,
                    incarnation,
                    body: RecordBody::Batch { batch: empty, load, liveness: liveness.clone() },
                };
                check(&r);
            }
        }
        let control = Record {
            cursor: 9,
            incarnation: 2,
            body: RecordBody::Control(Control { dp_rank: 1, kind: ControlKind::RankDegraded { reason: "gap".into() } }),
        };
        check(&control);
        assert_eq!(subscribe_bytes(&control, Shape::Lean), subscribe_bytes(&control, Shape::Full));
    }

    /// A message's fields: (number, name, type).
    type Fields = &'static [(i32, &'static str, &'static str)];

    /// The fields this module writes by hand, per message of the contract. A field the contract
    /// adds, renumbers, renames or retypes in one of them fails
    /// [`the_contract_has_no_field_the_encoder_does_not_write`] until the encoder writes it.
    const WRITTEN: &[(&str, Fields)] = &[
        ("SubscribeResponse", &[(1, "batch", ".kv_relay.v1.Batch")]),
        (
            "Batch",
            &[
                (1, "cursor", "uint64"),
                (2, "incarnation", "uint32"),
                (3, "dp_rank", "uint32"),
                (4, "engine_seq", "uint64"),
                (5, "engine_ts", "double"),
                (6, "events", "repeated .kv_relay.v1.Event"),
                (7, "load", ".kv_relay.v1.Load"),
                (8, "liveness", ".kv_relay.v1.Liveness"),
            ],
        ),
        (
            "Event",
            &[
                (1, "stored", ".kv_relay.v1.Stored"),
                (2, "removed", ".kv_relay.v1.Removed"),
                (3, "cleared", ".kv_relay.v1.Cleared"),
            ],
        ),
        (
            "Stored",
            &[
                (1, "tier", ".kv_relay.v1.Tier"),
                (2, "tier_name", "string"),
                (3, "group", ".kv_relay.v1.Group"),
                (4, "parent", "optional fixed64"),
                (5, "block_size", "uint32"),
                (6, "token_layout", ".kv_relay.v1.TokenLayout"),
                (7, "blocks", "repeated .kv_relay.v1.Block"),
                (8, "namespace", ".kv_relay.v1.Namespace"),
                (9, "session_id", "optional string"),
                (10, "ownership", "optional string"),
                (11, "lookahead_token_ids", "repeated .kv_relay.v1.TokenIds"),
                (12, "has_lookahead_token_ids", "bool"),
                (13, "block_mm_infos", ".kv_relay.v1.KeyPart"),
            ],
        ),
        (
            "Removed",
            &[
                (1, "tier", ".kv_relay.v1.Tier"),
                (2, "tier_name", "string"),
                (3, "group", "uint32"),
                (4, "block_hashes", "repeated fixed64"),
                (5, "ownership", "optional string"),
            ],
        ),
        ("Cleared", &[(1, "tier", ".kv_relay.v1.Tier"), (2, "tier_name", "string")]),
        ("Group", &[(1, "idx", "uint32"), (2, "kind", "optional string"), (3, "sliding_window", "optional uint32")]),
        (
            "Namespace",
            &[
                (1, "lora_name", "optional string"),
                (2, "lora_id", "optional int64"),
                (3, "cache_salt", "optional string"),
            ],
        ),
        (
            "Block",
            &[(1, "hash", "fixed64"), (2, "token_ids", "repeated uint32"), (3, "extra_keys", ".kv_relay.v1.KeyPart")],
        ),
        ("TokenIds", &[(1, "ids", "repeated uint32")]),
        (
            "Load",
            &[
                (1, "running", "double"),
                (2, "waiting", "double"),
                (3, "kv_usage", "double"),
                (4, "scraped_at_ms", "uint64"),
            ],
        ),
        (
            "Liveness",
            &[
                (1, "state", ".kv_relay.v1.EngineLiveness"),
                (2, "reason", "string"),
                (3, "since_ms", "uint64"),
                (4, "observed_at_ms", "uint64"),
            ],
        ),
    ];

    /// The enums this module writes by number: (number, name).
    const ENUMS: &[(&str, &[(i32, &str)])] =
        &[("TokenLayout", &[(0, "TOKEN_LAYOUT_SINGLE"), (1, "TOKEN_LAYOUT_BIGRAM")])];

    /// A field as the table above says it: its type, `optional` (proto3 presence) or `repeated`
    /// before it, and a message or enum by its full name.
    fn field_shape(f: &prost_types::FieldDescriptorProto) -> String {
        use prost_types::field_descriptor_proto::{Label, Type};
        let ty = match f.r#type() {
            Type::Message | Type::Enum => f.type_name().to_string(),
            t => t.as_str_name().trim_start_matches("TYPE_").to_lowercase(),
        };
        if f.label() == Label::Repeated {
            format!("repeated {ty}")
        } else if f.proto3_optional() {
            format!("optional {ty}")
        } else {
            ty
        }
    }

    #[test]
    fn the_contract_has_no_field_the_encoder_does_not_write() {
        let set = <prost_types::FileDescriptorSet as Message>::decode(kv_relay_proto::pb::FILE_DESCRIPTOR_SET).unwrap();
        let file = set.file.iter().find(|f| f.package() == "kv_relay.v1").expect("the contract's file");
        for (message, written) in WRITTEN {
            let d = file
                .message_type
                .iter()
                .find(|m| m.name() == *message)
                .unwrap_or_else(|| panic!("no message {message}"));
            let mut fields: Vec<(i32, String, String)> =
                d.field.iter().map(|f| (f.number(), f.name().to_string(), field_shape(f))).collect();
            fields.sort();
            let known: Vec<(i32, String, String)> =
                written.iter().map(|&(n, name, ty)| (n, name.to_string(), ty.to_string())).collect();
            if *message == "SubscribeResponse" {
                // Only its batch is written here; every other message goes through prost.
                let batch: Vec<_> = fields.iter().filter(|f| f.0 == 1).cloned().collect();
                assert_eq!(batch, known, "SubscribeResponse.batch");
                continue;
            }
            assert_eq!(fields, known, "the fields of {message} (contract, then what encode.rs writes)");
        }
        for (name, values) in ENUMS {
            let e = file.enum_type.iter().find(|e| e.name() == *name).unwrap_or_else(|| panic!("no enum {name}"));
            let got: Vec<(i32, &str)> = e.value.iter().map(|v| (v.number(), v.name())).collect();
            assert_eq!(got, values.to_vec(), "the values of {name}");
        }
        // Every message type a hand-written field holds is hand-written too, or one that
        // prost writes here (key parts).
        for (message, written) in WRITTEN {
            for (_, field, ty) in *written {
                let Some(inner) = ty.trim_start_matches("repeated ").strip_prefix(".kv_relay.v1.") else { continue };
                let by_hand = WRITTEN.iter().any(|(m, _)| *m == inner);
                let is_enum = file.enum_type.iter().any(|e| e.name() == inner);
                assert!(
                    by_hand || is_enum || inner == "KeyPart",
                    "{message}.{field} holds {inner}, which nothing here writes"
                );
            }
        }
    }
}
