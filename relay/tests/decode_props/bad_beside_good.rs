//! A bad event beside good ones never loses the good ones.

use super::mutated::check_cut;
use super::*;

#[derive(Debug, Clone)]
enum Hash {
    U(u64),
    /// Negative (SGLang's i64).
    I(i64),
    /// Raw digest bytes (vLLM): the last 8 bytes, big-endian.
    B(Vec<u8>),
}

impl Hash {
    fn value(&self) -> V {
        match self {
            Hash::U(u) => V::from(*u),
            Hash::I(i) => V::from(*i),
            Hash::B(b) => V::Binary(b.clone()),
        }
    }
    fn bits(&self) -> u64 {
        match self {
            Hash::U(u) => *u,
            Hash::I(i) => *i as u64,
            Hash::B(b) => b[b.len().saturating_sub(8)..].iter().fold(0, |a, x| (a << 8) | u64::from(*x)),
        }
    }
}

fn hash() -> impl Strategy<Value = Hash> {
    prop_oneof![
        any::<u64>().prop_map(Hash::U),
        (0u64..300).prop_map(Hash::U),
        (i64::MIN..0).prop_map(Hash::I),
        prop::collection::vec(any::<u8>(), 1..=32).prop_map(Hash::B),
    ]
}

#[derive(Debug, Clone)]
enum Tokens {
    Single(Vec<u32>),
    Bigram(Vec<(u32, u32)>),
    /// SGLang's wide form: some id beyond `u32`.
    Wide(Vec<u64>),
}

fn tokens() -> impl Strategy<Value = Tokens> {
    prop_oneof![
        4 => prop::collection::vec(any::<u32>(), 0..40).prop_map(Tokens::Single),
        2 => prop::collection::vec((any::<u32>(), any::<u32>()), 1..20).prop_map(Tokens::Bigram),
        1 => (prop::collection::vec(0u64..1000, 0..8), (1u64 << 32)..u64::MAX).prop_map(|(mut v, w)| {
            v.push(w);
            Tokens::Wide(v)
        }),
    ]
}

impl Tokens {
    fn value(&self) -> V {
        match self {
            Tokens::Single(v) => V::Array(v.iter().map(|x| V::from(*x)).collect()),
            Tokens::Bigram(v) => V::Array(v.iter().map(|(a, b)| V::Array(vec![V::from(*a), V::from(*b)])).collect()),
            Tokens::Wide(v) => V::Array(v.iter().map(|x| V::from(*x)).collect()),
        }
    }
    fn raw(&self) -> RawTokens {
        match self {
            Tokens::Single(v) => {
                RawTokens { layout: TokenLayout::Single, ids: v.clone(), positions: v.len(), wide: false }
            }
            Tokens::Bigram(v) => RawTokens {
                layout: TokenLayout::Bigram,
                ids: v.iter().flat_map(|(a, b)| [*a, *b]).collect(),
                positions: v.len(),
                wide: false,
            },
            Tokens::Wide(v) => RawTokens { layout: TokenLayout::Single, ids: vec![], positions: v.len(), wide: true },
        }
    }
}

fn word() -> impl Strategy<Value = String> {
    "[a-zA-Z0-9_]{0,12}"
}

fn medium() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("GPU".to_string()),
        Just("CPU".to_string()),
        Just("CPU_PINNED".to_string()),
        Just("DISK".to_string()),
        word()
    ]
}

/// A well-formed event, its wire value, and what the decoder must return for it.
#[derive(Debug, Clone)]
struct Good {
    value: V,
    want: RawEvent,
}

#[derive(Debug, Clone)]
struct StoredSpec {
    hashes: Vec<Hash>,
    parent: Option<Hash>,
    tokens: Tokens,
    block_size: u32,
    lora_id: Option<i64>,
    medium: Option<String>,
    lora_name: Option<String>,
    extra_keys: Option<Vec<Option<String>>>,
    group_idx: Option<u32>,
    kind: Option<String>,
    window: Option<u32>,
    locality: Option<String>,
    ownership: Option<String>,
    session_id: Option<String>,
    cache_salt: Option<String>,
    lookahead: Option<Vec<Vec<u32>>>,
}

fn kind() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("full_attention".to_string()),
        Just("sliding_window".to_string()),
        Just("mla_attention".to_string()),
        word()
    ]
}

prop_compose! {
    fn stored_spec()(
        hashes in prop::collection::vec(hash(), 0..6),
        parent in prop::option::of(hash()),
        tokens in tokens(),
        block_size in prop_oneof![Just(16u32), Just(32), Just(4), any::<u32>()],
        lora_id in prop::option::of(any::<i64>()),
        medium in prop::option::of(medium()),
        lora_name in prop::option::of(word()),
        extra_keys in prop::option::of(prop::collection::vec(prop::option::of(word()), 0..6)),
        group_idx in prop::option::of(0u32..4),
        kind in prop::option::of(kind()),
        window in prop::option::of(any::<u32>()),
        (locality, ownership, session_id) in (
            prop::option::of(prop_oneof![Just("LOCAL".to_string()), Just("REMOTE".to_string()), word()]),
            prop::option::of(word()),
            prop::option::of(word()),
        ),
        cache_salt in prop::option::of(word()),
        lookahead in prop::option::of(prop::collection::vec(prop::collection::vec(any::<u32>(), 0..4), 0..4)),
    ) -> StoredSpec {
        StoredSpec {
            hashes, parent, tokens, block_size, lora_id, medium, lora_name, extra_keys, group_idx, kind, window,
            locality, ownership, session_id, cache_salt, lookahead,
        }
    }
}

fn opt_str(v: &Option<String>) -> V {
    v.as_deref().map(V::from).unwrap_or(V::Nil)
}

fn opt_with<T>(v: &Option<T>, f: impl Fn(&T) -> V) -> V {
    v.as_ref().map(f).unwrap_or(V::Nil)
}

fn extra_keys_value(k: &[Option<String>]) -> V {
    V::Array(k.iter().map(opt_str).collect())
}

fn extra_keys_raw(k: &[Option<String>]) -> Vec<Option<KeyPart>> {
    k.iter().map(|x| x.clone().map(KeyPart::Str)).collect()
}

/// How a generated event is laid out.
#[derive(Debug, Clone)]
enum Form {
    /// A positional array of this many elements (clamped to what the event can have), with
    /// these trailing elements after the last known position; `salt_map` puts SGLang's
    /// `{"cache_salt": …}` map at position 7 instead of `lora_name`.
    Array { len: usize, salt_map: bool, trailing: usize },
    /// A map in a shuffled key order, `None` fields written as nil (else left out), with unknown
    /// keys mixed in.
    Map { shuffle: u64, nil_for_none: bool, unknown: usize },
}

fn form() -> impl Strategy<Value = Form> {
    prop_oneof![
        (0usize..14, any::<bool>(), 0usize..3).prop_map(|(len, salt_map, trailing)| Form::Array {
            len,
            salt_map,
            trailing
        }),
        (any::<u64>(), any::<bool>(), 0usize..3).prop_map(|(shuffle, nil_for_none, unknown)| Form::Map {
            shuffle,
            nil_for_none,
            unknown
        }),
    ]
}

/// A small deterministic shuffle (proptest shrinks the seed).
fn shuffle<T>(v: &mut [T], mut seed: u64) {
    for i in (1..v.len()).rev() {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        v.swap(i, (seed >> 33) as usize % (i + 1));
    }
}

fn unknown_entries(n: usize) -> Vec<(V, V)> {
    let vals = [V::from("future"), V::Array(vec![V::from(1), V::Nil]), V::Map(vec![(V::from(1), V::from(2))])];
    (0..n).map(|i| (V::from(format!("x_future_{i}")), vals[i % vals.len()].clone())).collect()
}

fn build_map(mut entries: Vec<(&'static str, Option<V>)>, shuffle_seed: u64, nil_for_none: bool, unknown: usize) -> V {
    shuffle(&mut entries, shuffle_seed);
    let mut m: Vec<(V, V)> = entries
        .into_iter()
        .filter_map(|(k, v)| match v {
            Some(v) => Some((V::from(k), v)),
            None if nil_for_none => Some((V::from(k), V::Nil)),
            None => None,
        })
        .collect();
    for (i, e) in unknown_entries(unknown).into_iter().enumerate() {
        let at = (shuffle_seed as usize).wrapping_add(i * 7) % (m.len() + 1);
        m.insert(at, e);
    }
    V::Map(m)
}

fn trailing(n: usize) -> impl Iterator<Item = V> {
    (0..n).map(|i| if i % 2 == 0 { V::from("trailing") } else { V::Array(vec![V::Nil]) })
}

fn good_stored(s: &StoredSpec, form: &Form) -> Good {
    let base = RawStored {
        block_hashes: s.hashes.iter().map(Hash::bits).collect(),
        parent_block_hash: s.parent.as_ref().map(Hash::bits),
        token_ids: s.tokens.raw(),
        block_size: s.block_size,
        ..RawStored::default()
    };
    match *form {
        Form::Array { len, salt_map, trailing: extra } => {
            let len = len.clamp(5, 12);
            let salt_map = salt_map && len >= 8;
            let mut v = vec![
                V::from("BlockStored"),
                V::Array(s.hashes.iter().map(Hash::value).collect()),
                opt_with(&s.parent, Hash::value),
                s.tokens.value(),
                V::from(s.block_size),
                opt_with(&s.lora_id, |x| V::from(*x)),
                opt_str(&s.medium),
                if salt_map {
                    V::Map(vec![(V::from("cache_salt"), opt_str(&s.cache_salt))])
                } else {
                    opt_str(&s.lora_name)
                },
                opt_with(&s.extra_keys, |k| extra_keys_value(k)),
                opt_with(&s.group_idx, |x| V::from(*x)),
                opt_str(&s.kind),
                opt_with(&s.window, |x| V::from(*x)),
            ];
            v.truncate(len);
            if len == 12 {
                v.extend(trailing(extra));
            }
            let has = |i: usize| i < len;
            let want = RawStored {
                lora_id: s.lora_id.filter(|_| has(5)),
                medium: s.medium.clone().filter(|_| has(6)),
                lora_name: s.lora_name.clone().filter(|_| has(7) && !salt_map),
                cache_salt: s.cache_salt.clone().filter(|_| salt_map),
                extra_keys: s.extra_keys.as_deref().map(extra_keys_raw).filter(|_| has(8)),
                group_idx: s.group_idx.filter(|_| has(9)),
                kv_cache_spec_kind: s.kind.clone().filter(|_| has(10)),
                kv_cache_spec_sliding_window: s.window.filter(|_| has(11)),
                ..base
            };
            Good { value: V::Array(v), want: RawEvent::Stored(want) }
        }
        Form::Map { shuffle, nil_for_none, unknown } => {
            let entries: Vec<(&'static str, Option<V>)> = vec![
                ("type", Some(V::from("BlockStored"))),
                ("block_hashes", Some(V::Array(s.hashes.iter().map(Hash::value).collect()))),
                ("parent_block_hash", s.parent.as_ref().map(Hash::value)),
                ("token_ids", Some(s.tokens.value())),
                ("block_size", Some(V::from(s.block_size))),
                ("lora_id", s.lora_id.map(V::from)),
                ("medium", s.medium.as_deref().map(V::from)),
                ("lora_name", s.lora_name.as_deref().map(V::from)),
                ("extra_keys", s.extra_keys.as_deref().map(extra_keys_value)),
                ("group_idx", s.group_idx.map(V::from)),
                ("kv_cache_spec_kind", s.kind.as_deref().map(V::from)),
                ("kv_cache_spec_sliding_window", s.window.map(V::from)),
                ("locality", s.locality.as_deref().map(V::from)),
                ("ownership", s.ownership.as_deref().map(V::from)),
                ("session_id", s.session_id.as_deref().map(V::from)),
                ("cache_salt", s.cache_salt.as_deref().map(V::from)),
                (
                    "lookahead_token_ids",
                    s.lookahead.as_ref().map(|l| {
                        V::Array(l.iter().map(|b| V::Array(b.iter().map(|x| V::from(*x)).collect())).collect())
                    }),
                ),
            ];
            let want = RawStored {
                lora_id: s.lora_id,
                medium: s.medium.clone(),
                lora_name: s.lora_name.clone(),
                extra_keys: s.extra_keys.as_deref().map(extra_keys_raw),
                group_idx: s.group_idx,
                kv_cache_spec_kind: s.kind.clone(),
                kv_cache_spec_sliding_window: s.window,
                locality: s.locality.clone(),
                ownership: s.ownership.clone(),
                session_id: s.session_id.clone(),
                cache_salt: s.cache_salt.clone(),
                lookahead_token_ids: s.lookahead.clone(),
                ..base
            };
            Good { value: build_map(entries, shuffle, nil_for_none, unknown), want: RawEvent::Stored(want) }
        }
    }
}

#[derive(Debug, Clone)]
struct RemovedSpec {
    hashes: Vec<Hash>,
    medium: Option<String>,
    group_idx: Option<u32>,
    locality: Option<String>,
    ownership: Option<String>,
}

prop_compose! {
    fn removed_spec()(
        hashes in prop::collection::vec(hash(), 0..6),
        medium in prop::option::of(medium()),
        group_idx in prop::option::of(0u32..4),
        locality in prop::option::of(prop_oneof![Just("LOCAL".to_string()), Just("REMOTE".to_string())]),
        ownership in prop::option::of(word()),
    ) -> RemovedSpec {
        RemovedSpec { hashes, medium, group_idx, locality, ownership }
    }
}

fn good_removed(s: &RemovedSpec, form: &Form) -> Good {
    let hashes = V::Array(s.hashes.iter().map(Hash::value).collect());
    let block_hashes: Vec<u64> = s.hashes.iter().map(Hash::bits).collect();
    match *form {
        Form::Array { len, trailing: extra, .. } => {
            let len = len.clamp(2, 4);
            let mut v =
                vec![V::from("BlockRemoved"), hashes, opt_str(&s.medium), opt_with(&s.group_idx, |x| V::from(*x))];
            v.truncate(len);
            if len == 4 {
                v.extend(trailing(extra));
            }
            let want = RawRemoved {
                block_hashes,
                medium: s.medium.clone().filter(|_| len > 2),
                group_idx: s.group_idx.filter(|_| len > 3),
                ..RawRemoved::default()
            };
            Good { value: V::Array(v), want: RawEvent::Removed(want) }
        }
        Form::Map { shuffle, nil_for_none, unknown } => {
            let entries = vec![
                ("type", Some(V::from("BlockRemoved"))),
                ("block_hashes", Some(hashes)),
                ("medium", s.medium.as_deref().map(V::from)),
                ("group_idx", s.group_idx.map(V::from)),
                ("locality", s.locality.as_deref().map(V::from)),
                ("ownership", s.ownership.as_deref().map(V::from)),
            ];
            let want = RawRemoved {
                block_hashes,
                medium: s.medium.clone(),
                group_idx: s.group_idx,
                locality: s.locality.clone(),
                ownership: s.ownership.clone(),
            };
            Good { value: build_map(entries, shuffle, nil_for_none, unknown), want: RawEvent::Removed(want) }
        }
    }
}

fn good_cleared(medium: &Option<String>, form: &Form) -> Good {
    match *form {
        Form::Array { trailing: extra, .. } => Good {
            value: V::Array(std::iter::once(V::from("AllBlocksCleared")).chain(trailing(extra)).collect()),
            want: RawEvent::Cleared(RawCleared::default()),
        },
        Form::Map { shuffle, nil_for_none, unknown } => Good {
            value: build_map(
                vec![("type", Some(V::from("AllBlocksCleared"))), ("medium", medium.as_deref().map(V::from))],
                shuffle,
                nil_for_none,
                unknown,
            ),
            want: RawEvent::Cleared(RawCleared { medium: medium.clone() }),
        },
    }
}

fn good_event() -> impl Strategy<Value = Good> {
    prop_oneof![
        6 => (stored_spec(), form()).prop_map(|(s, f)| good_stored(&s, &f)),
        3 => (removed_spec(), form()).prop_map(|(s, f)| good_removed(&s, &f)),
        1 => (prop::option::of(medium()), form()).prop_map(|(m, f)| good_cleared(&m, &f)),
    ]
}

/// A malformed event and the reason it must be dropped with.
#[derive(Debug, Clone)]
struct Bad {
    value: V,
    want: DropReason,
}

/// A field of a store, where it sits in the array form (`None`: map form only), and a value of
/// the wrong type for it.
fn wrong_type(f: Field) -> (Option<usize>, V) {
    match f {
        Field::BlockHashes => (Some(1), V::from("not hashes")),
        Field::ParentBlockHash => (Some(2), V::from("x")),
        Field::TokenIds => (Some(3), V::from(true)),
        Field::BlockSize => (Some(4), V::from(-3)),
        Field::LoraId => (Some(5), V::from("7")),
        Field::Medium => (Some(6), V::from(7)),
        Field::LoraName => (Some(7), V::from(7)),
        Field::ExtraKeys => (Some(8), V::from(7)),
        Field::GroupIdx => (Some(9), V::from(-1)),
        Field::KvCacheSpecKind => (Some(10), V::from(7)),
        Field::KvCacheSpecSlidingWindow => (Some(11), V::from("64")),
        Field::Locality => (None, V::from(7)),
        Field::Ownership => (None, V::Array(vec![])),
        Field::SessionId => (None, V::from(1.5)),
        Field::CacheSalt => (None, V::from(7)),
        Field::LookaheadTokenIds => (None, V::Array(vec![V::from(1)])),
        Field::BlockMmInfos | Field::Metadata => unreachable!("not generated"),
    }
}

const STORE_FIELDS: [Field; 16] = [
    Field::BlockHashes,
    Field::ParentBlockHash,
    Field::TokenIds,
    Field::BlockSize,
    Field::LoraId,
    Field::Medium,
    Field::LoraName,
    Field::ExtraKeys,
    Field::GroupIdx,
    Field::KvCacheSpecKind,
    Field::KvCacheSpecSlidingWindow,
    Field::Locality,
    Field::Ownership,
    Field::SessionId,
    Field::CacheSalt,
    Field::LookaheadTokenIds,
];

/// A well-formed store with one field given a value of the wrong type.
fn bad_field(s: &StoredSpec, form: &Form, field: Field) -> Bad {
    let (pos, wrong) = wrong_type(field);
    let good = good_stored(s, form);
    let value = match (good.value, pos) {
        (V::Array(mut v), Some(p)) => {
            if v.len() <= p {
                // Pad with nils up to the field: every earlier optional slot is nil, so valid.
                v.resize(p + 1, V::Nil);
            }
            v[p] = wrong;
            V::Array(v)
        }
        (V::Array(_), None) | (V::Map(_), _) => {
            // Map form (map-only fields turn an array event into a map one).
            let V::Map(mut m) = good_stored(s, &Form::Map { shuffle: 1, nil_for_none: false, unknown: 0 }).value else {
                unreachable!()
            };
            m.retain(|(k, _)| k.as_str() != Some(field.as_str()));
            let at = m.len() / 2;
            m.insert(at, (V::from(field.as_str()), wrong));
            V::Map(m)
        }
        _ => unreachable!(),
    };
    Bad { value, want: DropReason::Invalid(field) }
}

fn bad_event() -> impl Strategy<Value = Bad> {
    let not_an_event = prop_oneof![
        any::<i64>().prop_map(V::from),
        Just(V::from("BlockStored")),
        Just(V::Nil),
        any::<bool>().prop_map(V::from),
        any::<f64>().prop_map(V::from),
        prop::collection::vec(any::<u8>(), 0..10).prop_map(V::Binary),
        Just(V::Ext(3, vec![1, 2])),
    ]
    .prop_map(|value| Bad { value, want: DropReason::NotAnEvent });
    let unknown_tag = (
        prop_oneof![
            Just("BlockEvicted"),
            Just("blockstored"),
            Just("BlockStored2"),
            Just(""),
            Just("AllBlocksCleared ")
        ],
        any::<bool>(),
    )
        .prop_map(|(tag, as_map)| Bad {
            value: if as_map {
                V::Map(vec![(V::from("type"), V::from(tag)), (V::from("block_hashes"), V::Array(vec![V::from(1)]))])
            } else {
                V::Array(vec![V::from(tag), V::Array(vec![V::from(1)]), V::Nil])
            },
            want: DropReason::UnknownType,
        });
    let missing_type = prop_oneof![
        Just(V::Array(vec![])),
        Just(V::Array(vec![V::from(1), V::Array(vec![])])),
        Just(V::Map(vec![(V::from("block_hashes"), V::Array(vec![V::from(1)]))])),
        Just(V::Map(vec![(V::from("type"), V::from(3))])),
    ]
    .prop_map(|value| Bad { value, want: DropReason::MissingType });
    let wrong_field = (stored_spec(), form(), prop::sample::select(STORE_FIELDS.to_vec()))
        .prop_map(|(s, f, field)| bad_field(&s, &f, field));
    let missing_field = prop_oneof![
        Just(Bad { value: V::Array(vec![V::from("BlockRemoved")]), want: DropReason::Missing(Field::BlockHashes) }),
        Just(Bad {
            value: V::Array(vec![V::from("BlockStored"), V::Array(vec![]), V::Nil, V::Array(vec![])]),
            want: DropReason::Missing(Field::BlockSize),
        }),
        Just(Bad {
            value: V::Map(vec![(V::from("type"), V::from("BlockStored")), (V::from("block_size"), V::from(4))]),
            want: DropReason::Missing(Field::BlockHashes),
        }),
    ];
    prop_oneof![
        2 => not_an_event,
        2 => unknown_tag,
        1 => missing_type,
        4 => wrong_field,
        1 => missing_field,
    ]
}

// Test data only: the size difference does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
enum Slot {
    Good(Good),
    Bad(Bad),
}

fn batch_value(events: Vec<V>, tail: &BatchTail) -> V {
    let mut b = vec![V::F64(1_700_000_000.25), V::Array(events)];
    match tail {
        BatchTail::Two => {}
        BatchTail::Rank(r) => b.push(V::from(*r)),
        BatchTail::NilRank => b.push(V::Nil),
        BatchTail::RankAndMore(r) => b.extend([V::from(*r), V::from("future")]),
    }
    V::Array(b)
}

#[derive(Debug, Clone)]
enum BatchTail {
    Two,
    Rank(u32),
    NilRank,
    RankAndMore(u32),
}

fn batch_tail() -> impl Strategy<Value = BatchTail> {
    prop_oneof![
        Just(BatchTail::Two),
        (0u32..8).prop_map(BatchTail::Rank),
        Just(BatchTail::NilRank),
        (0u32..8).prop_map(BatchTail::RankAndMore),
    ]
}

fn slots() -> impl Strategy<Value = Vec<Slot>> {
    (
        prop::collection::vec(good_event(), 0..12),
        prop::collection::vec((bad_event(), any::<prop::sample::Index>()), 0..5),
    )
        .prop_map(|(good, bad)| {
            let mut slots: Vec<Slot> = good.into_iter().map(Slot::Good).collect();
            for (b, at) in bad {
                let i = at.index(slots.len() + 1);
                slots.insert(i, Slot::Bad(b));
            }
            slots
        })
}

proptest! {
    #[test]
    fn a_bad_event_beside_good_ones_never_loses_the_good_ones(slots in slots(), tail in batch_tail()) {
        let values: Vec<V> = slots.iter().map(|s| match s {
            Slot::Good(g) => g.value.clone(),
            Slot::Bad(b) => b.value.clone(),
        }).collect();
        let payload = enc(&batch_value(values, &tail));
        let raw = wire::decode_batch(&payload).expect("a batch");
        prop_assert!(!raw.truncated);
        prop_assert_eq!(raw.events.len(), slots.len());
        for (i, (got, slot)) in raw.events.iter().zip(&slots).enumerate() {
            match slot {
                Slot::Good(g) => prop_assert_eq!(got, &Ok(g.want.clone()), "event {} {:?}", i, g.value),
                Slot::Bad(b) => prop_assert_eq!(got, &Err(b.want), "event {} {:?}", i, b.value),
            }
        }
        let want_rank = match tail {
            BatchTail::Rank(r) | BatchTail::RankAndMore(r) => Some(r),
            _ => None,
        };
        prop_assert_eq!(raw.dp_rank, want_rank);

        // The normalizer treats the good events exactly as it would without the bad ones.
        let good_only: Vec<V> = slots.iter().filter_map(|s| match s {
            Slot::Good(g) => Some(g.value.clone()),
            Slot::Bad(_) => None,
        }).collect();
        let rank = want_rank.unwrap_or(0);
        let clean = Normalizer::new().normalize(rank, 9, wire::decode_batch(&enc(&batch_value(good_only, &tail))).unwrap());
        let mixed = Normalizer::new().normalize(rank, 9, raw);
        prop_assert_eq!(&mixed.batch, &clean.batch);
        let mut clean_outcomes = clean.outcomes.iter();
        for (o, slot) in mixed.outcomes.iter().zip(&slots) {
            match slot {
                Slot::Good(_) => prop_assert_eq!(Some(o), clean_outcomes.next()),
                Slot::Bad(b) => prop_assert_eq!(o, &Outcome::Dropped(b.want)),
            }
        }
        prop_assert_eq!(&mixed.rewrites, &clean.rewrites);
        let committed = store().commit(RecordBody::Batch { batch: mixed.batch, load: None, liveness: None });
        prop_assert!(committed.is_ok(), "the store refused a normalized batch: {:?}", committed.err());
    }
}

proptest! {
    #[test]
    fn a_cut_generated_batch_keeps_every_event_before_the_cut(
        slots in slots(),
        tail in batch_tail(),
        cut in any::<prop::sample::Index>(),
    ) {
        let values: Vec<V> = slots.iter().map(|s| match s {
            Slot::Good(g) => g.value.clone(),
            Slot::Bad(b) => b.value.clone(),
        }).collect();
        let payload = enc(&batch_value(values, &tail));
        check_cut(&payload, cut.index(payload.len()))?;
    }
}

/// Regression (found by `a_cut_generated_batch_keeps_every_event_before_the_cut`): a batch cut
/// where fewer bytes are left than its events array claims elements used to be rejected whole
/// (`truncated_payload`), losing the complete events before the cut.
#[test]
fn a_cut_batch_of_small_events_keeps_the_complete_ones_before_the_cut() {
    let mut events = vec![V::Array(vec![V::from("AllBlocksCleared")])];
    events.extend((0..30).map(V::from));
    let full = enc(&V::Array(vec![V::F64(1.5), V::Array(events), V::from(0)]));
    // 1 (batch header) + 9 (ts) + 3 (array16 header) + 18 (the clear) + 2 (two of the ints).
    let cut = 1 + 9 + 3 + 18 + 2;
    let b = wire::decode_batch(&full[..cut]).unwrap();
    assert!(b.truncated);
    assert_eq!(
        b.events,
        vec![
            Ok(RawEvent::Cleared(RawCleared::default())),
            Err(DropReason::NotAnEvent),
            Err(DropReason::NotAnEvent),
            Err(DropReason::Truncated),
        ]
    );
    assert_eq!(b.dp_rank, None);
}
