//! A lookup's answer: `Load`, `Match`, and the `Matches` sequence.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use kv_router_client::{Load, MatchOptions, MatchRef, WorkerState};
use pyo3::exceptions::{PyIndexError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PySlice, PyTuple};
use pyo3::IntoPyObjectExt as _;

use crate::*;

/// An engine's load as its relay last reported it.
#[pyclass(frozen, get_all, name = "Load", module = "kv_router_client")]
#[derive(Clone, Copy)]
pub(crate) struct PyLoad {
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
pub(crate) struct PyMatch {
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
pub(crate) struct PyMatches(pub(crate) Vec<PyMatch>);

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
pub(crate) struct MatchesIter {
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

pub(crate) fn options(matched_only: bool, limit: Option<usize>) -> PyResult<MatchOptions> {
    let limit = match limit {
        None => None,
        Some(k) => Some(
            std::num::NonZeroUsize::new(k)
                .ok_or_else(|| PyValueError::new_err("limit must be at least 1 (leave it out to list every worker)"))?,
        ),
    };
    Ok(MatchOptions { matched_only, limit })
}
