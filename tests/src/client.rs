//! Subscriber-side helpers for tests and drills: a SUB that collects messages, a DEALER that
//! asks for a replay, and a free-port finder for loopback tests.

use std::net::TcpListener;
use std::time::{Duration, Instant};

use crate::engine::{MockEngine, PROBE};
use crate::publisher::END_SEQ;

/// One message as a SUB received it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Received {
    pub frames: Vec<Vec<u8>>,
}

impl Received {
    /// `seq` of a well-formed 3-frame message.
    pub fn seq(&self) -> Option<u64> {
        if self.frames.len() != 3 || self.frames[1].len() != 8 {
            return None;
        }
        Some(u64::from_be_bytes(self.frames[1].as_slice().try_into().ok()?))
    }

    pub fn payload(&self) -> Option<&[u8]> {
        self.frames.get(2).map(Vec::as_slice)
    }
}

/// A SUB socket subscribed to everything.
pub struct Sub {
    sock: zmq::Socket,
}

impl Sub {
    pub fn connect(ctx: &zmq::Context, endpoint: &str) -> zmq::Result<Sub> {
        let sock = ctx.socket(zmq::SUB)?;
        sock.set_linger(0)?;
        sock.set_rcvhwm(0)?;
        sock.set_subscribe(b"")?;
        sock.connect(endpoint)?;
        Ok(Sub { sock })
    }

    /// The next message other than a probe, waiting at most `timeout`.
    pub fn recv(&self, timeout: Duration) -> Option<Received> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let m = self.recv_raw(left)?;
            if m.frames != [PROBE.to_vec()] {
                return Some(m);
            }
        }
    }

    /// The next message (probes included), waiting at most `timeout`.
    pub fn recv_raw(&self, timeout: Duration) -> Option<Received> {
        match self.sock.poll(zmq::POLLIN, timeout.as_millis() as i64) {
            Ok(n) if n > 0 => self.sock.recv_multipart(0).ok().map(|frames| Received { frames }),
            _ => None,
        }
    }

    /// Collect messages until `n` arrived or `timeout` passed.
    pub fn collect(&self, n: usize, timeout: Duration) -> Vec<Received> {
        let deadline = Instant::now() + timeout;
        let mut out = Vec::new();
        while out.len() < n {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            if let Some(m) = self.recv(left) {
                out.push(m);
            }
        }
        out
    }

    /// Drain whatever arrives within `quiet` of the last message.
    pub fn drain(&self, quiet: Duration) -> Vec<Received> {
        let mut out = Vec::new();
        while let Some(m) = self.recv(quiet) {
            out.push(m);
        }
        out
    }
}

/// One replayed batch as a DEALER sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replayed {
    /// `Some` in the new layout (`["", topic, seq, payload]`).
    pub topic: Option<Vec<u8>>,
    pub seq: u64,
    pub payload: Vec<u8>,
}

/// A replay answer: the batches, and the end marker's frames (after the empty delimiter).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayAnswer {
    pub batches: Vec<Replayed>,
    pub end_marker: Vec<Vec<u8>>,
}

/// Ask a replay ROUTER for every batch `>= start` with a DEALER (`["", seq8]`), reading until
/// the end marker. Accepts both reply layouts.
pub fn replay(ctx: &zmq::Context, endpoint: &str, start: u64, timeout: Duration) -> Result<ReplayAnswer, String> {
    let sock = ctx.socket(zmq::DEALER).map_err(|e| e.to_string())?;
    sock.set_linger(0).map_err(|e| e.to_string())?;
    sock.set_rcvhwm(0).map_err(|e| e.to_string())?;
    sock.connect(endpoint).map_err(|e| e.to_string())?;
    sock.send_multipart([&b""[..], &start.to_be_bytes()], 0).map_err(|e| e.to_string())?;
    let deadline = Instant::now() + timeout;
    let mut batches = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!("no end marker within {timeout:?} ({} batches so far)", batches.len()));
        }
        match sock.poll(zmq::POLLIN, left.as_millis().max(1) as i64) {
            Ok(n) if n > 0 => {}
            _ => continue,
        }
        let frames = sock.recv_multipart(0).map_err(|e| e.to_string())?;
        if frames.first().map(Vec::len) != Some(0) {
            return Err(format!("reply without empty delimiter: {frames:?}"));
        }
        let rest = &frames[1..];
        let (topic, seq, payload) = match rest.len() {
            2 => (None, &rest[0], &rest[1]),
            3 => (Some(rest[0].clone()), &rest[1], &rest[2]),
            n => return Err(format!("reply with {n} frames after the delimiter")),
        };
        if payload.is_empty() || seq.as_slice() == END_SEQ {
            return Ok(ReplayAnswer { batches, end_marker: rest.to_vec() });
        }
        let seq =
            u64::from_be_bytes(seq.as_slice().try_into().map_err(|_| format!("seq frame of {} bytes", seq.len()))?);
        batches.push(Replayed { topic, seq, payload: payload.clone() });
    }
}

/// `n` consecutive free tcp ports on 127.0.0.1 (checked by binding them; another process
/// could still take one before it is used).
pub fn free_ports(n: u16) -> u16 {
    for _ in 0..200 {
        let Ok(l) = TcpListener::bind("127.0.0.1:0") else {
            continue;
        };
        let Ok(addr) = l.local_addr() else { continue };
        let base = addr.port();
        drop(l);
        if base.checked_add(n).is_none() {
            continue;
        }
        let all: Vec<_> = (0..n).map(|i| TcpListener::bind(("127.0.0.1", base + i))).collect();
        if all.iter().all(Result::is_ok) {
            return base;
        }
    }
    panic!("no {n} consecutive free ports on 127.0.0.1");
}

/// Poll `f` until it returns `Some` or `timeout` passes.
pub fn wait_for<T>(timeout: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Wait until `sub` receives `rank`'s probes (its subscription reached the publisher), then
/// drain them. Panics after 5 s.
pub fn sync_sub(engine: &MockEngine, rank: u32, sub: &Sub) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        engine.probe(rank).expect("probe");
        if let Some(m) = sub.recv_raw(Duration::from_millis(20)) {
            if m.frames == [PROBE.to_vec()] {
                break;
            }
        }
        assert!(Instant::now() < deadline, "subscriber never saw rank {rank}");
    }
    // Later probes still in flight are skipped by `Sub::recv`.
}

/// Starts `cfg` on free loopback ports: PUB at `base + rank`, replay (when `replay`) at the next
/// block of `dp_size` ports. Ports found free can be taken before the engine binds them, so a
/// failed start is retried on other ports.
pub fn start_engine_on_free_ports(mut cfg: crate::engine::EngineConfig, replay: bool) -> crate::engine::MockEngine {
    let n = cfg.dp_size.max(1) as u16;
    let mut last_err = None;
    for _ in 0..20 {
        let base = free_ports(2 * n);
        cfg.endpoint = format!("tcp://127.0.0.1:{base}");
        cfg.replay_endpoint = replay.then(|| format!("tcp://127.0.0.1:{}", base + n));
        match crate::engine::MockEngine::start(cfg.clone()) {
            Ok(e) => return e,
            Err(e) => last_err = Some(e),
        }
    }
    panic!("cannot start a mock engine on free loopback ports: {last_err:?}");
}
