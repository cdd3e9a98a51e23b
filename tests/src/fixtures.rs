//! The captures and golden streams of `testdata/fixtures/` as the end-to-end tests use them: each
//! with its manifest, the live blocks the manifest expects keyed as the relay keys them (with
//! the relay's hybrid policy), the engine's hash settings, and playback through the mock engine.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicBool;

use kv_relay::live::LiveKey;
use kv_relay::model::Tier;
use kv_relay::wire::{self, RawEvent};
use kv_relay_proto::hash::{EngineHashConfig, EngineVersion, LoraRef, RequestKeys, VllmHashAlgo};
use serde_json::Value;

use crate::capture::{play, ranks_needed, read_capture, CaptureLine, PlayReport};
use crate::engine::MockEngine;
use crate::wire::{Engine, WireVersion};

/// Live blocks with copies, per (rank, tier, group).
pub type Expected = BTreeMap<LiveKey, BTreeMap<u64, u32>>;

/// Blocks checked, mismatched and skipped per rank when each fixture whose engine hash settings
/// are known is played with the check on. Every stored block of the real captures is checked
/// (the counts of `stored_hashes_checked` in their manifests) except vllm-hybrid's sliding-window
/// group, which the relay drops; sglang-basic's LoRA blocks are skipped (their namespace key is
/// not on the wire).
pub const HASH_CHECK_FIGURES: &[(&str, &[CheckFigures])] = &[
    ("golden-sglang-0.4.8", &[(9, 0, 0)]),
    ("golden-sglang-0.5.18", &[(6, 0, 0)]),
    ("golden-sglang-0.5.20", &[(9, 0, 0)]),
    ("golden-sglang-0.5.9", &[(5, 0, 0)]),
    ("sglang-basic", &[(164, 0, 36)]),
    ("sglang-dp2", &[(74, 0, 0), (89, 0, 0)]),
    ("sglang-eagle", &[(84, 0, 0)]),
    ("vllm-basic", &[(99, 0, 0)]),
    ("vllm-byteshash", &[(99, 0, 0)]),
    ("vllm-dp2", &[(44, 0, 0), (48, 0, 0)]),
    ("vllm-hybrid", &[(101, 0, 0)]),
    ("vllm-restart", &[(95, 0, 0)]),
    ("vllm-salt", &[(27, 0, 0)]),
    ("vllm-sha256cbor", &[(99, 0, 0)]),
];

/// One rank's hash check: blocks (checked, mismatched, skipped).
pub type CheckFigures = (u64, u64, u64);

/// Every fixture's name, from the directory itself (so none can be skipped), sorted.
pub use kv_relay_testdata::names;

/// One capture or golden stream with its manifest.
pub struct Fixture {
    pub name: String,
    pub manifest: Value,
    pub lines: Vec<CaptureLine>,
}

/// The engine's hash settings, as a relay's flags name them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HashSettings {
    /// `vllm` or `sglang`.
    pub engine: &'static str,
    pub version: String,
    /// vLLM's `prefix_caching_hash_algo`.
    pub algo: Option<String>,
    /// vLLM's `PYTHONHASHSEED`.
    pub seed: Option<String>,
}

impl HashSettings {
    /// The relay's flags for them, with the check on.
    pub fn relay_args(&self) -> Vec<String> {
        let mut a = vec!["--hash-check".into(), "--hash-engine".into(), self.engine.into()];
        a.extend(["--hash-engine-version".into(), self.version.clone()]);
        if let Some(algo) = &self.algo {
            a.extend(["--hash-algo".into(), algo.clone()]);
        }
        if let Some(seed) = &self.seed {
            a.extend(["--hash-seed".into(), seed.clone()]);
        }
        a
    }

    /// The relay's hash-check settings.
    pub fn check_config(&self) -> kv_relay::hashcheck::HashCheckConfig {
        kv_relay::hashcheck::HashCheckConfig::new(
            Some(self.engine),
            Some(&self.version),
            self.algo.as_deref(),
            self.seed.as_deref(),
            1.0,
        )
        .unwrap_or_else(|e| panic!("{self:?}: {}: {}", e.setting, e.why))
    }
}

/// A request the manifest recorded, as a lookup by token ids sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedRequest {
    pub token_ids: Vec<u64>,
    pub cache_salt: Option<String>,
    /// SGLang's LoRA `extra_key`.
    pub lora: Option<LoraRef>,
}

impl RecordedRequest {
    pub fn keys(&self) -> RequestKeys<'_> {
        RequestKeys {
            token_ids: &self.token_ids,
            cache_salt: self.cache_salt.as_deref(),
            lora: self.lora.as_ref(),
            ..Default::default()
        }
    }
}

fn token_ids(v: &Value) -> Vec<u64> {
    v.as_array().map(|a| a.iter().map(|t| t.as_u64().unwrap()).collect()).unwrap_or_default()
}

impl Fixture {
    pub fn load(name: &str) -> Fixture {
        let manifest =
            serde_json::from_str(&std::fs::read_to_string(kv_relay_testdata::manifest(name)).unwrap()).unwrap();
        let lines = read_capture(&kv_relay_testdata::capture(name)).unwrap();
        Fixture { name: name.to_string(), manifest, lines }
    }

    pub fn is_sglang(&self) -> bool {
        self.manifest["engine"].as_str().unwrap().contains("sglang")
    }

    /// The newest wire of the capture's engine (the mock only frames the recorded payloads).
    pub fn wire(&self) -> WireVersion {
        if self.is_sglang() {
            WireVersion::parse(Engine::Sglang, "0.5.23").unwrap()
        } else {
            WireVersion::parse(Engine::Vllm, "0.32").unwrap()
        }
    }

    pub fn ranks(&self) -> u32 {
        ranks_needed(&self.lines)
    }

    /// Every raw event of the `pub` lines with its rank, in order.
    fn raw_events(&self) -> Vec<(u32, RawEvent)> {
        let mut out = Vec::new();
        for l in self.lines.iter().filter(|l| l.socket == "pub") {
            let frames: Vec<&[u8]> = l.frames.iter().map(Vec::as_slice).collect();
            let f = wire::split_pub(&frames).unwrap();
            let b = wire::decode_batch(f.payload).unwrap();
            let rank = b.dp_rank.or(l.dp_rank).unwrap_or(0);
            out.extend(b.events.into_iter().flatten().map(|e| (rank, e)));
        }
        out
    }

    /// `(rank, group)` of the sliding-window groups that sit beside a main-attention group, read
    /// from the stores' `kv_cache_spec_kind` (the relay drops these groups' events).
    pub fn window_groups(&self) -> Vec<(u32, u32)> {
        let (mut window, mut main) = (Vec::new(), Vec::new());
        for (rank, e) in self.raw_events() {
            let RawEvent::Stored(s) = e else { continue };
            let Some(g) = s.group_idx else { continue };
            let is_window = matches!(
                s.kv_cache_spec_kind.as_deref(),
                Some("sliding_window" | "sliding_window_mla" | "chunked_local_attention")
            ) || s.kv_cache_spec_sliding_window.is_some();
            if is_window {
                window.push((rank, g));
            } else if s.kv_cache_spec_kind.is_some() {
                main.push(rank);
            }
        }
        window.sort_unstable();
        window.dedup();
        window.retain(|(r, _)| main.contains(r));
        window
    }

    /// The manifest's `expected_refcounted`, keyed as the relay keys it, without the window
    /// groups the relay drops (see [`Fixture::window_groups`]).
    pub fn expected(&self) -> Expected {
        let window = self.window_groups();
        let mut out = Expected::new();
        for e in self.manifest["expected_refcounted"].as_array().unwrap() {
            let rank = e["dp_rank"].as_u64().unwrap() as u32;
            let group = e["group_idx"].as_u64().map(|g| g as u32);
            if group.is_some_and(|g| window.contains(&(rank, g))) {
                continue;
            }
            let key =
                LiveKey { dp_rank: rank, tier: Tier::from_medium(e["medium"].as_str()), group: group.unwrap_or(0) };
            let into = out.entry(key).or_default();
            for (h, c) in e["block_hashes"].as_array().unwrap().iter().zip(e["counts"].as_array().unwrap()) {
                *into.entry(h.as_u64().unwrap()).or_default() += c.as_u64().unwrap() as u32;
            }
        }
        out
    }

    /// The engine's hash settings, where the manifest says what they were: every real capture,
    /// and the SGLang golden streams (whose hashes are the release's own); not the vLLM golden
    /// streams (their hashes are made up).
    pub fn hash_settings(&self) -> Option<HashSettings> {
        let m = &self.manifest;
        let version = m["engine_version"].as_str().unwrap().to_string();
        if self.is_sglang() {
            return Some(HashSettings { engine: "sglang", version, algo: None, seed: None });
        }
        let algo = m["config"]["prefix_caching_hash_algo"].as_str()?.split_whitespace().next()?.to_string();
        let seed = m["env"]["PYTHONHASHSEED"].as_str().map(str::to_string);
        Some(HashSettings { engine: "vllm", version, algo: Some(algo), seed })
    }

    /// The hash function a router uses to look up the recorded requests by token ids.
    pub fn engine_hash(&self) -> Option<EngineHashConfig> {
        let s = self.hash_settings()?;
        let m = &self.manifest;
        let version: EngineVersion = s.version.parse().unwrap();
        Some(if self.is_sglang() {
            let page = m["config"]["page_size"].as_u64().or(m["config"]["block_size"].as_u64()).unwrap() as usize;
            EngineHashConfig::sglang(version, page, m["config"]["eagle"].as_bool().unwrap_or(false)).unwrap()
        } else {
            let algo: VllmHashAlgo = s.algo.as_deref().unwrap().parse().unwrap();
            let block = m["config"]["block_size"].as_u64().unwrap() as usize;
            EngineHashConfig::vllm(version, algo, s.seed.as_deref(), block).unwrap()
        })
    }

    /// The requests the manifest recorded (vLLM `requests`, SGLang `operations_in_order`), each
    /// as its prompt and output tokens.
    pub fn recorded_requests(&self) -> Vec<RecordedRequest> {
        let m = &self.manifest;
        let list = m["requests"].as_array().or(m["extra"]["operations_in_order"].as_array());
        list.into_iter()
            .flatten()
            .filter(|r| r.get("prompt_token_ids").is_some())
            .map(|r| {
                let mut tokens = token_ids(&r["prompt_token_ids"]);
                tokens.extend(token_ids(&r["output_token_ids"]));
                RecordedRequest {
                    token_ids: tokens,
                    cache_salt: r["cache_salt"].as_str().map(str::to_string),
                    lora: r["extra_key"].as_str().map(|k| LoraRef { name: k.to_string(), path: String::new() }),
                }
            })
            .collect()
    }

    /// Plays the `pub` lines through `e`. A capture with a publisher restart (vllm-restart) is
    /// played in two parts: `caught_up(seq)` must return once the relay has the first
    /// publisher's last batch (`seq`), so that it sees the restart as one.
    pub fn play(&self, e: &MockEngine, mut caught_up: impl FnMut(u64)) -> PlayReport {
        let stop = AtomicBool::new(false);
        let pubs: Vec<CaptureLine> = self.lines.iter().filter(|l| l.socket == "pub").cloned().collect();
        let seq_of = |l: &CaptureLine| u64::from_be_bytes(l.frames[1].as_slice().try_into().unwrap());
        let mut last: BTreeMap<&str, u64> = BTreeMap::new();
        let cut = pubs.iter().position(|l| last.insert(&l.endpoint, seq_of(l)).is_some_and(|prev| seq_of(l) <= prev));
        match cut {
            None => play(e, &self.lines, false, &stop).unwrap(),
            Some(cut) => {
                assert_eq!(e.dp_size(), 1, "{}: restarts are played on single-rank captures", self.name);
                let mut r = play(e, &pubs[..cut], false, &stop).unwrap();
                caught_up(seq_of(&pubs[cut - 1]));
                e.restart(0).unwrap();
                r.restarts += 1;
                r.batches += play(e, &pubs[cut..], false, &stop).unwrap().batches;
                r
            }
        }
    }
}
