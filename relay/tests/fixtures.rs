//! Every capture and golden stream in `testdata/fixtures/` decodes to exactly what its manifest
//! says: the counts, each decoded event field by field, the live blocks with copies counted at
//! the end and at every checkpoint, and, through the normalizer, the relay's model.

use kv_relay::capture::{self, CapturedMessage, Decoded, SocketKind};
use kv_relay::live::LiveKey;
use kv_relay::model::{Tier, TokenLayout};
use kv_relay::wire::{self, RawEvent};
use serde_json::{json, Value};
use std::collections::BTreeMap;

fn load(name: &str) -> (Vec<CapturedMessage>, Value) {
    let messages = capture::read(&kv_relay_testdata::capture(name)).unwrap();
    let manifest: Value =
        serde_json::from_str(&std::fs::read_to_string(kv_relay_testdata::manifest(name)).unwrap()).unwrap();
    (messages, manifest)
}

#[test]
fn every_fixture_is_covered() {
    let names = kv_relay_testdata::names();
    assert_eq!(names.len(), 22, "{names:?}");
}

/// The raw events of the pub lines, in order, with their rank and line.
fn pub_events(messages: &[CapturedMessage]) -> Vec<(usize, u32, u64, Vec<RawEvent>)> {
    let mut out = Vec::new();
    for m in messages.iter().filter(|m| m.socket == SocketKind::Pub) {
        let frames: Vec<&[u8]> = m.frames.iter().map(Vec::as_slice).collect();
        let f = wire::split_pub(&frames).unwrap_or_else(|e| panic!("line {}: {e}", m.line));
        let b = wire::decode_batch(f.payload).unwrap_or_else(|e| panic!("line {}: {e}", m.line));
        assert!(!b.truncated, "line {}", m.line);
        let events = b
            .events
            .into_iter()
            .enumerate()
            .map(|(i, e)| e.unwrap_or_else(|r| panic!("line {} event {i}: dropped {r}", m.line)))
            .collect();
        out.push((m.line, b.dp_rank.or(m.dp_rank).unwrap(), f.seq, events));
    }
    out
}

#[test]
fn counts_match_every_manifest() {
    for name in kv_relay_testdata::names() {
        let (messages, m) = load(&name);
        let c = &m["counts"];
        let evs = pub_events(&messages);
        let mut got = BTreeMap::<&str, u64>::new();
        got.insert("batches", evs.len() as u64);
        for (_, _, _, events) in &evs {
            for e in events {
                *got.entry("events").or_default() += 1;
                *got.entry(e.type_name()).or_default() += 1;
                match e {
                    RawEvent::Stored(s) => {
                        *got.entry("stored_hashes").or_default() += s.block_hashes.len() as u64;
                        if s.block_hashes.is_empty() {
                            *got.entry("stored_events_with_empty_block_hashes").or_default() += 1;
                        }
                    }
                    RawEvent::Removed(r) => *got.entry("removed_hashes").or_default() += r.block_hashes.len() as u64,
                    RawEvent::Cleared(_) => {}
                }
            }
        }
        for key in [
            "batches",
            "events",
            "BlockStored",
            "BlockRemoved",
            "AllBlocksCleared",
            "stored_hashes",
            "removed_hashes",
            "stored_events_with_empty_block_hashes",
        ] {
            let want = c[key].as_u64().unwrap_or_else(|| panic!("{name}: no counts.{key}"));
            assert_eq!(got.get(key).copied().unwrap_or(0), want, "{name}: counts.{key}");
        }
        let num_pub = m["num_pub_messages"].as_u64().or(m["num_messages"].as_u64()).unwrap();
        assert_eq!(evs.len() as u64, num_pub, "{name}: pub messages");
        assert_eq!(messages.len() as u64, m["num_messages"].as_u64().unwrap(), "{name}: messages");
    }
}

fn tokens_json(t: &wire::RawTokens) -> Value {
    match t.layout {
        TokenLayout::Single => json!(t.ids),
        TokenLayout::Bigram => json!(t.ids.chunks(2).map(|p| json!([p[0], p[1]])).collect::<Vec<_>>()),
    }
}

/// A raw event in the manifests' neutral form (without the `_wire` and `wire_form` keys).
fn neutral(e: &RawEvent) -> Value {
    match e {
        RawEvent::Stored(s) => json!({
            "type": "BlockStored",
            "block_hashes": s.block_hashes,
            "parent_block_hash": s.parent_block_hash,
            "token_ids": tokens_json(&s.token_ids),
            "block_size": s.block_size,
            "lora_id": s.lora_id,
            "lora_name": s.lora_name,
            "extra_keys": s.extra_keys,
            "kind": s.kv_cache_spec_kind,
            "window": s.kv_cache_spec_sliding_window,
            "cache_salt": s.cache_salt,
            "session_id": s.session_id,
            "medium": s.medium,
            "group_idx": s.group_idx,
            "locality": s.locality,
        }),
        RawEvent::Removed(r) => json!({
            "type": "BlockRemoved",
            "block_hashes": r.block_hashes,
            "medium": r.medium,
            "group_idx": r.group_idx,
            "locality": r.locality,
        }),
        RawEvent::Cleared(_) => json!({"type": "AllBlocksCleared"}),
    }
}

#[test]
fn golden_streams_decode_field_by_field() {
    let mut checked = 0;
    for name in kv_relay_testdata::names().into_iter().filter(|n| n.starts_with("golden-")) {
        let (messages, m) = load(&name);
        let evs = pub_events(&messages);
        let batches = m["batches_decoded_neutral"].as_array().unwrap();
        assert_eq!(batches.len(), evs.len(), "{name}");
        for ((_, rank, seq, events), want) in evs.iter().zip(batches) {
            assert_eq!(*seq, want["seq"].as_u64().unwrap(), "{name}");
            assert_eq!(u64::from(*rank), want["dp_rank"].as_u64().unwrap(), "{name} seq {seq}");
            let want_events = want["events"].as_array().unwrap();
            assert_eq!(events.len(), want_events.len(), "{name} seq {seq}");
            for (i, (got, w)) in events.iter().zip(want_events).enumerate() {
                let mut w = w.as_object().unwrap().clone();
                w.retain(|k, _| !k.ends_with("_wire") && k != "wire_form");
                assert_eq!(neutral(got), Value::Object(w), "{name} seq {seq} event {i}");
                checked += 1;
            }
        }
    }
    let want: u64 = kv_relay_testdata::names()
        .iter()
        .filter(|n| n.starts_with("golden-"))
        .map(|n| load(n).1["counts"]["events"].as_u64().unwrap())
        .sum();
    assert_eq!(checked, want);
}

fn hash_u64(v: &Value) -> u64 {
    if let Some(u) = v.as_u64() {
        u
    } else if let Some(i) = v.as_i64() {
        i as u64
    } else {
        let hex = v["$bytes_hex"].as_str().unwrap();
        let b: Vec<u8> = (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap()).collect();
        b[b.len() - 8..].iter().fold(0, |a, x| (a << 8) | u64::from(*x))
    }
}

/// The real captures' `first_batches_decoded` (an untyped decode by the engines' own library)
/// agree with ours on every key they carry.
#[test]
fn real_captures_first_batches_match_the_untyped_decode() {
    let mut checked = 0;
    for name in kv_relay_testdata::names().into_iter().filter(|n| !n.starts_with("golden-")) {
        let (messages, m) = load(&name);
        let evs = pub_events(&messages);
        for fb in m["first_batches_decoded"].as_array().unwrap() {
            let seq = fb["seq"].as_u64().unwrap();
            let d = fb["decoded"].as_array().unwrap();
            let rank = d[2].as_u64().unwrap() as u32;
            let (_, _, _, events) = evs.iter().find(|(_, r, s, _)| *s == seq && *r == rank).unwrap();
            let want = d[1].as_array().unwrap();
            assert_eq!(events.len(), want.len(), "{name} seq {seq}");
            for (got, w) in events.iter().zip(want) {
                let g = neutral(got);
                for (k, v) in w.as_object().unwrap() {
                    let key = match k.as_str() {
                        "kv_cache_spec_kind" => "kind",
                        "kv_cache_spec_sliding_window" => "window",
                        k => k,
                    };
                    let want_v = match key {
                        "block_hashes" => json!(v.as_array().unwrap().iter().map(hash_u64).collect::<Vec<_>>()),
                        "parent_block_hash" if !v.is_null() => json!(hash_u64(v)),
                        _ => v.clone(),
                    };
                    assert_eq!(g[key], want_v, "{name} seq {seq} key {k}");
                    checked += 1;
                }
            }
        }
    }
    assert!(checked > 100, "{checked}");
}

/// The manifests' reference walk, on raw events: key = (rank, medium as sent, group_idx as sent).
type RawKey = (u32, Option<String>, Option<u32>);

fn expected_of(v: &Value) -> BTreeMap<RawKey, BTreeMap<u64, u32>> {
    let mut out = BTreeMap::new();
    for e in v.as_array().unwrap() {
        let key = (
            e["dp_rank"].as_u64().unwrap() as u32,
            e["medium"].as_str().map(str::to_owned),
            e["group_idx"].as_u64().map(|g| g as u32),
        );
        let hashes = e["block_hashes"].as_array().unwrap();
        let counts = e.get("counts").and_then(Value::as_array);
        let set: BTreeMap<u64, u32> = hashes
            .iter()
            .enumerate()
            .map(|(i, h)| (h.as_u64().unwrap(), counts.map_or(1, |c| c[i].as_u64().unwrap() as u32)))
            .collect();
        out.insert(key, set);
    }
    out
}

#[test]
fn raw_walk_matches_expected_refcounted_and_every_checkpoint() {
    for name in kv_relay_testdata::names() {
        let (messages, m) = load(&name);
        let checkpoints: BTreeMap<u64, &Value> = m["checkpoints"]
            .as_array()
            .map(|c| c.iter().map(|c| (c["after_line"].as_u64().unwrap(), c)).collect())
            .unwrap_or_default();
        let mut live: BTreeMap<RawKey, BTreeMap<u64, u32>> = BTreeMap::new();
        let mut last_seq: BTreeMap<String, u64> = BTreeMap::new();
        let mut seen_checkpoints = 0;
        let evs = pub_events(&messages);
        let endpoints: BTreeMap<usize, &str> = messages.iter().map(|m| (m.line, m.endpoint.as_str())).collect();
        for (line, rank, seq, events) in &evs {
            if let Some(prev) = last_seq.insert(endpoints[line].to_string(), *seq) {
                if *seq <= prev {
                    live.retain(|k, _| k.0 != *rank);
                }
            }
            for e in events {
                match e {
                    RawEvent::Stored(s) => {
                        let set = live.entry((*rank, s.medium.clone(), s.group_idx)).or_default();
                        for h in &s.block_hashes {
                            *set.entry(*h).or_default() += 1;
                        }
                    }
                    RawEvent::Removed(r) => {
                        if let Some(set) = live.get_mut(&(*rank, r.medium.clone(), r.group_idx)) {
                            for h in &r.block_hashes {
                                match set.get(h).copied() {
                                    Some(c) if c > 1 => {
                                        set.insert(*h, c - 1);
                                    }
                                    Some(_) => {
                                        set.remove(h);
                                    }
                                    None => {}
                                }
                            }
                        }
                    }
                    RawEvent::Cleared(_) => live.retain(|k, _| k.0 != *rank),
                }
            }
            live.retain(|_, s| !s.is_empty());
            if let Some(c) = checkpoints.get(&(*line as u64)) {
                assert_eq!(live, expected_of(&c["expected_refcounted"]), "{name}: checkpoint after line {line}");
                seen_checkpoints += 1;
            }
        }
        assert_eq!(seen_checkpoints, checkpoints.len(), "{name}: checkpoints");
        assert_eq!(live, expected_of(&m["expected_refcounted"]), "{name}: expected_refcounted");
    }
}

/// Through the normalizer: the relay's live blocks equal the manifest's, keyed by tier and
/// group, with the hybrid policy applied (vllm-hybrid's sliding-window group 0 is dropped beside
/// its full-attention group 1, and every one of its events is counted as such).
#[test]
fn normalized_walk_matches_expected_with_tiers_and_hybrid_policy() {
    for name in kv_relay_testdata::names() {
        let (messages, m) = load(&name);
        let walk = capture::walk(&messages);
        let evs = pub_events(&messages);
        // The hybrid policy, restated from the spec: per rank, the groups whose stores name a
        // sliding-window kind, where some store of the rank names a main-attention kind.
        let mut window: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
        let mut main: Vec<u32> = Vec::new();
        for (_, rank, _, events) in &evs {
            for e in events {
                if let RawEvent::Stored(s) = e {
                    match (s.group_idx, s.kv_cache_spec_kind.as_deref()) {
                        (Some(g), Some("sliding_window")) => window.entry(*rank).or_default().push(g),
                        (Some(_), Some("full_attention")) => main.push(*rank),
                        _ => {}
                    }
                }
            }
        }
        let dropped_group = |rank: u32, g: Option<u32>| {
            main.contains(&rank) && g.is_some_and(|g| window.get(&rank).is_some_and(|w| w.contains(&g)))
        };
        let mut want: BTreeMap<LiveKey, BTreeMap<u64, u32>> = BTreeMap::new();
        for ((rank, medium, group), set) in expected_of(&m["expected_refcounted"]) {
            if dropped_group(rank, group) {
                continue;
            }
            let key = LiveKey { dp_rank: rank, tier: Tier::from_medium(medium.as_deref()), group: group.unwrap_or(0) };
            let into = want.entry(key).or_default();
            for (h, c) in set {
                *into.entry(h).or_default() += c;
            }
        }
        assert_eq!(walk.live.blocks, want, "{name}");
        assert_eq!(walk.restarts, m["counts"]["restarts_detected"].as_u64().unwrap_or(0), "{name}: restarts");
        assert!(walk.summary.message_errors.0.is_empty(), "{name}: {:?}", walk.summary.message_errors);

        // Every drop is accounted for: window-group events, and nothing else.
        let replay_batches: u64 = walk
            .decoded
            .iter()
            .zip(&messages)
            .filter(|(d, m)| m.socket == SocketKind::Replay && matches!(d, Decoded::Batch { .. }))
            .count() as u64;
        let replays: u64 = walk.decoded.iter().filter(|d| matches!(d, Decoded::ReplayEnd)).count() as u64;
        assert_eq!(walk.summary.batches, evs.len() as u64 + replay_batches, "{name}");
        assert_eq!(replays + replay_batches, m["num_replay_messages"].as_u64().unwrap_or(0), "{name}: replay lines");
        let window_events: u64 = evs
            .iter()
            .flat_map(|(_, rank, _, e)| e.iter().map(move |e| (*rank, e)))
            .filter(|(rank, e)| match e {
                RawEvent::Stored(s) => dropped_group(*rank, s.group_idx),
                RawEvent::Removed(r) => dropped_group(*rank, r.group_idx),
                RawEvent::Cleared(_) => false,
            })
            .count() as u64;
        {
            // Drops are counted over pub and replay lines alike.
            let pub_drops: u64 = walk
                .decoded
                .iter()
                .zip(&messages)
                .filter(|(_, m)| m.socket == SocketKind::Pub)
                .map(|(d, _)| match d {
                    Decoded::Batch { normalized, .. } => normalized.drops.get("window_group_beside_main"),
                    _ => 0,
                })
                .sum();
            assert_eq!(pub_drops, window_events, "{name}: window drops");
            let empty_stores: u64 = m["counts"]["stored_events_with_empty_block_hashes"].as_u64().unwrap_or(0);
            let no_hash_drops = walk.summary.drops.get("no_block_hashes");
            // Every empty store in these captures is a window-group store, dropped as such.
            assert_eq!(no_hash_drops, 0, "{name}: {empty_stores} empty stores");
            assert_eq!(
                walk.summary.drops.total(),
                walk.summary.drops.get("window_group_beside_main"),
                "{name}: {:?}",
                walk.summary.drops
            );
        }
    }
}
