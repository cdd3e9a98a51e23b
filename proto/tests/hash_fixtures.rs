//! Reproduces every block hash stored in the real engine captures of `testdata/fixtures`
//! from the token ids of the requests recorded in their manifests.
//!
//! For each capture the `BlockStored` events of the `pub` stream are decoded (msgpack), and
//! each stored hash must be one of the hashes computed for the recorded requests with the
//! engine configuration of the manifest; the event's token ids for that block must be the
//! tokens the hash was computed from. Counts are exact.

use std::collections::HashMap;

use base64::Engine as _;
use kv_relay_proto::hash::{
    block_event_hashes, sglang, vllm, EngineHashConfig, EngineVersion, ExtraKeyForm, LoraRef, NoneHashSeed,
    RequestKeys, VllmHashAlgo,
};
use serde_json::Value as Json;

fn manifest(name: &str) -> Json {
    let path = kv_relay_testdata::manifest(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).expect("manifest is json")
}

/// One stored block as the wire carried it.
#[derive(Debug)]
struct StoredBlock {
    hash: u64,
    /// The block's own token ids (flattened pairs for EAGLE), or, when the event carried
    /// more tokens than its hashes cover, every block-aligned slice of them.
    tokens: Vec<Vec<u64>>,
    /// The event had more tokens than its hashes cover (vLLM sliding-window groups).
    in_longer_event: bool,
    /// `group_idx`, when the event has one.
    group: Option<u64>,
}

fn field<'a>(map: &'a [(rmpv::Value, rmpv::Value)], key: &str) -> Option<&'a rmpv::Value> {
    map.iter().find(|(k, _)| k.as_str() == Some(key)).map(|(_, v)| v)
}

/// Normalises a wire hash: ints as their 64-bit two's complement, bytes as the last 8
/// bytes big-endian.
fn wire_hash(v: &rmpv::Value) -> u64 {
    match v {
        rmpv::Value::Integer(i) => i.as_u64().or_else(|| i.as_i64().map(|x| x as u64)).expect("64-bit hash"),
        rmpv::Value::Binary(b) => {
            let mut buf = [0u8; 8];
            buf.copy_from_slice(&b[b.len() - 8..]);
            u64::from_be_bytes(buf)
        }
        other => panic!("unexpected hash {other:?}"),
    }
}

/// A `BlockStored` event as the wire carried it.
#[derive(Debug)]
struct WireStore {
    hashes: Vec<u64>,
    parent: Option<u64>,
    /// Token ids, EAGLE pairs flattened.
    tokens: Vec<u64>,
    /// Token ids per block (`block_size`, doubled for EAGLE pairs).
    block: usize,
    group: Option<u64>,
    /// SGLang `cache_salt`.
    cache_salt: Option<String>,
    /// SGLang `lora_name`.
    lora_name: Option<String>,
    /// vLLM: the string of the first block's `extra_keys` entry (the untagged cache salt
    /// in these captures).
    first_extra_key: Option<String>,
}

impl WireStore {
    /// Whether the token ids cover exactly the hashed blocks (not so for sliding-window
    /// groups, whose out-of-window blocks get no hash).
    fn exact(&self) -> bool {
        self.tokens.len() == self.hashes.len() * self.block
    }
}

/// Every `BlockStored` event of the `pub` lines of a capture, in file order.
fn store_events(name: &str) -> Vec<WireStore> {
    let path = kv_relay_testdata::capture(name);
    let text = std::fs::read_to_string(&path).expect("capture readable");
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut out = Vec::new();
    for line in text.lines() {
        let msg: Json = serde_json::from_str(line).expect("jsonl line");
        if msg["socket"] != "pub" {
            continue;
        }
        let frames = msg["frames"].as_array().expect("frames");
        let payload = b64.decode(frames[2].as_str().unwrap()).expect("base64");
        let batch = rmpv::decode::read_value(&mut payload.as_slice()).expect("msgpack");
        for ev in batch[1].as_array().expect("events array") {
            let map = ev.as_map().expect("map events in these captures");
            if field(map, "type").and_then(|t| t.as_str()) != Some("BlockStored") {
                continue;
            }
            let hashes = field(map, "block_hashes").and_then(|h| h.as_array()).expect("block_hashes");
            let units = field(map, "token_ids").and_then(|t| t.as_array()).expect("token_ids");
            // EAGLE pages carry [a, b] pairs; a block is `block_size` units either way.
            let width = match units.first() {
                Some(rmpv::Value::Array(pair)) => pair.len(),
                _ => 1,
            };
            let text_field = |key: &str| field(map, key).and_then(|v| v.as_str()).map(str::to_string);
            out.push(WireStore {
                hashes: hashes.iter().map(wire_hash).collect(),
                parent: field(map, "parent_block_hash").filter(|p| !p.is_nil()).map(wire_hash),
                tokens: units
                    .iter()
                    .flat_map(|t| match t {
                        rmpv::Value::Array(pair) => pair.iter().map(|x| x.as_u64().unwrap()).collect(),
                        x => vec![x.as_u64().unwrap()],
                    })
                    .collect(),
                block: width * field(map, "block_size").and_then(|b| b.as_u64()).expect("block_size") as usize,
                group: field(map, "group_idx").and_then(|g| g.as_u64()),
                cache_salt: text_field("cache_salt"),
                lora_name: text_field("lora_name"),
                first_extra_key: field(map, "extra_keys")
                    .and_then(|k| k.as_array())
                    .and_then(|k| k.first())
                    .and_then(|k| k.as_array())
                    .and_then(|k| k.first())
                    .and_then(|k| k.as_str())
                    .map(str::to_string),
            });
        }
    }
    out
}

/// Every stored block of a capture, in file order.
fn stored_blocks(name: &str) -> Vec<StoredBlock> {
    let mut out = Vec::new();
    for ev in store_events(name) {
        // Tokens normally cover exactly the hashed blocks. Sliding-window groups give
        // no hash to blocks outside the window but still send every token, so their
        // hashes match some of the event's blocks (not always the last ones).
        let exact = ev.exact();
        let slices: Vec<Vec<u64>> = ev.tokens.chunks_exact(ev.block).map(<[u64]>::to_vec).collect();
        for (i, &hash) in ev.hashes.iter().enumerate() {
            out.push(StoredBlock {
                hash,
                tokens: if exact { vec![slices[i].clone()] } else { slices.clone() },
                group: ev.group,
                in_longer_event: !exact,
            });
        }
    }
    out
}

fn token_ids(v: &Json) -> Vec<u64> {
    v.as_array().expect("token id list").iter().map(|t| t.as_u64().expect("token id")).collect()
}

/// Block tokens of a request as the event shows them (EAGLE: flattened bigrams).
fn block_tokens(tokens: &[u64], index: usize, size: usize, eagle: bool) -> Vec<u64> {
    if eagle {
        (index * size..(index + 1) * size).flat_map(|j| [tokens[j], tokens[j + 1]]).collect()
    } else {
        tokens[index * size..(index + 1) * size].to_vec()
    }
}

/// The outcome of one capture.
#[derive(Debug, PartialEq, Eq)]
struct Outcome {
    stored: usize,
    reproduced: usize,
    /// Blocks whose event tokens equal the tokens the hash was computed from.
    tokens_consistent: usize,
    /// Of those, blocks found among the blocks of a longer token list.
    in_longer_event: usize,
}

fn check(stored: &[StoredBlock], computed: &HashMap<u64, Vec<u64>>) -> Outcome {
    let mut o = Outcome { stored: stored.len(), reproduced: 0, tokens_consistent: 0, in_longer_event: 0 };
    for block in stored {
        let Some(tokens) = computed.get(&block.hash) else {
            continue;
        };
        o.reproduced += 1;
        if block.tokens.contains(tokens) {
            o.tokens_consistent += 1;
            o.in_longer_event += usize::from(block.in_longer_event);
        }
    }
    o
}

/// Hashes of every request of a vLLM capture, built from its manifest's configuration.
fn vllm_computed(m: &Json) -> HashMap<u64, Vec<u64>> {
    let version: EngineVersion = m["engine_version"].as_str().unwrap().parse().unwrap();
    let algo_text = m["config"]["prefix_caching_hash_algo"].as_str().unwrap();
    let algo: VllmHashAlgo = algo_text.split_whitespace().next().unwrap().parse().unwrap();
    let seed = m["env"]["PYTHONHASHSEED"].as_str();
    let block_size = m["config"]["block_size"].as_u64().unwrap() as usize;
    let config = EngineHashConfig::vllm(version, algo, seed, block_size).expect("config");
    let mut computed = HashMap::new();
    for r in m["requests"].as_array().unwrap() {
        let mut tokens = token_ids(&r["prompt_token_ids"]);
        tokens.extend(token_ids(&r["output_token_ids"]));
        let req = RequestKeys { token_ids: &tokens, cache_salt: r["cache_salt"].as_str(), ..Default::default() };
        let hashes = block_event_hashes(&config, &req).expect("hashes");
        for (i, h) in hashes.into_iter().enumerate() {
            computed.insert(h, block_tokens(&tokens, i, block_size, false));
        }
    }
    computed
}

/// Hashes of every request of an SGLang capture, built from its manifest's configuration.
fn sglang_computed(m: &Json) -> HashMap<u64, Vec<u64>> {
    let version: EngineVersion = m["engine_version"].as_str().unwrap().parse().unwrap();
    let page_size = m["config"]["page_size"].as_u64().unwrap() as usize;
    let eagle = m["config"]["eagle"].as_bool().unwrap();
    let config = EngineHashConfig::sglang(version, page_size, eagle).expect("config");
    let mut computed = HashMap::new();
    for op in m["extra"]["operations_in_order"].as_array().unwrap() {
        if op.get("prompt_token_ids").is_none() {
            continue; // evict / flush operations
        }
        let mut tokens = token_ids(&op["prompt_token_ids"]);
        tokens.extend(token_ids(&op["output_token_ids"]));
        let lora = op["extra_key"].as_str().map(|k| LoraRef { name: k.to_string(), path: String::new() });
        let req = RequestKeys {
            token_ids: &tokens,
            cache_salt: op["cache_salt"].as_str(),
            lora: lora.as_ref(),
            ..Default::default()
        };
        let hashes = block_event_hashes(&config, &req).expect("hashes");
        for (i, h) in hashes.into_iter().enumerate() {
            computed.insert(h, block_tokens(&tokens, i, page_size, eagle));
        }
    }
    computed
}

fn run(name: &str) -> Outcome {
    let m = manifest(name);
    let computed =
        if m["engine"].as_str().unwrap().starts_with("vllm") { vllm_computed(&m) } else { sglang_computed(&m) };
    let outcome = check(&stored_blocks(name), &computed);
    // The manifest's own independent check counted the same number of stored hashes.
    assert_eq!(
        outcome.stored as u64,
        m["hash_check"]["stored_hashes_checked"].as_u64().unwrap(),
        "{name}: stored hash count differs from the manifest"
    );
    outcome
}

fn all(n: usize) -> Outcome {
    Outcome { stored: n, reproduced: n, tokens_consistent: n, in_longer_event: 0 }
}

#[test]
fn vllm_basic_sha256_pythonhashseed_0_reproduces_99_of_99() {
    assert_eq!(run("vllm-basic"), all(99));
}

#[test]
fn vllm_sha256cbor_default_seed_reproduces_99_of_99() {
    assert_eq!(run("vllm-sha256cbor"), all(99));
}

#[test]
fn vllm_salt_tagged_cache_salt_reproduces_27_of_27() {
    assert_eq!(run("vllm-salt"), all(27));
}

#[test]
fn vllm_byteshash_bytes_digests_reproduce_99_of_99() {
    assert_eq!(run("vllm-byteshash"), all(99));
}

#[test]
fn vllm_restart_both_engines_reproduce_95_of_95() {
    assert_eq!(run("vllm-restart"), all(95));
}

#[test]
fn vllm_dp2_both_ranks_reproduce_92_of_92() {
    assert_eq!(run("vllm-dp2"), all(92));
}

#[test]
fn vllm_hybrid_both_groups_reproduce_148_of_148() {
    // Sliding-window stores carry more token ids than hashes × block size (blocks out of
    // the window get no hash): the manifest's check skipped those 34 blocks; here each is
    // found among the blocks of its event's token ids. They are not always the last
    // blocks: e.g. one event has 2 blocks of tokens and a hash for the first only.
    let m = manifest("vllm-hybrid");
    assert_eq!(m["hash_check"]["token_ids_consistent"], 114);
    assert_eq!(m["hash_check"]["token_check_skipped_len_mismatch"], 34);
    assert_eq!(
        run("vllm-hybrid"),
        Outcome { stored: 148, reproduced: 148, tokens_consistent: 148, in_longer_event: 34 }
    );
}

#[test]
fn vllm_hybrid_stores_47_sliding_and_101_full_attention_hashes() {
    let stored = stored_blocks("vllm-hybrid");
    let sliding = stored.iter().filter(|b| b.group == Some(0)).count();
    let full = stored.iter().filter(|b| b.group == Some(1)).count();
    assert_eq!((sliding, full), (47, GROUP1_HASHES));
}

#[test]
fn sglang_basic_salted_and_lora_reproduces_200_of_200() {
    assert_eq!(run("sglang-basic"), all(200));
}

#[test]
fn sglang_eagle_bigrams_reproduce_84_of_84() {
    assert_eq!(run("sglang-eagle"), all(84));
}

#[test]
fn sglang_dp2_both_ranks_reproduce_163_of_163() {
    assert_eq!(run("sglang-dp2"), all(163));
}

/// The spec said the salt prior was the hex digest; the capture says raw bytes.
#[test]
fn sglang_salt_prior_is_raw_digest_bytes_not_hexdigest() {
    let m = manifest("sglang-basic");
    let stored = stored_blocks("sglang-basic");
    let live: std::collections::HashSet<u64> = stored.iter().map(|b| b.hash).collect();
    let (mut raw_hits, mut hex_hits, mut salted_pages) = (0, 0, 0);
    for op in m["extra"]["operations_in_order"].as_array().unwrap() {
        let Some(salt) = op["cache_salt"].as_str() else {
            continue;
        };
        if op.get("extra_key").is_some() {
            continue; // LoRA-namespaced as well; counted by the main test
        }
        let mut tokens = token_ids(&op["prompt_token_ids"]);
        tokens.extend(token_ids(&op["output_token_ids"]));
        let raw = sglang::salt_prior(salt);
        let hex: String = raw.iter().map(|b| format!("{b:02x}")).collect();
        let (mut p_raw, mut p_hex): (Vec<u8>, Vec<u8>) = (raw.to_vec(), hex.into_bytes());
        for page in tokens.chunks_exact(16) {
            salted_pages += 1;
            let d_raw = sglang::page_digest(Some(&p_raw), page);
            let d_hex = sglang::page_digest(Some(&p_hex), page);
            raw_hits += usize::from(live.contains(&(sglang::digest_to_i64(&d_raw) as u64)));
            hex_hits += usize::from(live.contains(&(sglang::digest_to_i64(&d_hex) as u64)));
            p_raw = d_raw.to_vec();
            p_hex = d_hex.to_vec();
        }
    }
    assert!(salted_pages > 0);
    assert_eq!(raw_hits, salted_pages, "raw prior reproduces every salted page");
    assert_eq!(hex_hits, 0, "hex prior reproduces none");
}

// ---- Replaying the wire alone ----
//
// A relay or router that sees only the events can re-derive each stored hash from the
// event's token ids and the digest of its parent (remembered from the parent's own store
// event): the checks below do that, with no request list.

/// Counts of a wire replay.
#[derive(Debug, PartialEq, Eq)]
struct Replay {
    /// Hashes in the replayed events.
    hashes: usize,
    /// Hashes recomputed exactly from the event.
    reproduced: usize,
}

/// vLLM: block 0 (no parent) chains from NONE_HASH; the untagged salt seen in block 0's
/// `extra_keys` is hashed in the release's form.
fn replay_vllm(name: &str, only_group: Option<u64>) -> Replay {
    let m = manifest(name);
    let version: EngineVersion = m["engine_version"].as_str().unwrap().parse().unwrap();
    let algo: VllmHashAlgo =
        m["config"]["prefix_caching_hash_algo"].as_str().unwrap().split_whitespace().next().unwrap().parse().unwrap();
    let seed = NoneHashSeed::for_release(version, algo, m["env"]["PYTHONHASHSEED"].as_str()).unwrap();
    let none = seed.none_hash(algo);
    let form = ExtraKeyForm::for_release(version);
    let mut digests: HashMap<u64, Vec<u8>> = HashMap::new();
    let mut r = Replay { hashes: 0, reproduced: 0 };
    for ev in store_events(name) {
        if only_group.is_some() && ev.group != only_group {
            continue;
        }
        assert!(ev.exact(), "{name}: replayed events cover exactly their blocks");
        r.hashes += ev.hashes.len();
        let mut prior = match ev.parent {
            None => none.clone(),
            Some(p) => digests.get(&p).expect("parent stored earlier").clone(),
        };
        for (i, (&hash, tokens)) in ev.hashes.iter().zip(ev.tokens.chunks_exact(ev.block)).enumerate() {
            let salt = if ev.parent.is_none() && i == 0 { ev.first_extra_key.as_deref() } else { None };
            let keys = form.extra_keys(&vllm::BlockExtras { cache_salt: salt, ..Default::default() });
            let digest = vllm::block_digest(algo, &prior, tokens, keys.as_ref());
            r.reproduced += usize::from(vllm::event_hash(&digest) == hash);
            digests.insert(hash, digest.clone());
            prior = digest;
        }
    }
    r
}

/// SGLang chained SHA-256: a root page chains from nothing or from the event's salt; LoRA
/// events are namespaced with the radix extra key, which the wire does not carry (it shows
/// `lora_name`), so it is taken from the manifest.
fn replay_sglang(name: &str) -> Replay {
    let m = manifest(name);
    let extra_key = m["extra"]["operations_in_order"]
        .as_array()
        .unwrap()
        .iter()
        .find_map(|op| op["extra_key"].as_str().map(str::to_string));
    let mut digests: HashMap<u64, [u8; 32]> = HashMap::new();
    let mut r = Replay { hashes: 0, reproduced: 0 };
    for ev in store_events(name) {
        assert!(ev.exact());
        r.hashes += ev.hashes.len();
        let mut prior: Option<[u8; 32]> = match ev.parent {
            Some(p) => Some(*digests.get(&p).expect("parent stored earlier")),
            None => ev.cache_salt.as_deref().map(sglang::salt_prior),
        };
        let ns = ev.lora_name.as_ref().map(|_| sglang::namespace_seed(extra_key.as_deref(), None));
        for (&hash, page) in ev.hashes.iter().zip(ev.tokens.chunks_exact(ev.block)) {
            let digest = sglang::page_digest(prior.as_ref().map(|p| p.as_slice()), page);
            let mut h = sglang::digest_to_i64(&digest);
            if let Some(seed) = &ns {
                h = sglang::namespaced_block_hash(h, seed);
            }
            r.reproduced += usize::from(h as u64 == hash);
            digests.insert(hash, digest);
            prior = Some(digest);
        }
    }
    r
}

#[test]
fn vllm_captures_replay_from_the_wire_alone() {
    let all = |n| Replay { hashes: n, reproduced: n };
    assert_eq!(replay_vllm("vllm-basic", None), all(99));
    assert_eq!(replay_vllm("vllm-sha256cbor", None), all(99));
    assert_eq!(replay_vllm("vllm-salt", None), all(27));
    assert_eq!(replay_vllm("vllm-byteshash", None), all(99));
    assert_eq!(replay_vllm("vllm-restart", None), all(95));
    assert_eq!(replay_vllm("vllm-dp2", None), all(92));
    // The full-attention group; sliding-window stores skip blocks and cannot be chained
    // from their parent alone.
    assert_eq!(replay_vllm("vllm-hybrid", Some(1)), all(GROUP1_HASHES));
}

/// Hashes stored by the full-attention group of `vllm-hybrid`.
const GROUP1_HASHES: usize = 101;

#[test]
fn sglang_captures_replay_from_the_wire_alone() {
    let all = |n| Replay { hashes: n, reproduced: n };
    assert_eq!(replay_sglang("sglang-basic"), all(200));
    assert_eq!(replay_sglang("sglang-eagle"), all(84));
    assert_eq!(replay_sglang("sglang-dp2"), all(163));
}

// ---- Golden streams (older SGLang layouts) ----

/// The `BlockStored` events of a golden manifest's `batches_decoded_neutral`.
fn golden_stores(name: &str) -> Vec<Json> {
    manifest(name)["batches_decoded_neutral"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|b| b["events"].as_array().unwrap().clone())
        .filter(|e| e["type"] == "BlockStored")
        .collect()
}

fn golden_tokens(ev: &Json) -> (Vec<u64>, usize) {
    let units = ev["token_ids"].as_array().unwrap();
    let width = if units.first().is_some_and(Json::is_array) { 2 } else { 1 };
    let tokens = units
        .iter()
        .flat_map(|u| match u {
            Json::Array(pair) => pair.iter().map(|x| x.as_u64().unwrap()).collect(),
            x => vec![x.as_u64().unwrap()],
        })
        .collect();
    (tokens, width * ev["block_size"].as_u64().unwrap() as usize)
}

#[test]
fn golden_sglang_0_4_8_tuple_hashes_reproduce_9_of_9() {
    let (mut hashes, mut reproduced, mut root_parents) = (0, 0, 0);
    for ev in golden_stores("golden-sglang-0.4.8") {
        let (tokens, block) = golden_tokens(&ev);
        for (h, page) in ev["block_hashes"].as_array().unwrap().iter().zip(tokens.chunks(block)) {
            hashes += 1;
            reproduced += usize::from(sglang::page_tuple_hash(page) as u64 == h.as_u64().unwrap());
        }
        if ev["parent_block_hash"].as_u64() == Some(sglang::EMPTY_TUPLE_HASH as u64) {
            root_parents += 1;
        }
    }
    assert_eq!((hashes, reproduced), (9, 9));
    assert_eq!(root_parents, 3, "root children report hash(()) as their parent");
}

#[test]
fn golden_sglang_chained_streams_reproduce_every_hash() {
    let mut results = Vec::new();
    for name in ["golden-sglang-0.5.9", "golden-sglang-0.5.18", "golden-sglang-0.5.20"] {
        let mut digests: HashMap<u64, [u8; 32]> = HashMap::new();
        let (mut hashes, mut reproduced) = (0, 0);
        for ev in golden_stores(name) {
            let (tokens, block) = golden_tokens(&ev);
            let mut prior = match ev["parent_block_hash"].as_u64() {
                Some(p) => Some(digests[&p]),
                None => ev["cache_salt"].as_str().map(sglang::salt_prior),
            };
            for (h, page) in ev["block_hashes"].as_array().unwrap().iter().zip(tokens.chunks_exact(block)) {
                let h = h.as_u64().unwrap();
                let digest = sglang::page_digest(prior.as_ref().map(|p| p.as_slice()), page);
                hashes += 1;
                reproduced += usize::from(sglang::digest_to_i64(&digest) as u64 == h);
                digests.insert(h, digest);
                prior = Some(digest);
            }
        }
        results.push((name, hashes, reproduced));
    }
    assert_eq!(
        results,
        vec![("golden-sglang-0.5.9", 5, 5), ("golden-sglang-0.5.18", 6, 6), ("golden-sglang-0.5.20", 9, 9)]
    );
}
