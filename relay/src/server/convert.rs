//! Conversions between the relay's model ([`crate::model`]) and the gRPC contract
//! ([`kv_relay_proto::pb`]). Model → pb is what the server sends; pb → model is its exact
//! inverse (tests, `relayctl`, and any Rust client that wants the relay's types back).
//!
//! Every model field has a place in the contract, so a round trip is the identity
//! (`model_to_pb_and_back_is_identity` below).

use crate::model::{
    Batch, Block, Bytes, Cleared, Control, ControlKind, EngineState, Event, Group, KeyPart, Liveness, Load, MapParts,
    Namespace, RankHealth, Record, RecordBody, Removed, Stored, Tier, TokenLayout,
};
use crate::store::SnapshotBlock;
use kv_relay_proto::pb;

/// A pb message that cannot be read back into the model.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConvertError {
    #[error("missing field {0}")]
    Missing(&'static str),
    #[error("unknown enum value {value} in {field}")]
    UnknownEnum { field: &'static str, value: i32 },
    #[error("tier unspecified in {0}")]
    TierUnspecified(&'static str),
}

// ---- tiers ------------------------------------------------------------------------------------

/// A tier as the pb enum and the name (set only for [`Tier::Other`]).
pub fn tier_to_pb(t: &Tier) -> (pb::Tier, String) {
    match t {
        Tier::Device => (pb::Tier::Device, String::new()),
        Tier::Host => (pb::Tier::Host, String::new()),
        Tier::Disk => (pb::Tier::Disk, String::new()),
        Tier::External => (pb::Tier::External, String::new()),
        Tier::Other(s) => (pb::Tier::Other, s.clone()),
    }
}

/// A pb tier back to the model; `None` for `TIER_UNSPECIFIED`.
pub fn tier_from_pb(tier: i32, name: &str) -> Result<Option<Tier>, ConvertError> {
    let t = pb::Tier::try_from(tier).map_err(|_| ConvertError::UnknownEnum { field: "tier", value: tier })?;
    Ok(match t {
        pb::Tier::Unspecified => None,
        pb::Tier::Device => Some(Tier::Device),
        pb::Tier::Host => Some(Tier::Host),
        pb::Tier::Disk => Some(Tier::Disk),
        pb::Tier::External => Some(Tier::External),
        pb::Tier::Other => Some(Tier::Other(name.to_string())),
    })
}

fn required_tier(tier: i32, name: &str, field: &'static str) -> Result<Tier, ConvertError> {
    tier_from_pb(tier, name)?.ok_or(ConvertError::TierUnspecified(field))
}

// ---- leaves -----------------------------------------------------------------------------------

pub fn load_to_pb(l: &Load) -> pb::Load {
    pb::Load { running: l.running, waiting: l.waiting, kv_usage: l.kv_usage, scraped_at_ms: l.scraped_at_ms }
}

pub fn load_from_pb(l: &pb::Load) -> Load {
    Load { running: l.running, waiting: l.waiting, kv_usage: l.kv_usage, scraped_at_ms: l.scraped_at_ms }
}

pub fn liveness_to_pb(l: &Liveness) -> pb::Liveness {
    let state = match l.state {
        EngineState::Alive => pb::EngineLiveness::Alive,
        EngineState::Unreachable => pb::EngineLiveness::Unreachable,
        EngineState::Wedged => pb::EngineLiveness::Wedged,
        EngineState::Stopped => pb::EngineLiveness::Stopped,
    };
    pb::Liveness {
        state: state as i32,
        reason: l.reason.clone(),
        since_ms: l.since_ms,
        observed_at_ms: l.observed_at_ms,
    }
}

/// `None` when the state is unspecified (not watched) or unknown to this build.
pub fn liveness_from_pb(l: &pb::Liveness) -> Option<Liveness> {
    let state = match pb::EngineLiveness::try_from(l.state).ok()? {
        pb::EngineLiveness::Unspecified => return None,
        pb::EngineLiveness::Alive => EngineState::Alive,
        pb::EngineLiveness::Unreachable => EngineState::Unreachable,
        pb::EngineLiveness::Wedged => EngineState::Wedged,
        pb::EngineLiveness::Stopped => EngineState::Stopped,
    };
    Some(Liveness { state, reason: l.reason.clone(), since_ms: l.since_ms, observed_at_ms: l.observed_at_ms })
}

pub fn namespace_to_pb(n: &Namespace) -> pb::Namespace {
    pb::Namespace { lora_name: n.lora_name.clone(), lora_id: n.lora_id, cache_salt: n.cache_salt.clone() }
}

pub fn namespace_from_pb(n: Option<&pb::Namespace>) -> Namespace {
    n.map(|n| Namespace { lora_name: n.lora_name.clone(), lora_id: n.lora_id, cache_salt: n.cache_salt.clone() })
        .unwrap_or_default()
}

pub fn key_part_to_pb(k: &KeyPart) -> pb::KeyPart {
    use pb::key_part::Value as V;
    let value = match k {
        KeyPart::Nil => V::Nil(true),
        KeyPart::Bool(b) => V::BoolValue(*b),
        KeyPart::Int(i) => V::IntValue(*i),
        KeyPart::UInt(u) => V::UintValue(*u),
        KeyPart::Float(f) => V::FloatValue(*f),
        KeyPart::Str(s) => V::StrValue(s.clone()),
        KeyPart::Bytes(b) => V::BytesValue(b.0.clone()),
        KeyPart::List(items) => V::ListValue(pb::KeyPartList { items: items.iter().map(key_part_to_pb).collect() }),
        KeyPart::Map(m) => V::MapValue(pb::KeyPartMap {
            entries: m
                .map
                .iter()
                .map(|(k, v)| pb::KeyPartEntry { key: Some(key_part_to_pb(k)), value: Some(key_part_to_pb(v)) })
                .collect(),
        }),
    };
    pb::KeyPart { value: Some(value) }
}

pub fn key_part_from_pb(k: &pb::KeyPart) -> KeyPart {
    use pb::key_part::Value as V;
    match &k.value {
        None | Some(V::Nil(_)) => KeyPart::Nil,
        Some(V::BoolValue(b)) => KeyPart::Bool(*b),
        Some(V::IntValue(i)) => KeyPart::Int(*i),
        Some(V::UintValue(u)) => KeyPart::UInt(*u),
        Some(V::FloatValue(f)) => KeyPart::Float(*f),
        Some(V::StrValue(s)) => KeyPart::Str(s.clone()),
        Some(V::BytesValue(b)) => KeyPart::Bytes(Bytes(b.clone())),
        Some(V::ListValue(l)) => KeyPart::List(l.items.iter().map(key_part_from_pb).collect()),
        Some(V::MapValue(m)) => KeyPart::Map(MapParts {
            map: m
                .entries
                .iter()
                .map(|e| {
                    let k = e.key.as_ref().map(key_part_from_pb).unwrap_or(KeyPart::Nil);
                    let v = e.value.as_ref().map(key_part_from_pb).unwrap_or(KeyPart::Nil);
                    (k, v)
                })
                .collect(),
        }),
    }
}

pub fn group_to_pb(g: &Group) -> pb::Group {
    pb::Group { idx: g.idx, kind: g.kind.clone(), sliding_window: g.sliding_window }
}

pub fn group_from_pb(g: Option<&pb::Group>) -> Group {
    g.map(|g| Group { idx: g.idx, kind: g.kind.clone(), sliding_window: g.sliding_window }).unwrap_or_default()
}

// ---- events -----------------------------------------------------------------------------------

pub fn event_to_pb(e: &Event) -> pb::Event {
    use pb::event::Event as E;
    let event = match e {
        Event::Stored(s) => {
            let (tier, tier_name) = tier_to_pb(&s.tier);
            E::Stored(pb::Stored {
                tier: tier as i32,
                tier_name,
                group: Some(group_to_pb(&s.group)),
                parent: s.parent,
                block_size: s.block_size,
                token_layout: match s.token_layout {
                    TokenLayout::Single => pb::TokenLayout::Single,
                    TokenLayout::Bigram => pb::TokenLayout::Bigram,
                } as i32,
                blocks: s
                    .blocks
                    .iter()
                    .map(|b| pb::Block {
                        hash: b.hash,
                        token_ids: b.token_ids.clone(),
                        extra_keys: b.extra_keys.as_ref().map(key_part_to_pb),
                    })
                    .collect(),
                namespace: Some(namespace_to_pb(&s.namespace)),
                session_id: s.session_id.clone(),
                ownership: s.ownership.clone(),
                lookahead_token_ids: s
                    .lookahead_token_ids
                    .iter()
                    .flatten()
                    .map(|ids| pb::TokenIds { ids: ids.clone() })
                    .collect(),
                has_lookahead_token_ids: s.lookahead_token_ids.is_some(),
                block_mm_infos: s.block_mm_infos.as_ref().map(key_part_to_pb),
            })
        }
        Event::Removed(r) => {
            let (tier, tier_name) = tier_to_pb(&r.tier);
            E::Removed(pb::Removed {
                tier: tier as i32,
                tier_name,
                group: r.group,
                block_hashes: r.block_hashes.clone(),
                ownership: r.ownership.clone(),
            })
        }
        Event::Cleared(c) => {
            let (tier, tier_name) = match &c.tier {
                Some(t) => tier_to_pb(t),
                None => (pb::Tier::Unspecified, String::new()),
            };
            E::Cleared(pb::Cleared { tier: tier as i32, tier_name })
        }
    };
    pb::Event { event: Some(event) }
}

pub fn event_from_pb(e: &pb::Event) -> Result<Event, ConvertError> {
    use pb::event::Event as E;
    Ok(match e.event.as_ref().ok_or(ConvertError::Missing("Event.event"))? {
        E::Stored(s) => Event::Stored(Stored {
            tier: required_tier(s.tier, &s.tier_name, "Stored.tier")?,
            group: group_from_pb(s.group.as_ref()),
            parent: s.parent,
            block_size: s.block_size,
            token_layout: match pb::TokenLayout::try_from(s.token_layout) {
                Ok(pb::TokenLayout::Single) => TokenLayout::Single,
                Ok(pb::TokenLayout::Bigram) => TokenLayout::Bigram,
                Err(_) => return Err(ConvertError::UnknownEnum { field: "token_layout", value: s.token_layout }),
            },
            blocks: s
                .blocks
                .iter()
                .map(|b| Block {
                    hash: b.hash,
                    token_ids: b.token_ids.clone(),
                    extra_keys: b.extra_keys.as_ref().map(key_part_from_pb),
                })
                .collect(),
            namespace: namespace_from_pb(s.namespace.as_ref()),
            session_id: s.session_id.clone(),
            ownership: s.ownership.clone(),
            lookahead_token_ids: s
                .has_lookahead_token_ids
                .then(|| s.lookahead_token_ids.iter().map(|t| t.ids.clone()).collect()),
            block_mm_infos: s.block_mm_infos.as_ref().map(key_part_from_pb),
        }),
        E::Removed(r) => Event::Removed(Removed {
            tier: required_tier(r.tier, &r.tier_name, "Removed.tier")?,
            group: r.group,
            block_hashes: r.block_hashes.clone(),
            ownership: r.ownership.clone(),
        }),
        E::Cleared(c) => Event::Cleared(Cleared { tier: tier_from_pb(c.tier, &c.tier_name)? }),
    })
}

// ---- records ----------------------------------------------------------------------------------

/// A committed batch as the contract's `Batch`.
pub fn batch_to_pb(
    cursor: u64,
    incarnation: u32,
    batch: &Batch,
    load: Option<&Load>,
    liveness: Option<&Liveness>,
) -> pb::Batch {
    pb::Batch {
        cursor,
        incarnation,
        dp_rank: batch.dp_rank,
        engine_seq: batch.seq,
        engine_ts: batch.ts,
        events: batch.events.iter().map(event_to_pb).collect(),
        load: load.map(load_to_pb),
        liveness: liveness.map(liveness_to_pb),
    }
}

/// A streamed batch back to the model: the batch, its load and its liveness.
pub fn batch_from_pb(b: &pb::Batch) -> Result<(Batch, Option<Load>, Option<Liveness>), ConvertError> {
    let batch = Batch {
        dp_rank: b.dp_rank,
        seq: b.engine_seq,
        ts: b.engine_ts,
        events: b.events.iter().map(event_from_pb).collect::<Result<_, _>>()?,
    };
    Ok((batch, b.load.as_ref().map(load_from_pb), b.liveness.as_ref().and_then(liveness_from_pb)))
}

pub fn control_to_pb(cursor: u64, incarnation: u32, c: &Control) -> pb::Control {
    let (kind, reason) = match &c.kind {
        ControlKind::RankReset { reason } => (pb::ControlKind::RankReset, reason.clone()),
        ControlKind::RankDegraded { reason } => (pb::ControlKind::RankDegraded, reason.clone()),
        ControlKind::RankIncomplete { reason } => (pb::ControlKind::RankIncomplete, reason.clone()),
        ControlKind::RankRecovered => (pb::ControlKind::RankRecovered, String::new()),
    };
    pb::Control { cursor, incarnation, dp_rank: c.dp_rank, kind: kind as i32, reason }
}

pub fn control_from_pb(c: &pb::Control) -> Result<Control, ConvertError> {
    let reason = c.reason.clone();
    let kind = match pb::ControlKind::try_from(c.kind) {
        Ok(pb::ControlKind::RankReset) => ControlKind::RankReset { reason },
        Ok(pb::ControlKind::RankDegraded) => ControlKind::RankDegraded { reason },
        Ok(pb::ControlKind::RankIncomplete) => ControlKind::RankIncomplete { reason },
        Ok(pb::ControlKind::RankRecovered) => ControlKind::RankRecovered,
        _ => return Err(ConvertError::UnknownEnum { field: "Control.kind", value: c.kind }),
    };
    Ok(Control { dp_rank: c.dp_rank, kind })
}

/// One history record, as a Batch or a Control.
pub enum PbRecord {
    Batch(pb::Batch),
    Control(pb::Control),
}

impl PbRecord {
    pub fn into_subscribe(self) -> pb::SubscribeResponse {
        use pb::subscribe_response::Message as M;
        pb::SubscribeResponse {
            message: Some(match self {
                PbRecord::Batch(b) => M::Batch(b),
                PbRecord::Control(c) => M::Control(c),
            }),
        }
    }

    pub fn into_history(self) -> pb::HistoryResponse {
        use pb::history_response::Record as R;
        pb::HistoryResponse {
            record: Some(match self {
                PbRecord::Batch(b) => R::Batch(b),
                PbRecord::Control(c) => R::Control(c),
            }),
        }
    }
}

/// The DP rank a record is about.
pub fn record_rank(r: &Record) -> u32 {
    match &r.body {
        RecordBody::Batch { batch, .. } => batch.dp_rank,
        RecordBody::Control(c) => c.dp_rank,
    }
}

pub fn record_to_pb(r: &Record) -> PbRecord {
    match &r.body {
        RecordBody::Batch { batch, load, liveness } => {
            PbRecord::Batch(batch_to_pb(r.cursor, r.incarnation, batch, load.as_ref(), liveness.as_ref()))
        }
        RecordBody::Control(c) => PbRecord::Control(control_to_pb(r.cursor, r.incarnation, c)),
    }
}

/// A streamed record back to the model.
pub fn record_from_subscribe(m: &pb::SubscribeResponse) -> Option<Result<Record, ConvertError>> {
    use pb::subscribe_response::Message as M;
    match m.message.as_ref()? {
        M::Batch(b) => Some(batch_from_pb(b).map(|(batch, load, liveness)| Record {
            cursor: b.cursor,
            incarnation: b.incarnation,
            body: RecordBody::Batch { batch, load, liveness },
        })),
        M::Control(c) => Some(control_from_pb(c).map(|control| Record {
            cursor: c.cursor,
            incarnation: c.incarnation,
            body: RecordBody::Control(control),
        })),
        _ => None,
    }
}

// ---- snapshots --------------------------------------------------------------------------------

fn token_layout_to_pb(l: TokenLayout) -> pb::TokenLayout {
    match l {
        TokenLayout::Single => pb::TokenLayout::Single,
        TokenLayout::Bigram => pb::TokenLayout::Bigram,
    }
}

pub fn snapshot_block_to_pb(b: SnapshotBlock) -> pb::SnapshotBlock {
    let (tier, tier_name) = tier_to_pb(&b.tier);
    pb::SnapshotBlock {
        dp_rank: b.dp_rank,
        tier: tier as i32,
        tier_name,
        group: b.group,
        hash: b.hash,
        parent: b.parent,
        block_size: b.block_size,
        namespace: Some(namespace_to_pb(&b.namespace)),
        copies: b.copies,
        token_ids: b.token_ids,
        token_layout: token_layout_to_pb(b.token_layout) as i32,
    }
}

pub fn snapshot_block_from_pb(b: &pb::SnapshotBlock) -> Result<SnapshotBlock, ConvertError> {
    Ok(SnapshotBlock {
        dp_rank: b.dp_rank,
        tier: required_tier(b.tier, &b.tier_name, "SnapshotBlock.tier")?,
        group: b.group,
        hash: b.hash,
        parent: b.parent,
        block_size: b.block_size,
        namespace: namespace_from_pb(b.namespace.as_ref()),
        copies: b.copies,
        token_ids: b.token_ids.clone(),
        token_layout: match pb::TokenLayout::try_from(b.token_layout) {
            Ok(pb::TokenLayout::Bigram) => TokenLayout::Bigram,
            Ok(pb::TokenLayout::Single) => TokenLayout::Single,
            Err(_) => return Err(ConvertError::UnknownEnum { field: "token_layout", value: b.token_layout }),
        },
    })
}

/// A rank's health as the contract says it; a rank whose thread stopped is `Stopped`, whatever
/// its health.
pub fn rank_state_to_pb(health: &RankHealth, stopped: bool) -> pb::RankState {
    match (stopped, health) {
        (true, _) => pb::RankState::Stopped,
        (false, RankHealth::Ok) => pb::RankState::Ok,
        (false, RankHealth::Degraded { .. }) => pb::RankState::Degraded,
        (false, RankHealth::Incomplete { .. }) => pb::RankState::Incomplete,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample_batch() -> Batch {
        let kp = KeyPart::List(vec![
            KeyPart::Nil,
            KeyPart::Bool(true),
            KeyPart::Int(-3),
            KeyPart::UInt(u64::MAX),
            KeyPart::Float(1.5),
            KeyPart::Str("lora".into()),
            KeyPart::Bytes(Bytes(vec![0xab, 0])),
            KeyPart::Map(MapParts { map: vec![(KeyPart::Str("k".into()), KeyPart::Int(1))] }),
        ]);
        Batch {
            dp_rank: 3,
            seq: 42,
            ts: 1.25,
            events: vec![
                Event::Stored(Stored {
                    tier: Tier::Other("LMCache".into()),
                    group: Group { idx: 1, kind: Some("sliding_window".into()), sliding_window: Some(128) },
                    parent: Some(u64::MAX),
                    block_size: 16,
                    token_layout: TokenLayout::Bigram,
                    blocks: vec![
                        Block { hash: 1, token_ids: vec![1, 2], extra_keys: Some(kp.clone()) },
                        Block { hash: u64::MAX - 1, token_ids: vec![], extra_keys: None },
                    ],
                    namespace: Namespace {
                        lora_name: Some("a".into()),
                        lora_id: Some(7),
                        cache_salt: Some("s".into()),
                    },
                    session_id: Some("sess".into()),
                    ownership: Some("local".into()),
                    lookahead_token_ids: Some(vec![vec![5], vec![]]),
                    block_mm_infos: Some(kp),
                }),
                Event::Stored(Stored {
                    tier: Tier::Device,
                    group: Group::default(),
                    parent: None,
                    block_size: 16,
                    token_layout: TokenLayout::Single,
                    blocks: vec![],
                    namespace: Namespace::default(),
                    session_id: None,
                    ownership: None,
                    lookahead_token_ids: Some(vec![]),
                    block_mm_infos: None,
                }),
                Event::Removed(Removed { tier: Tier::Host, group: 2, block_hashes: vec![9, 8], ownership: None }),
                Event::Cleared(Cleared { tier: None }),
                Event::Cleared(Cleared { tier: Some(Tier::Disk) }),
            ],
        }
    }

    #[test]
    fn model_to_pb_and_back_is_identity() {
        let load = Load { running: 1.0, waiting: 2.0, kv_usage: 0.5, scraped_at_ms: 99 };
        let records = vec![
            Record {
                cursor: 7,
                incarnation: 2,
                body: RecordBody::Batch { batch: sample_batch(), load: Some(load), liveness: None },
            },
            Record {
                cursor: 8,
                incarnation: 2,
                body: RecordBody::Batch { batch: sample_batch(), load: None, liveness: None },
            },
            Record {
                cursor: 9,
                incarnation: 3,
                body: RecordBody::Control(Control { dp_rank: 1, kind: ControlKind::RankReset { reason: "r".into() } }),
            },
            Record {
                cursor: 10,
                incarnation: 3,
                body: RecordBody::Control(Control {
                    dp_rank: 1,
                    kind: ControlKind::RankDegraded { reason: "d".into() },
                }),
            },
            Record {
                cursor: 11,
                incarnation: 3,
                body: RecordBody::Control(Control {
                    dp_rank: 1,
                    kind: ControlKind::RankIncomplete { reason: "i".into() },
                }),
            },
            Record {
                cursor: 12,
                incarnation: 3,
                body: RecordBody::Control(Control { dp_rank: 1, kind: ControlKind::RankRecovered }),
            },
        ];
        for r in records {
            let back = record_from_subscribe(&record_to_pb(&r).into_subscribe()).unwrap().unwrap();
            assert_eq!(back, r);
        }
    }

    #[test]
    fn snapshot_blocks_round_trip() {
        let b = SnapshotBlock {
            dp_rank: 1,
            tier: Tier::Other("x".into()),
            group: 2,
            hash: u64::MAX,
            parent: Some(3),
            block_size: 16,
            namespace: Namespace { lora_name: None, lora_id: Some(1), cache_salt: None },
            copies: 2,
            token_ids: vec![1, 2, 3],
            token_layout: TokenLayout::Bigram,
        };
        assert_eq!(snapshot_block_from_pb(&snapshot_block_to_pb(b.clone())).unwrap(), b);
    }
}
