//! Byte layouts shared by the log, the checkpoints and the format-1 upgrade (format version
//! [`super::FORMAT_VERSION`]; the layouts only format 1 had are in `v1/`): records, rank rows,
//! tiers and namespaces.
//!
//! Integers in format 1's keys are big-endian, so sled's byte order is numeric order; values are
//! little-endian where hand-laid. Decoders never panic on short or
//! garbled input: they return `None`, which the store reports as [`super::StoreError::Decode`].

use crate::model::{Namespace, Record, Tier};
use serde::{Deserialize, Serialize};

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
    pub(crate) fn len(&self) -> usize {
        self.b.len()
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

/// The store's running totals of the history (in memory; an open recomputes them from the log).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Counters {
    /// Newest committed cursor (0: none yet).
    pub newest: u64,
    /// Oldest cursor of the history subscribers can resume from (0: the history is empty).
    pub oldest: u64,
    pub hist_batches: u64,
    pub hist_bytes: u64,
}

/// A record's bytes in the log: the hand-laid layout of `record.rs`.
pub(crate) fn encode_record(r: &Record) -> Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity(256);
    super::record::encode(r, &mut out)?;
    Ok(out)
}

/// A record of the log: the hand-laid layout (`record.rs`), or format 1's (`v1/record.rs`), which an
/// upgraded store's log holds until those records leave it.
pub(crate) fn decode_record(b: &[u8]) -> Result<Record, String> {
    match b.first() {
        Some(&super::record::LAYOUT) => super::record::decode(b).ok_or_else(|| "not a whole record".to_string()),
        _ => super::v1::record::decode(b),
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
pub(crate) mod tests {
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
                liveness: Some(Liveness {
                    state: EngineState::Wedged,
                    reason: "no progress".into(),
                    since_ms: 5,
                    observed_at_ms: 9,
                }),
            },
        };
        let b = encode_record(&rec).unwrap();
        assert_eq!(b[0], super::super::record::LAYOUT);
        assert_eq!(decode_record(&b).unwrap(), rec);
        // Every cut of it, and anything after it, is refused.
        for cut in 0..b.len() {
            assert!(decode_record(&b[..cut]).is_err(), "cut at {cut}");
        }
        let mut longer = b.clone();
        longer.push(0);
        assert_eq!(decode_record(&longer).unwrap_err(), "not a whole record");
        // Format 1's records (an upgraded store's log) still read back.
        let v1 = crate::store::v1::record::encode(&rec).unwrap();
        assert_eq!(v1[0], 0x92);
        assert_eq!(decode_record(&v1).unwrap(), rec);
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
            assert_eq!(decode_record(&crate::store::v1::record::encode(&rec).unwrap()).unwrap(), rec);
        }
    }

    fn key_part() -> impl proptest::strategy::Strategy<Value = KeyPart> {
        use proptest::prelude::*;
        let leaf = prop_oneof![
            Just(KeyPart::Nil),
            any::<bool>().prop_map(KeyPart::Bool),
            any::<i64>().prop_map(KeyPart::Int),
            any::<u64>().prop_map(KeyPart::UInt),
            (-1e9f64..1e9).prop_map(KeyPart::Float),
            ".{0,6}".prop_map(KeyPart::Str),
            proptest::collection::vec(any::<u8>(), 0..6).prop_map(|b| KeyPart::Bytes(Bytes(b))),
        ];
        leaf.prop_recursive(3, 16, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(KeyPart::List),
                proptest::collection::vec((inner.clone(), inner), 0..3).prop_map(|map| KeyPart::Map(MapParts { map })),
            ]
        })
    }

    /// Any record the model can hold (also the server's encoder's test input).
    pub(crate) fn record() -> impl proptest::strategy::Strategy<Value = Record> {
        use proptest::prelude::*;
        let tier = prop_oneof![Just(Tier::Device), Just(Tier::Host), ".{0,5}".prop_map(Tier::Other)];
        let block = (any::<u64>(), proptest::collection::vec(any::<u32>(), 0..5), proptest::option::of(key_part()))
            .prop_map(|(hash, token_ids, extra_keys)| Block { hash, token_ids, extra_keys });
        let stored = (
            tier.clone(),
            (any::<u32>(), proptest::option::of(".{0,4}"), proptest::option::of(any::<u32>())),
            proptest::option::of(any::<u64>()),
            (any::<u32>(), any::<bool>(), proptest::collection::vec(block, 0..4)),
            (proptest::option::of(".{0,3}"), proptest::option::of(any::<i64>()), proptest::option::of(".{0,3}")),
            (proptest::option::of(".{0,3}"), proptest::option::of(".{0,3}")),
            proptest::option::of(proptest::collection::vec(proptest::collection::vec(any::<u32>(), 0..3), 0..3)),
            proptest::option::of(key_part()),
        )
            .prop_map(
                |(
                    tier,
                    (idx, kind, sliding_window),
                    parent,
                    (block_size, bigram, blocks),
                    ns,
                    (session_id, ownership),
                    lookahead_token_ids,
                    block_mm_infos,
                )| {
                    Event::Stored(Stored {
                        tier,
                        group: Group { idx, kind, sliding_window },
                        parent,
                        block_size,
                        token_layout: if bigram { TokenLayout::Bigram } else { TokenLayout::Single },
                        blocks,
                        namespace: Namespace { lora_name: ns.0, lora_id: ns.1, cache_salt: ns.2 },
                        session_id,
                        ownership,
                        lookahead_token_ids,
                        block_mm_infos,
                    })
                },
            );
        let removed =
            (tier.clone(), any::<u32>(), proptest::collection::vec(any::<u64>(), 0..4), proptest::option::of(".{0,3}"))
                .prop_map(|(tier, group, block_hashes, ownership)| {
                    Event::Removed(Removed { tier, group, block_hashes, ownership })
                });
        let cleared = proptest::option::of(tier).prop_map(|tier| Event::Cleared(Cleared { tier }));
        let event = prop_oneof![stored, removed, cleared];
        let load = proptest::option::of((any::<f64>(), any::<f64>(), any::<f64>(), any::<u64>()).prop_map(
            |(running, waiting, kv_usage, scraped_at_ms)| Load { running, waiting, kv_usage, scraped_at_ms },
        ));
        let state = prop_oneof![
            Just(EngineState::Alive),
            Just(EngineState::Unreachable),
            Just(EngineState::Wedged),
            Just(EngineState::Stopped)
        ];
        let liveness = proptest::option::of((state, ".{0,5}", any::<u64>(), any::<u64>()).prop_map(
            |(state, reason, since_ms, observed_at_ms)| Liveness { state, reason, since_ms, observed_at_ms },
        ));
        let batch = (any::<u32>(), any::<u64>(), any::<f64>(), proptest::collection::vec(event, 0..4), load, liveness)
            .prop_map(|(dp_rank, seq, ts, events, load, liveness)| RecordBody::Batch {
                batch: Batch { dp_rank, seq, ts, events },
                load,
                liveness,
            });
        let control = (any::<u32>(), ".{0,5}", 0..4u8).prop_map(|(dp_rank, reason, k)| {
            let kind = match k {
                0 => ControlKind::RankReset { reason },
                1 => ControlKind::RankDegraded { reason },
                2 => ControlKind::RankIncomplete { reason },
                _ => ControlKind::RankRecovered,
            };
            RecordBody::Control(Control { dp_rank, kind })
        });
        (any::<u64>(), any::<u32>(), prop_oneof![batch, control]).prop_map(|(cursor, incarnation, body)| Record {
            cursor,
            incarnation,
            body,
        })
    }

    /// Bit-exact equality (NaN loads compare equal to themselves).
    fn same(a: &Record, b: &Record) -> bool {
        format!("{a:?}") == format!("{b:?}")
    }

    proptest::proptest! {
        /// The record layout round-trips every record; every cut of one and every byte changed
        /// in one decodes to an error or to some record, never a panic.
        #[test]
        fn records_round_trip_and_damaged_bytes_never_panic(rec in record(), at in 0usize..10_000, x in 1u8..=255) {
            let b = encode_record(&rec).unwrap();
            let back = decode_record(&b).unwrap();
            proptest::prop_assert!(same(&back, &rec), "{back:?} != {rec:?}");
            for cut in 0..b.len() {
                proptest::prop_assert!(decode_record(&b[..cut]).is_err());
            }
            let mut bad = b.clone();
            let at = at % bad.len();
            bad[at] ^= x;
            let _ = decode_record(&bad);
        }
    }
}
