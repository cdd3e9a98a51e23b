//! The optional check of the engine's block hashes: each rank's stores are re-hashed from their
//! token ids with the engine's hash settings (`hash_check` in the configuration) and compared
//! with the hashes the engine announced. A worker with another `PYTHONHASHSEED`, hash algorithm,
//! release or block size than the relay was told shows up as a mismatch rate above 0.
//!
//! A diagnostic only: no event is dropped or changed because of what the check finds.
//!
//! How a block is re-derived from the wire alone (the functions are `kv_relay_proto::hash`'s):
//! * vLLM (0.10.2+): `digest = H((parent_digest, tuple(tokens), extra_keys))`; the parent digest
//!   of a sequence's first block is NONE_HASH (from `PYTHONHASHSEED`, or `"vllm-none-hash"` from
//!   0.29), otherwise the digest the relay computed when the parent block was stored. The cache
//!   salt is read from the first block's `extra_keys` (vLLM sends it untagged there) and hashed
//!   in the release's form.
//! * SGLang 0.5.6+: the chained SHA-256 over the page's tokens, from the parent's digest, or
//!   from the salt prior (the event's `cache_salt`) for a sequence's first page. 0.4.8–0.5.5:
//!   CPython's tuple hash of the page, not chained. EAGLE bigram pages hash both tokens of each
//!   pair.
//!
//! So the relay keeps, per rank, the digest of every block it has seen stored and not yet
//! removed (one entry per live hash, copies counted; at most [`MAX_TRACKED`], beyond which the
//! table starts again empty). Blocks that cannot be re-derived are *skipped*, by reason
//! ([`Skip`]): their children inherit the reason. The cost is bounded by sampling whole chains:
//! a sequence's first block is checked with probability `hash_sample` (decided from its hash,
//! so deterministic), and its descendants follow that decision.

use crate::model::{Batch, Event, KeyPart, Stored, TokenLayout};
use kv_relay_proto::hash::{
    sglang, vllm, EngineVersion, ExtraKeyForm, HashError, LoraRef, NoneHashSeed, SglangHashScheme, SglangHasher,
    VllmHashAlgo,
};
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

/// Most block digests a rank's check keeps; past it the table is emptied and chains start again
/// from their first blocks (about 64 bytes each: 64 MiB per rank at most).
pub const MAX_TRACKED: usize = 1 << 20;

/// First vLLM release that hashes the LoRA name rather than its int id.
const VLLM_LORA_NAME_SINCE: EngineVersion = EngineVersion::new(0, 11, 1);
/// First SGLang release that namespaces LoRA requests' event hashes (with a key the wire does
/// not carry).
const SGLANG_NAMESPACE_SINCE: EngineVersion = EngineVersion::new(0, 5, 22);

/// The engine's hash function, resolved from the configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HashScheme {
    Vllm {
        algo: VllmHashAlgo,
        /// NONE_HASH, the parent digest of a sequence's first block.
        none_hash: Vec<u8>,
        form: ExtraKeyForm,
        /// LoRA requests hash the adapter's name (0.11.1+) rather than its id.
        lora_by_name: bool,
    },
    Sglang {
        scheme: SglangHashScheme,
        /// LoRA requests' event hashes are namespaced (0.5.22+).
        lora_namespaced: bool,
    },
}

/// The check's settings: the engine's hash function and the share of chains checked.
#[derive(Debug, Clone, PartialEq)]
pub struct HashCheckConfig {
    pub engine: &'static str,
    pub version: EngineVersion,
    pub scheme: HashScheme,
    /// The engine's `PYTHONHASHSEED` as configured (vLLM), for `check-config`.
    pub seed: Option<String>,
    /// Share of sequences (chains) checked, in (0, 1].
    pub sample: f64,
}

/// Why the hash settings cannot work, naming the setting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HashSettingError {
    pub setting: &'static str,
    pub why: String,
}

fn bad(setting: &'static str, why: impl Into<String>) -> HashSettingError {
    HashSettingError { setting, why: why.into() }
}

impl HashCheckConfig {
    /// Resolves the engine's hash settings: `engine` (`vllm` or `sglang`), its release, vLLM's
    /// `--prefix-caching-hash-algo` (default `sha256`) and `PYTHONHASHSEED` (unset: `None`), and
    /// the share of chains checked.
    pub fn new(
        engine: Option<&str>,
        version: Option<&str>,
        algo: Option<&str>,
        seed: Option<&str>,
        sample: f64,
    ) -> Result<Self, HashSettingError> {
        if !(sample > 0.0 && sample <= 1.0) {
            return Err(bad("hash-sample", format!("{sample} is not in (0, 1]")));
        }
        let engine = match engine {
            Some("vllm") => "vllm",
            Some("sglang") => "sglang",
            Some(other) => return Err(bad("hash-engine", format!("{other:?}: use vllm or sglang"))),
            None => return Err(bad("hash-engine", "hash-check needs the engine: vllm or sglang")),
        };
        let Some(v) = version else {
            return Err(bad("hash-engine-version", "hash-check needs the engine's release, e.g. 0.32.0"));
        };
        let version: EngineVersion = v.parse().map_err(|e: HashError| bad("hash-engine-version", e.to_string()))?;
        let scheme = if engine == "vllm" {
            let algo: VllmHashAlgo = algo.unwrap_or("sha256").parse().map_err(|e: HashError| {
                bad("hash-algo", format!("{e}: use sha256, sha256_cbor, xxhash or xxhash_cbor"))
            })?;
            let none = NoneHashSeed::for_release(version, algo, seed).map_err(|e| match e {
                HashError::RandomNoneHash { .. } => bad(
                    "hash-seed",
                    e.to_string().replace(
                        "supply the engine's none hash explicitly",
                        "set the engine's PYTHONHASHSEED and give it here",
                    ),
                ),
                HashError::AlgorithmUnavailable { .. } => bad("hash-algo", e.to_string()),
                _ => bad("hash-engine-version", e.to_string()),
            })?;
            HashScheme::Vllm {
                algo,
                none_hash: none.none_hash(algo),
                form: ExtraKeyForm::for_release(version),
                lora_by_name: version >= VLLM_LORA_NAME_SINCE,
            }
        } else {
            if let Some(a) = algo {
                return Err(bad("hash-algo", format!("{a:?}: sglang has one hash function per release; unset it")));
            }
            if seed.is_some() {
                return Err(bad("hash-seed", "sglang's block hashes do not depend on PYTHONHASHSEED; unset it"));
            }
            let h =
                SglangHasher::for_release(version, 1, false).map_err(|e| bad("hash-engine-version", e.to_string()))?;
            HashScheme::Sglang { scheme: h.scheme(), lora_namespaced: version >= SGLANG_NAMESPACE_SINCE }
        };
        Ok(HashCheckConfig { engine, version, scheme, seed: seed.map(str::to_string), sample })
    }

    /// The algorithm's name as the engine's configuration spells it.
    pub fn algo_name(&self) -> Option<&'static str> {
        match &self.scheme {
            HashScheme::Vllm { algo, .. } => Some(algo.name()),
            HashScheme::Sglang { .. } => None,
        }
    }
}

/// Why a stored block was not checked. The names are metric labels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Skip {
    /// Its sequence was not drawn by `hash_sample`.
    NotSampled,
    /// The parent block was never seen stored (stored before the relay started, removed, or
    /// the table was emptied at [`MAX_TRACKED`]).
    UnknownParent,
    /// The event carried no token ids for it (or a short last page, or wide token ids).
    NoTokenIds,
    /// A sliding-window group's store: the hashed tokens are not all on the wire.
    WindowGroup,
    /// LoRA, multimodal or other extra keys that cannot be re-derived from the wire (the
    /// adapter's path, SGLang's LoRA namespace key, multimodal identifiers).
    ExtraKeys,
}

impl Skip {
    pub const ALL: [Skip; 5] =
        [Skip::NotSampled, Skip::UnknownParent, Skip::NoTokenIds, Skip::WindowGroup, Skip::ExtraKeys];

    pub fn as_str(self) -> &'static str {
        match self {
            Skip::NotSampled => "not_sampled",
            Skip::UnknownParent => "unknown_parent",
            Skip::NoTokenIds => "no_token_ids",
            Skip::WindowGroup => "window_group",
            Skip::ExtraKeys => "extra_keys",
        }
    }
}

impl fmt::Display for Skip {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What checking one batch found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CheckCounts {
    /// Blocks re-derived and compared.
    pub checked: u64,
    /// Of those, blocks whose hash differs from the engine's.
    pub mismatched: u64,
    /// Blocks not checked, by reason.
    pub skipped: Vec<(Skip, u64)>,
}

impl CheckCounts {
    fn skip_n(&mut self, why: Skip, n: u64) {
        match self.skipped.iter_mut().find(|(s, _)| *s == why) {
            Some((_, m)) => *m += n,
            None => self.skipped.push((why, n)),
        }
    }

    fn skip(&mut self, why: Skip) {
        self.skip_n(why, 1);
    }

    /// Mismatched over checked blocks; 0 when none was checked.
    pub fn mismatch_rate(&self) -> f64 {
        if self.checked == 0 {
            0.0
        } else {
            self.mismatched as f64 / self.checked as f64
        }
    }

    /// Every skipped block, whatever the reason.
    pub fn skipped_total(&self) -> u64 {
        self.skipped.iter().map(|(_, n)| n).sum()
    }

    /// Adds `other` into `self`.
    pub fn add(&mut self, other: &CheckCounts) {
        self.checked += other.checked;
        self.mismatched += other.mismatched;
        for &(why, n) in &other.skipped {
            self.skip_n(why, n);
        }
    }
}

/// What the check knows of a live block: the digest its children chain from, or why it has none.
#[derive(Debug, Clone)]
enum Known {
    Digest { bytes: [u8; 32], len: u8 },
    Skipped(Skip),
}

impl Known {
    fn digest(d: &[u8]) -> Known {
        let mut bytes = [0u8; 32];
        let len = d.len().min(32);
        bytes[..len].copy_from_slice(&d[..len]);
        Known::Digest { bytes, len: len as u8 }
    }
}

/// One rank's check: the digests of the blocks it holds, and the chains drawn.
#[derive(Debug)]
pub struct RankCheck {
    cfg: Arc<HashCheckConfig>,
    /// `sample` as a threshold on a 64-bit mix of a first block's hash.
    threshold: u64,
    known: HashMap<u64, (Known, u32)>,
}

/// SplitMix64's finalizer: spreads a block hash evenly over 64 bits for sampling.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl RankCheck {
    pub fn new(cfg: Arc<HashCheckConfig>) -> Self {
        let threshold = if cfg.sample >= 1.0 { u64::MAX } else { (cfg.sample * u64::MAX as f64) as u64 };
        RankCheck { cfg, threshold, known: HashMap::new() }
    }

    /// Forgets every block (the rank was reset or cleared).
    pub fn reset(&mut self) {
        self.known.clear();
    }

    /// Blocks whose digest (or skip reason) is held.
    pub fn tracked(&self) -> usize {
        self.known.len()
    }

    /// Checks the stores of a normalized batch, and follows its removals and clears.
    pub fn check(&mut self, batch: &Batch) -> CheckCounts {
        let mut out = CheckCounts::default();
        for e in &batch.events {
            match e {
                Event::Stored(s) => self.stored(s, &mut out),
                Event::Removed(r) => {
                    for h in &r.block_hashes {
                        if let Some((_, copies)) = self.known.get_mut(h) {
                            *copies -= 1;
                            if *copies == 0 {
                                self.known.remove(h);
                            }
                        }
                    }
                }
                // A tier's clear leaves the other tiers' copies, whose digests stay useful.
                Event::Cleared(c) if c.tier.is_none() => self.known.clear(),
                Event::Cleared(_) => {}
            }
        }
        out
    }

    fn remember(&mut self, hash: u64, known: Known) {
        if self.known.len() >= MAX_TRACKED && !self.known.contains_key(&hash) {
            self.known.clear();
        }
        let e = self.known.entry(hash).or_insert((known.clone(), 0));
        e.0 = known;
        e.1 += 1;
    }

    fn stored(&mut self, s: &Stored, out: &mut CheckCounts) {
        let window = matches!(
            s.group.kind.as_deref(),
            Some("sliding_window" | "sliding_window_mla" | "chunked_local_attention")
        ) || s.group.sliding_window.is_some();
        // SGLang before 0.5.6 hashes each page alone: every page is a sequence of its own.
        let chained = !matches!(self.cfg.scheme, HashScheme::Sglang { scheme: SglangHashScheme::PageTupleHash, .. });
        let per_pos = if s.token_layout == TokenLayout::Bigram { 2 } else { 1 };
        let block_len = s.block_size as usize * per_pos;
        let cfg = self.cfg.clone();
        // The chain's state before the event's first block: the parent's digest (`None` at the
        // start of a sequence), or why there is none.
        let mut prior: Result<Option<Vec<u8>>, Skip> = match s.parent {
            _ if window => Err(Skip::WindowGroup),
            Some(p) if chained => match self.known.get(&p) {
                Some((Known::Digest { bytes, len }, _)) => Ok(Some(bytes[..*len as usize].to_vec())),
                Some((Known::Skipped(why), _)) => Err(*why),
                None => Err(Skip::UnknownParent),
            },
            _ => Ok(None),
        };
        for (i, b) in s.blocks.iter().enumerate() {
            let first_of_sequence = s.parent.is_none() && i == 0;
            if !chained && !window {
                prior = Ok(None);
            }
            if (first_of_sequence || !chained) && prior.is_ok() && mix(b.hash) > self.threshold {
                prior = Err(Skip::NotSampled);
            }
            let known = match &prior {
                Err(why) => {
                    out.skip(*why);
                    Known::Skipped(*why)
                }
                Ok(_) if b.token_ids.len() != block_len || block_len == 0 => {
                    out.skip(Skip::NoTokenIds);
                    Known::Skipped(Skip::NoTokenIds)
                }
                Ok(p) => {
                    let tokens: Vec<u64> = b.token_ids.iter().map(|&t| u64::from(t)).collect();
                    let d = derive(&cfg, s, b.extra_keys.as_ref(), first_of_sequence, p.as_deref(), &tokens);
                    match d.event_hash {
                        Some(h) => {
                            out.checked += 1;
                            out.mismatched += u64::from(h != b.hash);
                        }
                        None => out.skip(Skip::ExtraKeys),
                    }
                    match d.digest {
                        Some(digest) => Known::digest(&digest),
                        None if !chained => Known::digest(&[]),
                        None => Known::Skipped(Skip::ExtraKeys),
                    }
                }
            };
            prior = match &known {
                Known::Skipped(why) => Err(*why),
                Known::Digest { bytes, len } => Ok(Some(bytes[..*len as usize].to_vec())),
            };
            self.remember(b.hash, known);
        }
    }
}

/// A block re-derived: the digest its children chain from (`None`: not chained, or not
/// derivable) and the event hash to compare (`None`: cannot be compared).
struct Derived {
    digest: Option<Vec<u8>>,
    event_hash: Option<u64>,
}

/// The strings of a block's `extra_keys` entry, or `None` when it holds anything else.
fn extra_strings(k: Option<&KeyPart>) -> Option<Vec<&str>> {
    match k {
        None | Some(KeyPart::Nil) => Some(Vec::new()),
        Some(KeyPart::List(items)) => items
            .iter()
            .map(|i| match i {
                KeyPart::Str(s) => Some(s.as_str()),
                _ => None,
            })
            .collect(),
        Some(KeyPart::Str(s)) => Some(vec![s.as_str()]),
        Some(_) => None,
    }
}

fn derive(
    cfg: &HashCheckConfig,
    s: &Stored,
    extra: Option<&KeyPart>,
    first_of_sequence: bool,
    prior: Option<&[u8]>,
    tokens: &[u64],
) -> Derived {
    match &cfg.scheme {
        HashScheme::Vllm { algo, none_hash, form, lora_by_name } => {
            let none = Derived { digest: None, event_hash: None };
            if s.block_mm_infos.is_some() || s.lookahead_token_ids.is_some() {
                return none;
            }
            let Some(mut strings) = extra_strings(extra) else { return none };
            // vLLM's extra keys, in its order: the LoRA name, (multimodal ids), the cache salt
            // on a sequence's first block. The tagged form (0.31+) also hashes the adapter's
            // path, which the wire does not carry.
            let lora = match (&s.namespace.lora_name, s.namespace.lora_id) {
                (None, None) => None,
                (Some(name), _) if *lora_by_name && *form != ExtraKeyForm::Tagged => {
                    if strings.first() != Some(&name.as_str()) {
                        return none;
                    }
                    strings.remove(0);
                    Some(LoraRef { name: name.clone(), path: String::new() })
                }
                _ => return none,
            };
            let salt = match strings.as_slice() {
                [] => None,
                [salt] if first_of_sequence => Some(*salt),
                _ => return none,
            };
            let keys =
                form.extra_keys(&vllm::BlockExtras { lora: lora.as_ref(), cache_salt: salt, ..Default::default() });
            let parent = prior.unwrap_or(none_hash);
            let digest = vllm::block_digest(*algo, parent, tokens, keys.as_ref());
            let h = vllm::event_hash(&digest);
            Derived { digest: Some(digest), event_hash: Some(h) }
        }
        HashScheme::Sglang { scheme: SglangHashScheme::PageTupleHash, .. } => {
            let h = if s.token_layout == TokenLayout::Bigram {
                let pairs: Vec<(u64, u64)> = tokens.chunks_exact(2).map(|p| (p[0], p[1])).collect();
                sglang::bigram_page_tuple_hash(&pairs)
            } else {
                sglang::page_tuple_hash(tokens)
            };
            Derived { digest: None, event_hash: Some(h as u64) }
        }
        HashScheme::Sglang { scheme: SglangHashScheme::ChainedSha256, lora_namespaced } => {
            let salt;
            let prior = match prior {
                None => {
                    salt = s.namespace.cache_salt.as_deref().filter(|x| !x.is_empty()).map(sglang::salt_prior);
                    salt.as_ref().map(|x| x.as_slice())
                }
                p => p,
            };
            // Bigram pages are flattened pairs: hashing them in order is SGLang's bigram digest.
            let digest = sglang::page_digest(prior, tokens);
            let namespaced = *lora_namespaced && s.namespace.lora_name.is_some();
            let h = (!namespaced).then(|| sglang::digest_to_i64(&digest) as u64);
            Derived { digest: Some(digest.to_vec()), event_hash: h }
        }
    }
}
