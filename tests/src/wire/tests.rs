use super::*;
use crate::kit::hex;

fn spec_batch() -> Batch {
    Batch {
        ts: 1.5,
        events: vec![
            EngineEvent::Stored(Stored {
                hashes: vec![BlockHash::U64(15760518052499183552)],
                token_ids: TokenIds::Single(vec![1, 2, 3, 4]),
                block_size: 4,
                medium: Some("GPU".into()),
                group_idx: Some(0),
                kind: Some("full_attention".into()),
                ..Default::default()
            }),
            EngineEvent::Removed(Removed {
                hashes: vec![BlockHash::U64(1234)],
                medium: Some("GPU".into()),
                group_idx: Some(0),
                ..Default::default()
            }),
            EngineEvent::Cleared,
        ],
        dp_rank: Some(0),
    }
}

/// Concatenate hex pieces; `"s:TEXT"` pieces are the hex of TEXT.
fn h(parts: &[&str]) -> String {
    parts
        .iter()
        .map(|p| match p.strip_prefix("s:") {
            Some(text) => hex(text.as_bytes()),
            None => p.replace(' ', ""),
        })
        .collect()
}

#[test]
fn spec_golden_vllm_0_9_0_is_78_bytes_with_two_element_batch() {
    let b = encode_batch(&WireVersion::new(Engine::Vllm, 0, 9, 0), &spec_batch());
    let expect = h(&[
        "92 cb3ff8000000000000 93 96 ab",
        "s:BlockStored",
        "91 cfdab89baa7b5857c0 c0 94 01020304 04 c0 92 ac",
        "s:BlockRemoved",
        "91 cd04d2 91 b0",
        "s:AllBlocksCleared",
    ]);
    assert_eq!(hex(&b), expect);
    assert_eq!(b.len(), 78);
    let b091 = encode_batch(&WireVersion::new(Engine::Vllm, 0, 9, 1), &spec_batch());
    assert_eq!(hex(&b091), format!("93{}00", &expect[2..]));
}

#[test]
fn spec_golden_vllm_0_22_is_107_bytes() {
    let b = encode_batch(&WireVersion::new(Engine::Vllm, 0, 22, 0), &spec_batch());
    assert_eq!(b.len(), 107);
}

#[test]
fn spec_golden_vllm_0_24_is_256_bytes_and_0_33_uses_map16() {
    let b24 = encode_batch(&WireVersion::new(Engine::Vllm, 0, 24, 0), &spec_batch());
    assert_eq!(b24.len(), 256);
    let b33 = encode_batch(&WireVersion::new(Engine::Vllm, 0, 33, 0), &spec_batch());
    // Same bytes, except the BlockStored header `8a` becomes `de 00 0a`.
    let i = 1 + 9 + 1; // batch header, ts, events header
    assert_eq!(b24[i], 0x8a);
    assert_eq!(&b33[i..i + 3], &[0xde, 0x00, 0x0a]);
    assert_eq!(&b24[i + 1..], &b33[i + 3..]);
}

#[test]
fn spec_golden_sglang_0_5_23_bigram_salt_lora_event() {
    let batch = Batch {
        ts: 1.5,
        events: vec![EngineEvent::Stored(Stored {
            hashes: vec![BlockHash::I64(0x9a7587135a2a6608u64 as i64)],
            token_ids: TokenIds::Pairs(vec![[1, 2], [2, 3]]),
            block_size: 2,
            medium: Some("GPU".into()),
            cache_salt: Some("tenant-a".into()),
            lora_name: Some("my-lora".into()),
            ..Default::default()
        })],
        dp_rank: Some(1),
    };
    let b = encode_batch(&WireVersion::new(Engine::Sglang, 0, 5, 23), &batch);
    let expect = format!(
        "93cb3ff80000000000009189a474797065ab{}ac{}91d39a7587135a2a6608b1{}c0a9{}92920102920203aa{}02a7{}c0a6{}a3475055aa{}a8{}a9{}a7{}01",
        hex(b"BlockStored"),
        hex(b"block_hashes"),
        hex(b"parent_block_hash"),
        hex(b"token_ids"),
        hex(b"block_size"),
        hex(b"lora_id"),
        hex(b"medium"),
        hex(b"cache_salt"),
        hex(b"tenant-a"),
        hex(b"lora_name"),
        hex(b"my-lora"),
    );
    assert_eq!(hex(&b), expect);
}

#[test]
fn version_parsing_reads_two_and_three_part_versions() {
    assert_eq!(WireVersion::parse(Engine::Vllm, "0.32").unwrap().release, (0, 32, 0));
    assert_eq!(WireVersion::parse(Engine::Sglang, "0.4.6.post5").unwrap().release, (0, 4, 6));
    assert!(WireVersion::parse(Engine::Vllm, "x").is_err());
}

#[test]
fn bytes_hash_normalises_to_last_eight_bytes_big_endian() {
    assert_eq!(bytes_tail_u64(&[1, 2]), 0x0102);
    let mut b = vec![0xaa; 24];
    b.extend_from_slice(&[0, 0, 0, 0, 0, 0, 1, 0]);
    assert_eq!(BlockHash::Bytes(b).as_u64(), 256);
    assert_eq!(BlockHash::I64(-1).as_u64(), u64::MAX);
}
