//! `kv_router_client._native`: the Python face of [`kv_router_client::Follower`] and
//! [`kv_router::Router`]. The Python package (`python/kv_router_client`) re-exports it; its
//! stubs (`_native.pyi`) are the API's reference.
//!
//! One tokio runtime lives in the extension, made at the first [`Follower`]: the relays'
//! streams run on its threads (`KV_ROUTER_CLIENT_THREADS`, 2 by default), never on Python's.
//! Every call releases the GIL while it works in Rust. Lookups read the index and the workers'
//! views without waiting for the streams; only the answer's Python objects are built with the
//! GIL held.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, PoisonError, RwLock};
use std::time::{Duration, Instant};

use kv_relay_proto::hash::{block_event_hashes, EngineHashConfig, RequestKeys};
use kv_router::{HashSettings, LoraSettings, Outcome, PolicyKind, Reason, RouteError, Router, RouterConfig, Tokens};
use kv_router_client::discovery::{Discovery, DnsName, SystemResolver};
use kv_router_client::{
    ClientError, FollowConfig, Follower as RustFollower, Load, MatchOptions, MatchRef, WorkerState,
};
use pyo3::exceptions::{PyException, PyIndexError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PySlice, PyTuple};
use pyo3::IntoPyObjectExt as _;
use serde_json::Value;
use tokio::sync::oneshot;

pyo3::create_exception!(kv_router_client, Error, PyException, "The base of the package's own errors.");
pyo3::create_exception!(
    kv_router_client,
    RouteFailed,
    Error,
    "A request could not be routed: no worker is routable, or every one is overloaded and \
     shedding is on (`reason` in the message: NoWorker or Shed)."
);
pyo3::create_exception!(kv_router_client, NoWorker, RouteFailed, "No worker is routable.");
pyo3::create_exception!(
    kv_router_client,
    Shed,
    RouteFailed,
    "Every routable worker is overloaded, and shedding is on."
);
pyo3::create_exception!(
    kv_router_client,
    ReportRejected,
    Error,
    "A report named no routed request in flight (unknown, already reported, or forgotten)."
);
pyo3::create_exception!(kv_router_client, Closed, Error, "The follower was closed.");

/// The extension's runtime, made once.
fn runtime() -> PyResult<&'static tokio::runtime::Runtime> {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    if let Some(rt) = RT.get() {
        return Ok(rt);
    }
    let threads = match std::env::var("KV_ROUTER_CLIENT_THREADS") {
        Ok(s) => s.trim().parse::<usize>().ok().filter(|&n| n > 0).ok_or_else(|| {
            PyValueError::new_err(format!("KV_ROUTER_CLIENT_THREADS={s:?}: a number of threads, at least 1"))
        })?,
        Err(_) => 2,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name("kv-router-client")
        .enable_all()
        .build()
        .map_err(|e| PyRuntimeError::new_err(format!("cannot start the runtime: {e}")))?;
    Ok(RT.get_or_init(|| rt))
}

fn value_error(e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(e.to_string())
}

fn client_error(e: ClientError) -> PyErr {
    value_error(e)
}

fn millis(name: &str, ms: f64) -> PyResult<Duration> {
    if ms.is_finite() && ms >= 0.0 {
        Ok(Duration::from_secs_f64(ms / 1000.0))
    } else {
        Err(PyValueError::new_err(format!("{name} must be a number of milliseconds, at least 0 (got {ms})")))
    }
}

/// A JSON value as the Python object `json.loads` would give.
fn to_py<'py>(py: Python<'py>, v: &Value) -> PyResult<Bound<'py, PyAny>> {
    Ok(match v {
        Value::Null => py.None().into_bound(py),
        Value::Bool(b) => b.into_bound_py_any(py)?,
        Value::Number(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => u.into_bound_py_any(py)?,
            (None, Some(i)) => i.into_bound_py_any(py)?,
            _ => n.as_f64().unwrap_or(f64::NAN).into_bound_py_any(py)?,
        },
        Value::String(s) => s.into_bound_py_any(py)?,
        Value::Array(a) => {
            let items = a.iter().map(|x| to_py(py, x)).collect::<PyResult<Vec<_>>>()?;
            PyList::new(py, items)?.into_any()
        }
        Value::Object(o) => {
            let d = PyDict::new(py);
            for (k, x) in o {
                d.set_item(k, to_py(py, x)?)?;
            }
            d.into_any()
        }
    })
}

fn ser_py<'py>(py: Python<'py>, v: &impl serde::Serialize) -> PyResult<Bound<'py, PyAny>> {
    let v = serde_json::to_value(v).map_err(|e| PyRuntimeError::new_err(format!("serializing an answer: {e}")))?;
    to_py(py, &v)
}

/// An engine's block-hash settings: how it turns a request's token ids into the block hashes it
/// publishes. Build one with `Engine.vllm(...)`, `Engine.sglang(...)` or `Engine.from_json(...)`
/// and pass it as `engine=` (a dict or JSON string of the same settings works too, parsed at
/// each call).
#[pyclass(frozen, name = "Engine", module = "kv_router_client")]
struct PyEngine {
    cfg: EngineHashConfig,
    json: String,
}

impl PyEngine {
    fn from_settings(json: String) -> PyResult<Self> {
        let s: HashSettings =
            serde_json::from_str(&json).map_err(|e| PyValueError::new_err(format!("engine settings {json}: {e}")))?;
        let cfg = s.resolve().map_err(|e| PyValueError::new_err(format!("engine settings {json}: {e}")))?;
        Ok(PyEngine { cfg, json })
    }

    /// `engine=` as given: an [`PyEngine`], a dict or a JSON string.
    fn of(engine: &Bound<'_, PyAny>) -> PyResult<EngineArg> {
        if let Ok(e) = engine.cast::<PyEngine>() {
            return Ok(EngineArg::Built(e.clone().unbind()));
        }
        let json = settings_json(engine)?;
        Ok(EngineArg::Parsed(PyEngine::from_settings(json)?))
    }
}

enum EngineArg {
    Built(Py<PyEngine>),
    Parsed(PyEngine),
}

impl EngineArg {
    fn cfg(&self) -> &EngineHashConfig {
        match self {
            EngineArg::Built(e) => &e.get().cfg,
            EngineArg::Parsed(e) => &e.cfg,
        }
    }
}

/// A dict's or string's JSON text.
fn settings_json(v: &Bound<'_, PyAny>) -> PyResult<String> {
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

fn lora_of(name: Option<String>, path: Option<String>) -> PyResult<Option<kv_relay_proto::hash::LoraRef>> {
    match (name, path) {
        (Some(name), path) => Ok(Some(LoraSettings { name, path: path.unwrap_or_default() }.to_ref())),
        (None, Some(_)) => Err(PyValueError::new_err("lora_path needs lora_name")),
        (None, None) => Ok(None),
    }
}

fn hashes(
    cfg: &EngineHashConfig,
    token_ids: &[u64],
    cache_salt: Option<&str>,
    lora: Option<&kv_relay_proto::hash::LoraRef>,
) -> PyResult<Vec<u64>> {
    let keys = RequestKeys { token_ids, cache_salt, lora, ..RequestKeys::default() };
    block_event_hashes(cfg, &keys).map_err(|e| PyValueError::new_err(format!("block hashes: {e}")))
}

/// An engine's load as its relay last reported it.
#[pyclass(frozen, get_all, name = "Load", module = "kv_router_client")]
#[derive(Clone, Copy)]
struct PyLoad {
    /// Requests running.
    running: f64,
    /// Requests waiting.
    waiting: f64,
    /// KV-cache usage, 0..1.
    kv_usage: f64,
    /// Unix milliseconds of the relay's scrape of the engine.
    scraped_at_ms: u64,
}

impl From<Load> for PyLoad {
    fn from(l: Load) -> Self {
        PyLoad { running: l.running, waiting: l.waiting, kv_usage: l.kv_usage, scraped_at_ms: l.scraped_at_ms }
    }
}

#[pymethods]
impl PyLoad {
    fn __repr__(&self) -> String {
        format!(
            "Load(running={}, waiting={}, kv_usage={}, scraped_at_ms={})",
            self.running, self.waiting, self.kv_usage, self.scraped_at_ms
        )
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other.cast::<PyLoad>().is_ok_and(|o| {
            let o = o.get();
            (o.running, o.waiting, o.kv_usage, o.scraped_at_ms)
                == (self.running, self.waiting, self.kv_usage, self.scraped_at_ms)
        })
    }
}

/// One worker's answer to a lookup: its relay and DP rank, the request's leading blocks it
/// holds (in any tier, and per tier), its state and its load.
#[pyclass(frozen, name = "Match", module = "kv_router_client")]
#[derive(Clone, PartialEq)]
struct PyMatch {
    relay: Arc<str>,
    dp_rank: u32,
    matched_blocks: u32,
    by_tier: Vec<(Box<str>, u32)>,
    state: WorkerState,
    load: Option<Load>,
}

impl From<MatchRef<'_>> for PyMatch {
    fn from(m: MatchRef<'_>) -> Self {
        PyMatch {
            relay: m.relay.clone(),
            dp_rank: m.dp_rank,
            matched_blocks: m.matched_blocks,
            by_tier: m.by_tier.iter().map(|(name, n)| (Box::from(name), n)).collect(),
            state: m.state,
            load: m.load,
        }
    }
}

#[pymethods]
impl PyMatch {
    /// The relay's URL.
    #[getter]
    fn relay(&self) -> &str {
        &self.relay
    }

    /// The DP rank.
    #[getter]
    fn dp_rank(&self) -> u32 {
        self.dp_rank
    }

    /// Leading blocks of the request held in any tier.
    #[getter]
    fn matched_blocks(&self) -> u32 {
        self.matched_blocks
    }

    /// Leading blocks held within each tier alone, by tier name (tiers with 0 left out).
    #[getter]
    fn by_tier<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (name, n) in &self.by_tier {
            d.set_item(&**name, n)?;
        }
        Ok(d)
    }

    /// The worker's state: "ready", "stale", "degraded", "incomplete", "stopped", ...
    #[getter]
    fn state(&self) -> &'static str {
        self.state.as_str()
    }

    /// The worker's latest load, when its relay knows it.
    #[getter]
    fn load(&self) -> Option<PyLoad> {
        self.load.map(PyLoad::from)
    }

    /// The match as `POST /match` lists it.
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("relay", &*self.relay)?;
        d.set_item("dp_rank", self.dp_rank)?;
        d.set_item("matched_blocks", self.matched_blocks)?;
        d.set_item("by_tier", self.by_tier(py)?)?;
        d.set_item("load", ser_py(py, &self.load)?)?;
        d.set_item("state", self.state.as_str())?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        let tiers: Vec<String> = self.by_tier.iter().map(|(n, b)| format!("{n:?}: {b}")).collect();
        format!(
            "Match(relay={:?}, dp_rank={}, matched_blocks={}, by_tier={{{}}}, state={:?})",
            &*self.relay,
            self.dp_rank,
            self.matched_blocks,
            tiers.join(", "),
            self.state.as_str()
        )
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other.cast::<PyMatch>().is_ok_and(|o| o.get() == self)
    }
}

/// A lookup's answer: its matches in order, as a read-only sequence (`len`, indexes, slices,
/// iteration; `list(answer)` makes a list). Each Match object is made when it is read, so an
/// answer over many workers costs one object until its items are used.
#[pyclass(frozen, sequence, name = "Matches", module = "kv_router_client")]
struct PyMatches(Vec<PyMatch>);

#[pymethods]
impl PyMatches {
    fn __len__(&self) -> usize {
        self.0.len()
    }

    fn __getitem__<'py>(&self, py: Python<'py>, index: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        if let Ok(slice) = index.cast::<PySlice>() {
            let ix = slice.indices(isize::try_from(self.0.len()).unwrap_or(isize::MAX))?;
            let mut out = Vec::with_capacity(ix.slicelength);
            let mut i = ix.start;
            for _ in 0..ix.slicelength {
                out.push(self.0[i as usize].clone());
                i += ix.step;
            }
            return out.into_bound_py_any(py);
        }
        let i: isize = index.extract()?;
        let n = self.0.len() as isize;
        let at = if i < 0 { i + n } else { i };
        if !(0..n).contains(&at) {
            return Err(PyIndexError::new_err(format!("match index {i} out of range ({n} matches)")));
        }
        self.0[at as usize].clone().into_bound_py_any(py)
    }

    fn __iter__(slf: Bound<'_, Self>) -> MatchesIter {
        MatchesIter { matches: slf.unbind(), next: AtomicUsize::new(0) }
    }

    /// Equal to another answer, or to a list or tuple of the same Matches in the same order.
    fn __eq__(&self, other: &Bound<'_, PyAny>) -> PyResult<bool> {
        if let Ok(o) = other.cast::<PyMatches>() {
            return Ok(o.get().0 == self.0);
        }
        if !(other.is_instance_of::<PyList>() || other.is_instance_of::<PyTuple>()) || other.len()? != self.0.len() {
            return Ok(false);
        }
        for (m, o) in self.0.iter().zip(other.try_iter()?) {
            if !o?.cast::<PyMatch>().is_ok_and(|o| o.get() == m) {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Every match as `POST /match` lists it.
    fn to_dicts<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        self.0.iter().map(|m| m.to_dict(py)).collect()
    }

    fn __repr__(&self) -> String {
        let items: Vec<String> = self.0.iter().map(PyMatch::__repr__).collect();
        format!("Matches([{}])", items.join(", "))
    }
}

/// Iterates a [`PyMatches`].
#[pyclass(frozen, name = "MatchesIterator", module = "kv_router_client")]
struct MatchesIter {
    matches: Py<PyMatches>,
    next: AtomicUsize,
}

#[pymethods]
impl MatchesIter {
    fn __iter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    fn __next__(&self) -> Option<PyMatch> {
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        self.matches.get().0.get(i).cloned()
    }
}

/// What a follower runs: the router over it, and discovery when DNS names were given.
struct Live {
    router: Arc<Router>,
    /// Stops discovery (dropping it does too).
    _discovery: Option<oneshot::Sender<()>>,
}

impl Live {
    fn follower(&self) -> &RustFollower {
        self.router.follower()
    }
}

/// Follows kv-relays and holds the prefix index of every worker behind them; answers which
/// worker holds most of a request's prefix, and routes requests (see the package's docs).
#[pyclass(frozen, name = "Follower", module = "kv_router_client")]
struct PyFollower {
    live: RwLock<Option<Arc<Live>>>,
}

impl PyFollower {
    fn live(&self) -> PyResult<Arc<Live>> {
        self.live
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .ok_or_else(|| Closed::new_err("the follower is closed"))
    }
}

fn route_error(e: RouteError) -> PyErr {
    match e {
        RouteError::NoWorker { .. } => NoWorker::new_err(e.to_string()),
        RouteError::Shed => Shed::new_err(e.to_string()),
        RouteError::Hash(m) => PyValueError::new_err(format!("block hashes: {m}")),
    }
}

fn outcome_of(s: &str) -> PyResult<Outcome> {
    match s {
        "done" => Ok(Outcome::Done),
        "failed" => Ok(Outcome::Failed { connect: false }),
        "connect_failed" => Ok(Outcome::Failed { connect: true }),
        _ => Err(PyValueError::new_err(format!("outcome {s:?}: one of \"done\", \"failed\", \"connect_failed\""))),
    }
}

#[pymethods]
impl PyFollower {
    /// Follows `relays` (gRPC URLs, `http://host:port` or `https://...`) and the relays behind
    /// `dns` names (`NAME:PORT`, resolved every `dns_interval_ms`). Every other argument is a
    /// setting, by keyword; the defaults are the library's and kv-router's.
    #[new]
    #[pyo3(signature = (
        relays = None,
        *,
        dns = None,
        stale_after_ms = 2000.0,
        receive_timeout_ms = 5000.0,
        connect_timeout_ms = 5000.0,
        status_interval_ms = 5000.0,
        allow_snapshot = true,
        bearer_token = None,
        tls_ca_pem = None,
        max_message_bytes = 64 << 20,
        max_concurrent_resyncs = 16,
        start_jitter_ms = 500.0,
        dns_interval_ms = 5000.0,
        dns_grace_ms = 30000.0,
        policy = "cache_aware",
        overload_kv_usage = 0.8,
        overload_waiting = 8.0,
        overload_protection = true,
        shed = false,
        seed = None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        relays: Option<Vec<String>>,
        dns: Option<Vec<String>>,
        stale_after_ms: f64,
        receive_timeout_ms: f64,
        connect_timeout_ms: f64,
        status_interval_ms: f64,
        allow_snapshot: bool,
        bearer_token: Option<String>,
        tls_ca_pem: Option<Vec<u8>>,
        max_message_bytes: usize,
        max_concurrent_resyncs: usize,
        start_jitter_ms: f64,
        dns_interval_ms: f64,
        dns_grace_ms: f64,
        policy: &str,
        overload_kv_usage: f64,
        overload_waiting: f64,
        overload_protection: bool,
        shed: bool,
        seed: Option<u64>,
    ) -> PyResult<Self> {
        let cfg = FollowConfig {
            stale_after: millis("stale_after_ms", stale_after_ms)?,
            receive_timeout: millis("receive_timeout_ms", receive_timeout_ms)?,
            connect_timeout: millis("connect_timeout_ms", connect_timeout_ms)?,
            status_interval: millis("status_interval_ms", status_interval_ms)?,
            allow_snapshot,
            bearer_token,
            tls_ca_pem,
            max_message_bytes,
            max_concurrent_resyncs,
            start_jitter: millis("start_jitter_ms", start_jitter_ms)?,
            ..FollowConfig::default()
        };
        let dns_interval = millis("dns_interval_ms", dns_interval_ms)?;
        let grace = millis("dns_grace_ms", dns_grace_ms)?;
        let policy: PolicyKind = policy.parse().map_err(PyValueError::new_err)?;
        let mut rcfg = RouterConfig { policy, seed, ..RouterConfig::default() };
        let o = &mut rcfg.cache_aware.overload;
        (o.enabled, o.kv_usage, o.waiting, o.shed) = (overload_protection, overload_kv_usage, overload_waiting, shed);
        let names = dns
            .unwrap_or_default()
            .iter()
            .map(|n| n.parse::<DnsName>().map_err(PyValueError::new_err))
            .collect::<PyResult<Vec<_>>>()?;
        let relays = relays.unwrap_or_default();
        for r in &relays {
            kv_router_client::validate_url(r).map_err(client_error)?;
        }
        let rt = runtime()?;
        py.detach(|| {
            let _in = rt.enter();
            let follower = RustFollower::new(cfg);
            for r in &relays {
                follower.add_relay(r).map_err(client_error)?;
            }
            let discovery = (!names.is_empty()).then(|| {
                let mut d = Discovery::new(follower.clone(), Arc::new(SystemResolver)).with_grace(grace);
                for n in names {
                    d.add_name(n);
                }
                let (stop, stopped) = oneshot::channel::<()>();
                rt.spawn(d.run(dns_interval, async move {
                    let _ = stopped.await;
                }));
                stop
            });
            let router = Arc::new(Router::new(follower, rcfg));
            Ok(PyFollower { live: RwLock::new(Some(Arc::new(Live { router, _discovery: discovery }))) })
        })
    }

    /// Starts following a relay. Raises ValueError for a URL that is not `http://` or
    /// `https://`, or a relay already followed.
    fn add_relay(&self, py: Python<'_>, url: &str) -> PyResult<()> {
        let live = self.live()?;
        let rt = runtime()?;
        py.detach(|| {
            let _in = rt.enter();
            live.follower().add_relay(url).map_err(client_error)
        })
    }

    /// Stops following a relay and drops its workers from the index. Raises ValueError for a
    /// relay not followed.
    fn remove_relay(&self, py: Python<'_>, url: &str) -> PyResult<()> {
        let live = self.live()?;
        py.detach(|| live.follower().remove_relay(url).map_err(client_error))
    }

    /// For a request's block hashes (as the engine publishes them), every ready worker, by
    /// relay then rank, with the leading blocks it holds. `matched_only`: only the workers that
    /// hold the first block; `limit`: at most this many, most matched first.
    #[pyo3(name = "match", signature = (block_hashes, *, matched_only = false, limit = None))]
    fn match_blocks(
        &self,
        py: Python<'_>,
        block_hashes: U64s,
        matched_only: bool,
        limit: Option<usize>,
    ) -> PyResult<PyMatches> {
        let live = self.live()?;
        let opts = options(matched_only, limit)?;
        Ok(py.detach(|| PyMatches(live.follower().matches(&block_hashes.0, opts).iter().map(PyMatch::from).collect())))
    }

    /// The benchmark's peer: `runs` calls of the Rust lookup that `match` makes, each timed
    /// inside Rust (nanoseconds per call, no crossing, no Python objects). Not API.
    #[pyo3(name = "_time_match", signature = (block_hashes, runs, *, matched_only = false, limit = None))]
    fn time_match(
        &self,
        py: Python<'_>,
        block_hashes: U64s,
        runs: usize,
        matched_only: bool,
        limit: Option<usize>,
    ) -> PyResult<Vec<u64>> {
        let live = self.live()?;
        let opts = options(matched_only, limit)?;
        Ok(py.detach(|| {
            let f = live.follower();
            (0..runs)
                .map(|_| {
                    let t = std::time::Instant::now();
                    let m = std::hint::black_box(f.matches(std::hint::black_box(&block_hashes.0), opts));
                    let ns = t.elapsed().as_nanos() as u64;
                    drop(m);
                    ns
                })
                .collect()
        }))
    }

    /// [`match`] for a request's token ids, hashed as `engine` hashes them (an Engine, or its
    /// settings as a dict or JSON string).
    #[pyo3(signature = (token_ids, *, engine, cache_salt = None, lora_name = None, lora_path = None, matched_only = false, limit = None))]
    #[allow(clippy::too_many_arguments)]
    fn match_tokens(
        &self,
        py: Python<'_>,
        token_ids: U64s,
        engine: &Bound<'_, PyAny>,
        cache_salt: Option<String>,
        lora_name: Option<String>,
        lora_path: Option<String>,
        matched_only: bool,
        limit: Option<usize>,
    ) -> PyResult<PyMatches> {
        let live = self.live()?;
        let opts = options(matched_only, limit)?;
        let engine = PyEngine::of(engine)?;
        let lora = lora_of(lora_name, lora_path)?;
        py.detach(|| {
            let h = hashes(engine.cfg(), &token_ids.0, cache_salt.as_deref(), lora.as_ref())?;
            Ok(PyMatches(live.follower().matches(&h, opts).iter().map(PyMatch::from).collect()))
        })
    }

    /// Chooses the worker for a request, given by its block hashes or by its token ids with
    /// `engine`, and counts it in flight there until `report`. Returns a dict: `request_id`,
    /// `relay`, `dp_rank`, `engine_url`, `blocks`, `matched_blocks`, `device_blocks`,
    /// `reason`, `policy`, `expected_wait_us` (as kv-router's `POST /route`). Raises NoWorker
    /// or Shed.
    #[pyo3(signature = (block_hashes = None, *, token_ids = None, engine = None, cache_salt = None, lora_name = None, lora_path = None))]
    #[allow(clippy::too_many_arguments)]
    fn route<'py>(
        &self,
        py: Python<'py>,
        block_hashes: Option<U64s>,
        token_ids: Option<U64s>,
        engine: Option<&Bound<'py, PyAny>>,
        cache_salt: Option<String>,
        lora_name: Option<String>,
        lora_path: Option<String>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let live = self.live()?;
        let routed = match (block_hashes, token_ids, engine) {
            (Some(h), None, None) => py.detach(|| live.router.route(&h.0)),
            (None, Some(t), Some(e)) => {
                let engine = PyEngine::of(e)?;
                let lora = lora_of(lora_name, lora_path)?;
                py.detach(|| {
                    let keys = RequestKeys {
                        token_ids: &t.0,
                        cache_salt: cache_salt.as_deref(),
                        lora: lora.as_ref(),
                        ..RequestKeys::default()
                    };
                    live.router.route_tokens(engine.cfg(), &keys)
                })
            }
            (None, Some(_), None) => return Err(PyValueError::new_err("token_ids need engine=")),
            _ => return Err(PyValueError::new_err("give either block_hashes, or token_ids with engine=")),
        }
        .map_err(route_error)?;
        ser_py(py, &routed)
    }

    /// A routed request's end: "done" (the engine answered, whatever its status), "failed"
    /// (after the engine's first byte) or "connect_failed" (before it: the worker leaves
    /// routing), with its tokens. Returns the worker it had gone to (`relay`, `dp_rank`).
    /// Raises ReportRejected for an id not in flight.
    #[pyo3(signature = (request_id, outcome = "done", *, prompt_tokens = 0, completion_tokens = 0, cached_tokens = None))]
    fn report<'py>(
        &self,
        py: Python<'py>,
        request_id: u64,
        outcome: &str,
        prompt_tokens: u64,
        completion_tokens: u64,
        cached_tokens: Option<u64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let live = self.live()?;
        let outcome = outcome_of(outcome)?;
        let tokens = Tokens { prompt_tokens, completion_tokens, cached_tokens };
        let at = py
            .detach(|| live.router.report(request_id, outcome, tokens))
            .map_err(|e| ReportRejected::new_err(e.to_string()))?;
        ser_py(py, &at)
    }

    /// Every worker known, by relay then rank, with its state, load, liveness and routing (as
    /// kv-router's `GET /workers` lists them).
    fn workers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let live = self.live()?;
        let w = py.detach(|| live.router.workers());
        ser_py(py, &w)
    }

    /// Every relay followed, by URL: whether connected, the position held (epoch, cursor,
    /// incarnation), the relay's newest cursor, whether resyncing, the last error and the
    /// stream's counters.
    fn relays<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let live = self.live()?;
        let relays = py.detach(|| live.follower().relays());
        let list = relays
            .iter()
            .map(|r| {
                let mut v = serde_json::to_value(r).unwrap_or(Value::Null);
                if let Value::Object(o) = &mut v {
                    o.insert("counters".into(), serde_json::to_value(r.counters).unwrap_or(Value::Null));
                }
                to_py(py, &v)
            })
            .collect::<PyResult<Vec<_>>>()?;
        Ok(PyList::new(py, list)?.into_any())
    }

    /// The counters: `relays` (the streams' counters summed over every relay ever followed),
    /// `discovery`, and `routing` (decisions by reason, refusals, the breakers' transitions,
    /// reports and tokens).
    fn counters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let live = self.live()?;
        let (relays, discovery, routing, in_flight) = py.detach(|| {
            let f = live.follower();
            (f.counters(), f.discovery_counters(), live.router.counters(), live.router.in_flight())
        });
        let by_reason: serde_json::Map<String, Value> =
            Reason::ALL.iter().map(|r| (r.as_str().to_string(), Value::from(routing.routed[*r as usize]))).collect();
        let mut routing_v = serde_json::to_value(routing).unwrap_or(Value::Null);
        if let Value::Object(o) = &mut routing_v {
            o.insert("routed".into(), Value::Object(by_reason));
            o.insert("in_flight".into(), Value::from(in_flight));
        }
        let v = serde_json::json!({
            "relays": relays,
            "discovery": discovery,
            "routing": routing_v,
        });
        to_py(py, &v)
    }

    /// Waits until every relay followed has a stream open and is past any snapshot (at least
    /// one relay), for up to `timeout` seconds. Returns whether it is.
    #[pyo3(signature = (timeout = 10.0))]
    fn wait_ready(&self, py: Python<'_>, timeout: f64) -> PyResult<bool> {
        let live = self.live()?;
        let timeout = millis("timeout", timeout * 1000.0)?;
        let deadline = Instant::now() + timeout;
        loop {
            let ready = py.detach(|| {
                let r = live.follower().relays();
                !r.is_empty() && r.iter().all(|r| r.connected && !r.syncing && !r.staging)
            });
            if ready {
                return Ok(true);
            }
            if Instant::now() >= deadline {
                return Ok(false);
            }
            py.detach(|| std::thread::sleep(Duration::from_millis(10)));
            py.check_signals()?;
        }
    }

    /// The policy's name.
    #[getter]
    fn policy(&self) -> PyResult<&'static str> {
        Ok(self.live()?.router.policy())
    }

    /// Whether `close` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.live.read().unwrap_or_else(PoisonError::into_inner).is_none()
    }

    /// Stops every stream and waits for them to end; the follower answers nothing after. Closing
    /// twice is a no-op.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let Some(live) = self.live.write().unwrap_or_else(PoisonError::into_inner).take() else {
            return Ok(());
        };
        let rt = runtime()?;
        let follower = live.follower().clone();
        drop(live);
        py.detach(|| rt.block_on(follower.shutdown()));
        Ok(())
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<bool> {
        self.close(py)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        match self.live() {
            Ok(l) => format!("Follower(relays={}, policy={:?})", l.follower().relays().len(), l.router.policy()),
            Err(_) => "Follower(closed)".to_string(),
        }
    }
}

/// A sequence of unsigned 64-bit ints from Python (token ids, block hashes). A list or tuple of
/// plain ints is read item by item through the C API without iterator objects (a 512-hash list
/// in about 2 µs rather than 9); anything else, and any item that is not a plain int in range,
/// goes through PyO3's own conversion, which gives the error message.
struct U64s(Vec<u64>);

impl<'py> FromPyObject<'_, 'py> for U64s {
    type Error = PyErr;

    fn extract(obj: Borrowed<'_, 'py, PyAny>) -> PyResult<Self> {
        if let Some(v) = fast_u64s(&obj) {
            return Ok(U64s(v));
        }
        obj.extract::<Vec<u64>>().map(U64s)
    }
}

/// A list's or tuple's items as u64s when every one is an int in range, else None (and no
/// Python error left set). Unsafe because PyO3 offers no way to read a list's items without an
/// iterator object and an owned reference per item under the stable ABI; the read is 4-5 times
/// cheaper this way, and a 2,048-token prompt is most of a lookup's crossing otherwise.
#[allow(unsafe_code)]
fn fast_u64s(obj: &Borrowed<'_, '_, PyAny>) -> Option<Vec<u64>> {
    use pyo3::ffi;
    let p = obj.as_ptr();
    // SAFETY: `p` is a live object (borrowed for this call, the GIL held); the items are read
    // as borrowed references while the sequence is held, and nothing here runs Python code
    // (PyLong_AsUnsignedLongLong on an int does not call __index__), so the sequence cannot
    // change under the loop.
    unsafe {
        let (len, item): (
            ffi::Py_ssize_t,
            unsafe extern "C" fn(*mut ffi::PyObject, ffi::Py_ssize_t) -> *mut ffi::PyObject,
        ) = if ffi::PyList_Check(p) != 0 {
            (ffi::PyList_Size(p), ffi::PyList_GetItem)
        } else if ffi::PyTuple_Check(p) != 0 {
            (ffi::PyTuple_Size(p), ffi::PyTuple_GetItem)
        } else {
            return None;
        };
        let mut out = Vec::with_capacity(usize::try_from(len).ok()?);
        for i in 0..len {
            let x = item(p, i);
            if x.is_null() || ffi::PyLong_Check(x) == 0 {
                ffi::PyErr_Clear();
                return None;
            }
            // An unsigned long is 64 bits on the LP64 targets the wheel is built for, and
            // CPython reads it digit by digit, where PyLong_AsUnsignedLongLong takes the
            // byte-array path for every int of more than one digit (a hash is three).
            #[allow(clippy::useless_conversion)] // c_ulong is u64 on LP64, u32 elsewhere
            let v: u64 = ffi::PyLong_AsUnsignedLong(x).into();
            if v == u64::MAX && !ffi::PyErr_Occurred().is_null() {
                ffi::PyErr_Clear();
                return None;
            }
            out.push(v);
        }
        Some(out)
    }
}

fn options(matched_only: bool, limit: Option<usize>) -> PyResult<MatchOptions> {
    let limit = match limit {
        None => None,
        Some(k) => Some(
            std::num::NonZeroUsize::new(k)
                .ok_or_else(|| PyValueError::new_err("limit must be at least 1 (leave it out to list every worker)"))?,
        ),
    };
    Ok(MatchOptions { matched_only, limit })
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<PyFollower>()?;
    m.add_class::<PyEngine>()?;
    m.add_class::<PyMatch>()?;
    m.add_class::<PyMatches>()?;
    m.add_class::<PyLoad>()?;
    m.add("Error", py.get_type::<Error>())?;
    m.add("RouteFailed", py.get_type::<RouteFailed>())?;
    m.add("NoWorker", py.get_type::<NoWorker>())?;
    m.add("Shed", py.get_type::<Shed>())?;
    m.add("ReportRejected", py.get_type::<ReportRejected>())?;
    m.add("Closed", py.get_type::<Closed>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
