//! Format 1's record layout, which an upgraded store's log holds until those records leave it.

#[cfg(test)]
use crate::model::Stored;
use crate::model::{Bytes, Event, KeyPart, MapParts, Record, RecordBody};
use serde::{Deserialize, Serialize};

/// Format 1's records: a MessagePack array `[record, keyparts]`, both with named fields
/// (`rmp_serde::to_vec_named`). `record` is the [`Record`] with every opaque engine value
/// ([`Stored::block_mm_infos`], then each [`crate::model::Block::extra_keys`], event by event)
/// taken out, and `keyparts` lists those values in that order in an externally tagged form.
///
/// Why: the model's [`KeyPart`] is an untagged enum, and its `Bytes` variant (a struct) also reads
/// from a one-element sequence, so `List([Str("ab")])` would read back as `Bytes([0xab])` in any
/// serde format. The tagged form here round-trips every value.
#[cfg(test)]
pub(crate) fn encode(r: &Record) -> Result<Vec<u8>, String> {
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

pub(crate) fn decode(b: &[u8]) -> Result<Record, String> {
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

#[cfg(test)]
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
