//! vLLM block hashes (v1 engine, releases 0.10.2 and later, where hashes are digests).
//!
//! `hash_i = H((parent, tuple(token_ids_i), extra_keys_i))`, `parent = NONE_HASH` for block 0
//! and the previous block's digest after it. `H` is one of [`VllmHashAlgo`]; the event carries
//! [`event_hash`] of the digest (its last 8 bytes, big-endian).

use std::fmt;
use std::str::FromStr;

use sha2::{Digest, Sha256};
use xxhash_rust::xxh3::xxh3_128;

use super::value::PyValue;
use super::version::EngineVersion;
use super::{cbor, pickle, HashError};

/// The seed vLLM 0.29+ hashes for NONE_HASH when `PYTHONHASHSEED` is unset (sha256 family).
pub const DEFAULT_NONE_HASH_SEED: &str = "vllm-none-hash";

/// First release whose NONE_HASH falls back to [`DEFAULT_NONE_HASH_SEED`].
const DEFAULT_SEED_SINCE: EngineVersion = EngineVersion::new(0, 29, 0);
/// First release with digest (bytes) block hashes and `sha256_cbor`.
const BYTES_HASHES_SINCE: EngineVersion = EngineVersion::new(0, 10, 2);
/// First release with `xxhash` / `xxhash_cbor`.
const XXHASH_SINCE: EngineVersion = EngineVersion::new(0, 13, 0);
/// First release hashing the LoRA name (earlier: the LoRA int id).
const LORA_NAME_SINCE: EngineVersion = EngineVersion::new(0, 11, 1);
/// First release with `(identifier, offset)` multimodal keys.
const MM_OFFSET_SINCE: EngineVersion = EngineVersion::new(0, 19, 0);
/// First release with tagged extra keys.
const TAGGED_SINCE: EngineVersion = EngineVersion::new(0, 31, 0);

/// vLLM's `--prefix-caching-hash-algo`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum VllmHashAlgo {
    /// `sha256`: SHA-256 of the pickle (protocol 5) of the tuple; 32-byte digest. The default.
    Sha256,
    /// `sha256_cbor`: SHA-256 of the canonical CBOR of the tuple; 32-byte digest.
    Sha256Cbor,
    /// `xxhash`: XXH3-128 of the pickle; 16-byte big-endian digest (0.13+).
    Xxhash,
    /// `xxhash_cbor`: XXH3-128 of the canonical CBOR; 16-byte big-endian digest (0.13+).
    XxhashCbor,
}

impl VllmHashAlgo {
    /// The name vLLM's config uses.
    pub fn name(self) -> &'static str {
        match self {
            VllmHashAlgo::Sha256 => "sha256",
            VllmHashAlgo::Sha256Cbor => "sha256_cbor",
            VllmHashAlgo::Xxhash => "xxhash",
            VllmHashAlgo::XxhashCbor => "xxhash_cbor",
        }
    }

    /// The bytes this algorithm hashes for `value` (pickle protocol 5 or canonical CBOR).
    pub fn serialize(self, value: &PyValue) -> Vec<u8> {
        match self {
            VllmHashAlgo::Sha256 | VllmHashAlgo::Xxhash => pickle::dumps(value),
            VllmHashAlgo::Sha256Cbor | VllmHashAlgo::XxhashCbor => cbor::dumps(value),
        }
    }

    /// `hash_fn(value)`: the digest (32 bytes for SHA-256, 16 for XXH3-128).
    pub fn digest(self, value: &PyValue) -> Vec<u8> {
        let data = self.serialize(value);
        match self {
            VllmHashAlgo::Sha256 | VllmHashAlgo::Sha256Cbor => Sha256::digest(&data).to_vec(),
            VllmHashAlgo::Xxhash | VllmHashAlgo::XxhashCbor => xxh3_128(&data).to_be_bytes().to_vec(),
        }
    }

    /// Whether NONE_HASH defaults to [`DEFAULT_NONE_HASH_SEED`] (0.29+) rather than randomness.
    fn has_default_seed(self) -> bool {
        matches!(self, VllmHashAlgo::Sha256 | VllmHashAlgo::Sha256Cbor)
    }

    fn first_release(self) -> EngineVersion {
        match self {
            VllmHashAlgo::Sha256 | VllmHashAlgo::Sha256Cbor => BYTES_HASHES_SINCE,
            VllmHashAlgo::Xxhash | VllmHashAlgo::XxhashCbor => XXHASH_SINCE,
        }
    }
}

impl fmt::Display for VllmHashAlgo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for VllmHashAlgo {
    type Err = HashError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "sha256" => Ok(VllmHashAlgo::Sha256),
            "sha256_cbor" => Ok(VllmHashAlgo::Sha256Cbor),
            "xxhash" => Ok(VllmHashAlgo::Xxhash),
            "xxhash_cbor" => Ok(VllmHashAlgo::XxhashCbor),
            other => Err(HashError::UnknownAlgorithm(other.to_string())),
        }
    }
}

/// Where NONE_HASH, the parent of block 0, comes from.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum NoneHashSeed {
    /// `hash_fn(seed)`: the `PYTHONHASHSEED` string, or [`DEFAULT_NONE_HASH_SEED`].
    Seed(String),
    /// The NONE_HASH digest itself. An engine without `PYTHONHASHSEED` (before 0.29, or with
    /// an xxhash algorithm) draws it from `os.urandom(32)`; nothing outside that process can
    /// reproduce it, so whoever knows it must supply it here.
    Explicit(Vec<u8>),
}

impl NoneHashSeed {
    /// The rule of a release: `PYTHONHASHSEED` when set; else `"vllm-none-hash"` for
    /// sha256/sha256_cbor from 0.29; else random, reported as [`HashError::RandomNoneHash`].
    pub fn for_release(
        version: EngineVersion,
        algo: VllmHashAlgo,
        python_hash_seed: Option<&str>,
    ) -> Result<Self, HashError> {
        check_algo(version, algo)?;
        match python_hash_seed {
            Some(seed) => Ok(NoneHashSeed::Seed(seed.to_string())),
            None if version >= DEFAULT_SEED_SINCE && algo.has_default_seed() => {
                Ok(NoneHashSeed::Seed(DEFAULT_NONE_HASH_SEED.to_string()))
            }
            None => Err(HashError::RandomNoneHash { algo: algo.name(), version }),
        }
    }

    /// The NONE_HASH digest under `algo`.
    pub fn none_hash(&self, algo: VllmHashAlgo) -> Vec<u8> {
        match self {
            NoneHashSeed::Seed(seed) => algo.digest(&PyValue::str(seed.as_str())),
            NoneHashSeed::Explicit(digest) => digest.clone(),
        }
    }
}

fn check_algo(version: EngineVersion, algo: VllmHashAlgo) -> Result<(), HashError> {
    if version < BYTES_HASHES_SINCE {
        return Err(HashError::UnsupportedVersion { engine: "vllm", version });
    }
    if version < algo.first_release() {
        return Err(HashError::AlgorithmUnavailable { algo: algo.name(), version });
    }
    Ok(())
}

/// The shape of the hashed `extra_keys` tuple, which changed between releases.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ExtraKeyForm {
    /// 0.11.1–0.18: `lora_name`, bare multimodal identifier, bare salt, prompt-embeds digest.
    UntaggedBareMm,
    /// 0.19–0.30: as above with `(identifier, offset_in_block)` multimodal keys.
    Untagged,
    /// 0.31+: `("lora", name, path)`, `("mm", identifier, offset)`, `("cache_salt", salt)`,
    /// `("prompt_embeds", digest)`.
    Tagged,
}

impl ExtraKeyForm {
    /// The form a release hashes. Releases before 0.11.1 hashed the LoRA int id, which this
    /// crate does not model; they get [`ExtraKeyForm::UntaggedBareMm`] and reject LoRA.
    pub fn for_release(version: EngineVersion) -> Self {
        if version >= TAGGED_SINCE {
            ExtraKeyForm::Tagged
        } else if version >= MM_OFFSET_SINCE {
            ExtraKeyForm::Untagged
        } else {
            ExtraKeyForm::UntaggedBareMm
        }
    }

    /// The `extra_keys` element of one block's hashed tuple (`None` when there are none),
    /// in vLLM's order: LoRA, multimodal items, cache salt, prompt-embeds digest.
    pub fn extra_keys(self, extras: &BlockExtras<'_>) -> Option<PyValue> {
        let tagged = self == ExtraKeyForm::Tagged;
        let mut keys = Vec::new();
        if let Some(lora) = extras.lora {
            keys.push(if tagged {
                PyValue::Tuple(vec![
                    PyValue::interned("lora"),
                    PyValue::str(lora.name.as_str()),
                    PyValue::str(lora.path.as_str()),
                ])
            } else {
                PyValue::str(lora.name.as_str())
            });
        }
        for &(identifier, offset) in &extras.mm {
            keys.push(match self {
                ExtraKeyForm::UntaggedBareMm => PyValue::str(identifier),
                ExtraKeyForm::Untagged => PyValue::Tuple(vec![PyValue::str(identifier), PyValue::int(offset)]),
                ExtraKeyForm::Tagged => {
                    PyValue::Tuple(vec![PyValue::interned("mm"), PyValue::str(identifier), PyValue::int(offset)])
                }
            });
        }
        if let Some(salt) = extras.cache_salt.filter(|s| !s.is_empty()) {
            keys.push(if tagged {
                PyValue::Tuple(vec![PyValue::interned("cache_salt"), PyValue::str(salt)])
            } else {
                PyValue::str(salt)
            });
        }
        if let Some(digest) = extras.prompt_embeds {
            keys.push(if tagged {
                PyValue::Tuple(vec![PyValue::interned("prompt_embeds"), PyValue::bytes(digest.to_vec())])
            } else {
                PyValue::bytes(digest.to_vec())
            });
        }
        if keys.is_empty() {
            None
        } else {
            Some(PyValue::Tuple(keys))
        }
    }
}

/// A LoRA adapter as vLLM hashes it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct LoraRef {
    /// `lora_request.lora_name`.
    pub name: String,
    /// `lora_request.lora_path` (hashed by the tagged form only).
    pub path: String,
}

/// A multimodal item of a request: its identifier and its placeholder range in the prompt.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct MmFeature {
    /// `mm_feature.identifier` (the content hash).
    pub identifier: String,
    /// First token position of the placeholder range.
    pub offset: usize,
    /// Number of tokens of the placeholder range.
    pub length: usize,
}

/// The ingredients of one block's extra keys.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlockExtras<'a> {
    /// The request's LoRA adapter.
    pub lora: Option<&'a LoraRef>,
    /// Multimodal items touching the block: identifier and `offset - block_start`.
    pub mm: Vec<(&'a str, i64)>,
    /// The cache salt (block 0 only; ignored when empty).
    pub cache_salt: Option<&'a str>,
    /// SHA-256 of the block's prompt embeddings.
    pub prompt_embeds: Option<&'a [u8; 32]>,
}

/// One block's digest: `H((parent, tuple(tokens), extra_keys))`.
pub fn block_digest(algo: VllmHashAlgo, parent: &[u8], tokens: &[u64], extra_keys: Option<&PyValue>) -> Vec<u8> {
    let value = PyValue::Tuple(vec![
        PyValue::bytes(parent.to_vec()),
        PyValue::token_tuple(tokens),
        extra_keys.cloned().unwrap_or(PyValue::None),
    ]);
    algo.digest(&value)
}

/// The integer a `BlockStored`/`BlockRemoved` event carries for a digest:
/// `int.from_bytes(digest, "big") & (2**64 - 1)`, i.e. the last 8 bytes big-endian
/// (left-padded with zeros when the digest is shorter than 8 bytes).
pub fn event_hash(digest: &[u8]) -> u64 {
    let tail = &digest[digest.len().saturating_sub(8)..];
    let mut buf = [0u8; 8];
    buf[8 - tail.len()..].copy_from_slice(tail);
    u64::from_be_bytes(buf)
}

/// What a vLLM request contributes to its block hashes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VllmRequest<'a> {
    /// All token ids (prompt then output); only full blocks are hashed.
    pub token_ids: &'a [u64],
    /// The LoRA adapter, if any.
    pub lora: Option<&'a LoraRef>,
    /// Multimodal items, sorted by offset.
    pub mm_features: &'a [MmFeature],
    /// `cache_salt` of the request (hashed into block 0 only).
    pub cache_salt: Option<&'a str>,
    /// Per-block SHA-256 digests of the prompt embeddings (empty when the request has none).
    pub prompt_embeds: &'a [[u8; 32]],
}

/// A vLLM engine's block hash function, fully resolved (algorithm, NONE_HASH, block size,
/// extra-key form).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VllmHasher {
    algo: VllmHashAlgo,
    none_hash: Vec<u8>,
    block_size: usize,
    form: ExtraKeyForm,
    /// False for releases before 0.11.1, which hashed the LoRA int id (not modelled).
    lora_by_name: bool,
}

impl VllmHasher {
    /// The hasher of a release with `PYTHONHASHSEED` as given (`None` = unset).
    /// Fails with [`HashError::RandomNoneHash`] when that release would seed randomly; use
    /// [`VllmHasher::with_none_hash`] with the engine's NONE_HASH then.
    pub fn for_release(
        version: EngineVersion,
        algo: VllmHashAlgo,
        python_hash_seed: Option<&str>,
        block_size: usize,
    ) -> Result<Self, HashError> {
        let seed = NoneHashSeed::for_release(version, algo, python_hash_seed)?;
        let mut hasher = Self::new(algo, &seed, block_size, ExtraKeyForm::for_release(version))?;
        hasher.lora_by_name = version >= LORA_NAME_SINCE;
        Ok(hasher)
    }

    /// A hasher from its parts.
    pub fn new(
        algo: VllmHashAlgo,
        seed: &NoneHashSeed,
        block_size: usize,
        form: ExtraKeyForm,
    ) -> Result<Self, HashError> {
        if block_size == 0 {
            return Err(HashError::ZeroBlockSize);
        }
        Ok(Self { algo, none_hash: seed.none_hash(algo), block_size, form, lora_by_name: true })
    }

    /// A hasher whose NONE_HASH digest is known (e.g. a random one reported by the engine).
    pub fn with_none_hash(
        algo: VllmHashAlgo,
        none_hash: Vec<u8>,
        block_size: usize,
        form: ExtraKeyForm,
    ) -> Result<Self, HashError> {
        Self::new(algo, &NoneHashSeed::Explicit(none_hash), block_size, form)
    }

    /// The algorithm.
    pub fn algo(&self) -> VllmHashAlgo {
        self.algo
    }

    /// NONE_HASH, the parent digest of block 0.
    pub fn none_hash(&self) -> &[u8] {
        &self.none_hash
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The extra-key form.
    pub fn extra_key_form(&self) -> ExtraKeyForm {
        self.form
    }

    /// The digest of every full block of the request, in order.
    pub fn block_digests(&self, request: &VllmRequest<'_>) -> Result<Vec<Vec<u8>>, HashError> {
        let n = request.token_ids.len() / self.block_size;
        if request.lora.is_some() && !self.lora_by_name {
            return Err(HashError::Unsupported("lora keys before vllm 0.11.1 (the lora int id was hashed)"));
        }
        if !request.prompt_embeds.is_empty() && request.prompt_embeds.len() < n {
            return Err(HashError::MissingPromptEmbeds { blocks: n, digests: request.prompt_embeds.len() });
        }
        let mut out: Vec<Vec<u8>> = Vec::with_capacity(n);
        let mut mm_cursor = 0usize;
        for i in 0..n {
            let start = i * self.block_size;
            let end = start + self.block_size;
            let extras = BlockExtras {
                lora: request.lora,
                mm: mm_keys(request.mm_features, start, end, &mut mm_cursor),
                cache_salt: if i == 0 { request.cache_salt } else { None },
                prompt_embeds: request.prompt_embeds.get(i),
            };
            let extra_keys = self.form.extra_keys(&extras);
            let parent = out.last().map_or(self.none_hash.as_slice(), Vec::as_slice);
            let digest = block_digest(self.algo, parent, &request.token_ids[start..end], extra_keys.as_ref());
            out.push(digest);
        }
        Ok(out)
    }

    /// The event hash of every full block of the request, in order.
    pub fn block_event_hashes(&self, request: &VllmRequest<'_>) -> Result<Vec<u64>, HashError> {
        Ok(self.block_digests(request)?.iter().map(|d| event_hash(d)).collect())
    }
}

/// Multimodal keys of block `[start, end)`, walking the offset-sorted features with a cursor
/// carried from block to block as vLLM does: a feature is keyed in every block it overlaps
/// and the cursor moves past it in the block that contains its end.
fn mm_keys<'a>(features: &'a [MmFeature], start: usize, end: usize, cursor: &mut usize) -> Vec<(&'a str, i64)> {
    let mut keys = Vec::new();
    while let Some(f) = features.get(*cursor) {
        if end <= f.offset {
            break; // the block ends before this item starts
        }
        if start > f.offset + f.length {
            *cursor += 1; // the block starts after this item
            continue;
        }
        keys.push((f.identifier.as_str(), f.offset as i64 - start as i64));
        if end >= f.offset + f.length {
            *cursor += 1;
        } else {
            break; // the item goes on into the next block
        }
    }
    keys
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_hash_is_the_last_eight_bytes_big_endian() {
        let mut d = [0u8; 32];
        d[24..].copy_from_slice(&0x0102030405060708u64.to_be_bytes());
        assert_eq!(event_hash(&d), 0x0102030405060708);
        assert_eq!(event_hash(&[1, 2]), 0x0102);
    }

    #[test]
    fn mm_items_spanning_blocks_are_keyed_in_each_block() {
        let f = vec![
            MmFeature { identifier: "a".into(), offset: 2, length: 6 },
            MmFeature { identifier: "b".into(), offset: 9, length: 1 },
        ];
        let mut cur = 0;
        assert_eq!(mm_keys(&f, 0, 4, &mut cur), vec![("a", 2)]);
        assert_eq!(mm_keys(&f, 4, 8, &mut cur), vec![("a", -2)]);
        assert_eq!(mm_keys(&f, 8, 12, &mut cur), vec![("b", 1)]);
        assert_eq!(mm_keys(&f, 12, 16, &mut cur), vec![]);
    }

    #[test]
    fn none_hash_rules_follow_the_release() {
        let v = |s: &str| s.parse::<EngineVersion>().unwrap();
        assert_eq!(
            NoneHashSeed::for_release(v("0.32.0"), VllmHashAlgo::Sha256Cbor, None).unwrap(),
            NoneHashSeed::Seed("vllm-none-hash".into())
        );
        assert_eq!(
            NoneHashSeed::for_release(v("0.32.0"), VllmHashAlgo::Sha256, Some("0")).unwrap(),
            NoneHashSeed::Seed("0".into())
        );
        assert!(matches!(
            NoneHashSeed::for_release(v("0.28.0"), VllmHashAlgo::Sha256, None),
            Err(HashError::RandomNoneHash { .. })
        ));
        assert!(matches!(
            NoneHashSeed::for_release(v("0.32.0"), VllmHashAlgo::Xxhash, None),
            Err(HashError::RandomNoneHash { .. })
        ));
        assert!(matches!(
            NoneHashSeed::for_release(v("0.12.0"), VllmHashAlgo::Xxhash, Some("0")),
            Err(HashError::AlgorithmUnavailable { .. })
        ));
        assert!(matches!(
            NoneHashSeed::for_release(v("0.10.1"), VllmHashAlgo::Sha256, Some("0")),
            Err(HashError::UnsupportedVersion { .. })
        ));
    }
}
