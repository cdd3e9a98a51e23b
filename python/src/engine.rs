//! `Engine`: an engine's block-hash settings, and the block hashes it publishes.

use kv_relay_proto::hash::{block_event_hashes, EngineHashConfig, RequestKeys};
use kv_router::{HashSettings, LoraSettings};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::*;

/// An engine's block-hash settings: how it turns a request's token ids into the block hashes it
/// publishes. Build one with `Engine.vllm(...)`, `Engine.sglang(...)` or `Engine.from_json(...)`
/// and pass it as `engine=` (a dict or JSON string of the same settings works too, parsed at
/// each call).
#[pyclass(frozen, name = "Engine", module = "kv_router_client")]
pub(crate) struct PyEngine {
    cfg: EngineHashConfig,
    json: String,
}

impl PyEngine {
    pub(crate) fn from_settings(json: String) -> PyResult<Self> {
        let s: HashSettings =
            serde_json::from_str(&json).map_err(|e| PyValueError::new_err(format!("engine settings {json}: {e}")))?;
        let cfg = s.resolve().map_err(|e| PyValueError::new_err(format!("engine settings {json}: {e}")))?;
        Ok(PyEngine { cfg, json })
    }

    /// `engine=` as given: an [`PyEngine`], a dict or a JSON string.
    pub(crate) fn of(engine: &Bound<'_, PyAny>) -> PyResult<EngineArg> {
        if let Ok(e) = engine.cast::<PyEngine>() {
            return Ok(EngineArg::Built(e.clone().unbind()));
        }
        let json = settings_json(engine)?;
        Ok(EngineArg::Parsed(PyEngine::from_settings(json)?))
    }
}

pub(crate) enum EngineArg {
    Built(Py<PyEngine>),
    Parsed(PyEngine),
}

impl EngineArg {
    pub(crate) fn cfg(&self) -> &EngineHashConfig {
        match self {
            EngineArg::Built(e) => &e.get().cfg,
            EngineArg::Parsed(e) => &e.cfg,
        }
    }
}

/// A dict's or string's JSON text.
pub(crate) fn settings_json(v: &Bound<'_, PyAny>) -> PyResult<String> {
    if let Ok(s) = v.extract::<String>() {
        return Ok(s);
    }
    if v.cast::<PyDict>().is_ok() {
        return v.py().import("json")?.call_method1("dumps", (v,))?.extract();
    }
    Err(pyo3::exceptions::PyTypeError::new_err(format!(
        "engine must be an Engine, a dict or a JSON string, not {}",
        v.get_type().name()?
    )))
}

#[pymethods]
impl PyEngine {
    /// vLLM's block hashes: its release (e.g. "0.32"), block size, `--prefix-caching-hash-algo`
    /// ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor") and its PYTHONHASHSEED when set.
    #[staticmethod]
    #[pyo3(signature = (version, block_size, algo = "sha256", python_hash_seed = None))]
    fn vllm(version: &str, block_size: usize, algo: &str, python_hash_seed: Option<&str>) -> PyResult<Self> {
        let json = serde_json::json!({
            "engine": "vllm", "version": version, "algo": algo,
            "python_hash_seed": python_hash_seed, "block_size": block_size,
        });
        PyEngine::from_settings(json.to_string())
    }

    /// SGLang's page hashes: its release (e.g. "0.5.23"), page size, and EAGLE bigram keys.
    #[staticmethod]
    #[pyo3(signature = (version, page_size, eagle = false))]
    fn sglang(version: &str, page_size: usize, eagle: bool) -> PyResult<Self> {
        let json =
            serde_json::json!({ "engine": "sglang", "version": version, "page_size": page_size, "eagle": eagle });
        PyEngine::from_settings(json.to_string())
    }

    /// The settings as kv-router's `--engine-hash` takes them: a dict or a JSON string, e.g.
    /// `{"engine": "vllm", "version": "0.32", "algo": "sha256_cbor", "block_size": 16}`.
    #[staticmethod]
    fn from_json(settings: &Bound<'_, PyAny>) -> PyResult<Self> {
        PyEngine::from_settings(settings_json(settings)?)
    }

    /// The block hashes the engine publishes for a request with these token ids (its full
    /// blocks only), with its cache salt and LoRA adapter when it has them.
    #[pyo3(signature = (token_ids, *, cache_salt = None, lora_name = None, lora_path = None))]
    fn block_hashes(
        &self,
        py: Python<'_>,
        token_ids: U64s,
        cache_salt: Option<String>,
        lora_name: Option<String>,
        lora_path: Option<String>,
    ) -> PyResult<Vec<u64>> {
        let lora = lora_of(lora_name, lora_path)?;
        py.detach(|| hashes(&self.cfg, &token_ids.0, cache_salt.as_deref(), lora.as_ref()))
    }

    fn __repr__(&self) -> String {
        format!("Engine.from_json({:?})", self.json)
    }
}

pub(crate) fn lora_of(name: Option<String>, path: Option<String>) -> PyResult<Option<kv_relay_proto::hash::LoraRef>> {
    match (name, path) {
        (Some(name), path) => Ok(Some(LoraSettings { name, path: path.unwrap_or_default() }.to_ref())),
        (None, Some(_)) => Err(PyValueError::new_err("lora_path needs lora_name")),
        (None, None) => Ok(None),
    }
}

pub(crate) fn hashes(
    cfg: &EngineHashConfig,
    token_ids: &[u64],
    cache_salt: Option<&str>,
    lora: Option<&kv_relay_proto::hash::LoraRef>,
) -> PyResult<Vec<u64>> {
    let keys = RequestKeys { token_ids, cache_salt, lora, ..RequestKeys::default() };
    block_event_hashes(cfg, &keys).map_err(|e| PyValueError::new_err(format!("block hashes: {e}")))
}
