//! One DP rank's publisher: a PUB socket sending `[topic, seq8, payload]`, a ROUTER replay
//! socket with a bounded buffer, and the wire-level faults.
//!
//! Each rank runs on its own thread, which owns both sockets (a `zmq::Socket` is not `Sync`),
//! the sequence counter and the replay buffer. The rest of the kit talks to it through a
//! bounded command channel ([`RankHandle`]); when that channel is full, senders block (the
//! engine's own publisher queue blocks the scheduler the same way), so nothing is dropped
//! silently. The thread waits on the ROUTER socket and on a doorbell (an inproc PUSH/PULL pair)
//! that every command rings, so replay requests are answered while traffic flows and while a
//! delay holds the wire, and a batch goes out as soon as it is handed over; the wait's timeout
//! only serves a held wire's release.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::wire::ReplayLayout;

/// The replay protocol's end-of-replay seq (`(-1).to_bytes(8, "big", signed=True)`).
pub const END_SEQ: [u8; 8] = [0xff; 8];

/// How many commands may wait for a rank thread before senders block.
const COMMAND_QUEUE: usize = 4096;

/// The longest the rank thread sleeps. Commands ring the doorbell and replay requests wake the
/// ROUTER poll, so only a held wire's deadline needs a timer (see [`Worker::wait_ms`]); the
/// bound keeps a many-rank engine idle without busy wake-ups.
const IDLE_WAIT_MS: u64 = 100;

#[derive(Debug, thiserror::Error)]
pub enum PublisherError {
    #[error("endpoint {0:?}: {1}")]
    Endpoint(String, String),
    #[error("zmq: {0}")]
    Zmq(#[from] zmq::Error),
    #[error("rank {0} publisher thread is gone")]
    Gone(u32),
}

/// The engines' `offset_endpoint_port`: rank 0 unchanged; `inproc` gets `_dp{rank}`; `tcp`
/// gets port + rank (port `*` or `0`, ephemeral, is left alone); anything else is an error
/// for rank ≠ 0.
pub fn offset_endpoint(endpoint: &str, rank: u32) -> Result<String, PublisherError> {
    if rank == 0 {
        return Ok(endpoint.to_string());
    }
    if endpoint.contains("inproc") {
        return Ok(format!("{endpoint}_dp{rank}"));
    }
    if endpoint.contains("tcp") {
        let (head, port) = endpoint
            .rsplit_once(':')
            .ok_or_else(|| PublisherError::Endpoint(endpoint.to_string(), "no port".to_string()))?;
        if port == "*" || port == "0" {
            return Ok(endpoint.to_string());
        }
        let p: u32 =
            port.parse().map_err(|_| PublisherError::Endpoint(endpoint.to_string(), format!("bad port {port:?}")))?;
        return Ok(format!("{head}:{}", p + rank));
    }
    Err(PublisherError::Endpoint(
        endpoint.to_string(),
        format!("cannot offset a non-tcp, non-inproc endpoint for rank {rank}"),
    ))
}

/// zmq spells an ephemeral tcp port `*`; accept `0` too.
fn bindable(endpoint: &str) -> String {
    match endpoint.strip_suffix(":0") {
        Some(head) if endpoint.starts_with("tcp://") => format!("{head}:*"),
        _ => endpoint.to_string(),
    }
}

/// Settings of one rank's publisher.
#[derive(Debug, Clone)]
pub struct RankConfig {
    pub rank: u32,
    /// PUB endpoint of this rank (already offset).
    pub endpoint: String,
    /// ROUTER endpoint of this rank (already offset), if replay is enabled.
    pub replay_endpoint: Option<String>,
    /// Topic frame of every message (the engines' default is empty).
    pub topic: Vec<u8>,
    /// Replay buffer bound, in batches (`buffer_steps`, default 10,000).
    pub buffer_steps: usize,
    pub replay_layout: ReplayLayout,
    /// PUB high-water mark (the engines' `hwm`, default 100,000).
    pub hwm: i32,
}

/// What happened to one batch the rank was asked to publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublishRecord {
    /// How many restarts this rank had before the batch (0 for the first publisher).
    pub generation: u64,
    pub seq: u64,
    pub topic: Vec<u8>,
    pub payload: Vec<u8>,
    /// Sent on the PUB socket.
    pub on_wire: bool,
    /// Put in the replay buffer.
    pub buffered: bool,
}

/// Counters of one rank, updated by its thread.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct RankStats {
    /// Batches given a seq by the current publisher instance (= next seq).
    pub next_seq: u64,
    pub generation: u64,
    pub running: bool,
    pub sent: u64,
    pub dropped_on_wire: u64,
    pub lost: u64,
    pub raw_messages: u64,
    pub buffered: usize,
    pub oldest_buffered_seq: Option<u64>,
    pub replay_requests: u64,
    pub replay_bad_requests: u64,
    pub replayed_batches: u64,
    /// Commands dropped because the rank was stopped.
    pub discarded_while_stopped: u64,
    /// Bound endpoints of the current instance (ephemeral ports resolved).
    pub pub_endpoint: String,
    pub replay_endpoint: Option<String>,
}

pub(crate) type Ack = SyncSender<Result<(), String>>;

pub(crate) enum Cmd {
    /// A batch payload: gets the next seq, goes to the buffer and the wire (unless a fault
    /// says otherwise). `topic: None` uses the configured topic.
    Publish {
        topic: Option<Vec<u8>>,
        payload: Vec<u8>,
    },
    /// Frames sent as they are on the PUB socket: no seq, not buffered.
    Raw(Vec<Vec<u8>>),
    /// The next N batches get a seq and are buffered but are not sent.
    DropWire(u64),
    /// The next N batches get a seq but are neither sent nor buffered.
    Lose(u64),
    /// The next N batches get a seq and are buffered at once, but go on the wire only after the
    /// replay socket has answered a request: a subscriber asking the replay meanwhile gets them
    /// there first.
    WireAfterReplay(u64),
    /// `(whole, n)`: the next `whole` replay requests are answered whole, and the one after them
    /// with at most `n` batches and no end marker, as by an engine that stops answering: the
    /// asker's timeout ends it. Later requests are answered whole.
    StallReplay(u64, u64),
    /// Forget buffered batches, keeping only the newest `keep`.
    TrimBuffer(usize),
    /// Hold publishing for this long: batches wait, then go out in order.
    Delay(Duration),
    SetReplayLayout(ReplayLayout),
    /// Close the sockets and bind new ones; seq back to 0, buffer emptied.
    Restart(Ack),
    /// Close the sockets; commands that publish are discarded until `Start`.
    Stop(Ack),
    /// Bind new sockets (as after a restart).
    Start(Ack),
    /// Answered once every command before it has been carried out.
    Sync(Ack),
    Shutdown,
}

impl Cmd {
    /// Commands that wait behind a delay, in order with the batches.
    fn is_ordered(&self) -> bool {
        matches!(self, Cmd::Publish { .. } | Cmd::Raw(_) | Cmd::Sync(_))
    }
}

/// The handle the engine keeps for one rank.
pub struct RankHandle {
    pub rank: u32,
    tx: SyncSender<Cmd>,
    /// Rung after every command: wakes the thread from its ROUTER poll.
    doorbell: Mutex<zmq::Socket>,
    stats: Arc<Mutex<RankStats>>,
    log: Arc<Mutex<Option<Vec<PublishRecord>>>>,
    thread: Option<JoinHandle<()>>,
}

/// A fresh inproc endpoint for a rank's doorbell.
fn doorbell_endpoint() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!("inproc://mock-engine-doorbell-{}", NEXT.fetch_add(1, Ordering::Relaxed))
}

impl RankHandle {
    /// Bind the rank's sockets and start its thread. `record` keeps every publish record
    /// (for tests; unbounded).
    pub fn start(ctx: &zmq::Context, cfg: RankConfig, record: bool) -> Result<RankHandle, PublisherError> {
        let stats = Arc::new(Mutex::new(RankStats::default()));
        let log = Arc::new(Mutex::new(if record { Some(Vec::new()) } else { None }));
        let bell = doorbell_endpoint();
        let doorbell_in = ctx.socket(zmq::PULL)?;
        doorbell_in.bind(&bell)?;
        let doorbell = ctx.socket(zmq::PUSH)?;
        // Rings never delivered must not hold the context's termination.
        doorbell.set_linger(0)?;
        doorbell_in.set_linger(0)?;
        doorbell.connect(&bell)?;
        let mut worker = Worker {
            doorbell: doorbell_in,
            ctx: ctx.clone(),
            cfg,
            sockets: None,
            seq: 0,
            generation: 0,
            buffer: VecDeque::new(),
            drop_wire: 0,
            wire_after_replay: 0,
            stall_replay: None,
            after_replay: Vec::new(),
            lose: 0,
            hold_until: None,
            more_pending: false,
            pending: VecDeque::new(),
            stats: stats.clone(),
            log: log.clone(),
            counters: RankStats::default(),
            bound_pub: None,
            bound_replay: None,
        };
        worker.open()?;
        worker.publish_stats();
        let rank = worker.cfg.rank;
        let (tx, rx) = mpsc::sync_channel(COMMAND_QUEUE);
        let thread = std::thread::Builder::new()
            .name(format!("mock-engine-rank{rank}"))
            .spawn(move || worker.run(rx))
            .map_err(|e| PublisherError::Endpoint(String::new(), e.to_string()))?;
        Ok(RankHandle { rank, tx, doorbell: Mutex::new(doorbell), stats, log, thread: Some(thread) })
    }

    pub(crate) fn send(&self, cmd: Cmd) -> Result<(), PublisherError> {
        self.tx.send(cmd).map_err(|_| PublisherError::Gone(self.rank))?;
        // A full doorbell already has a ring waiting: the thread wakes either way.
        let _ = self.doorbell.lock().expect("doorbell lock").send(&[][..], zmq::DONTWAIT);
        Ok(())
    }

    /// Send a command that answers, and wait for the answer.
    pub(crate) fn call(&self, make: impl FnOnce(Ack) -> Cmd) -> Result<(), PublisherError> {
        let (ack, done) = mpsc::sync_channel(1);
        self.send(make(ack))?;
        match done.recv() {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(PublisherError::Endpoint(String::new(), e)),
            Err(_) => Err(PublisherError::Gone(self.rank)),
        }
    }

    pub fn stats(&self) -> RankStats {
        self.stats.lock().expect("stats lock").clone()
    }

    /// Every publish record so far (empty unless recording was asked for).
    pub fn records(&self) -> Vec<PublishRecord> {
        self.log.lock().expect("log lock").as_ref().cloned().unwrap_or_default()
    }
}

impl Drop for RankHandle {
    fn drop(&mut self) {
        let _ = self.send(Cmd::Shutdown);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct Buffered {
    seq: u64,
    topic: Vec<u8>,
    payload: Vec<u8>,
}

struct Sockets {
    publisher: zmq::Socket,
    router: Option<zmq::Socket>,
}

struct Worker {
    /// Ends the ROUTER poll when a command arrives (see [`RankHandle::send`]).
    doorbell: zmq::Socket,
    ctx: zmq::Context,
    cfg: RankConfig,
    /// `None` while the rank is stopped.
    sockets: Option<Sockets>,
    seq: u64,
    generation: u64,
    /// Bounded by `cfg.buffer_steps`: the oldest batch is evicted when full.
    buffer: VecDeque<Buffered>,
    drop_wire: u64,
    lose: u64,
    wire_after_replay: u64,
    /// `StallReplay`: how many replay answers are still sent whole, and how many batches the one
    /// after them sends before it stops.
    stall_replay: Option<(u64, u64)>,
    /// Batches buffered under `WireAfterReplay`, sent once a replay request has been answered.
    after_replay: Vec<[Vec<u8>; 3]>,
    hold_until: Option<Instant>,
    /// The last round stopped at its bound with commands possibly left in the channel.
    more_pending: bool,
    /// Ordered commands held back by a delay.
    pending: VecDeque<Cmd>,
    stats: Arc<Mutex<RankStats>>,
    log: Arc<Mutex<Option<Vec<PublishRecord>>>>,
    counters: RankStats,
    /// Endpoints as first bound (ephemeral ports resolved), reused by restarts so
    /// subscribers find the new instance where the old one was.
    bound_pub: Option<String>,
    bound_replay: Option<String>,
}

/// Bind, retrying for a while: a tcp port that was just closed can stay busy briefly.
fn bind_retry(sock: &zmq::Socket, endpoint: &str) -> Result<(), PublisherError> {
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        match sock.bind(endpoint) {
            Ok(()) => return Ok(()),
            Err(zmq::Error::EADDRINUSE) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(PublisherError::Endpoint(endpoint.to_string(), format!("bind: {e}"))),
        }
    }
}

fn last_endpoint(sock: &zmq::Socket) -> Result<String, PublisherError> {
    Ok(match sock.get_last_endpoint()? {
        Ok(s) => s,
        Err(b) => String::from_utf8_lossy(&b).into_owned(),
    })
}

impl Worker {
    fn open(&mut self) -> Result<(), PublisherError> {
        let publisher = self.ctx.socket(zmq::PUB)?;
        publisher.set_linger(0)?;
        publisher.set_sndhwm(self.cfg.hwm)?;
        let pub_ep = self.bound_pub.clone().unwrap_or_else(|| bindable(&self.cfg.endpoint));
        bind_retry(&publisher, &pub_ep)?;
        self.bound_pub = Some(last_endpoint(&publisher)?);
        let router = match &self.cfg.replay_endpoint {
            None => None,
            Some(ep) => {
                let router = self.ctx.socket(zmq::ROUTER)?;
                router.set_linger(0)?;
                // vLLM 0.33: room for a whole buffer's replay (and its end marker) twice.
                let hwm = 2 * (self.cfg.buffer_steps as i64 + 1);
                router.set_sndhwm(hwm.min(i64::from(i32::MAX)) as i32)?;
                let ep = self.bound_replay.clone().unwrap_or_else(|| bindable(ep));
                bind_retry(&router, &ep)?;
                self.bound_replay = Some(last_endpoint(&router)?);
                Some(router)
            }
        };
        self.sockets = Some(Sockets { publisher, router });
        Ok(())
    }

    /// The publisher instance goes away: sockets, seq, buffer and batches held by a delay
    /// (the engine process that queued them is gone). Armed `drop`/`lose` faults stay armed:
    /// they are about the wire, not the instance.
    fn close(&mut self) {
        self.sockets = None;
        self.seq = 0;
        self.buffer.clear();
        self.after_replay.clear();
        for cmd in self.pending.drain(..) {
            // Whoever waits on a held Sync is answered, not left with a dropped channel.
            if let Cmd::Sync(ack) = cmd {
                let _ = ack.send(Ok(()));
            }
        }
        self.hold_until = None;
    }

    fn publish_stats(&mut self) {
        let c = &mut self.counters;
        c.next_seq = self.seq;
        c.generation = self.generation;
        c.running = self.sockets.is_some();
        c.buffered = self.buffer.len();
        c.oldest_buffered_seq = self.buffer.front().map(|b| b.seq);
        c.pub_endpoint = self.bound_pub.clone().unwrap_or_default();
        c.replay_endpoint = self.bound_replay.clone();
        *self.stats.lock().expect("stats lock") = c.clone();
    }

    fn run(mut self, rx: Receiver<Cmd>) {
        loop {
            self.serve_replay();
            self.release_held();
            // With a ROUTER, serve_replay's poll was the wait (the doorbell ends it).
            let first = if self.sockets.as_ref().is_some_and(|s| s.router.is_some()) {
                rx.try_recv().map_err(|e| match e {
                    mpsc::TryRecvError::Empty => RecvTimeoutError::Timeout,
                    mpsc::TryRecvError::Disconnected => RecvTimeoutError::Disconnected,
                })
            } else {
                rx.recv_timeout(Duration::from_millis(self.wait_ms()))
            };
            let mut next = match first {
                Ok(cmd) => Some(cmd),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => return,
            };
            let mut handled = 0;
            while let Some(cmd) = next.take() {
                if matches!(cmd, Cmd::Shutdown) {
                    return;
                }
                self.handle(cmd);
                handled += 1;
                if handled < 256 {
                    next = rx.try_recv().ok();
                }
            }
            // A full round may have left commands whose rings were drained already.
            self.more_pending = handled >= 256;
            if handled > 0 {
                self.publish_stats();
            }
        }
    }

    /// How long the thread may wait for a command or a replay request: until a held wire's
    /// release is due, at most [`IDLE_WAIT_MS`].
    fn wait_ms(&self) -> u64 {
        if self.more_pending {
            return 0;
        }
        match self.hold_until {
            Some(t) => (t.saturating_duration_since(Instant::now()).as_millis() as u64 + 1).min(IDLE_WAIT_MS),
            None => IDLE_WAIT_MS,
        }
    }

    fn held(&self) -> bool {
        self.hold_until.is_some_and(|t| Instant::now() < t)
    }

    fn release_held(&mut self) {
        if self.hold_until.is_some() && !self.held() {
            self.hold_until = None;
            while let Some(cmd) = self.pending.pop_front() {
                self.handle(cmd);
            }
            self.publish_stats();
        }
    }

    fn handle(&mut self, cmd: Cmd) {
        if cmd.is_ordered() && self.held() {
            self.pending.push_back(cmd);
            return;
        }
        match cmd {
            Cmd::Publish { topic, payload } => self.publish(topic, payload),
            Cmd::Raw(frames) => {
                if let Some(s) = &self.sockets {
                    let _ = s.publisher.send_multipart(frames, 0);
                    self.counters.raw_messages += 1;
                } else {
                    self.counters.discarded_while_stopped += 1;
                }
            }
            Cmd::DropWire(n) => self.drop_wire += n,
            Cmd::Lose(n) => self.lose += n,
            Cmd::WireAfterReplay(n) => self.wire_after_replay += n,
            Cmd::StallReplay(whole, n) => self.stall_replay = Some((whole, n)),
            Cmd::TrimBuffer(keep) => {
                while self.buffer.len() > keep {
                    self.buffer.pop_front();
                }
            }
            Cmd::Delay(d) => {
                let until = Instant::now() + d;
                self.hold_until = Some(self.hold_until.map_or(until, |t| t.max(until)));
            }
            Cmd::SetReplayLayout(l) => self.cfg.replay_layout = l,
            Cmd::Restart(ack) => {
                self.close();
                self.generation += 1;
                let r = self.open().map_err(|e| e.to_string());
                self.publish_stats();
                let _ = ack.send(r);
            }
            Cmd::Stop(ack) => {
                self.close();
                self.publish_stats();
                let _ = ack.send(Ok(()));
            }
            Cmd::Start(ack) => {
                let r = if self.sockets.is_some() {
                    Ok(())
                } else {
                    self.close();
                    self.generation += 1;
                    self.open().map_err(|e| e.to_string())
                };
                self.publish_stats();
                let _ = ack.send(r);
            }
            Cmd::Sync(ack) => {
                self.publish_stats();
                let _ = ack.send(Ok(()));
            }
            Cmd::Shutdown => {}
        }
    }

    fn publish(&mut self, topic: Option<Vec<u8>>, payload: Vec<u8>) {
        let Some(sockets) = &self.sockets else {
            self.counters.discarded_while_stopped += 1;
            return;
        };
        let topic = topic.unwrap_or_else(|| self.cfg.topic.clone());
        let seq = self.seq;
        self.seq += 1;
        let (on_wire, buffered);
        if self.lose > 0 {
            self.lose -= 1;
            self.counters.lost += 1;
            on_wire = false;
            buffered = false;
        } else {
            buffered = true;
            if self.drop_wire > 0 {
                self.drop_wire -= 1;
                self.counters.dropped_on_wire += 1;
                on_wire = false;
            } else if self.wire_after_replay > 0 {
                self.wire_after_replay -= 1;
                self.after_replay.push([topic.clone(), seq.to_be_bytes().to_vec(), payload.clone()]);
                on_wire = true;
            } else {
                let frames: [&[u8]; 3] = [&topic, &seq.to_be_bytes(), &payload];
                // PUB never blocks: past the high-water mark zmq drops, as the engines' do.
                let _ = sockets.publisher.send_multipart(frames, 0);
                self.counters.sent += 1;
                on_wire = true;
            }
        }
        if let Some(log) = self.log.lock().expect("log lock").as_mut() {
            log.push(PublishRecord {
                generation: self.generation,
                seq,
                topic: topic.clone(),
                payload: payload.clone(),
                on_wire,
                buffered,
            });
        }
        if buffered && self.cfg.buffer_steps > 0 {
            if self.buffer.len() >= self.cfg.buffer_steps {
                self.buffer.pop_front();
            }
            self.buffer.push_back(Buffered { seq, topic, payload });
        }
    }

    fn serve_replay(&mut self) {
        let Some(router) = self.sockets.as_ref().and_then(|s| s.router.as_ref()) else {
            return;
        };
        let mut items = [router.as_poll_item(zmq::POLLIN), self.doorbell.as_poll_item(zmq::POLLIN)];
        if zmq::poll(&mut items, self.wait_ms() as i64).is_err() {
            return;
        }
        let (request, rung) = (items[0].is_readable(), items[1].is_readable());
        if rung {
            while self.doorbell.recv_bytes(zmq::DONTWAIT).is_ok() {}
        }
        if !request {
            return;
        }
        let mut answered = false;
        while let Ok(frames) = router.recv_multipart(zmq::DONTWAIT) {
            self.counters.replay_requests += 1;
            // The engines accept exactly [identity, "", start_seq] and ignore anything else.
            if frames.len() != 3 || !frames[1].is_empty() {
                self.counters.replay_bad_requests += 1;
                continue;
            }
            let mut seq8 = [0u8; 8];
            let raw = &frames[2];
            if raw.len() > 8 {
                self.counters.replay_bad_requests += 1;
                continue;
            }
            seq8[8 - raw.len()..].copy_from_slice(raw);
            let start = u64::from_be_bytes(seq8);
            let id = &frames[0];
            let layout = self.cfg.replay_layout;
            let stall = match self.stall_replay {
                Some((0, n)) => {
                    self.stall_replay = None;
                    Some(n)
                }
                Some((whole, n)) => {
                    self.stall_replay = Some((whole - 1, n));
                    None
                }
                None => None,
            };
            let limit = stall.map_or(usize::MAX, |n| n as usize);
            for b in self.buffer.iter().filter(|b| b.seq >= start).take(limit) {
                let seq = b.seq.to_be_bytes();
                let r = match layout {
                    ReplayLayout::Old => router.send_multipart([id.as_slice(), b"", &seq, &b.payload], 0),
                    ReplayLayout::New => router.send_multipart([id.as_slice(), b"", &b.topic, &seq, &b.payload], 0),
                };
                if r.is_ok() {
                    self.counters.replayed_batches += 1;
                }
            }
            if stall.is_some() {
                continue;
            }
            let _ = match layout {
                ReplayLayout::Old => router.send_multipart([id.as_slice(), b"", &END_SEQ, b""], 0),
                ReplayLayout::New => router.send_multipart([id.as_slice(), b"", b"", &END_SEQ, b""], 0),
            };
            answered = true;
        }
        if answered {
            if let Some(s) = &self.sockets {
                for frames in self.after_replay.drain(..) {
                    let _ = s.publisher.send_multipart(frames, 0);
                    self.counters.sent += 1;
                }
            }
            self.publish_stats();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offset_endpoint_follows_the_engines_rule() {
        assert_eq!(offset_endpoint("tcp://127.0.0.1:5557", 0).unwrap(), "tcp://127.0.0.1:5557");
        assert_eq!(offset_endpoint("tcp://127.0.0.1:5557", 2).unwrap(), "tcp://127.0.0.1:5559");
        assert_eq!(offset_endpoint("tcp://*:0", 1).unwrap(), "tcp://*:0");
        assert_eq!(offset_endpoint("inproc://kv", 1).unwrap(), "inproc://kv_dp1");
        assert!(offset_endpoint("ipc:///tmp/kv", 1).is_err());
        assert_eq!(offset_endpoint("ipc:///tmp/kv", 0).unwrap(), "ipc:///tmp/kv");
    }

    #[test]
    fn port_zero_binds_ephemeral() {
        assert_eq!(bindable("tcp://127.0.0.1:0"), "tcp://127.0.0.1:*");
        assert_eq!(bindable("inproc://x:0"), "inproc://x:0");
    }
}
