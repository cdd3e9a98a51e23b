//! The engines' ZeroMQ wire: frames, replay replies, and the msgpack batch of every released
//! layout, decoded into [`RawBatch`]es that keep each field as the engine sent it.
//!
//! One decoder serves vLLM 0.9 to 0.33+ and SGLang 0.4.6 to 0.5.23+ (see `docs/wire-formats.md`):
//!
//! * a batch is an array `[ts, events]` or `[ts, events, dp_rank]` (extra elements ignored);
//! * an event is a positional array whose element 0 is the tag, or a map with a `type` key.
//!   Positions follow vLLM (`[tag, hashes, parent, token_ids, block_size, lora_id, medium,
//!   lora_name, extra_keys, group_idx, kind, window]`, removals `[tag, hashes, medium,
//!   group_idx]`); SGLang's arrays share the first seven positions, and its 0.5.18/0.5.19 salted
//!   form puts a `{"cache_salt": …}` map at index 7, told apart from vLLM's `lora_name` by type.
//!   Trailing elements and unknown map keys are ignored.
//!
//! Everything here is a pure function of bytes. A field that cannot be read drops its event
//! with a [`DropReason`]; the other events of the batch are kept. Nothing panics on any input
//! (the decoder is fuzzed: `relay/fuzz`).

pub mod msgpack;

use crate::drops::{DropReason, Field};
use crate::model::{Bytes, KeyPart, MapParts, TokenLayout};
use msgpack::{Int, Kind, MsgpackError, Reader};
use std::fmt;

/// The seq frame of the replay end marker: `-1` as 8 big-endian bytes.
pub const END_SEQ: [u8; 8] = [0xff; 8];

/// Why a whole message could not be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MessageError {
    /// Not the expected number of frames.
    FrameCount(usize),
    /// The seq frame is not 8 bytes.
    SeqFrame(usize),
    /// A replay reply whose first frame is not the empty delimiter.
    ReplayDelimiter,
    /// The payload is not msgpack, or is cut short before the events.
    Payload(MsgpackError),
    /// The payload is msgpack but not a batch (`[ts, events, …]`).
    NotABatch,
    /// The batch's timestamp is not a number.
    BatchTs,
    /// The batch's DP rank is neither nil nor an int in `0..2^32`.
    BatchDpRank,
}

impl MessageError {
    /// The stable label (a metric label).
    pub fn as_str(self) -> &'static str {
        match self {
            MessageError::FrameCount(_) => "wrong_frame_count",
            MessageError::SeqFrame(_) => "bad_seq_frame",
            MessageError::ReplayDelimiter => "bad_replay_delimiter",
            MessageError::Payload(MsgpackError::Truncated) => "truncated_payload",
            MessageError::Payload(_) => "not_msgpack",
            MessageError::NotABatch => "not_a_batch",
            MessageError::BatchTs => "invalid_batch_ts",
            MessageError::BatchDpRank => "invalid_batch_dp_rank",
        }
    }
}

impl fmt::Display for MessageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MessageError::FrameCount(n) => write!(f, "{}: {n} frames", self.as_str()),
            MessageError::SeqFrame(n) => write!(f, "{}: {n} bytes", self.as_str()),
            MessageError::Payload(e) => write!(f, "{}: {e}", self.as_str()),
            _ => f.write_str(self.as_str()),
        }
    }
}

impl std::error::Error for MessageError {}

/// The three frames of a published message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Frames<'a> {
    pub topic: &'a [u8],
    pub seq: u64,
    pub payload: &'a [u8],
}

fn seq_of(frame: &[u8]) -> Result<u64, MessageError> {
    let b: [u8; 8] = frame.try_into().map_err(|_| MessageError::SeqFrame(frame.len()))?;
    Ok(u64::from_be_bytes(b))
}

/// Splits a PUB message `[topic, seq (8 bytes BE), payload]`.
pub fn split_pub<'a>(frames: &[&'a [u8]]) -> Result<Frames<'a>, MessageError> {
    match frames {
        [topic, seq, payload] => Ok(Frames { topic, seq: seq_of(seq)?, payload }),
        _ => Err(MessageError::FrameCount(frames.len())),
    }
}

/// One reply read by a DEALER from a replay ROUTER.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplayReply<'a> {
    /// A buffered batch.
    Batch(Frames<'a>),
    /// The end of this replay.
    End,
}

/// Splits a replay reply in either layout: `["", seq, payload]` (vLLM ≤0.25, SGLang ≤0.5.21) or
/// `["", topic, seq, payload]` (vLLM 0.26+, SGLang 0.5.22+). The end marker has an empty payload
/// and the seq `ff×8`; either alone ends the replay.
pub fn split_replay<'a>(frames: &[&'a [u8]]) -> Result<ReplayReply<'a>, MessageError> {
    let (topic, seq, payload) = match frames {
        [[], seq, payload] => (&[][..], *seq, *payload),
        [[], topic, seq, payload] => (*topic, *seq, *payload),
        [d, ..] if !d.is_empty() && (frames.len() == 3 || frames.len() == 4) => {
            return Err(MessageError::ReplayDelimiter)
        }
        _ => return Err(MessageError::FrameCount(frames.len())),
    };
    if payload.is_empty() || seq == END_SEQ {
        return Ok(ReplayReply::End);
    }
    Ok(ReplayReply::Batch(Frames { topic, seq: seq_of(seq)?, payload }))
}

/// Token ids as the engine sent them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RawTokens {
    pub layout: TokenLayout,
    /// Ids, with bigram pairs flattened. Empty when [`RawTokens::wide`] is set.
    pub ids: Vec<u32>,
    /// Positions (ids, or pairs for bigrams) on the wire.
    pub positions: usize,
    /// Some id did not fit `u32` (SGLang's wide form); `ids` is then empty.
    pub wide: bool,
}

/// `BlockStored`, every field as sent (absent and nil are both `None`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RawStored {
    pub block_hashes: Vec<u64>,
    pub parent_block_hash: Option<u64>,
    pub token_ids: RawTokens,
    pub block_size: u32,
    pub lora_id: Option<i64>,
    pub medium: Option<String>,
    pub lora_name: Option<String>,
    pub extra_keys: Option<Vec<Option<KeyPart>>>,
    pub group_idx: Option<u32>,
    pub kv_cache_spec_kind: Option<String>,
    pub kv_cache_spec_sliding_window: Option<u32>,
    pub locality: Option<String>,
    pub ownership: Option<String>,
    pub session_id: Option<String>,
    pub lookahead_token_ids: Option<Vec<Vec<u32>>>,
    pub block_mm_infos: Option<KeyPart>,
    pub cache_salt: Option<String>,
}

/// `BlockRemoved`, every field as sent.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RawRemoved {
    pub block_hashes: Vec<u64>,
    pub medium: Option<String>,
    pub group_idx: Option<u32>,
    pub locality: Option<String>,
    pub ownership: Option<String>,
}

/// `AllBlocksCleared` (no engine sends a medium today; one that does scopes the clear).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RawCleared {
    pub medium: Option<String>,
}

/// One event as the engine sent it.
// Stores dominate the stream and are consumed straight away by the normalizer: boxing them
// would add an allocation per store for no saving.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum RawEvent {
    Stored(RawStored),
    Removed(RawRemoved),
    Cleared(RawCleared),
}

impl RawEvent {
    pub fn type_name(&self) -> &'static str {
        match self {
            RawEvent::Stored(_) => "BlockStored",
            RawEvent::Removed(_) => "BlockRemoved",
            RawEvent::Cleared(_) => "AllBlocksCleared",
        }
    }
}

/// How an event was laid out on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventForm {
    /// A positional array of this many elements.
    Array(usize),
    /// A map of this many entries.
    Map(usize),
}

/// A decoded batch: the events in order, each decoded or dropped with its reason.
#[derive(Debug, Clone, PartialEq)]
pub struct RawBatch {
    pub ts: f64,
    /// The batch's own rank (element 2), when present and not nil.
    pub dp_rank: Option<u32>,
    /// The batch array's length (2 for vLLM 0.9.0 / SGLang 0.4.6, else 3).
    pub batch_len: usize,
    pub events: Vec<Result<RawEvent, DropReason>>,
    /// The payload ended inside the events array: the events before the cut are kept, and the
    /// event the cut fell in is dropped as [`DropReason::Truncated`].
    pub truncated: bool,
}

/// Decodes a batch payload.
pub fn decode_batch(payload: &[u8]) -> Result<RawBatch, MessageError> {
    let mut r = Reader::new(payload);
    let len = match r.array_len() {
        Ok(n) => n,
        Err(MsgpackError::Type(_)) => {
            // Valid msgpack of another shape is "not a batch"; anything else is not msgpack.
            return Err(match Reader::new(payload).skip() {
                Ok(()) => MessageError::NotABatch,
                Err(e) => MessageError::Payload(e),
            });
        }
        Err(e) => return Err(MessageError::Payload(e)),
    };
    if len < 2 {
        return Err(MessageError::NotABatch);
    }
    let ts = match r.number() {
        Ok(ts) => ts,
        Err(MsgpackError::Truncated) => return Err(MessageError::Payload(MsgpackError::Truncated)),
        Err(_) => return Err(MessageError::BatchTs),
    };
    // The claimed count is not checked against the bytes left: a payload cut inside the events
    // keeps the events before the cut (each takes at least one byte, so the loop below ends at
    // the end of the input whatever the header claims).
    let n_events = match r.array_header() {
        Ok(n) => n,
        Err(MsgpackError::Type(_)) => return Err(MessageError::NotABatch),
        Err(e) => return Err(MessageError::Payload(e)),
    };
    let mut events = Vec::with_capacity((n_events as usize).min(r.remaining()).min(1024));
    let mut truncated = false;
    for _ in 0..n_events {
        let start = r.position();
        if let Err(e) = r.skip() {
            // The event runs past the end (or holds a reserved marker): nothing after it can be
            // located, so it and the rest of the batch are cut.
            truncated = true;
            events.push(Err(if e == MsgpackError::Truncated { DropReason::Truncated } else { DropReason::NotAnEvent }));
            break;
        }
        events.push(decode_event(r.slice(start, r.position())).map(|(e, _)| e));
    }
    let mut dp_rank = None;
    if !truncated && len >= 3 {
        if r.eat_nil() {
        } else {
            match r.int() {
                Ok(i) => dp_rank = Some(i.to_u32().ok_or(MessageError::BatchDpRank)?),
                Err(MsgpackError::Truncated) => truncated = true,
                Err(_) => return Err(MessageError::BatchDpRank),
            }
        }
    }
    Ok(RawBatch { ts, dp_rank, batch_len: len, events, truncated })
}

/// Decodes one event from exactly its bytes.
pub fn decode_event(bytes: &[u8]) -> Result<(RawEvent, EventForm), DropReason> {
    let mut r = Reader::new(bytes);
    match r.peek_kind() {
        Ok(Kind::Array) => {
            let n = r.array_len().map_err(|_| DropReason::Truncated)?;
            decode_array_event(&mut r, n).map(|e| (e, EventForm::Array(n)))
        }
        Ok(Kind::Map) => {
            let n = r.map_len().map_err(|_| DropReason::Truncated)?;
            decode_map_event(&mut r, n).map(|e| (e, EventForm::Map(n)))
        }
        _ => Err(DropReason::NotAnEvent),
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Tag {
    Stored,
    Removed,
    Cleared,
}

fn tag_of(s: &str) -> Result<Tag, DropReason> {
    match s {
        "BlockStored" => Ok(Tag::Stored),
        "BlockRemoved" => Ok(Tag::Removed),
        "AllBlocksCleared" => Ok(Tag::Cleared),
        _ => Err(DropReason::UnknownType),
    }
}

/// Reads one field; a value of the wrong type drops the event as `invalid_<field>`.
fn field<T>(
    r: &mut Reader<'_>,
    f: Field,
    read: impl FnOnce(&mut Reader<'_>) -> Result<T, MsgpackError>,
) -> Result<T, DropReason> {
    read(r).map_err(|_| DropReason::Invalid(f))
}

/// Reads a nullable field.
fn opt<T>(
    r: &mut Reader<'_>,
    f: Field,
    read: impl FnOnce(&mut Reader<'_>) -> Result<T, MsgpackError>,
) -> Result<Option<T>, DropReason> {
    if r.eat_nil() {
        return Ok(None);
    }
    field(r, f, read).map(Some)
}

fn read_hash(r: &mut Reader<'_>) -> Result<u64, MsgpackError> {
    match r.peek_kind()? {
        Kind::Bin => {
            let b = r.bin()?;
            if b.is_empty() {
                return Err(MsgpackError::Type(0xc4));
            }
            // The last 8 bytes, big-endian (left-padded when shorter), as vLLM's
            // `int.from_bytes(b, "big") & (2**64 - 1)` and llm-d read them.
            let tail = &b[b.len().saturating_sub(8)..];
            Ok(tail.iter().fold(0u64, |acc, x| (acc << 8) | u64::from(*x)))
        }
        _ => r.int().map(Int::bits),
    }
}

fn read_hashes(r: &mut Reader<'_>) -> Result<Vec<u64>, MsgpackError> {
    let n = r.array_len()?;
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        v.push(read_hash(r)?);
    }
    Ok(v)
}

fn read_u32(r: &mut Reader<'_>) -> Result<u32, MsgpackError> {
    r.int()?.to_u32().ok_or(MsgpackError::Type(0xcf))
}

fn read_i64(r: &mut Reader<'_>) -> Result<i64, MsgpackError> {
    r.int()?.to_i64().ok_or(MsgpackError::Type(0xcf))
}

fn read_string(r: &mut Reader<'_>) -> Result<String, MsgpackError> {
    r.str().map(str::to_owned)
}

/// The longest medium (tier) name taken, in bytes. Engines name media in a few letters
/// (`GPU`, `CPU`, `cpu_pinned`, a connector's name); a tier's name is part of the store's keys
/// and of metric labels, so a longer one drops its event (`invalid_medium`) rather than reach
/// them. The store itself holds names of up to 65,535 bytes.
pub const MAX_MEDIUM_BYTES: usize = 256;

fn read_medium(r: &mut Reader<'_>) -> Result<String, MsgpackError> {
    let s = r.str()?;
    if s.len() > MAX_MEDIUM_BYTES {
        return Err(MsgpackError::TooLong(s.len()));
    }
    Ok(s.to_owned())
}

/// A token id: any non-negative int; `None` when it does not fit `u32`.
fn read_token(r: &mut Reader<'_>) -> Result<Option<u32>, MsgpackError> {
    match r.int()? {
        Int::U(u) => Ok(u32::try_from(u).ok()),
        Int::I(_) => Err(MsgpackError::Type(0xd3)),
    }
}

fn read_tokens(r: &mut Reader<'_>) -> Result<RawTokens, MsgpackError> {
    let n = r.array_len()?;
    let mut t = RawTokens { positions: n, ..RawTokens::default() };
    if n == 0 {
        return Ok(t);
    }
    if r.peek_kind()? == Kind::Array {
        t.layout = TokenLayout::Bigram;
    }
    t.ids.reserve(if t.layout == TokenLayout::Bigram { 2 * n } else { n });
    for _ in 0..n {
        let ids = match t.layout {
            TokenLayout::Single => [read_token(r)?, None],
            TokenLayout::Bigram => {
                if r.array_len()? != 2 {
                    return Err(MsgpackError::Type(0x92));
                }
                let a = read_token(r)?;
                let b = read_token(r)?;
                if a.is_none() || b.is_none() {
                    t.wide = true;
                }
                [a, b]
            }
        };
        match ids {
            [Some(a), None] if t.layout == TokenLayout::Single => t.ids.push(a),
            [Some(a), Some(b)] => t.ids.extend([a, b]),
            _ => t.wide = true,
        }
    }
    if t.wide {
        t.ids = Vec::new();
    }
    Ok(t)
}

fn read_lookahead(r: &mut Reader<'_>) -> Result<Vec<Vec<u32>>, MsgpackError> {
    let n = r.array_len()?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let m = r.array_len()?;
        let mut v = Vec::with_capacity(m);
        for _ in 0..m {
            v.push(read_u32(r)?);
        }
        out.push(v);
    }
    Ok(out)
}

/// Deepest opaque value kept; deeper ones are invalid (engines send depth ≤ 3).
const MAX_KEY_DEPTH: usize = 32;

fn read_key_part(r: &mut Reader<'_>, depth: usize) -> Result<KeyPart, MsgpackError> {
    if depth > MAX_KEY_DEPTH {
        return Err(MsgpackError::Type(0x91));
    }
    Ok(match r.peek_kind()? {
        Kind::Nil => {
            r.eat_nil();
            KeyPart::Nil
        }
        Kind::Bool => KeyPart::Bool(r.bool()?),
        Kind::Int => match r.int()? {
            Int::I(i) => KeyPart::Int(i),
            Int::U(u) => match i64::try_from(u) {
                Ok(i) => KeyPart::Int(i),
                Err(_) => KeyPart::UInt(u),
            },
        },
        Kind::Float => KeyPart::Float(r.number()?),
        Kind::Str => KeyPart::Str(read_string(r)?),
        Kind::Bin => KeyPart::Bytes(Bytes(r.bin()?.to_vec())),
        Kind::Array => {
            let n = r.array_len()?;
            let mut v = Vec::with_capacity(n);
            for _ in 0..n {
                v.push(read_key_part(r, depth + 1)?);
            }
            KeyPart::List(v)
        }
        Kind::Map => {
            let n = r.map_len()?;
            let mut v = Vec::with_capacity(n);
            for _ in 0..n {
                let k = read_key_part(r, depth + 1)?;
                v.push((k, read_key_part(r, depth + 1)?));
            }
            KeyPart::Map(MapParts { map: v })
        }
        Kind::Ext => {
            let start = r.position();
            r.skip()?;
            KeyPart::Bytes(Bytes(r.slice(start, r.position()).to_vec()))
        }
    })
}

fn read_extra_keys(r: &mut Reader<'_>) -> Result<Vec<Option<KeyPart>>, MsgpackError> {
    let n = r.array_len()?;
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        v.push(if r.eat_nil() { None } else { Some(read_key_part(r, 1)?) });
    }
    Ok(v)
}

/// SGLang 0.5.18/0.5.19's `BlockStoredWithMetadata` trailing map: `{"cache_salt": str}`.
fn read_metadata(r: &mut Reader<'_>, s: &mut RawStored) -> Result<(), DropReason> {
    let n = field(r, Field::Metadata, |r| r.map_len())?;
    for _ in 0..n {
        match r.str() {
            Ok("cache_salt") => s.cache_salt = opt(r, Field::CacheSalt, read_string)?,
            Ok(_) => field(r, Field::Metadata, |r| r.skip())?,
            Err(_) => {
                field(r, Field::Metadata, |r| r.skip())?;
                field(r, Field::Metadata, |r| r.skip())?;
            }
        }
    }
    Ok(())
}

fn decode_array_event(r: &mut Reader<'_>, n: usize) -> Result<RawEvent, DropReason> {
    if n == 0 {
        return Err(DropReason::MissingType);
    }
    let tag = tag_of(r.str().map_err(|_| DropReason::MissingType)?)?;
    // `r` holds exactly this event, so reading past its elements is impossible; each
    // position below is read only when the array is long enough to have it.
    let has = |i: usize| i < n;
    match tag {
        Tag::Cleared => {
            // `["AllBlocksCleared"]` has no fields in any release; anything after is ignored.
            Ok(RawEvent::Cleared(RawCleared::default()))
        }
        Tag::Removed => {
            if !has(1) {
                return Err(DropReason::Missing(Field::BlockHashes));
            }
            let mut e =
                RawRemoved { block_hashes: field(r, Field::BlockHashes, read_hashes)?, ..RawRemoved::default() };
            if has(2) {
                e.medium = opt(r, Field::Medium, read_medium)?;
            }
            if has(3) {
                e.group_idx = opt(r, Field::GroupIdx, read_u32)?;
            }
            Ok(RawEvent::Removed(e))
        }
        Tag::Stored => {
            if !has(4) {
                return Err(DropReason::Missing(match n {
                    1 => Field::BlockHashes,
                    2 => Field::ParentBlockHash,
                    3 => Field::TokenIds,
                    _ => Field::BlockSize,
                }));
            }
            let mut e = RawStored {
                block_hashes: field(r, Field::BlockHashes, read_hashes)?,
                parent_block_hash: opt(r, Field::ParentBlockHash, read_hash)?,
                token_ids: field(r, Field::TokenIds, read_tokens)?,
                block_size: field(r, Field::BlockSize, read_u32)?,
                ..RawStored::default()
            };
            if has(5) {
                e.lora_id = opt(r, Field::LoraId, read_i64)?;
            }
            if has(6) {
                e.medium = opt(r, Field::Medium, read_medium)?;
            }
            if has(7) {
                // vLLM 0.14+: lora_name (str | nil); SGLang 0.5.18/19: the salt metadata map.
                if r.peek_kind() == Ok(Kind::Map) {
                    read_metadata(r, &mut e)?;
                } else {
                    e.lora_name = opt(r, Field::LoraName, read_string)?;
                }
            }
            if has(8) {
                e.extra_keys = opt(r, Field::ExtraKeys, read_extra_keys)?;
            }
            if has(9) {
                e.group_idx = opt(r, Field::GroupIdx, read_u32)?;
            }
            if has(10) {
                e.kv_cache_spec_kind = opt(r, Field::KvCacheSpecKind, read_string)?;
            }
            if has(11) {
                e.kv_cache_spec_sliding_window = opt(r, Field::KvCacheSpecSlidingWindow, read_u32)?;
            }
            Ok(RawEvent::Stored(e))
        }
    }
}

fn decode_map_event(r: &mut Reader<'_>, n: usize) -> Result<RawEvent, DropReason> {
    // The tag may come anywhere (msgspec writes it first): fields are collected, then checked.
    let mut tag: Option<Tag> = None;
    let mut s = RawStored::default();
    let (mut hashes, mut tokens, mut block_size) = (false, false, false);
    let mut unknown_tag = false;
    for _ in 0..n {
        let key = match r.str() {
            Ok(k) => k,
            Err(_) => {
                // A non-string key: skip the pair.
                r.skip().map_err(|_| DropReason::Truncated)?;
                r.skip().map_err(|_| DropReason::Truncated)?;
                continue;
            }
        };
        match key {
            "type" => match r.str() {
                Ok(t) => match tag_of(t) {
                    Ok(t) => tag = Some(t),
                    Err(_) => unknown_tag = true,
                },
                Err(_) => return Err(DropReason::MissingType),
            },
            "block_hashes" => {
                s.block_hashes = field(r, Field::BlockHashes, read_hashes)?;
                hashes = true;
            }
            "parent_block_hash" => s.parent_block_hash = opt(r, Field::ParentBlockHash, read_hash)?,
            "token_ids" => {
                s.token_ids = field(r, Field::TokenIds, read_tokens)?;
                tokens = true;
            }
            "block_size" => {
                s.block_size = field(r, Field::BlockSize, read_u32)?;
                block_size = true;
            }
            "lora_id" => s.lora_id = opt(r, Field::LoraId, read_i64)?,
            "medium" => s.medium = opt(r, Field::Medium, read_medium)?,
            "lora_name" => s.lora_name = opt(r, Field::LoraName, read_string)?,
            "extra_keys" => s.extra_keys = opt(r, Field::ExtraKeys, read_extra_keys)?,
            "group_idx" => s.group_idx = opt(r, Field::GroupIdx, read_u32)?,
            "kv_cache_spec_kind" => s.kv_cache_spec_kind = opt(r, Field::KvCacheSpecKind, read_string)?,
            "kv_cache_spec_sliding_window" => {
                s.kv_cache_spec_sliding_window = opt(r, Field::KvCacheSpecSlidingWindow, read_u32)?
            }
            "locality" => s.locality = opt(r, Field::Locality, read_string)?,
            "ownership" => s.ownership = opt(r, Field::Ownership, read_string)?,
            "session_id" => s.session_id = opt(r, Field::SessionId, read_string)?,
            "lookahead_token_ids" => s.lookahead_token_ids = opt(r, Field::LookaheadTokenIds, read_lookahead)?,
            "block_mm_infos" => s.block_mm_infos = opt(r, Field::BlockMmInfos, |r| read_key_part(r, 0))?,
            "cache_salt" => s.cache_salt = opt(r, Field::CacheSalt, read_string)?,
            _ => r.skip().map_err(|_| DropReason::Truncated)?,
        }
    }
    if unknown_tag {
        return Err(DropReason::UnknownType);
    }
    match tag.ok_or(DropReason::MissingType)? {
        Tag::Cleared => Ok(RawEvent::Cleared(RawCleared { medium: s.medium })),
        Tag::Removed => {
            if !hashes {
                return Err(DropReason::Missing(Field::BlockHashes));
            }
            Ok(RawEvent::Removed(RawRemoved {
                block_hashes: s.block_hashes,
                medium: s.medium,
                group_idx: s.group_idx,
                locality: s.locality,
                ownership: s.ownership,
            }))
        }
        Tag::Stored => {
            for (present, f) in
                [(hashes, Field::BlockHashes), (tokens, Field::TokenIds), (block_size, Field::BlockSize)]
            {
                if !present {
                    return Err(DropReason::Missing(f));
                }
            }
            Ok(RawEvent::Stored(s))
        }
    }
}
