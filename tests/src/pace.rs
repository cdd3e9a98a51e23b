//! A fixed rate from a start: event k is due k / rate seconds after it. A loop that fell behind
//! catches up as fast as it can, and never runs ahead of the rate.

use std::time::{Duration, Instant};

/// Event k of a paced loop is due `k / rate` seconds after [`Pace::new`].
#[derive(Debug, Clone, Copy)]
pub struct Pace {
    start: Instant,
    rate: f64,
}

impl Pace {
    /// Starts now, at `rate` events a second (positive).
    pub fn new(rate: f64) -> Pace {
        Pace { start: Instant::now(), rate }
    }

    /// When event `k` is due.
    pub fn due(&self, k: u64) -> Instant {
        self.start + Duration::from_secs_f64(k as f64 / self.rate)
    }

    /// Sleeps until event `k` is due (not at all when it is).
    pub fn wait(&self, k: u64) {
        if let Some(wait) = self.due(k).checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_k_is_due_k_over_rate_seconds_after_the_start() {
        let p = Pace::new(4.0);
        assert_eq!(p.due(0), p.start);
        assert_eq!(p.due(2) - p.start, Duration::from_millis(500));
        assert_eq!(p.due(10) - p.start, Duration::from_millis(2500));
        // Event 0 is already due: no wait. Event 1 of 20 a second is due 50 ms after the start.
        let p = Pace::new(20.0);
        p.wait(0);
        p.wait(1);
        assert!(Instant::now() >= p.due(1));
    }
}
