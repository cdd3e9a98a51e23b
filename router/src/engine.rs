//! An engine's block-hash settings as a router is told them (`--engine-hash`, `POST /match`'s
//! `hash`, the Python package's `engine=`): JSON with the engine's name, release and block size,
//! resolved to the hash function the engine runs ([`EngineHashConfig`]).

use kv_relay_proto::hash::{EngineHashConfig, EngineVersion, LoraRef, VllmHashAlgo};
use serde::Deserialize;

/// A LoRA adapter as the engine hashes it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoraSettings {
    /// The adapter's name (SGLang: its id, the radix `extra_key`).
    pub name: String,
    /// The adapter's path (vLLM).
    #[serde(default)]
    pub path: String,
}

/// An engine's block-hash settings.
#[derive(Debug, Deserialize)]
#[serde(tag = "engine", rename_all = "lowercase", deny_unknown_fields)]
pub enum HashSettings {
    /// vLLM: release, `--prefix-caching-hash-algo`, `PYTHONHASHSEED`, block size.
    Vllm {
        /// The release, e.g. `0.11.0`.
        version: String,
        /// `sha256` (default), `sha256_cbor`, `xxhash`, `xxhash_cbor`.
        #[serde(default)]
        algo: Option<String>,
        /// The engine's `PYTHONHASHSEED`, when set.
        #[serde(default)]
        python_hash_seed: Option<String>,
        /// Tokens per block.
        block_size: usize,
    },
    /// SGLang: release, page size, EAGLE bigram keys.
    Sglang {
        /// The release, e.g. `0.5.23`.
        version: String,
        /// Tokens per page.
        page_size: usize,
        /// EAGLE bigram keys on.
        #[serde(default)]
        eagle: bool,
    },
}

impl HashSettings {
    /// The engine's hash function.
    pub fn resolve(&self) -> Result<EngineHashConfig, String> {
        match self {
            HashSettings::Vllm { version, algo, python_hash_seed, block_size } => {
                let v: EngineVersion = version.parse().map_err(|e| format!("{e}"))?;
                let algo: VllmHashAlgo = algo.as_deref().unwrap_or("sha256").parse().map_err(|e| format!("{e}"))?;
                EngineHashConfig::vllm(v, algo, python_hash_seed.as_deref(), *block_size).map_err(|e| e.to_string())
            }
            HashSettings::Sglang { version, page_size, eagle } => {
                let v: EngineVersion = version.parse().map_err(|e| format!("{e}"))?;
                EngineHashConfig::sglang(v, *page_size, *eagle).map_err(|e| e.to_string())
            }
        }
    }
}

impl LoraSettings {
    /// The adapter as the hash functions take it.
    pub fn to_ref(&self) -> LoraRef {
        LoraRef { name: self.name.clone(), path: self.path.clone() }
    }
}
