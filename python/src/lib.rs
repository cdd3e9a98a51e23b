//! `kv_router_client._native`: the Python face of [`kv_router_client::Follower`] and
//! [`kv_router::Router`]. The Python package (`python/kv_router_client`) re-exports it; its
//! stubs (`_native.pyi`) are the API's reference.
//!
//! One tokio runtime lives in the extension, made at the first `Follower`: the relays'
//! streams run on its threads (`KV_ROUTER_CLIENT_THREADS`, 2 by default), never on Python's.
//! Every call releases the GIL while it works in Rust. Lookups read the index and the workers'
//! views without waiting for the streams; only the answer's Python objects are built with the
//! GIL held.

mod convert;
mod engine;
mod follower;
mod matches;

pub(crate) use convert::U64s;
pub(crate) use engine::{hashes, lora_of, PyEngine};
pub(crate) use follower::PyFollower;
pub(crate) use matches::{options, PyLoad, PyMatch, PyMatches};

use std::sync::OnceLock;
use std::time::Duration;

use kv_router_client::ClientError;
use pyo3::exceptions::{PyException, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use pyo3::IntoPyObjectExt as _;
use serde_json::Value;

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
