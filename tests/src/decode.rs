//! A small, tolerant decoder for checking what went on the wire (built on `rmpv`, independent
//! of the relay's decoder): enough to walk batches into the engine's truth the way the
//! fixtures README's reference rule does.
//!
//! Array events are read by position; the positions truth needs agree across engines
//! (`BlockStored`: hashes 1, medium 6, group_idx 9; `BlockRemoved`: hashes 1, medium 2,
//! group_idx 3 — SGLang has no group_idx, and its index 7 is the 0.5.18 salt metadata map).

use rmpv::Value;

use crate::wire::bytes_tail_u64;

/// What truth needs from one event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WireEvent {
    Stored { hashes: Vec<u64>, medium: Option<String>, group_idx: Option<u32> },
    Removed { hashes: Vec<u64>, medium: Option<String>, group_idx: Option<u32> },
    Cleared,
}

/// A decoded batch: each event decoded on its own, so one bad event costs only itself.
#[derive(Debug, Clone, PartialEq)]
pub struct WireBatch {
    pub ts: f64,
    pub events: Vec<Result<WireEvent, String>>,
    pub dp_rank: Option<u32>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("not msgpack: {0}")]
    NotMsgpack(String),
    #[error("trailing bytes after the batch")]
    Trailing,
    #[error("batch is not a 2- or 3-element array")]
    BadBatch,
}

/// A hash as every consumer normalises it (ints two's complement, bytes last 8 BE).
pub fn hash_u64(v: &Value) -> Option<u64> {
    match v {
        Value::Integer(i) => i.as_u64().or_else(|| i.as_i64().map(|x| x as u64)),
        Value::Binary(b) => Some(bytes_tail_u64(b)),
        _ => None,
    }
}

fn hashes(v: Option<&Value>) -> Result<Vec<u64>, String> {
    let arr = v.and_then(Value::as_array).ok_or_else(|| "block_hashes is not an array".to_string())?;
    arr.iter().map(|h| hash_u64(h).ok_or_else(|| format!("unreadable hash {h}"))).collect()
}

fn opt_string(v: Option<&Value>) -> Result<Option<String>, String> {
    match v {
        None | Some(Value::Nil) => Ok(None),
        Some(Value::String(s)) => Ok(s.as_str().map(str::to_string)),
        Some(other) => Err(format!("expected a string, got {other}")),
    }
}

fn opt_u32(v: Option<&Value>) -> Result<Option<u32>, String> {
    match v {
        None | Some(Value::Nil) => Ok(None),
        Some(Value::Integer(i)) => {
            i.as_u64().and_then(|x| u32::try_from(x).ok()).map(Some).ok_or_else(|| format!("bad integer {i}"))
        }
        Some(other) => Err(format!("expected an integer, got {other}")),
    }
}

/// Decode one event value.
pub fn decode_event(v: &Value) -> Result<WireEvent, String> {
    match v {
        Value::Array(items) => {
            let tag = items.first().and_then(Value::as_str).ok_or("no tag")?;
            match tag {
                "AllBlocksCleared" => Ok(WireEvent::Cleared),
                "BlockStored" => Ok(WireEvent::Stored {
                    hashes: hashes(items.get(1))?,
                    // SGLang's 0.5.18 salt metadata sits at index 7, so 6 is always medium.
                    medium: opt_string(items.get(6))?,
                    group_idx: opt_u32(items.get(9))?,
                }),
                "BlockRemoved" => Ok(WireEvent::Removed {
                    hashes: hashes(items.get(1))?,
                    medium: opt_string(items.get(2))?,
                    group_idx: opt_u32(items.get(3))?,
                }),
                other => Err(format!("unknown event tag {other:?}")),
            }
        }
        Value::Map(entries) => {
            let get = |k: &str| entries.iter().find(|(key, _)| key.as_str() == Some(k)).map(|(_, v)| v);
            let tag = get("type").and_then(Value::as_str).ok_or("no type")?;
            match tag {
                "AllBlocksCleared" => Ok(WireEvent::Cleared),
                "BlockStored" => Ok(WireEvent::Stored {
                    hashes: hashes(get("block_hashes"))?,
                    medium: opt_string(get("medium"))?,
                    group_idx: opt_u32(get("group_idx"))?,
                }),
                "BlockRemoved" => Ok(WireEvent::Removed {
                    hashes: hashes(get("block_hashes"))?,
                    medium: opt_string(get("medium"))?,
                    group_idx: opt_u32(get("group_idx"))?,
                }),
                other => Err(format!("unknown event type {other:?}")),
            }
        }
        other => Err(format!("event is neither array nor map: {other}")),
    }
}

/// Decode a batch payload.
pub fn decode_batch(payload: &[u8]) -> Result<WireBatch, DecodeError> {
    let mut rd = payload;
    let v = rmpv::decode::read_value(&mut rd).map_err(|e| DecodeError::NotMsgpack(e.to_string()))?;
    if !rd.is_empty() {
        return Err(DecodeError::Trailing);
    }
    let items = v.as_array().ok_or(DecodeError::BadBatch)?;
    if items.len() < 2 {
        return Err(DecodeError::BadBatch);
    }
    let ts = items[0].as_f64().ok_or(DecodeError::BadBatch)?;
    let events = items[1].as_array().ok_or(DecodeError::BadBatch)?.iter().map(decode_event).collect();
    let dp_rank = items.get(2).and_then(Value::as_u64).and_then(|r| u32::try_from(r).ok());
    Ok(WireBatch { ts, events, dp_rank })
}
