//! The engines' block hashes, reproduced exactly, as pure functions (no I/O, no globals).
//!
//! A router that knows a request's token ids can compute the hashes the engine will
//! announce in `BlockStored` events, and look them up in its index before the engine has
//! seen the request. The sha256 / sha256_cbor chains (with and without cache salt) and the
//! SGLang chains (salted, LoRA-namespaced, EAGLE) reproduce every hash stored in the real
//! vLLM 0.32 and SGLang 0.5.23 captures (`tests/hash_fixtures.rs`); the rest is checked
//! against values computed with CPython, cbor2 and python-xxhash (`tests/hash_vectors.rs`).
//!
//! # Hash families
//!
//! | engine | releases | block hash | event value |
//! |---|---|---|---|
//! | vLLM | 0.10.2+ | `sha256`: SHA-256 of `pickle.dumps((parent, tuple(tokens), extra_keys), protocol=5)` ([`pickle`]) | last 8 digest bytes, big-endian `u64` |
//! | vLLM | 0.10.2+ | `sha256_cbor`: SHA-256 of `cbor2.dumps(…, canonical=True)` ([`cbor`]) | same |
//! | vLLM | 0.13+ | `xxhash` / `xxhash_cbor`: XXH3-128 of the same bytes, 16-byte big-endian digest | same (low 64 bits) |
//! | SGLang | 0.4.8–0.5.5 | CPython `hash(tuple(page))`, not chained | the signed int |
//! | SGLang | 0.5.6+ | chained SHA-256 over `u32` LE tokens (wide `u64` form past `u32::MAX`) | first 8 digest bytes, big-endian `i64` |
//!
//! vLLM chains from NONE_HASH = `hash_fn(PYTHONHASHSEED)` when that is set; without it,
//! 0.29+ uses `hash_fn("vllm-none-hash")` for sha256/sha256_cbor and a random value
//! otherwise (unreproducible: supply it with [`NoneHashSeed::Explicit`]). Extra keys (LoRA,
//! multimodal items, the cache salt on block 0, prompt-embeds digests) enter the hashed
//! tuple untagged up to 0.30 and tagged (`("cache_salt", salt)` …) from 0.31: [`ExtraKeyForm`].
//!
//! SGLang seeds a salted request's chain with `SHA256(b"sglang-cache-salt-v1\0" + salt)`
//! (0.5.18+) and namespaces LoRA requests' event hashes (0.5.22+): [`sglang`].
//!
//! Not modelled: vLLM before 0.10.2 (builtin `hash()` or 256-bit int hashes, which its
//! events could not even carry) and its LoRA int-id keys before 0.11.1; vLLM 0.33's
//! lookahead extra keys; hybrid groups whose block size is a multiple of the hash block
//! size (0.24+ announce the hash of each group block's last sub-block: values `k-1`,
//! `2k-1`, … of [`block_event_hashes`] computed with the hash block size); SGLang before
//! 0.4.8 (whole-node hashes) and the `"dynamo"` event format's salt+LoRA namespacing (the
//! primitives are in [`sglang`]).
//!
//! # Layout
//! * [`value`]: the Python values that get hashed (`PyValue`, `PyInt`).
//! * [`pickle`]: CPython-identical pickle protocol 5 writer, and its memo caveat.
//! * [`cbor`]: cbor2-identical canonical CBOR writer.
//! * [`vllm`]: vLLM algorithms, NONE_HASH rules, extra keys, the block chain.
//! * [`sglang`]: SGLang tuple hash, SHA-256 chain, bigrams, salts, LoRA namespaces.
//! * [`version`]: release numbers.
//! * this module: [`EngineHashConfig`] and [`block_event_hashes`], the one call a router needs.

pub mod cbor;
pub mod pickle;
pub mod sglang;
pub mod value;
pub mod version;
pub mod vllm;

pub use sglang::{SglangHashScheme, SglangHasher, SglangRequest};
pub use value::{PyInt, PyValue};
pub use version::EngineVersion;
pub use vllm::{ExtraKeyForm, LoraRef, MmFeature, NoneHashSeed, VllmHashAlgo, VllmHasher, VllmRequest};

/// Why a hash cannot be computed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HashError {
    /// The block (page) size is zero.
    #[error("block size must be at least 1")]
    ZeroBlockSize,
    /// A hash algorithm name vLLM does not have.
    #[error("unknown hash algorithm {0:?}")]
    UnknownAlgorithm(String),
    /// The algorithm exists, but not in this release.
    #[error("hash algorithm {algo} is not available in vllm {version}")]
    AlgorithmUnavailable {
        /// Algorithm name.
        algo: &'static str,
        /// Release asked for.
        version: EngineVersion,
    },
    /// The release seeds NONE_HASH from `os.urandom` in this configuration.
    #[error(
        "vllm {version} seeds the {algo} none hash randomly when PYTHONHASHSEED is unset; \
         supply the engine's none hash explicitly"
    )]
    RandomNoneHash {
        /// Algorithm name.
        algo: &'static str,
        /// Release asked for.
        version: EngineVersion,
    },
    /// A release whose hashing is not modelled.
    #[error("{engine} {version} block hashes are not supported")]
    UnsupportedVersion {
        /// `"vllm"` or `"sglang"`.
        engine: &'static str,
        /// Release asked for.
        version: EngineVersion,
    },
    /// A request feature whose hashing is not modelled for this release.
    #[error("not supported: {0}")]
    Unsupported(&'static str),
    /// Fewer prompt-embeds digests than full blocks.
    #[error("prompt embeds given for {digests} blocks but the request has {blocks} full blocks")]
    MissingPromptEmbeds {
        /// Full blocks of the request.
        blocks: usize,
        /// Digests supplied.
        digests: usize,
    },
    /// A version string that is not `major.minor[.patch]`.
    #[error("invalid version {0:?}")]
    InvalidVersion(String),
}

/// An engine's block hash function, resolved from its configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EngineHashConfig {
    /// A vLLM engine.
    Vllm(VllmHasher),
    /// An SGLang engine.
    Sglang(SglangHasher),
}

impl EngineHashConfig {
    /// A vLLM engine: its release, `--prefix-caching-hash-algo`, `PYTHONHASHSEED` (`None`
    /// when unset) and block size. Fails when the release would seed NONE_HASH randomly;
    /// build a [`VllmHasher::with_none_hash`] then.
    pub fn vllm(
        version: EngineVersion,
        algo: VllmHashAlgo,
        python_hash_seed: Option<&str>,
        block_size: usize,
    ) -> Result<Self, HashError> {
        VllmHasher::for_release(version, algo, python_hash_seed, block_size).map(Self::Vllm)
    }

    /// An SGLang engine: its release, page size and whether EAGLE bigram keys are on.
    pub fn sglang(version: EngineVersion, page_size: usize, eagle: bool) -> Result<Self, HashError> {
        SglangHasher::for_release(version, page_size, eagle).map(Self::Sglang)
    }
}

/// A request as far as block hashes care.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RequestKeys<'a> {
    /// Token ids, prompt then output. Only full blocks (pages) are hashed.
    pub token_ids: &'a [u64],
    /// The request's cache salt.
    pub cache_salt: Option<&'a str>,
    /// vLLM: the LoRA adapter. SGLang: `name` is the radix `extra_key` (the LoRA id) and
    /// `path` is unused.
    pub lora: Option<&'a LoraRef>,
    /// vLLM multimodal items, sorted by offset (SGLang: must be empty).
    pub mm_features: &'a [MmFeature],
    /// vLLM per-block prompt-embeds digests (SGLang: must be empty).
    pub prompt_embeds: &'a [[u8; 32]],
}

/// The event hash of every full block (page) of a request, in order, as unsigned 64-bit
/// values (SGLang's signed hashes as their two's complement bits).
pub fn block_event_hashes(config: &EngineHashConfig, request: &RequestKeys<'_>) -> Result<Vec<u64>, HashError> {
    match config {
        EngineHashConfig::Vllm(h) => h.block_event_hashes(&VllmRequest {
            token_ids: request.token_ids,
            lora: request.lora,
            mm_features: request.mm_features,
            cache_salt: request.cache_salt,
            prompt_embeds: request.prompt_embeds,
        }),
        EngineHashConfig::Sglang(h) => {
            if !request.mm_features.is_empty() || !request.prompt_embeds.is_empty() {
                return Err(HashError::Unsupported("multimodal or prompt-embeds keys in sglang hashes"));
            }
            h.block_event_hashes(&SglangRequest {
                token_ids: request.token_ids,
                cache_salt: request.cache_salt,
                lora_extra_key: request.lora.map(|l| l.name.as_str()),
            })
        }
    }
}
