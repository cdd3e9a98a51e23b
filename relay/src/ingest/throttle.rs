//! A warning that a peer can cause once per message, logged at most once an interval.

use std::time::{Duration, Instant};

/// How often a warning that a peer can cause once per message is logged at most (its counters
/// count every one).
const WARN_EVERY: Duration = Duration::from_secs(10);

/// A warning logged the first time, then at most once every [`WARN_EVERY`], saying how many
/// were held back since the last one logged.
#[derive(Debug, Default)]
pub(super) struct Throttle {
    /// When the next one may be logged.
    next: Option<Instant>,
    held: u64,
}

impl Throttle {
    /// `Some(held back since the last one logged)` when this one is to be logged at `now`.
    pub fn pass(&mut self, now: Instant) -> Option<u64> {
        match self.next {
            Some(next) if now < next => {
                self.held += 1;
                None
            }
            _ => {
                self.next = Some(now + WARN_EVERY);
                Some(std::mem::take(&mut self.held))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_throttled_warning_passes_first_then_once_per_interval_with_the_count_held_back() {
        let mut t = Throttle::default();
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        assert_eq!(t.pass(at(0)), Some(0));
        assert_eq!(t.pass(at(1)), None);
        assert_eq!(t.pass(at(9_999)), None);
        // The interval is measured from the last one logged.
        assert_eq!(t.pass(at(10_000)), Some(2));
        assert_eq!(t.pass(at(10_001)), None);
        assert_eq!(t.pass(at(19_999)), None);
        assert_eq!(t.pass(at(20_000)), Some(2));
        // After a quiet spell the next passes at once, with nothing held back.
        assert_eq!(t.pass(at(60_000)), Some(0));
        assert_eq!(t.pass(at(60_000)), None);
    }
}
