//! The wire encoders against the golden manifests: every batch of every
//! `golden-*.manifest.json`, rebuilt from its neutral form and re-encoded, must reproduce the
//! manifest's `payload_hex` byte for byte.
//!
//! What the neutral form lacks, and why it does not matter here:
//! - `ownership` and `lookahead_token_ids` are not in the neutral form; no golden release has
//!   them (the newest golden is vLLM 0.26), so they are always absent.
//! - "null = absent or nil": which fields are written is decided by the release's rules
//!   (arrays: full length; maps: omit_defaults), and each event's `wire_form` is checked to
//!   equal what the encoder writes, so a field the rules would drop wrongly is caught.

use std::path::PathBuf;

use kv_relay_testkit::kit::hex;
use kv_relay_testkit::wire::{
    encode_batch, wire_form, Batch, BlockHash, Engine, EngineEvent, Removed, Stored, TokenIds, WireVersion,
};
use rmpv::Value;
use serde_json::Value as Json;

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex")).collect()
}

fn hash_from(j: &Json) -> BlockHash {
    if let Some(obj) = j.as_object() {
        let h = obj["bytes_hex"].as_str().expect("bytes_hex");
        return BlockHash::Bytes(unhex(h));
    }
    if let Some(u) = j.as_u64() {
        return BlockHash::U64(u);
    }
    BlockHash::I64(j.as_i64().unwrap_or_else(|| panic!("hash {j}")))
}

fn value_from(j: &Json) -> Value {
    match j {
        Json::Null => Value::Nil,
        Json::Bool(b) => Value::Boolean(*b),
        Json::Number(n) => {
            if let Some(u) = n.as_u64() {
                Value::from(u)
            } else if let Some(i) = n.as_i64() {
                Value::from(i)
            } else {
                Value::F64(n.as_f64().expect("float"))
            }
        }
        Json::String(s) => Value::from(s.as_str()),
        Json::Array(items) => Value::Array(items.iter().map(value_from).collect()),
        Json::Object(obj) => match obj.get("bytes_hex").and_then(Json::as_str) {
            Some(h) => Value::Binary(unhex(h)),
            None => panic!("unexpected object in extra_keys: {j}"),
        },
    }
}

fn opt_str(e: &Json, k: &str) -> Option<String> {
    e.get(k).and_then(Json::as_str).map(str::to_string)
}

fn opt_u32(e: &Json, k: &str) -> Option<u32> {
    e.get(k).and_then(Json::as_u64).map(|v| v as u32)
}

fn event_from(e: &Json) -> EngineEvent {
    let hashes = || -> Vec<BlockHash> {
        e["block_hashes_wire"].as_array().expect("block_hashes_wire").iter().map(hash_from).collect()
    };
    match e["type"].as_str().expect("type") {
        "AllBlocksCleared" => EngineEvent::Cleared,
        "BlockRemoved" => EngineEvent::Removed(Removed {
            hashes: hashes(),
            medium: opt_str(e, "medium"),
            group_idx: opt_u32(e, "group_idx"),
            locality: opt_str(e, "locality"),
            ownership: None,
        }),
        "BlockStored" => {
            let toks = e["token_ids"].as_array().expect("token_ids");
            let token_ids = if toks.first().is_some_and(Json::is_array) {
                TokenIds::Pairs(
                    toks.iter()
                        .map(|p| {
                            let p = p.as_array().expect("pair");
                            [p[0].as_u64().expect("tok"), p[1].as_u64().expect("tok")]
                        })
                        .collect(),
                )
            } else {
                TokenIds::Single(toks.iter().map(|t| t.as_u64().expect("tok")).collect())
            };
            let parent = match e.get("parent_block_hash_wire") {
                None | Some(Json::Null) => None,
                Some(j) => Some(hash_from(j)),
            };
            let extra_keys = match e.get("extra_keys") {
                None | Some(Json::Null) => None,
                Some(Json::Array(items)) => Some(items.iter().map(value_from).collect()),
                Some(other) => panic!("extra_keys {other}"),
            };
            EngineEvent::Stored(Stored {
                hashes: hashes(),
                parent,
                token_ids,
                block_size: e["block_size"].as_u64().expect("block_size") as u32,
                lora_id: e.get("lora_id").and_then(Json::as_i64),
                medium: opt_str(e, "medium"),
                lora_name: opt_str(e, "lora_name"),
                extra_keys,
                group_idx: opt_u32(e, "group_idx"),
                kind: opt_str(e, "kind"),
                sliding_window: opt_u32(e, "window"),
                locality: opt_str(e, "locality"),
                ownership: None,
                cache_salt: opt_str(e, "cache_salt"),
                session_id: opt_str(e, "session_id"),
                lookahead_token_ids: None,
            })
        }
        other => panic!("unknown event type {other}"),
    }
}

#[test]
fn every_golden_batch_reencodes_byte_for_byte() {
    let manifests: Vec<PathBuf> = kv_relay_testdata::names()
        .iter()
        .filter(|n| n.starts_with("golden-"))
        .map(|n| kv_relay_testdata::manifest(n))
        .collect();
    // 12 golden manifests are listed in the fixtures README; none may go unchecked.
    assert_eq!(manifests.len(), 12, "golden manifests found: {manifests:?}");

    let mut checked_batches = 0;
    let mut failures = Vec::new();
    for path in &manifests {
        let m: Json = serde_json::from_slice(&std::fs::read(path).expect("read manifest")).expect("manifest json");
        let engine = Engine::parse(m["engine"].as_str().expect("engine")).expect("engine name");
        let version = m["engine_version"].as_str().expect("engine_version");
        let wire = WireVersion::parse(engine, version).expect("version");
        let batches = m["batches_decoded_neutral"].as_array().expect("batches_decoded_neutral");
        assert!(!batches.is_empty(), "{path:?} has no batches");
        for b in batches {
            let events: Vec<EngineEvent> = b["events"].as_array().expect("events").iter().map(event_from).collect();
            for (ev, j) in events.iter().zip(b["events"].as_array().expect("events")) {
                let want = j["wire_form"].as_str().expect("wire_form");
                let got = wire_form(&wire, ev);
                if got != want {
                    failures.push(format!(
                        "{} seq {}: wire_form\n  expected {want}\n  got      {got}",
                        path.display(),
                        b["seq"]
                    ));
                }
            }
            let batch =
                Batch { ts: b["ts"].as_f64().expect("ts"), events, dp_rank: b["dp_rank"].as_u64().map(|r| r as u32) };
            let got = hex(&encode_batch(&wire, &batch));
            let want = b["payload_hex"].as_str().expect("payload_hex");
            if got != want {
                failures.push(format!("{} seq {}:\n  expected {want}\n  got      {got}", path.display(), b["seq"]));
            }
            assert_eq!(b["batch_array_len"].as_u64(), Some(if wire.batch_has_rank() { 3 } else { 2 }));
            checked_batches += 1;
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // 5+4+7+4 SGLang batches, 8×7 + 7 vLLM batches (see the fixtures README, section 4).
    assert_eq!(checked_batches, 83);
}
