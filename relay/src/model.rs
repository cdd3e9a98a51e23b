//! The relay's normalized model: one shape for every engine and wire layout.
//!
//! The wire decoder ([`crate::wire`]) reads bytes into [`crate::wire::RawEvent`]s that keep every
//! field as the engine sent it; the normalizer ([`crate::normalize`]) turns those into the types
//! here. Everything downstream (the store, the gRPC streams, the router client) speaks this model.
//!
//! Block hashes are always `u64`: unsigned ints as they are, signed ints by their bit pattern
//! (SGLang's i64), byte strings by their last 8 bytes read big-endian (vLLM's raw digests).

use serde::{Deserialize, Serialize};
use std::fmt;

/// An engine block hash, normalized to 64 bits.
pub type BlockHash = u64;

/// Where a block lives. Derived from the engine's `medium` string, case-insensitively.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    /// Accelerator memory: `GPU`, and events that carry no medium at all (releases before vLLM
    /// 0.10.2 and SGLang 0.5.9 published only the device block pool).
    Device,
    /// Host memory: `CPU`, `CPU_PINNED`.
    Host,
    /// Local or shared storage: `DISK`, `STORAGE`, and vLLM 0.26's `FS` / `OBJ` (renamed
    /// `STORAGE` in 0.27).
    Disk,
    /// A store outside the worker: `EXTERNAL`.
    External,
    /// Any other medium, kept as the engine spelled it.
    Other(String),
}

impl Tier {
    /// Maps an engine's `medium` to a tier.
    pub fn from_medium(medium: Option<&str>) -> Tier {
        let Some(m) = medium else {
            return Tier::Device;
        };
        let known = [
            ("gpu", Tier::Device),
            ("cpu", Tier::Host),
            ("cpu_pinned", Tier::Host),
            ("disk", Tier::Disk),
            ("storage", Tier::Disk),
            ("fs", Tier::Disk),
            ("obj", Tier::Disk),
            ("external", Tier::External),
        ];
        known
            .into_iter()
            .find(|(name, _)| m.eq_ignore_ascii_case(name))
            .map(|(_, t)| t)
            .unwrap_or_else(|| Tier::Other(m.to_string()))
    }

    /// The tier's name: `device`, `host`, `disk`, `external`, or the raw medium.
    pub fn as_str(&self) -> &str {
        match self {
            Tier::Device => "device",
            Tier::Host => "host",
            Tier::Disk => "disk",
            Tier::External => "external",
            Tier::Other(s) => s,
        }
    }

    /// Parses a tier name as [`Tier::as_str`] prints it.
    pub fn parse(s: &str) -> Tier {
        match s {
            "device" => Tier::Device,
            "host" => Tier::Host,
            "disk" => Tier::Disk,
            "external" => Tier::External,
            other => Tier::Other(other.to_string()),
        }
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One element of an opaque engine value (extra keys, multimodal infos), kept losslessly.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum KeyPart {
    Nil,
    Bool(bool),
    Int(i64),
    /// Unsigned values above `i64::MAX`.
    UInt(u64),
    Float(f64),
    Str(String),
    Bytes(#[serde(with = "hex_bytes")] Bytes),
    List(Vec<KeyPart>),
    Map(MapParts),
}

/// A msgpack map inside a [`KeyPart`], entries in wire order; serialized as `{"map": [[k, v], …]}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MapParts {
    pub map: Vec<(KeyPart, KeyPart)>,
}

/// A byte string inside a [`KeyPart`]; serialized as `{"bytes_hex": "…"}` in JSON.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bytes(pub Vec<u8>);

mod hex_bytes {
    use super::Bytes;
    use serde::{Deserializer, Serialize, Serializer};

    #[derive(Serialize)]
    struct Hex {
        bytes_hex: String,
    }

    pub fn serialize<S: Serializer>(b: &Bytes, s: S) -> Result<S::Ok, S::Error> {
        let bytes_hex = b.0.iter().map(|x| format!("{x:02x}")).collect();
        Hex { bytes_hex }.serialize(s)
    }

    /// Only a map `{"bytes_hex": …}` is a byte string: a derived struct would also accept a
    /// one-element sequence, and an untagged `KeyPart::List(["ab"])` would read back as bytes.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Bytes, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = String;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a map {\"bytes_hex\": hex}")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut m: A) -> Result<String, A::Error> {
                let mut hex = None;
                while let Some(k) = m.next_key::<String>()? {
                    if k != "bytes_hex" || hex.is_some() {
                        return Err(serde::de::Error::custom("expected only bytes_hex"));
                    }
                    hex = Some(m.next_value::<String>()?);
                }
                hex.ok_or_else(|| serde::de::Error::missing_field("bytes_hex"))
            }
        }
        let hex = d.deserialize_map(V)?;
        let s = hex.as_bytes();
        if s.len() % 2 != 0 {
            return Err(serde::de::Error::custom("odd hex length"));
        }
        s.chunks(2)
            .map(|p| {
                std::str::from_utf8(p)
                    .ok()
                    .and_then(|p| u8::from_str_radix(p, 16).ok())
                    .ok_or_else(|| serde::de::Error::custom("bad hex"))
            })
            .collect::<Result<Vec<u8>, _>>()
            .map(Bytes)
    }
}

/// The cache namespace a block was stored under: blocks of different namespaces never share a
/// prefix even when their tokens do (the engine folds these into the hash).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Namespace {
    /// The LoRA adapter's name (vLLM 0.14+, SGLang 0.5.22+).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub lora_name: Option<String>,
    /// The LoRA adapter's numeric id (deprecated by vLLM 0.14 in favour of the name).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub lora_id: Option<i64>,
    /// The cache salt (SGLang 0.5.18+ carries it as a field; vLLM only inside `extra_keys`).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub cache_salt: Option<String>,
}

impl Namespace {
    pub fn is_default(&self) -> bool {
        self.lora_name.is_none() && self.lora_id.is_none() && self.cache_salt.is_none()
    }
}

/// How a store's token ids are laid out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenLayout {
    /// One token id per position.
    #[default]
    Single,
    /// EAGLE bigram pages (SGLang): each position is a pair `(a, b)`, flattened as `a, b` in
    /// [`Block::token_ids`]; `block_size` counts pairs.
    Bigram,
}

/// One block of a store, with the token ids it covers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Block {
    pub hash: BlockHash,
    /// The block's token ids (pairs flattened for [`TokenLayout::Bigram`]). Empty when the
    /// engine sent none for this block (offload placeholders, short `token_ids`).
    pub token_ids: Vec<u32>,
    /// vLLM's per-block `extra_keys` entry (LoRA, multimodal ids, salt), as sent.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub extra_keys: Option<KeyPart>,
}

impl Block {
    /// A block with its token ids and no extra keys.
    pub fn new(hash: BlockHash, token_ids: Vec<u32>) -> Block {
        Block { hash, token_ids, extra_keys: None }
    }
}

/// A KV-cache group (vLLM 0.20+; engines without groups are group 0).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Group {
    pub idx: u32,
    /// The group's spec kind as the engine named it (`full_attention`, `sliding_window`, …).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub kind: Option<String>,
    /// The sliding window in tokens, for window groups.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub sliding_window: Option<u32>,
}

/// Blocks stored: each hash is one new physical copy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Stored {
    pub tier: Tier,
    pub group: Group,
    /// The hash of the block before the first one (`None` at the start of a sequence).
    pub parent: Option<BlockHash>,
    /// Tokens (or pairs) per block, as the engine sent it.
    pub block_size: u32,
    pub token_layout: TokenLayout,
    pub blocks: Vec<Block>,
    #[serde(default, skip_serializing_if = "Namespace::is_default")]
    pub namespace: Namespace,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub session_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub ownership: Option<String>,
    /// vLLM 0.33 lookahead tokens per block.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub lookahead_token_ids: Option<Vec<Vec<u32>>>,
    /// Multimodal block infos, opaque.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub block_mm_infos: Option<KeyPart>,
}

impl Stored {
    /// Blocks of `group` (a main-attention group) in `tier`, one token per id, with no parent,
    /// namespace, session, ownership, lookahead or multimodal infos.
    pub fn plain(tier: Tier, group: u32, block_size: u32, blocks: Vec<Block>) -> Stored {
        Stored {
            tier,
            group: Group { idx: group, kind: None, sliding_window: None },
            parent: None,
            block_size,
            token_layout: TokenLayout::Single,
            blocks,
            namespace: Namespace::default(),
            session_id: None,
            ownership: None,
            lookahead_token_ids: None,
            block_mm_infos: None,
        }
    }
}

/// Blocks removed: each hash takes one physical copy away.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Removed {
    pub tier: Tier,
    pub group: u32,
    pub block_hashes: Vec<BlockHash>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub ownership: Option<String>,
}

/// Every block of the rank dropped (or of one tier, when the engine scopes it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cleared {
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub tier: Option<Tier>,
}

/// One normalized event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Event {
    Stored(Stored),
    Removed(Removed),
    Cleared(Cleared),
}

impl Event {
    /// The event kind's name: `stored`, `removed` or `cleared`.
    pub fn kind(&self) -> &'static str {
        match self {
            Event::Stored(_) => "stored",
            Event::Removed(_) => "removed",
            Event::Cleared(_) => "cleared",
        }
    }

    /// Block operations this event carries (one per stored or removed hash; a clear counts 1).
    pub fn block_ops(&self) -> usize {
        match self {
            Event::Stored(s) => s.blocks.len(),
            Event::Removed(r) => r.block_hashes.len(),
            Event::Cleared(_) => 1,
        }
    }
}

/// The engine's load, scraped from its `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Load {
    pub running: f64,
    pub waiting: f64,
    /// KV-cache usage, 0..1.
    pub kv_usage: f64,
    /// Unix milliseconds of the scrape.
    pub scraped_at_ms: u64,
}

/// Whether the engine serves, as the relay sees it from beside it (its health endpoint, its
/// progress counters and its KV events).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EngineState {
    /// The health endpoint answers and the engine progresses (or has nothing to do).
    Alive,
    /// The health endpoint does not answer in time, or answers an error.
    Unreachable,
    /// The health endpoint answers, but requests run and nothing progresses.
    Wedged,
    /// Nothing listens on the health endpoint.
    Stopped,
}

impl EngineState {
    pub fn as_str(self) -> &'static str {
        match self {
            EngineState::Alive => "alive",
            EngineState::Unreachable => "unreachable",
            EngineState::Wedged => "wedged",
            EngineState::Stopped => "stopped",
        }
    }
}

/// A rank's engine liveness: the state, why (empty when alive), when it began and when it was
/// observed (Unix milliseconds).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Liveness {
    pub state: EngineState,
    pub reason: String,
    pub since_ms: u64,
    pub observed_at_ms: u64,
}

/// One engine batch after normalization.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Batch {
    /// The DP rank that published it.
    pub dp_rank: u32,
    /// The engine publisher's sequence number.
    pub seq: u64,
    /// The engine's timestamp (seconds since the epoch).
    pub ts: f64,
    pub events: Vec<Event>,
}

/// A rank-scoped change of the relay's knowledge of the engine, carried in the history and the
/// streams in order with the batches.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ControlKind {
    /// The rank's publisher restarted: every block of the rank is gone; rebuild from what follows.
    RankReset { reason: String },
    /// A gap the replay buffer could not cover: removals may be missing, so stale blocks may be
    /// held until the rank's state is known again.
    RankDegraded { reason: String },
    /// The engine had announced blocks before the relay could see them (its replay buffer no
    /// longer starts at seq 0): old blocks may be missing, no stale ones are held.
    RankIncomplete { reason: String },
    /// The rank's state is known again (a clear or a restart after degraded/incomplete).
    RankRecovered,
}

/// A rank's condition as its control records leave it: one model for the ingest (which decides
/// it), the store (which keeps it for a restart) and the status (which serves it).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(tag = "health", rename_all = "snake_case")]
pub enum RankHealth {
    /// Following the rank; nothing missed.
    #[default]
    Ok,
    /// A gap could not be refilled: stale blocks may be held.
    Degraded { reason: String },
    /// Blocks announced before the relay saw the rank may be missing; none is stale.
    Incomplete { reason: String },
}

impl RankHealth {
    /// The health after `kind`: degraded wins over incomplete, only a recovery (an
    /// `AllBlocksCleared`, or a publisher restart) makes either ok, and a reset leaves it as it
    /// is (the recovery that follows it says so).
    pub fn after(&self, kind: &ControlKind) -> RankHealth {
        match kind {
            ControlKind::RankDegraded { reason } => RankHealth::Degraded { reason: reason.clone() },
            ControlKind::RankIncomplete { reason } if self.is_ok() => RankHealth::Incomplete { reason: reason.clone() },
            ControlKind::RankRecovered => RankHealth::Ok,
            ControlKind::RankIncomplete { .. } | ControlKind::RankReset { .. } => self.clone(),
        }
    }

    pub fn is_ok(&self) -> bool {
        *self == RankHealth::Ok
    }

    /// `ok`, `degraded` or `incomplete`.
    pub fn as_str(&self) -> &'static str {
        match self {
            RankHealth::Ok => "ok",
            RankHealth::Degraded { .. } => "degraded",
            RankHealth::Incomplete { .. } => "incomplete",
        }
    }

    /// Why the rank is not ok (empty when it is).
    pub fn reason(&self) -> &str {
        match self {
            RankHealth::Ok => "",
            RankHealth::Degraded { reason } | RankHealth::Incomplete { reason } => reason,
        }
    }
}

/// A control event for one rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Control {
    pub dp_rank: u32,
    #[serde(flatten)]
    pub kind: ControlKind,
}

/// What one history entry holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "record", rename_all = "snake_case")]
pub enum RecordBody {
    /// An engine batch, with the engine's latest load and its liveness when it was committed
    /// (`None`: not scraped, not watched).
    Batch {
        batch: Batch,
        load: Option<Load>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        liveness: Option<Liveness>,
    },
    /// A control event.
    Control(Control),
}

/// One committed history entry: the relay cursor (one `u64` sequence per relay, across all
/// ranks, starting at 1) and what it holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Record {
    pub cursor: u64,
    /// The store incarnation (one per open of the store) that committed it: after a crash lost
    /// the newest commits, a cursor may be committed again with a different record, and this
    /// tells the two apart (see `Store::cursor_matches`).
    #[serde(default)]
    pub incarnation: u32,
    pub body: RecordBody,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mediums_map_to_tiers_case_insensitively() {
        let cases = [
            (None, Tier::Device),
            (Some("GPU"), Tier::Device),
            (Some("gpu"), Tier::Device),
            (Some("CPU"), Tier::Host),
            (Some("CPU_PINNED"), Tier::Host),
            (Some("cpu"), Tier::Host),
            (Some("DISK"), Tier::Disk),
            (Some("STORAGE"), Tier::Disk),
            (Some("FS"), Tier::Disk),
            (Some("OBJ"), Tier::Disk),
            (Some("EXTERNAL"), Tier::External),
            (Some("LMCache"), Tier::Other("LMCache".into())),
        ];
        for (medium, tier) in cases {
            assert_eq!(Tier::from_medium(medium), tier, "{medium:?}");
        }
        for t in [Tier::Device, Tier::Host, Tier::Disk, Tier::External, Tier::Other("x".into())] {
            assert_eq!(Tier::parse(t.as_str()), t);
        }
    }

    #[test]
    fn key_parts_serialize_bytes_as_hex() {
        let k = KeyPart::List(vec![KeyPart::Str("a".into()), KeyPart::Bytes(Bytes(vec![0xab, 1]))]);
        let j = serde_json::to_string(&k).unwrap();
        assert_eq!(j, r#"["a",{"bytes_hex":"ab01"}]"#);
        assert_eq!(serde_json::from_str::<KeyPart>(&j).unwrap(), k);
    }

    #[test]
    fn a_one_string_list_does_not_read_back_as_bytes() {
        let k = KeyPart::List(vec![KeyPart::Str("ab".into())]);
        let j = serde_json::to_string(&k).unwrap();
        assert_eq!(serde_json::from_str::<KeyPart>(&j).unwrap(), k);
        let m = KeyPart::Map(MapParts { map: vec![(KeyPart::Str("k".into()), KeyPart::UInt(u64::MAX))] });
        assert_eq!(serde_json::from_str::<KeyPart>(&serde_json::to_string(&m).unwrap()).unwrap(), m);
    }

    #[test]
    fn degraded_wins_over_incomplete_and_only_a_recovery_clears_either() {
        let why = |s: &str| s.to_string();
        let degraded = RankHealth::Degraded { reason: why("gap") };
        let incomplete = RankHealth::Incomplete { reason: why("late") };
        let cases = [
            (RankHealth::Ok, ControlKind::RankDegraded { reason: why("gap") }, degraded.clone()),
            (RankHealth::Ok, ControlKind::RankIncomplete { reason: why("late") }, incomplete.clone()),
            (RankHealth::Ok, ControlKind::RankReset { reason: why("restart") }, RankHealth::Ok),
            (incomplete.clone(), ControlKind::RankDegraded { reason: why("gap") }, degraded.clone()),
            (degraded.clone(), ControlKind::RankIncomplete { reason: why("other") }, degraded.clone()),
            (degraded.clone(), ControlKind::RankReset { reason: why("restart") }, degraded.clone()),
            (degraded.clone(), ControlKind::RankRecovered, RankHealth::Ok),
            (incomplete.clone(), ControlKind::RankRecovered, RankHealth::Ok),
        ];
        for (before, kind, after) in cases {
            assert_eq!(before.after(&kind), after, "{before:?} then {kind:?}");
        }
        assert_eq!((degraded.as_str(), degraded.reason()), ("degraded", "gap"));
        assert_eq!((RankHealth::Ok.as_str(), RankHealth::Ok.reason()), ("ok", ""));
    }
}
