//! Each drop reason and each normalization rule, with exact expected values.

use kv_relay::drops::{DropReason, Field};
use kv_relay::model::{Event, Tier, TokenLayout};
use kv_relay::normalize::{Normalizer, Outcome};
use kv_relay::wire::{self, MessageError, RawEvent, ReplayReply};
use rmpv::Value as V;

fn s(x: &str) -> V {
    V::from(x)
}

fn enc(v: &V) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).unwrap();
    out
}

fn batch(events: Vec<V>) -> Vec<u8> {
    enc(&V::Array(vec![V::F64(1.5), V::Array(events), V::from(0)]))
}

fn map(pairs: Vec<(&str, V)>) -> V {
    V::Map(pairs.into_iter().map(|(k, v)| (s(k), v)).collect())
}

fn stored_map(hashes: Vec<V>, extra: Vec<(&str, V)>) -> V {
    let mut p = vec![
        ("type", s("BlockStored")),
        ("block_hashes", V::Array(hashes)),
        ("parent_block_hash", V::Nil),
        ("token_ids", V::Array((1..=4).map(V::from).collect())),
        ("block_size", V::from(4)),
        ("lora_id", V::Nil),
        ("medium", s("GPU")),
    ];
    p.extend(extra);
    map(p)
}

fn outcomes(payload: &[u8]) -> Vec<Result<RawEvent, DropReason>> {
    wire::decode_batch(payload).unwrap().events
}

fn reason(r: &Result<RawEvent, DropReason>) -> Option<DropReason> {
    r.as_ref().err().copied()
}

#[test]
fn a_bad_field_costs_its_event_and_keeps_the_rest_of_the_batch() {
    let good = stored_map(vec![V::from(7u64)], vec![]);
    let bad_medium = stored_map(vec![V::from(8u64)], vec![("medium", V::from(3))]);
    let bad_hash = stored_map(vec![V::F64(1.0)], vec![]);
    let removed = map(vec![("type", s("BlockRemoved")), ("block_hashes", V::Array(vec![V::from(7u64)]))]);
    let ev = outcomes(&batch(vec![good, bad_medium, bad_hash, removed]));
    assert_eq!(ev.len(), 4);
    assert!(matches!(&ev[0], Ok(RawEvent::Stored(s)) if s.block_hashes == vec![7]));
    assert_eq!(reason(&ev[1]), Some(DropReason::Invalid(Field::Medium)));
    assert_eq!(reason(&ev[2]), Some(DropReason::Invalid(Field::BlockHashes)));
    assert!(matches!(&ev[3], Ok(RawEvent::Removed(r)) if r.block_hashes == vec![7]));
}

#[test]
fn each_event_level_drop_reason_is_named() {
    let cases: Vec<(V, DropReason)> = vec![
        (V::from(5), DropReason::NotAnEvent),
        (s("BlockStored"), DropReason::NotAnEvent),
        (V::Array(vec![]), DropReason::MissingType),
        (V::Array(vec![V::from(1), V::Array(vec![])]), DropReason::MissingType),
        (map(vec![("block_hashes", V::Array(vec![]))]), DropReason::MissingType),
        (V::Array(vec![s("BlockEvicted"), V::Array(vec![])]), DropReason::UnknownType),
        (map(vec![("type", s("Whatever"))]), DropReason::UnknownType),
        (V::Array(vec![s("BlockRemoved")]), DropReason::Missing(Field::BlockHashes)),
        (map(vec![("type", s("BlockRemoved"))]), DropReason::Missing(Field::BlockHashes)),
        (
            V::Array(vec![s("BlockStored"), V::Array(vec![]), V::Nil, V::Array(vec![])]),
            DropReason::Missing(Field::BlockSize),
        ),
        (
            map(vec![
                ("type", s("BlockStored")),
                ("block_hashes", V::Array(vec![V::from(1)])),
                ("block_size", V::from(4)),
            ]),
            DropReason::Missing(Field::TokenIds),
        ),
        (
            stored_map(vec![V::from(1)], vec![("parent_block_hash", s("x"))]),
            DropReason::Invalid(Field::ParentBlockHash),
        ),
        (
            stored_map(vec![V::from(1)], vec![("token_ids", V::Array(vec![V::from(-1)]))]),
            DropReason::Invalid(Field::TokenIds),
        ),
        (
            stored_map(
                vec![V::from(1)],
                vec![("token_ids", V::Array(vec![V::from(1), V::Array(vec![V::from(1), V::from(2)])]))],
            ),
            DropReason::Invalid(Field::TokenIds),
        ),
        (
            stored_map(
                vec![V::from(1)],
                vec![("token_ids", V::Array(vec![V::Array(vec![V::from(1), V::from(2), V::from(3)])]))],
            ),
            DropReason::Invalid(Field::TokenIds),
        ),
        (stored_map(vec![V::from(1)], vec![("block_size", V::from(-4))]), DropReason::Invalid(Field::BlockSize)),
        (stored_map(vec![V::from(1)], vec![("lora_id", s("7"))]), DropReason::Invalid(Field::LoraId)),
        (stored_map(vec![V::from(1)], vec![("lora_name", V::from(1))]), DropReason::Invalid(Field::LoraName)),
        (stored_map(vec![V::from(1)], vec![("extra_keys", s("k"))]), DropReason::Invalid(Field::ExtraKeys)),
        (stored_map(vec![V::from(1)], vec![("group_idx", V::from(-1))]), DropReason::Invalid(Field::GroupIdx)),
        (
            stored_map(vec![V::from(1)], vec![("kv_cache_spec_kind", V::from(1))]),
            DropReason::Invalid(Field::KvCacheSpecKind),
        ),
        (
            stored_map(vec![V::from(1)], vec![("kv_cache_spec_sliding_window", s("64"))]),
            DropReason::Invalid(Field::KvCacheSpecSlidingWindow),
        ),
        (stored_map(vec![V::from(1)], vec![("locality", V::from(0))]), DropReason::Invalid(Field::Locality)),
        (stored_map(vec![V::from(1)], vec![("ownership", V::from(0))]), DropReason::Invalid(Field::Ownership)),
        (stored_map(vec![V::from(1)], vec![("session_id", V::Array(vec![]))]), DropReason::Invalid(Field::SessionId)),
        (
            stored_map(vec![V::from(1)], vec![("lookahead_token_ids", V::Array(vec![V::from(1)]))]),
            DropReason::Invalid(Field::LookaheadTokenIds),
        ),
        (stored_map(vec![V::from(1)], vec![("cache_salt", V::from(1))]), DropReason::Invalid(Field::CacheSalt)),
        (
            V::Array(vec![
                s("BlockStored"),
                V::Array(vec![V::from(1)]),
                V::Nil,
                V::Array(vec![]),
                V::from(4),
                V::Nil,
                s("GPU"),
                V::Map(vec![(s("cache_salt"), V::from(3))]),
            ]),
            DropReason::Invalid(Field::CacheSalt),
        ),
        (V::Array(vec![s("BlockRemoved"), V::Array(vec![V::Binary(vec![])])]), DropReason::Invalid(Field::BlockHashes)),
    ];
    let n = cases.len();
    let (events, want): (Vec<V>, Vec<DropReason>) = cases.into_iter().unzip();
    let got: Vec<_> = outcomes(&batch(events)).iter().map(reason).collect();
    assert_eq!(got, want.into_iter().map(Some).collect::<Vec<_>>());
    assert_eq!(got.len(), n);
}

#[test]
fn a_truncated_payload_keeps_the_events_before_the_cut() {
    let full = batch(vec![stored_map(vec![V::from(1)], vec![]), stored_map(vec![V::from(2)], vec![])]);
    let cut = &full[..full.len() - 5];
    let b = wire::decode_batch(cut).unwrap();
    assert!(b.truncated);
    assert_eq!(b.events.len(), 2);
    assert!(matches!(&b.events[0], Ok(RawEvent::Stored(s)) if s.block_hashes == vec![1]));
    assert_eq!(reason(&b.events[1]), Some(DropReason::Truncated));
}

#[test]
fn message_level_errors_are_named() {
    assert_eq!(wire::decode_batch(&[]), Err(MessageError::Payload(wire::msgpack::MsgpackError::Truncated)));
    assert_eq!(wire::decode_batch(&[0xc1]).unwrap_err().as_str(), "not_msgpack");
    assert_eq!(wire::decode_batch(&enc(&s("hello"))), Err(MessageError::NotABatch));
    assert_eq!(wire::decode_batch(&enc(&V::Array(vec![V::F64(1.0)]))), Err(MessageError::NotABatch));
    assert_eq!(wire::decode_batch(&enc(&V::Array(vec![V::F64(1.0), V::from(3)]))), Err(MessageError::NotABatch));
    assert_eq!(wire::decode_batch(&enc(&V::Array(vec![s("ts"), V::Array(vec![])]))), Err(MessageError::BatchTs));
    assert_eq!(
        wire::decode_batch(&enc(&V::Array(vec![V::F64(1.0), V::Array(vec![]), V::from(-1)]))),
        Err(MessageError::BatchDpRank)
    );
    let f: [&[u8]; 2] = [b"kv", &[0; 8]];
    assert_eq!(wire::split_pub(&f), Err(MessageError::FrameCount(2)));
    let f: [&[u8]; 3] = [b"kv", &[0; 7], b"x"];
    assert_eq!(wire::split_pub(&f), Err(MessageError::SeqFrame(7)));
}

#[test]
fn batches_of_two_and_three_elements_and_extra_elements_decode() {
    let two = enc(&V::Array(vec![V::F64(2.0), V::Array(vec![V::Array(vec![s("AllBlocksCleared")])])]));
    let b = wire::decode_batch(&two).unwrap();
    assert_eq!((b.ts, b.dp_rank, b.batch_len, b.events.len()), (2.0, None, 2, 1));
    let four = enc(&V::Array(vec![V::F64(2.0), V::Array(vec![]), V::from(3), s("future")]));
    let b = wire::decode_batch(&four).unwrap();
    assert_eq!((b.dp_rank, b.batch_len), (Some(3), 4));
    let nil_rank = enc(&V::Array(vec![V::F64(2.0), V::Array(vec![]), V::Nil]));
    assert_eq!(wire::decode_batch(&nil_rank).unwrap().dp_rank, None);
}

#[test]
fn replay_replies_in_both_layouts_and_the_end_marker() {
    let seq = 5u64.to_be_bytes();
    let old: [&[u8]; 3] = [b"", &seq, b"payload"];
    let new: [&[u8]; 4] = [b"", b"kv", &seq, b"payload"];
    assert_eq!(
        wire::split_replay(&old),
        Ok(ReplayReply::Batch(wire::Frames { topic: b"", seq: 5, payload: b"payload" }))
    );
    assert_eq!(
        wire::split_replay(&new),
        Ok(ReplayReply::Batch(wire::Frames { topic: b"kv", seq: 5, payload: b"payload" }))
    );
    let end_old: [&[u8]; 3] = [b"", &wire::END_SEQ, b""];
    let end_new: [&[u8]; 4] = [b"", b"", &wire::END_SEQ, b""];
    assert_eq!(wire::split_replay(&end_old), Ok(ReplayReply::End));
    assert_eq!(wire::split_replay(&end_new), Ok(ReplayReply::End));
    let no_delim: [&[u8]; 3] = [b"x", &seq, b"p"];
    assert_eq!(wire::split_replay(&no_delim), Err(MessageError::ReplayDelimiter));
    let two: [&[u8]; 2] = [b"", &seq];
    assert_eq!(wire::split_replay(&two), Err(MessageError::FrameCount(2)));
}

#[test]
fn hashes_read_unsigned_signed_and_bytes() {
    let mut digest = vec![0u8; 32];
    digest[24..].copy_from_slice(&0x0123_4567_89ab_cdefu64.to_be_bytes());
    let short = vec![0x01, 0x02];
    let ev = V::Array(vec![
        s("BlockRemoved"),
        V::Array(vec![V::from(u64::MAX), V::from(-2i64), V::Binary(digest), V::Binary(short), V::from(0)]),
    ]);
    let got = outcomes(&batch(vec![ev]));
    let Ok(RawEvent::Removed(r)) = &got[0] else { panic!("{got:?}") };
    assert_eq!(r.block_hashes, vec![u64::MAX, u64::MAX - 1, 0x0123_4567_89ab_cdef, 0x0102, 0]);
}

#[test]
fn unknown_keys_and_trailing_positions_are_ignored() {
    let m = stored_map(
        vec![V::from(1)],
        vec![("future_field", V::Map(vec![(s("x"), V::Array(vec![V::Nil]))])), ("another", V::from(1))],
    );
    let mut arr = vec![s("BlockStored"), V::Array(vec![V::from(1)]), V::Nil, V::Array(vec![V::from(1)]), V::from(1)];
    arr.extend([V::Nil, s("GPU"), V::Nil, V::Nil, V::from(0), s("full_attention"), V::Nil, s("trailing"), V::from(9)]);
    let got = outcomes(&batch(vec![m, V::Array(arr)]));
    assert!(got.iter().all(Result::is_ok), "{got:?}");
}

#[test]
fn sglang_salted_array_form_is_told_apart_from_vllm_lora_name() {
    let sglang = V::Array(vec![
        s("BlockStored"),
        V::Array(vec![V::from(-5)]),
        V::Nil,
        V::Array(vec![V::from(1), V::from(2)]),
        V::from(2),
        V::Nil,
        s("GPU"),
        V::Map(vec![(s("cache_salt"), s("tenant-a"))]),
    ]);
    let vllm = V::Array(vec![
        s("BlockStored"),
        V::Array(vec![V::from(5)]),
        V::Nil,
        V::Array(vec![V::from(1), V::from(2)]),
        V::from(2),
        V::Nil,
        s("GPU"),
        s("my-lora"),
    ]);
    let got = outcomes(&batch(vec![sglang, vllm]));
    let Ok(RawEvent::Stored(a)) = &got[0] else { panic!() };
    let Ok(RawEvent::Stored(b)) = &got[1] else { panic!() };
    assert_eq!(
        (a.cache_salt.as_deref(), a.lora_name.as_deref(), a.block_hashes[0]),
        (Some("tenant-a"), None, (-5i64) as u64)
    );
    assert_eq!((b.cache_salt.as_deref(), b.lora_name.as_deref()), (None, Some("my-lora")));
}

fn normalize(events: Vec<V>) -> kv_relay::normalize::Normalized {
    let raw = wire::decode_batch(&batch(events)).unwrap();
    Normalizer::new().normalize(0, 0, raw)
}

#[test]
fn remote_locality_is_dropped_and_counted() {
    let n = normalize(vec![
        stored_map(vec![V::from(1)], vec![("locality", s("REMOTE"))]),
        stored_map(vec![V::from(2)], vec![("locality", s("LOCAL"))]),
        map(vec![("type", s("BlockRemoved")), ("block_hashes", V::Array(vec![V::from(3)])), ("locality", s("remote"))]),
    ]);
    assert_eq!(
        n.outcomes,
        vec![Outcome::Dropped(DropReason::RemoteLocality), Outcome::Kept, Outcome::Dropped(DropReason::RemoteLocality)]
    );
    assert_eq!(n.drops.get("remote_locality"), 2);
    assert_eq!(n.batch.events.len(), 1);
}

fn group_store(group: u32, kind: &str, window: Option<u32>, hashes: Vec<u64>, tokens: u32) -> V {
    let mut extra = vec![
        ("group_idx", V::from(group)),
        ("kv_cache_spec_kind", s(kind)),
        ("token_ids", V::Array((0..tokens).map(V::from).collect())),
    ];
    if let Some(w) = window {
        extra.push(("kv_cache_spec_sliding_window", V::from(w)));
    }
    stored_map(hashes.into_iter().map(V::from).collect(), extra)
}

#[test]
fn window_group_beside_a_main_group_is_dropped_stores_and_removals() {
    let mut norm = Normalizer::new();
    let b1 = batch(vec![
        group_store(0, "sliding_window", Some(8), vec![10], 8),
        group_store(1, "full_attention", None, vec![20, 21], 8),
    ]);
    let n = norm.normalize(0, 0, wire::decode_batch(&b1).unwrap());
    assert_eq!(n.outcomes, vec![Outcome::Dropped(DropReason::WindowGroupBesideMain), Outcome::Kept]);
    let b2 = batch(vec![
        map(vec![
            ("type", s("BlockRemoved")),
            ("block_hashes", V::Array(vec![V::from(10)])),
            ("group_idx", V::from(0)),
        ]),
        map(vec![
            ("type", s("BlockRemoved")),
            ("block_hashes", V::Array(vec![V::from(20)])),
            ("group_idx", V::from(1)),
        ]),
    ]);
    let n = norm.normalize(0, 1, wire::decode_batch(&b2).unwrap());
    assert_eq!(n.outcomes, vec![Outcome::Dropped(DropReason::WindowGroupBesideMain), Outcome::Kept]);
    assert_eq!(n.drops.get("window_group_beside_main"), 1);
    // Another rank has not seen a main group: its window group is kept.
    let n = norm.normalize(
        1,
        0,
        wire::decode_batch(&batch(vec![group_store(0, "sliding_window", Some(8), vec![10], 8)])).unwrap(),
    );
    assert_eq!(n.outcomes, vec![Outcome::Kept]);
    // A rank reset forgets the groups.
    norm.reset_rank(0);
    let n = norm.normalize(
        0,
        0,
        wire::decode_batch(&batch(vec![group_store(0, "sliding_window", Some(8), vec![10], 8)])).unwrap(),
    );
    assert_eq!(n.outcomes, vec![Outcome::Kept]);
}

#[test]
fn window_only_stores_are_read_tail_aligned() {
    // 2 hashes of block size 4 over 12 tokens: they cover tokens 4..8 and 8..12.
    let n = normalize(vec![group_store(0, "sliding_window", Some(8), vec![10, 11], 12)]);
    let Event::Stored(st) = &n.batch.events[0] else { panic!() };
    assert_eq!(st.blocks[0].token_ids, vec![4, 5, 6, 7]);
    assert_eq!(st.blocks[1].token_ids, vec![8, 9, 10, 11]);
    assert_eq!(n.rewrites.get("tail_aligned"), 1);
    // A main group over the same tokens reads from the head.
    let n = normalize(vec![group_store(0, "full_attention", None, vec![10, 11], 12)]);
    let Event::Stored(st) = &n.batch.events[0] else { panic!() };
    assert_eq!(st.blocks[0].token_ids, vec![0, 1, 2, 3]);
    assert_eq!(st.blocks[1].token_ids, vec![4, 5, 6, 7]);
    assert_eq!(n.rewrites.get("token_ids_mismatch"), 1);
}

#[test]
fn empty_block_hashes_are_dropped_as_no_block_hashes() {
    let n = normalize(vec![stored_map(vec![], vec![])]);
    assert_eq!(n.outcomes, vec![Outcome::Dropped(DropReason::NoBlockHashes)]);
}

#[test]
fn tiers_namespaces_and_sessions_normalize() {
    let n = normalize(vec![
        stored_map(
            vec![V::from(1)],
            vec![
                ("medium", s("CPU_PINNED")),
                ("lora_name", s("my-lora")),
                ("lora_id", V::from(7)),
                ("cache_salt", s("tenant-a")),
                ("session_id", s("sess-1")),
                ("ownership", s("owner")),
                ("extra_keys", V::Array(vec![V::Array(vec![s("my-lora"), V::Array(vec![s("mm"), V::from(3)])])])),
            ],
        ),
        map(vec![("type", s("BlockRemoved")), ("block_hashes", V::Array(vec![V::from(1)])), ("medium", s("DISK"))]),
        map(vec![("type", s("AllBlocksCleared"))]),
        map(vec![("type", s("AllBlocksCleared")), ("medium", s("CPU"))]),
    ]);
    let Event::Stored(st) = &n.batch.events[0] else { panic!() };
    assert_eq!(st.tier, Tier::Host);
    assert_eq!(st.namespace.lora_name.as_deref(), Some("my-lora"));
    assert_eq!(st.namespace.lora_id, Some(7));
    assert_eq!(st.namespace.cache_salt.as_deref(), Some("tenant-a"));
    assert_eq!(st.session_id.as_deref(), Some("sess-1"));
    assert_eq!(st.ownership.as_deref(), Some("owner"));
    assert_eq!(serde_json::to_string(&st.blocks[0].extra_keys).unwrap(), r#"["my-lora",["mm",3]]"#);
    let Event::Removed(r) = &n.batch.events[1] else { panic!() };
    assert_eq!(r.tier, Tier::Disk);
    assert_eq!(n.batch.events[2], Event::Cleared(kv_relay::model::Cleared { tier: None }));
    assert_eq!(n.batch.events[3], Event::Cleared(kv_relay::model::Cleared { tier: Some(Tier::Host) }));
}

#[test]
fn a_medium_name_past_the_bound_drops_its_event_and_keeps_the_rest() {
    let at_bound = "m".repeat(wire::MAX_MEDIUM_BYTES);
    let past = "m".repeat(wire::MAX_MEDIUM_BYTES + 1);
    let n = normalize(vec![
        stored_map(vec![V::from(1)], vec![("medium", s(&at_bound))]),
        stored_map(vec![V::from(2)], vec![("medium", s(&past))]),
        map(vec![("type", s("BlockRemoved")), ("block_hashes", V::Array(vec![V::from(1)])), ("medium", s(&past))]),
        map(vec![("type", s("AllBlocksCleared")), ("medium", s(&past))]),
        // vLLM's positional forms: a store's medium at 6, a removal's at 2.
        V::Array(vec![
            s("BlockStored"),
            V::Array(vec![V::from(3)]),
            V::Nil,
            V::Array((1..=4).map(V::from).collect()),
            V::from(4),
            V::Nil,
            s(&past),
        ]),
        V::Array(vec![s("BlockRemoved"), V::Array(vec![V::from(1)]), s(&past)]),
        map(vec![("type", s("BlockRemoved")), ("block_hashes", V::Array(vec![V::from(1)])), ("medium", s(&at_bound))]),
    ]);
    let dropped = || Outcome::Dropped(DropReason::Invalid(Field::Medium));
    assert_eq!(n.outcomes, vec![Outcome::Kept, dropped(), dropped(), dropped(), dropped(), dropped(), Outcome::Kept]);
    let Event::Stored(st) = &n.batch.events[0] else { panic!("{:?}", n.batch.events) };
    assert_eq!(st.tier, Tier::Other(at_bound.clone()));
    assert_eq!(n.batch.events.len(), 2);
    let Event::Removed(r) = &n.batch.events[1] else { panic!("{:?}", n.batch.events) };
    assert_eq!((r.tier.clone(), r.block_hashes.clone()), (Tier::Other(at_bound), vec![1]));
}

#[test]
fn bigram_pages_are_kept_as_pairs_per_block() {
    let pairs = |a: u32, n: u32| V::Array((a..a + n).map(|i| V::Array(vec![V::from(i), V::from(i + 1)])).collect());
    let n = normalize(vec![stored_map(vec![V::from(1), V::from(2)], vec![("token_ids", pairs(10, 8))])]);
    let Event::Stored(st) = &n.batch.events[0] else { panic!() };
    assert_eq!(st.token_layout, TokenLayout::Bigram);
    assert_eq!(st.blocks[0].token_ids, vec![10, 11, 11, 12, 12, 13, 13, 14]);
    assert_eq!(st.blocks[1].token_ids, vec![14, 15, 15, 16, 16, 17, 17, 18]);
    assert!(n.rewrites.0.is_empty());
}

#[test]
fn wide_and_absent_token_ids_keep_the_store_without_tokens() {
    let n = normalize(vec![
        stored_map(vec![V::from(1)], vec![("token_ids", V::Array(vec![V::from(1u64 << 33)]))]),
        stored_map(vec![V::from(2)], vec![("token_ids", V::Array(vec![])), ("block_size", V::from(0))]),
    ]);
    assert_eq!(n.outcomes, vec![Outcome::Kept, Outcome::Kept]);
    for e in &n.batch.events {
        let Event::Stored(st) = e else { panic!() };
        assert!(st.blocks[0].token_ids.is_empty());
    }
    assert_eq!(n.rewrites.get("token_ids_wide"), 1);
    assert_eq!(n.rewrites.get("token_ids_absent"), 1);
}

#[test]
fn sglang_short_last_page_is_not_a_mismatch() {
    // 2 pages of 4: the last page of a node holds 2 tokens.
    let n = normalize(vec![stored_map(
        vec![V::from(1), V::from(2)],
        vec![("token_ids", V::Array((0..6).map(V::from).collect()))],
    )]);
    let Event::Stored(st) = &n.batch.events[0] else { panic!() };
    assert_eq!(st.blocks[1].token_ids, vec![4, 5]);
    assert!(n.rewrites.0.is_empty());
}

#[test]
fn stores_and_removals_stay_one_for_one() {
    let n = normalize(vec![
        stored_map(vec![V::from(1)], vec![]),
        stored_map(vec![V::from(1)], vec![]),
        map(vec![("type", s("BlockRemoved")), ("block_hashes", V::Array(vec![V::from(1)])), ("medium", s("GPU"))]),
    ]);
    let mut live = kv_relay::live::LiveBlocks::new();
    live.apply(&n.batch);
    assert_eq!(n.batch.events.len(), 3);
    let set = live.blocks.values().next().unwrap();
    assert_eq!(set.get(&1), Some(&1));
    assert_eq!(live.stored_already_live, 1);
}
