//! Jittered exponential backoff between reconnects.

use std::time::Duration;

use rand::Rng;

/// Backoff settings: the delay starts at `initial`, is multiplied by `multiplier` after each
/// failed attempt up to `max`, and each wait is drawn uniformly from `[d * (1 - jitter), d]`
/// so that many routers restarted together do not reconnect in lockstep.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BackoffConfig {
    /// The first delay.
    pub initial: Duration,
    /// The largest delay.
    pub max: Duration,
    /// Growth per attempt (at least 1).
    pub multiplier: f64,
    /// The fraction of each delay drawn at random (0..=1).
    pub jitter: f64,
}

impl Default for BackoffConfig {
    fn default() -> Self {
        BackoffConfig {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(10),
            multiplier: 2.0,
            jitter: 0.5,
        }
    }
}

/// The backoff state of one relay's follower.
#[derive(Clone, Debug)]
pub struct Backoff {
    cfg: BackoffConfig,
    next: Duration,
}

impl Backoff {
    /// A fresh backoff.
    pub fn new(cfg: BackoffConfig) -> Self {
        Backoff { cfg, next: cfg.initial }
    }

    /// The delay before the next attempt; grows the one after.
    pub fn next_delay(&mut self) -> Duration {
        let d = self.next.min(self.cfg.max);
        self.next = d.mul_f64(self.cfg.multiplier.max(1.0)).min(self.cfg.max).max(self.cfg.initial);
        let jitter = self.cfg.jitter.clamp(0.0, 1.0);
        let low = d.mul_f64(1.0 - jitter);
        if d > low {
            rand::rng().random_range(low..=d)
        } else {
            d
        }
    }

    /// The longest delay (for errors that retrying soon will not fix).
    pub fn max_delay(&self) -> Duration {
        self.cfg.max
    }

    /// Back to the first delay (after a stream that worked).
    pub fn reset(&mut self) {
        self.next = self.cfg.initial;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_to_the_cap_within_jitter_and_resets() {
        let cfg = BackoffConfig {
            initial: Duration::from_millis(100),
            max: Duration::from_millis(700),
            multiplier: 2.0,
            jitter: 0.5,
        };
        let mut b = Backoff::new(cfg);
        for nominal in [100u64, 200, 400, 700, 700] {
            let d = b.next_delay();
            let n = Duration::from_millis(nominal);
            assert!(d <= n && d >= n / 2, "nominal {n:?}, got {d:?}");
        }
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(100));
    }
}
