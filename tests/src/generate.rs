//! The traffic loop: requests from a [`RequestSource`] served by the ranks' prefix caches,
//! at a given rate or as fast as possible, with occasional clears and moving load gauges.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::engine::{EngineError, MockEngine};
use crate::metrics::Load;
use crate::traffic::{RequestSource, Rng};

/// How to generate.
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    /// Requests per second over all ranks; `None`: as fast as possible.
    pub rate: Option<f64>,
    /// Stop after this many requests (`None`: until the source ends or `stop`).
    pub max_requests: Option<u64>,
    /// Per request, the chance that its rank's cache is reset first (`AllBlocksCleared`).
    pub clear_probability: f64,
    /// Seeds rank choice, clears and load values.
    pub seed: u64,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions { rate: None, max_requests: None, clear_probability: 0.0, seed: 0 }
    }
}

/// Serve requests until the source ends, `max_requests` is reached or `stop` is set.
/// Waits while the engine is paused; skips stopped ranks. Returns the requests served.
pub fn generate(
    engine: &MockEngine,
    source: &mut dyn RequestSource,
    opts: &GenerateOptions,
    stop: &AtomicBool,
) -> Result<u64, EngineError> {
    let mut rng = Rng::new(opts.seed ^ 0x005e_ed0f_7ea1);
    let pace = opts.rate.filter(|r| *r > 0.0).map(crate::pace::Pace::new);
    let mut served = 0u64;
    let dp = engine.dp_size();
    loop {
        if stop.load(Ordering::SeqCst) || opts.max_requests.is_some_and(|m| served >= m) {
            return Ok(served);
        }
        if !engine.wait_unpaused(Duration::from_millis(100)) {
            continue;
        }
        if let Some(pace) = &pace {
            let due = pace.due(served);
            let now = Instant::now();
            if due > now {
                // Sleep in slices so `stop` and `pause` are noticed.
                std::thread::sleep((due - now).min(Duration::from_millis(100)));
                continue;
            }
        }
        let running: Vec<u32> = (0..dp).filter(|&r| engine.is_running(r).unwrap_or(false)).collect();
        if running.is_empty() {
            std::thread::sleep(Duration::from_millis(20));
            continue;
        }
        let Some(blocks) = source.next_request() else {
            return Ok(served);
        };
        let rank = running[rng.below(running.len() as u64) as usize];
        let clear = rng.chance(opts.clear_probability);
        match engine.serve_request(rank, &blocks, clear) {
            Ok(()) | Err(EngineError::Stopped(_)) => {}
            Err(e) => return Err(e),
        }
        let kv_usage = engine.load(rank)?.kv_usage;
        engine.set_load(rank, Load { running: rng.below(8) as u32, waiting: rng.below(4) as u32, kv_usage })?;
        served += 1;
    }
}
