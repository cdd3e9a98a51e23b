//! Wire encoders: the engine-side event model and its msgpack payload for every layout of
//! `docs/engine-wire-formats.md`, byte for byte as msgspec writes them.
//!
//! Pure functions over values: no sockets, no clocks.
//!
//! msgspec rules reproduced here:
//! - integers take the smallest marker (positive fixint, `cc..cf`; negative fixint, `d0..d3`);
//! - floats are always float64 (`cb`);
//! - `array_like` structs are written full length for their release (msgspec ignores
//!   `omit_defaults` for arrays);
//! - map structs (`omit_defaults`) leave out fields that have a default and hold it (`None`),
//!   keep fields without a default (possibly nil), write `type` first then declaration order,
//!   and size the map header by the number of *possible* entries (16 or more: `map16`).

use std::fmt;

use rmpv::Value;

/// Which engine produced the bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Engine {
    Vllm,
    Sglang,
}

impl Engine {
    pub fn parse(s: &str) -> Result<Self, WireError> {
        match s.to_ascii_lowercase().as_str() {
            "vllm" => Ok(Engine::Vllm),
            "sglang" => Ok(Engine::Sglang),
            other => Err(WireError::UnknownEngine(other.to_string())),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Engine::Vllm => "vllm",
            Engine::Sglang => "sglang",
        }
    }
}

/// How the replay ROUTER frames its replies (spec 1.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplayLayout {
    /// `["", seq8, payload]`, end `["", ff×8, ""]` (vLLM ≤ 0.25, SGLang ≤ 0.5.21).
    Old,
    /// `["", topic, seq8, payload]`, end `["", "", ff×8, ""]` (vLLM ≥ 0.26, SGLang ≥ 0.5.22).
    New,
}

impl ReplayLayout {
    pub fn parse(s: &str) -> Result<Self, WireError> {
        match s.to_ascii_lowercase().as_str() {
            "old" => Ok(ReplayLayout::Old),
            "new" => Ok(ReplayLayout::New),
            other => Err(WireError::UnknownReplayLayout(other.to_string())),
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum WireError {
    #[error("unknown engine {0:?} (expected vllm or sglang)")]
    UnknownEngine(String),
    #[error("cannot read wire version {0:?} (expected e.g. 0.32 or 0.5.18)")]
    BadVersion(String),
    #[error("unknown replay layout {0:?} (expected old or new)")]
    UnknownReplayLayout(String),
}

/// A release of one engine; every layout decision is derived from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WireVersion {
    pub engine: Engine,
    /// (major, minor, patch); `0.32` is `(0, 32, 0)`.
    pub release: (u32, u32, u32),
}

impl fmt::Display for WireVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (a, b, c) = self.release;
        write!(f, "{} {a}.{b}.{c}", self.engine.name())
    }
}

impl WireVersion {
    pub const fn new(engine: Engine, major: u32, minor: u32, patch: u32) -> Self {
        WireVersion { engine, release: (major, minor, patch) }
    }

    /// `"0.32"`, `"0.9.1"`, `"0.4.6.post5"` (suffixes after the patch number are ignored).
    pub fn parse(engine: Engine, version: &str) -> Result<Self, WireError> {
        let bad = || WireError::BadVersion(version.to_string());
        let mut nums = [0u32; 3];
        let parts: Vec<&str> = version.trim().trim_start_matches('v').split('.').collect();
        if parts.len() < 2 {
            return Err(bad());
        }
        for (i, part) in parts.iter().take(3).enumerate() {
            let digits: String = part.chars().take_while(|c| c.is_ascii_digit()).collect();
            if digits.is_empty() {
                if i == 2 {
                    break; // "0.4.post1"-like: no patch number
                }
                return Err(bad());
            }
            nums[i] = digits.parse().map_err(|_| bad())?;
        }
        Ok(WireVersion::new(engine, nums[0], nums[1], nums[2]))
    }

    /// The newest layout of each engine that this encoder knows.
    pub const fn latest(engine: Engine) -> Self {
        match engine {
            Engine::Vllm => WireVersion::new(Engine::Vllm, 0, 33, 0),
            Engine::Sglang => WireVersion::new(Engine::Sglang, 0, 5, 23),
        }
    }

    fn at_least(&self, major: u32, minor: u32, patch: u32) -> bool {
        self.release >= (major, minor, patch)
    }

    fn is_vllm(&self) -> bool {
        self.engine == Engine::Vllm
    }

    /// The batch carries its DP rank as third element (vLLM ≥ 0.9.1, SGLang ≥ 0.4.7).
    pub fn batch_has_rank(&self) -> bool {
        if self.is_vllm() {
            self.at_least(0, 9, 1)
        } else {
            self.at_least(0, 4, 7)
        }
    }

    /// Events are msgpack maps (vLLM ≥ 0.24, SGLang ≥ 0.5.20); before, positional arrays.
    pub fn events_are_maps(&self) -> bool {
        if self.is_vllm() {
            self.at_least(0, 24, 0)
        } else {
            self.at_least(0, 5, 20)
        }
    }

    /// The replay layout this release answers with.
    pub fn replay_layout(&self) -> ReplayLayout {
        let new = if self.is_vllm() { self.at_least(0, 26, 0) } else { self.at_least(0, 5, 22) };
        if new {
            ReplayLayout::New
        } else {
            ReplayLayout::Old
        }
    }

    /// The events carry a `medium` field.
    pub fn has_medium(&self) -> bool {
        if self.is_vllm() {
            self.at_least(0, 10, 2)
        } else {
            self.at_least(0, 5, 9)
        }
    }

    /// The events carry `group_idx` (vLLM ≥ 0.20 only).
    pub fn has_group_idx(&self) -> bool {
        self.is_vllm() && self.at_least(0, 20, 0)
    }

    /// SGLang's first batch after start carries `AllBlocksCleared`.
    pub fn clears_on_start(&self) -> bool {
        self.engine == Engine::Sglang
    }

    fn vllm_stored_fields(&self) -> Vec<Field> {
        use Field::*;
        let mut f = vec![BlockHashes, Parent, TokenIds, BlockSize, LoraId];
        if self.at_least(0, 10, 2) {
            f.push(Medium);
        }
        if self.at_least(0, 14, 0) {
            f.push(LoraName);
        }
        if self.at_least(0, 17, 0) {
            f.push(ExtraKeys);
        }
        if self.at_least(0, 20, 0) {
            f.push(GroupIdx);
        }
        if self.at_least(0, 22, 0) {
            f.push(Kind);
            f.push(Window);
        }
        if self.at_least(0, 26, 0) {
            f.push(Locality);
        }
        if self.at_least(0, 29, 0) {
            f.push(Ownership);
        }
        if self.at_least(0, 30, 0) {
            f.push(SessionId);
        }
        if self.at_least(0, 33, 0) {
            f.push(Lookahead);
        }
        f
    }

    fn vllm_removed_fields(&self) -> Vec<Field> {
        use Field::*;
        let mut f = vec![BlockHashes];
        if self.at_least(0, 10, 2) {
            f.push(Medium);
        }
        if self.at_least(0, 20, 0) {
            f.push(GroupIdx);
        }
        if self.at_least(0, 26, 0) {
            f.push(Locality);
        }
        if self.at_least(0, 29, 0) {
            f.push(Ownership);
        }
        f
    }

    fn sglang_stored_fields(&self) -> Vec<Field> {
        use Field::*;
        let mut f = vec![BlockHashes, Parent, TokenIds, BlockSize, LoraId];
        if self.at_least(0, 5, 9) {
            f.push(Medium);
        }
        if self.at_least(0, 5, 20) {
            f.push(CacheSalt);
            f.push(SessionId);
        }
        if self.at_least(0, 5, 22) {
            f.push(LoraName);
        }
        f
    }

    fn sglang_removed_fields(&self) -> Vec<Field> {
        let mut f = vec![Field::BlockHashes];
        if self.at_least(0, 5, 9) {
            f.push(Field::Medium);
        }
        f
    }

    /// 0.5.18–0.5.19: a salted store is `BlockStoredWithMetadata`, 8 elements ending in
    /// `{"cache_salt": salt}`.
    fn sglang_salt_metadata(&self) -> bool {
        !self.is_vllm() && self.at_least(0, 5, 18) && !self.at_least(0, 5, 20)
    }
}

/// A field of an event struct, in no particular order (order comes from the field lists).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    BlockHashes,
    Parent,
    TokenIds,
    BlockSize,
    LoraId,
    Medium,
    LoraName,
    ExtraKeys,
    GroupIdx,
    Kind,
    Window,
    Locality,
    Ownership,
    SessionId,
    Lookahead,
    CacheSalt,
}

impl Field {
    fn key(self) -> &'static str {
        match self {
            Field::BlockHashes => "block_hashes",
            Field::Parent => "parent_block_hash",
            Field::TokenIds => "token_ids",
            Field::BlockSize => "block_size",
            Field::LoraId => "lora_id",
            Field::Medium => "medium",
            Field::LoraName => "lora_name",
            Field::ExtraKeys => "extra_keys",
            Field::GroupIdx => "group_idx",
            Field::Kind => "kv_cache_spec_kind",
            Field::Window => "kv_cache_spec_sliding_window",
            Field::Locality => "locality",
            Field::Ownership => "ownership",
            Field::SessionId => "session_id",
            Field::Lookahead => "lookahead_token_ids",
            Field::CacheSalt => "cache_salt",
        }
    }

    /// In map mode: a field without a default is always written (possibly nil).
    fn always_present(self, engine: Engine) -> bool {
        match self {
            Field::BlockHashes | Field::Parent | Field::TokenIds | Field::BlockSize | Field::LoraId => true,
            // vLLM: `medium` and `lora_name` have no default; SGLang: `medium=None`, `lora_name=None`.
            Field::Medium => engine == Engine::Vllm,
            Field::LoraName => engine == Engine::Vllm,
            _ => false,
        }
    }
}

/// A block hash as the engine puts it on the wire.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BlockHash {
    /// Unsigned int (vLLM int hashes, often ≥ 2^63 → `cf`).
    U64(u64),
    /// Signed int (SGLang's i64 hashes, vLLM 0.9 builtin `hash()`): negative → `d0..d3`.
    I64(i64),
    /// Raw digest bytes (vLLM with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`).
    Bytes(Vec<u8>),
}

impl BlockHash {
    /// The normalised value every consumer indexes by: ints as two's complement u64,
    /// bytes as their last 8 bytes big-endian (left-padded when shorter).
    pub fn as_u64(&self) -> u64 {
        match self {
            BlockHash::U64(v) => *v,
            BlockHash::I64(v) => *v as u64,
            BlockHash::Bytes(b) => bytes_tail_u64(b),
        }
    }
}

/// The last 8 bytes of `b`, big-endian, left-padded with zeros when shorter.
pub fn bytes_tail_u64(b: &[u8]) -> u64 {
    let tail = &b[b.len().saturating_sub(8)..];
    tail.iter().fold(0u64, |acc, &x| (acc << 8) | u64::from(x))
}

/// `token_ids` of a store: plain ids, or EAGLE bigram pairs (SGLang).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum TokenIds {
    Single(Vec<u64>),
    Pairs(Vec<[u64; 2]>),
    #[default]
    Empty,
}

impl TokenIds {
    pub fn len(&self) -> usize {
        match self {
            TokenIds::Single(v) => v.len(),
            TokenIds::Pairs(v) => v.len(),
            TokenIds::Empty => 0,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// `BlockStored`, with the union of every release's fields. Fields a release lacks are not
/// written; `cache_salt` is only an SGLang field (vLLM puts the salt in `extra_keys`).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Stored {
    pub hashes: Vec<BlockHash>,
    pub parent: Option<BlockHash>,
    pub token_ids: TokenIds,
    pub block_size: u32,
    pub lora_id: Option<i64>,
    pub medium: Option<String>,
    pub lora_name: Option<String>,
    /// One entry per block: `Value::Nil` or an array (the untagged tuple).
    pub extra_keys: Option<Vec<Value>>,
    pub group_idx: Option<u32>,
    pub kind: Option<String>,
    pub sliding_window: Option<u32>,
    pub locality: Option<String>,
    pub ownership: Option<String>,
    pub cache_salt: Option<String>,
    pub session_id: Option<String>,
    pub lookahead_token_ids: Option<Vec<Vec<u64>>>,
}

/// `BlockRemoved`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Removed {
    pub hashes: Vec<BlockHash>,
    pub medium: Option<String>,
    pub group_idx: Option<u32>,
    pub locality: Option<String>,
    pub ownership: Option<String>,
}

/// One KV-cache event as the engine produces it.
// Events are built once and encoded once; boxing `Stored` would only add noise.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum EngineEvent {
    Stored(Stored),
    Removed(Removed),
    Cleared,
}

impl EngineEvent {
    pub fn tag(&self) -> &'static str {
        match self {
            EngineEvent::Stored(_) => "BlockStored",
            EngineEvent::Removed(_) => "BlockRemoved",
            EngineEvent::Cleared => "AllBlocksCleared",
        }
    }

    /// One stored event of `blocks` blocks of 4 token ids past `u16` (5 bytes each in msgpack)
    /// under 64-bit hashes counting down from `u64::MAX`: about 29 bytes a block on the wire,
    /// for batches larger than a bound.
    pub fn large_store(blocks: u64) -> EngineEvent {
        EngineEvent::Stored(Stored {
            hashes: (0..blocks).map(|i| BlockHash::U64(u64::MAX - i)).collect(),
            token_ids: TokenIds::Single((0..blocks * 4).map(|t| 100_000 + t).collect()),
            block_size: 4,
            ..Stored::default()
        })
    }
}

/// A `KVEventBatch`.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    pub ts: f64,
    pub events: Vec<EngineEvent>,
    /// `data_parallel_rank` / `attn_dp_rank` (written only by releases that have it).
    pub dp_rank: Option<u32>,
}

/// A thin msgpack writer over a `Vec<u8>` with msgspec's marker choices.
struct Enc {
    buf: Vec<u8>,
}

// Writing into a Vec<u8> cannot fail; rmp's signatures are generic over io errors.
const VEC_WRITE: &str = "writing msgpack into a Vec cannot fail";

impl Enc {
    fn uint(&mut self, v: u64) {
        rmp::encode::write_uint(&mut self.buf, v).expect(VEC_WRITE);
    }
    fn sint(&mut self, v: i64) {
        rmp::encode::write_sint(&mut self.buf, v).expect(VEC_WRITE);
    }
    fn nil(&mut self) {
        rmp::encode::write_nil(&mut self.buf).expect(VEC_WRITE);
    }
    fn f64(&mut self, v: f64) {
        rmp::encode::write_f64(&mut self.buf, v).expect(VEC_WRITE);
    }
    fn str(&mut self, s: &str) {
        rmp::encode::write_str(&mut self.buf, s).expect(VEC_WRITE);
    }
    fn bin(&mut self, b: &[u8]) {
        rmp::encode::write_bin(&mut self.buf, b).expect(VEC_WRITE);
    }
    fn array(&mut self, len: usize) {
        rmp::encode::write_array_len(&mut self.buf, len as u32).expect(VEC_WRITE);
    }
    /// A map header the way msgspec sizes it: by the possible entries of the struct.
    fn struct_map(&mut self, len: usize, possible: usize) {
        if possible < 16 {
            rmp::encode::write_map_len(&mut self.buf, len as u32).expect(VEC_WRITE);
        } else {
            self.buf.push(0xde);
            self.buf.extend_from_slice(&(len as u16).to_be_bytes());
        }
    }
    fn opt_str(&mut self, s: &Option<String>) {
        match s {
            Some(s) => self.str(s),
            None => self.nil(),
        }
    }
    fn opt_uint(&mut self, v: Option<u64>) {
        match v {
            Some(v) => self.uint(v),
            None => self.nil(),
        }
    }
    fn hash(&mut self, h: &BlockHash) {
        match h {
            BlockHash::U64(v) => self.uint(*v),
            BlockHash::I64(v) => self.sint(*v),
            BlockHash::Bytes(b) => self.bin(b),
        }
    }
    fn hashes(&mut self, hs: &[BlockHash]) {
        self.array(hs.len());
        for h in hs {
            self.hash(h);
        }
    }
    fn token_ids(&mut self, t: &TokenIds) {
        match t {
            TokenIds::Single(v) => {
                self.array(v.len());
                for &x in v {
                    self.uint(x);
                }
            }
            TokenIds::Pairs(v) => {
                self.array(v.len());
                for [a, b] in v {
                    self.array(2);
                    self.uint(*a);
                    self.uint(*b);
                }
            }
            TokenIds::Empty => self.array(0),
        }
    }
    fn value(&mut self, v: &Value) {
        match v {
            Value::Nil => self.nil(),
            Value::Boolean(b) => {
                rmp::encode::write_bool(&mut self.buf, *b).expect(VEC_WRITE);
            }
            Value::Integer(i) => {
                if let Some(u) = i.as_u64() {
                    self.uint(u)
                } else if let Some(s) = i.as_i64() {
                    self.sint(s)
                }
            }
            Value::F32(f) => self.f64(f64::from(*f)),
            Value::F64(f) => self.f64(*f),
            Value::String(s) => match s.as_str() {
                Some(s) => self.str(s),
                None => {
                    let b = s.as_bytes();
                    rmp::encode::write_str_len(&mut self.buf, b.len() as u32).expect(VEC_WRITE);
                    self.buf.extend_from_slice(b);
                }
            },
            Value::Binary(b) => self.bin(b),
            Value::Array(items) => {
                self.array(items.len());
                for x in items {
                    self.value(x);
                }
            }
            Value::Map(entries) => {
                rmp::encode::write_map_len(&mut self.buf, entries.len() as u32).expect(VEC_WRITE);
                for (k, x) in entries {
                    self.value(k);
                    self.value(x);
                }
            }
            Value::Ext(ty, data) => {
                rmp::encode::write_ext_meta(&mut self.buf, data.len() as u32, *ty).expect(VEC_WRITE);
                self.buf.extend_from_slice(data);
            }
        }
    }
    fn extra_keys(&mut self, e: &Option<Vec<Value>>) {
        match e {
            None => self.nil(),
            Some(items) => {
                self.array(items.len());
                for x in items {
                    self.value(x);
                }
            }
        }
    }
    fn lookahead(&mut self, l: &Option<Vec<Vec<u64>>>) {
        match l {
            None => self.nil(),
            Some(rows) => {
                self.array(rows.len());
                for row in rows {
                    self.array(row.len());
                    for &t in row {
                        self.uint(t);
                    }
                }
            }
        }
    }

    fn stored_field(&mut self, f: Field, s: &Stored) {
        match f {
            Field::BlockHashes => self.hashes(&s.hashes),
            Field::Parent => match &s.parent {
                Some(h) => self.hash(h),
                None => self.nil(),
            },
            Field::TokenIds => self.token_ids(&s.token_ids),
            Field::BlockSize => self.uint(u64::from(s.block_size)),
            Field::LoraId => match s.lora_id {
                Some(v) => self.sint(v),
                None => self.nil(),
            },
            Field::Medium => self.opt_str(&s.medium),
            Field::LoraName => self.opt_str(&s.lora_name),
            Field::ExtraKeys => self.extra_keys(&s.extra_keys),
            Field::GroupIdx => self.opt_uint(s.group_idx.map(u64::from)),
            Field::Kind => self.opt_str(&s.kind),
            Field::Window => self.opt_uint(s.sliding_window.map(u64::from)),
            Field::Locality => self.opt_str(&s.locality),
            Field::Ownership => self.opt_str(&s.ownership),
            Field::SessionId => self.opt_str(&s.session_id),
            Field::Lookahead => self.lookahead(&s.lookahead_token_ids),
            Field::CacheSalt => self.opt_str(&s.cache_salt),
        }
    }

    fn removed_field(&mut self, f: Field, r: &Removed) {
        match f {
            Field::BlockHashes => self.hashes(&r.hashes),
            Field::Medium => self.opt_str(&r.medium),
            Field::GroupIdx => self.opt_uint(r.group_idx.map(u64::from)),
            Field::Locality => self.opt_str(&r.locality),
            Field::Ownership => self.opt_str(&r.ownership),
            other => unreachable!("{other:?} is not a BlockRemoved field"),
        }
    }
}

fn stored_field_is_none(f: Field, s: &Stored) -> bool {
    match f {
        Field::BlockHashes | Field::TokenIds | Field::BlockSize => false,
        Field::Parent => s.parent.is_none(),
        Field::LoraId => s.lora_id.is_none(),
        Field::Medium => s.medium.is_none(),
        Field::LoraName => s.lora_name.is_none(),
        Field::ExtraKeys => s.extra_keys.is_none(),
        Field::GroupIdx => s.group_idx.is_none(),
        Field::Kind => s.kind.is_none(),
        Field::Window => s.sliding_window.is_none(),
        Field::Locality => s.locality.is_none(),
        Field::Ownership => s.ownership.is_none(),
        Field::SessionId => s.session_id.is_none(),
        Field::Lookahead => s.lookahead_token_ids.is_none(),
        Field::CacheSalt => s.cache_salt.is_none(),
    }
}

fn removed_field_is_none(f: Field, r: &Removed) -> bool {
    match f {
        Field::Medium => r.medium.is_none(),
        Field::GroupIdx => r.group_idx.is_none(),
        Field::Locality => r.locality.is_none(),
        Field::Ownership => r.ownership.is_none(),
        _ => false,
    }
}

/// Encode one event in the layout of `wire`.
fn encode_event(enc: &mut Enc, wire: &WireVersion, ev: &EngineEvent) {
    let maps = wire.events_are_maps();
    match ev {
        EngineEvent::Cleared => {
            if maps {
                enc.struct_map(1, 1);
                enc.str("type");
            } else {
                enc.array(1);
            }
            enc.str("AllBlocksCleared");
        }
        EngineEvent::Stored(s) => {
            let fields = if wire.is_vllm() { wire.vllm_stored_fields() } else { wire.sglang_stored_fields() };
            if maps {
                let present: Vec<Field> = fields
                    .iter()
                    .copied()
                    .filter(|f| f.always_present(wire.engine) || !stored_field_is_none(*f, s))
                    .collect();
                enc.struct_map(present.len() + 1, fields.len() + 1);
                enc.str("type");
                enc.str("BlockStored");
                for f in present {
                    enc.str(f.key());
                    enc.stored_field(f, s);
                }
            } else {
                let salted = wire.sglang_salt_metadata() && s.cache_salt.is_some();
                enc.array(fields.len() + 1 + usize::from(salted));
                enc.str("BlockStored");
                for f in fields {
                    enc.stored_field(f, s);
                }
                if let (true, Some(salt)) = (salted, &s.cache_salt) {
                    enc.struct_map(1, 1);
                    enc.str("cache_salt");
                    enc.str(salt);
                }
            }
        }
        EngineEvent::Removed(r) => {
            let fields = if wire.is_vllm() { wire.vllm_removed_fields() } else { wire.sglang_removed_fields() };
            if maps {
                let present: Vec<Field> = fields
                    .iter()
                    .copied()
                    .filter(|f| f.always_present(wire.engine) || !removed_field_is_none(*f, r))
                    .collect();
                enc.struct_map(present.len() + 1, fields.len() + 1);
                enc.str("type");
                enc.str("BlockRemoved");
                for f in present {
                    enc.str(f.key());
                    enc.removed_field(f, r);
                }
            } else {
                enc.array(fields.len() + 1);
                enc.str("BlockRemoved");
                for f in fields {
                    enc.removed_field(f, r);
                }
            }
        }
    }
}

/// The msgpack payload of `batch` as the release `wire` publishes it.
pub fn encode_batch(wire: &WireVersion, batch: &Batch) -> Vec<u8> {
    let mut enc = Enc { buf: Vec::with_capacity(64 + 64 * batch.events.len()) };
    let with_rank = wire.batch_has_rank();
    enc.array(if with_rank { 3 } else { 2 });
    enc.f64(batch.ts);
    enc.array(batch.events.len());
    for ev in &batch.events {
        encode_event(&mut enc, wire, ev);
    }
    if with_rank {
        enc.opt_uint(batch.dp_rank.map(u64::from));
    }
    enc.buf
}

/// Encode a single event on its own (for building batches with a malformed neighbour).
pub fn encode_event_bytes(wire: &WireVersion, ev: &EngineEvent) -> Vec<u8> {
    let mut enc = Enc { buf: Vec::new() };
    encode_event(&mut enc, wire, ev);
    enc.buf
}

/// Assemble a batch payload from already-encoded events (any bytes), as `encode_batch` would.
pub fn encode_batch_raw(wire: &WireVersion, ts: f64, events: &[Vec<u8>], dp_rank: Option<u32>) -> Vec<u8> {
    let mut enc = Enc { buf: Vec::new() };
    let with_rank = wire.batch_has_rank();
    enc.array(if with_rank { 3 } else { 2 });
    enc.f64(ts);
    enc.array(events.len());
    for e in events {
        enc.buf.extend_from_slice(e);
    }
    if with_rank {
        enc.opt_uint(dp_rank.map(u64::from));
    }
    enc.buf
}

/// The key list (map) or length (array) each event of `batch` gets under `wire`, in the
/// manifests' `wire_form` notation: `map['type', ...]` or `array(len=N)`.
pub fn wire_form(wire: &WireVersion, ev: &EngineEvent) -> String {
    let bytes = encode_event_bytes(wire, ev);
    let v = rmpv::decode::read_value(&mut bytes.as_slice()).expect("own encoding decodes");
    match v {
        Value::Map(entries) => {
            let keys: Vec<String> = entries.iter().map(|(k, _)| format!("'{}'", k.as_str().unwrap_or("?"))).collect();
            format!("map[{}]", keys.join(", "))
        }
        Value::Array(items) => format!("array(len={})", items.len()),
        _ => "?".to_string(),
    }
}

#[cfg(test)]
mod tests;
