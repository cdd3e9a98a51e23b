//! The layout of every release the spec lists, including those no golden covers (vLLM 0.29
//! ownership, 0.30 session_id, 0.33 lookahead and map16 header; SGLang 0.4.6, 0.5.18 salted
//! stores, 0.5.22 lora_name): array lengths, map keys in order, omit_defaults.

use kv_relay_testkit::decode::decode_batch;
use kv_relay_testkit::wire::{
    encode_batch, wire_form, Batch, BlockHash, Engine, EngineEvent, Removed, Stored, TokenIds, WireVersion,
};
use rmpv::Value;

fn full_store() -> EngineEvent {
    EngineEvent::Stored(Stored {
        hashes: vec![BlockHash::U64(1)],
        parent: Some(BlockHash::U64(2)),
        token_ids: TokenIds::Single(vec![1, 2]),
        block_size: 2,
        lora_id: Some(3),
        medium: Some("GPU".into()),
        lora_name: Some("l".into()),
        extra_keys: Some(vec![Value::Nil]),
        group_idx: Some(0),
        kind: Some("full_attention".into()),
        sliding_window: Some(8),
        locality: Some("LOCAL".into()),
        ownership: Some("OWNED".into()),
        cache_salt: Some("s".into()),
        session_id: Some("sess".into()),
        lookahead_token_ids: Some(vec![vec![5]]),
    })
}

fn bare_store() -> EngineEvent {
    EngineEvent::Stored(Stored {
        hashes: vec![BlockHash::I64(-1)],
        token_ids: TokenIds::Single(vec![1, 2]),
        block_size: 2,
        ..Default::default()
    })
}

fn full_remove() -> EngineEvent {
    EngineEvent::Removed(Removed {
        hashes: vec![BlockHash::U64(1)],
        medium: Some("GPU".into()),
        group_idx: Some(0),
        locality: Some("LOCAL".into()),
        ownership: Some("OWNED".into()),
    })
}

fn keys(list: &[&str]) -> String {
    let quoted: Vec<String> = list.iter().map(|k| format!("'{k}'")).collect();
    format!("map[{}]", quoted.join(", "))
}

const VLLM_MAP_STORED: [&str; 12] = [
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
];

#[test]
fn vllm_layouts_by_release() {
    let v = |m, p| WireVersion::new(Engine::Vllm, 0, m, p);
    let arrays = [
        (v(9, 0), 6, 2),
        (v(9, 1), 6, 2),
        (v(10, 1), 6, 2),
        (v(10, 2), 7, 3),
        (v(14, 0), 8, 3),
        (v(17, 0), 9, 3),
        (v(20, 0), 10, 4),
        (v(22, 0), 12, 4),
        (v(23, 0), 12, 4),
    ];
    for (wire, stored, removed) in arrays {
        assert_eq!(wire_form(&wire, &full_store()), format!("array(len={stored})"), "{wire}");
        assert_eq!(wire_form(&wire, &full_remove()), format!("array(len={removed})"), "{wire}");
        assert_eq!(wire_form(&wire, &EngineEvent::Cleared), "array(len=1)");
    }
    let mut stored: Vec<&str> = VLLM_MAP_STORED.to_vec();
    let mut removed = vec!["type", "block_hashes", "medium", "group_idx"];
    for (wire, extra_stored, extra_removed) in [
        (v(24, 0), None, None),
        (v(26, 0), Some("locality"), Some("locality")),
        (v(29, 0), Some("ownership"), Some("ownership")),
        (v(30, 0), Some("session_id"), None),
        (v(33, 0), Some("lookahead_token_ids"), None),
    ] {
        stored.extend(extra_stored);
        removed.extend(extra_removed);
        assert_eq!(wire_form(&wire, &full_store()), keys(&stored), "{wire}");
        assert_eq!(wire_form(&wire, &full_remove()), keys(&removed), "{wire}");
        assert_eq!(wire_form(&wire, &EngineEvent::Cleared), "map['type']");
        // omit_defaults: fields without a default stay (nil), the rest go.
        assert_eq!(wire_form(&wire, &bare_store()), keys(&VLLM_MAP_STORED[..8]), "{wire}");
    }
}

#[test]
fn vllm_0_33_sizes_the_store_map_header_by_its_sixteen_possible_entries() {
    let batch = Batch { ts: 0.0, events: vec![bare_store()], dp_rank: Some(0) };
    let b = encode_batch(&WireVersion::new(Engine::Vllm, 0, 33, 0), &batch);
    // [batch fixarray, ts float64 (9 bytes), events fixarray] then the store's header.
    assert_eq!(&b[11..14], &[0xde, 0x00, 0x08]);
    let b30 = encode_batch(&WireVersion::new(Engine::Vllm, 0, 30, 0), &batch);
    assert_eq!(b30[11], 0x88);
}

#[test]
fn sglang_layouts_by_release() {
    let s = |m, p| WireVersion::new(Engine::Sglang, 0, m, p);
    for (wire, stored, removed) in [
        (s(4, 6), "array(len=6)", "array(len=2)"),
        (s(4, 7), "array(len=6)", "array(len=2)"),
        (s(5, 8), "array(len=6)", "array(len=2)"),
        (s(5, 9), "array(len=7)", "array(len=3)"),
        (s(5, 17), "array(len=7)", "array(len=3)"),
        // 0.5.18-0.5.19: a salted store is BlockStoredWithMetadata (8 elements).
        (s(5, 18), "array(len=8)", "array(len=3)"),
        (s(5, 19), "array(len=8)", "array(len=3)"),
    ] {
        assert_eq!(wire_form(&wire, &full_store()), stored, "{wire}");
        assert_eq!(wire_form(&wire, &full_remove()), removed, "{wire}");
    }
    assert_eq!(wire_form(&s(5, 18), &bare_store()), "array(len=7)");
    let base = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id"];
    let mut full = base.to_vec();
    full.extend(["medium", "cache_salt", "session_id"]);
    assert_eq!(wire_form(&s(5, 20), &full_store()), keys(&full));
    assert_eq!(wire_form(&s(5, 21), &full_store()), keys(&full));
    full.push("lora_name");
    assert_eq!(wire_form(&s(5, 22), &full_store()), keys(&full));
    // SGLang's medium has a default: omitted when None (vLLM's is always present).
    assert_eq!(wire_form(&s(5, 23), &bare_store()), keys(&base));
    assert_eq!(wire_form(&s(5, 23), &full_remove()), keys(&["type", "block_hashes", "medium"]));
}

#[test]
fn two_element_batches_before_the_rank_field_three_after() {
    let batch = Batch { ts: 1.0, events: vec![bare_store()], dp_rank: Some(3) };
    for (wire, len, rank) in [
        (WireVersion::new(Engine::Vllm, 0, 9, 0), 2, None),
        (WireVersion::new(Engine::Vllm, 0, 9, 1), 3, Some(3)),
        (WireVersion::new(Engine::Sglang, 0, 4, 6), 2, None),
        (WireVersion::new(Engine::Sglang, 0, 4, 7), 3, Some(3)),
    ] {
        let b = encode_batch(&wire, &batch);
        assert_eq!(b[0], 0x90 | len, "{wire}");
        let d = decode_batch(&b).unwrap();
        assert_eq!(d.dp_rank, rank);
        assert_eq!(d.events.len(), 1);
    }
}

#[test]
fn hashes_take_msgspec_markers() {
    let enc = |h: BlockHash| {
        let ev = EngineEvent::Removed(Removed { hashes: vec![h], ..Default::default() });
        let b =
            encode_batch(&WireVersion::new(Engine::Vllm, 0, 9, 0), &Batch { ts: 0.0, events: vec![ev], dp_rank: None });
        // 92 cb<8> 91 92 ac"BlockRemoved" 91 <hash>
        b[1 + 9 + 1 + 1 + 13 + 1..].to_vec()
    };
    assert_eq!(enc(BlockHash::U64(5)), vec![0x05]);
    assert_eq!(enc(BlockHash::U64(200)), vec![0xcc, 200]);
    assert_eq!(enc(BlockHash::U64(1 << 63))[0], 0xcf);
    assert_eq!(enc(BlockHash::I64(-5)), vec![0xfb]);
    assert_eq!(enc(BlockHash::I64(-100)), vec![0xd0, 0x9c]);
    assert_eq!(enc(BlockHash::I64(i64::MIN))[0], 0xd3);
    // Non-negative signed values take the unsigned markers, as msgspec does.
    assert_eq!(enc(BlockHash::I64(1 << 62))[0], 0xcf);
    assert_eq!(enc(BlockHash::Bytes(vec![7; 16]))[..2], [0xc4, 16]);
}
