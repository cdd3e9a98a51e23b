//! The helpers every test and benchmark shares: waiting for a condition, reading `/proc`,
//! percentiles, hex. One copy each, here.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Asks `f` every `every` until it is true, for up to `limit`: the time it took, `None` if it
/// never was.
pub fn poll_until(limit: Duration, every: Duration, mut f: impl FnMut() -> bool) -> Option<Duration> {
    let start = Instant::now();
    loop {
        if f() {
            return Some(start.elapsed());
        }
        if start.elapsed() > limit {
            return None;
        }
        std::thread::sleep(every);
    }
}

/// A number from `/proc/PID/status` (`VmRSS`, `VmHWM`, `Threads`, ...): KiB for the sizes.
pub fn proc_status(pid: u32, field: &str) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = s.lines().find(|l| l.strip_prefix(field).is_some_and(|r| r.starts_with(':')))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// utime + stime of a `/proc/.../stat` file, in clock ticks (100 a second), with the command.
pub fn stat_ticks(path: &str) -> Option<(String, u64)> {
    let s = std::fs::read_to_string(path).ok()?;
    let (head, after) = s.rsplit_once(')')?;
    let comm = head.split_once('(')?.1.to_string();
    let f: Vec<&str> = after.split_whitespace().collect();
    Some((comm, f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?))
}

/// A process's CPU so far, in clock ticks (0 if it is gone).
pub fn cpu_ticks(pid: u32) -> u64 {
    stat_ticks(&format!("/proc/{pid}/stat")).map_or(0, |x| x.1)
}

/// A process's CPU so far per thread name (threads of one name summed), in clock ticks.
pub fn thread_ticks(pid: u32) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    if let Ok(rd) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for e in rd.flatten() {
            if let Some((comm, t)) = stat_ticks(&format!("{}/stat", e.path().display())) {
                *out.entry(comm).or_insert(0) += t;
            }
        }
    }
    out
}

/// The `p` quantile (0..=1) of sorted samples, by nearest rank: the smallest sample with at
/// least `p` of them at or below it. `None` for no samples.
pub fn percentile<T: Copy>(sorted: &[T], p: f64) -> Option<T> {
    let n = sorted.len();
    (n > 0).then(|| sorted[((n as f64 * p).ceil() as usize).clamp(1, n) - 1])
}

/// Lowercase hex of `b`.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_by_nearest_rank() {
        let v: Vec<u32> = (1..=100).collect();
        assert_eq!([0.0, 0.5, 0.99, 0.999, 1.0].map(|p| percentile(&v, p)), [1, 50, 99, 100, 100].map(Some));
        assert_eq!(percentile(&[7u8], 0.99), Some(7));
        assert_eq!(percentile::<u8>(&[], 0.5), None);
    }

    #[test]
    fn hex_and_proc_readers_read_what_they_say() {
        assert_eq!(hex(&[0x00, 0xab, 0x10]), "00ab10");
        let me = std::process::id();
        assert!(proc_status(me, "VmRSS").is_some_and(|kib| kib > 0));
        assert_eq!(proc_status(me, "NoSuchField"), None);
        assert!(thread_ticks(me).keys().count() >= 1);
        let calls = std::cell::Cell::new(0);
        let took = poll_until(Duration::from_secs(5), Duration::from_millis(1), || {
            calls.set(calls.get() + 1);
            calls.get() == 3
        });
        assert!(took.is_some());
        assert_eq!(calls.get(), 3);
        assert_eq!(poll_until(Duration::ZERO, Duration::from_millis(1), || false), None);
    }
}
