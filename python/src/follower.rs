//! `Follower`: the relays followed, their prefix index, and the router over them.

use std::sync::{Arc, PoisonError, RwLock};
use std::time::{Duration, Instant};

use kv_relay_proto::hash::RequestKeys;
use kv_router::{Outcome, PolicyKind, Reason, RouteError, Router, RouterConfig, Tokens};
use kv_router_client::discovery::{Discovery, DnsName, SystemResolver};
use kv_router_client::{FollowConfig, Follower as RustFollower};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyList;
use serde_json::Value;
use tokio::sync::oneshot;

use crate::*;

/// What a follower runs: the router over it, and discovery when DNS names were given.
pub(crate) struct Live {
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
pub(crate) struct PyFollower {
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

pub(crate) fn route_error(e: RouteError) -> PyErr {
    match e {
        RouteError::NoWorker { .. } => NoWorker::new_err(e.to_string()),
        RouteError::Shed => Shed::new_err(e.to_string()),
        RouteError::Hash(m) => PyValueError::new_err(format!("block hashes: {m}")),
    }
}

pub(crate) fn outcome_of(s: &str) -> PyResult<Outcome> {
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
