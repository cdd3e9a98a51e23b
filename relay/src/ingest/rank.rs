//! One DP rank's ingest: a SUB socket on the rank's PUB endpoint and a DEALER to its replay
//! ROUTER, run on a thread of its own (ZeroMQ sockets are blocking).
//!
//! The rules (also in `docs/architecture.md`, "Ingest"):
//! * **Order.** Batches are handed on in engine `seq` order with no hole: the next batch of a
//!   rank is always `last + 1`.
//! * **Gap.** A live batch past `last + 1` asks the replay socket for `last + 1 ..`; the refilled
//!   batches go first, then the live one. What the replay buffer no longer holds is lost for
//!   good: counted, and the rank is marked *degraded* (removals may be missing, so stale blocks may
//!   be held) until its state is known again: an `AllBlocksCleared` or a publisher restart.
//! * **Publisher restart.** `seq` not greater than the last one (every release restarts at 0 and
//!   empties its buffer) resets the rank: a `RankReset` control first, then the new publisher's
//!   batches, refilled from seq 0 when the first one seen is later.
//! * **Priming.** Before taking live batches, the rank is read from its replay socket: from seq 0
//!   for a rank the relay has never seen; from the last seq the store holds otherwise, checking
//!   by the batch's timestamp that it is still the same publisher (else it is a restart). A
//!   buffer that no longer starts at seq 0 marks a new rank *incomplete*: it may miss blocks
//!   announced before, but holds no stale ones.
//! * **Lost tail.** A batch lost just before the engine goes quiet has no successor to reveal the
//!   gap, so while the rank is quiet the replay socket is asked for anything after `last`, at most
//!   once per `tail_probe` interval. What the replay holds past `last` may also be on its way on
//!   the SUB socket (this thread was not reading it while it asked): the live socket gets the
//!   first claim for [`LIVE_FIRST`], and only what it does not deliver is a lost tail, refilled
//!   and counted as a gap.
//! * **Message bound.** Both sockets take messages up to `max_message_bytes`. libzmq drops the
//!   connection of a peer that sends a larger one and does not connect it again, so each socket
//!   is watched (`Watched`): a dropped SUB is read out and replaced, and a replay whose
//!   connection drops keeps what came before the refused batch and asks again past it. The
//!   refused batch alone is lost.
//! * **Backpressure.** Items go to the rank's [`Sink`], which commits them on this thread: what
//!   was decoded since the SUB socket last had nothing ready goes as one group. While a commit
//!   waits, this thread reads nothing, the SUB socket's queue fills, and the engine's PUB drops
//!   at its high-water mark: those batches come back through the gap rule. Nothing is dropped
//!   silently here.

use super::metrics as m;
use super::{Closed, Sink};
use crate::drops::Tally;
use crate::hashcheck::{CheckCounts, HashCheckConfig, RankCheck};
use crate::model::{Batch, Control, ControlKind};
use crate::normalize::Normalizer;
use crate::wire::{self, ReplayReply};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What the ingest hands to its sink.
#[derive(Debug, Clone, PartialEq)]
pub enum IngestItem {
    /// A normalized batch.
    Batch {
        batch: Batch,
        /// Events dropped by the decoder and normalizer in this batch, by reason.
        drops: Tally,
        /// Came from the replay socket (priming, gap refill, lost tail) rather than live.
        refilled: bool,
    },
    /// A change of the rank's state.
    Control(Control),
}

/// Where a rank stood when the relay last committed it (from the store).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Resume {
    pub last_seq: u64,
    /// The engine's timestamp of that batch: tells the same publisher from a restarted one.
    pub last_ts: f64,
}

/// One rank's settings.
#[derive(Debug, Clone)]
pub struct RankConfig {
    pub dp_rank: u32,
    pub pub_endpoint: String,
    pub replay_endpoint: Option<String>,
    pub topic: String,
    /// How long one replay may go without a reply before it is abandoned.
    pub replay_timeout: Duration,
    /// How long a rank must be quiet before its replay socket is probed for a lost tail, and the
    /// least time between two probes.
    pub tail_probe: Duration,
    /// The SUB socket's receive high-water mark (messages).
    pub rcvhwm: i32,
    /// The largest message the SUB and DEALER sockets take (see [`super::IngestConfig`]).
    pub max_message_bytes: u64,
    /// The engine's hash settings when its block hashes are checked.
    pub hash_check: Option<Arc<HashCheckConfig>>,
}

/// The rank's health as the relay knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Health {
    #[default]
    Ok,
    Degraded,
    Incomplete,
}

impl Health {
    pub fn as_str(self) -> &'static str {
        match self {
            Health::Ok => "ok",
            Health::Degraded => "degraded",
            Health::Incomplete => "incomplete",
        }
    }
}

/// What the rank thread shares with status readers.
#[derive(Debug, Clone, Default)]
pub struct RankStatus {
    pub health: Health,
    pub reason: Option<String>,
    /// Last engine seq handed on.
    pub last_seq: Option<u64>,
    /// Engine timestamp of that batch.
    pub last_ts: Option<f64>,
    /// When the last batch arrived (live or refilled).
    pub last_batch_at: Option<Instant>,
    pub batches: u64,
    pub gaps: u64,
    pub refilled: u64,
    pub lost: u64,
    pub restarts: u64,
    pub message_errors: u64,
    /// Events dropped, by reason (`crate::drops`), since the relay started.
    pub dropped: Tally,
    pub tail_probes: u64,
    /// Times the replay connection dropped while sending a batch (see `Rank::replay`).
    pub replay_cuts: u64,
    /// Times the SUB's connection to the engine dropped (see `Rank::on_drop`).
    pub disconnects: u64,
    /// What the hash check found so far; `None` when the check is off.
    pub hash_check: Option<CheckCounts>,
    /// The rank's thread has stopped (shutdown, or the channel closed).
    pub stopped: bool,
}

/// Shared, cheap-to-clone view of one rank's status.
pub type SharedRankStatus = Arc<Mutex<RankStatus>>;

#[derive(Debug)]
enum ReplayError {
    NoEndpoint,
    /// Nothing came for this long.
    Timeout(Duration),
    /// The connection dropped while sending a batch this many times in one replay.
    Cut(u32),
    Zmq(zmq::Error),
}

impl std::fmt::Display for ReplayError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReplayError::NoEndpoint => f.write_str("no replay endpoint configured"),
            ReplayError::Timeout(t) => {
                write!(f, "the replay socket did not answer within replay_timeout_ms, {}", t.as_millis())
            }
            ReplayError::Cut(n) => write!(f, "the replay connection dropped while sending a batch, {n} times"),
            ReplayError::Zmq(e) => write!(f, "replay socket: {e}"),
        }
    }
}

/// Batches read from the replay socket, (seq, payload), in order.
type Replayed = Vec<(u64, Vec<u8>)>;

/// How a replay request's answer ended.
enum Reply {
    /// The end marker: every buffered batch from the seq asked for was sent.
    End,
    /// The connection dropped before the end marker (see [`Rank::replay`]).
    Cut,
}

/// How many times one replay asks again past a batch that dropped its connection.
const MAX_CUTS: u32 = 16;

/// How a replay fell short of the whole answer, and where, so that each hole it left is said to
/// be lost for its own cause. A hole can also have none of them: the engine's buffer no longer
/// held those batches (it rolled past them, or had never held them).
#[derive(Debug, Default)]
struct Shortfall {
    /// The seqs whose batch dropped the connection (a message over `max_message_bytes`): each
    /// was asked past.
    cuts: Vec<u64>,
    /// Why the replay ended before the end marker (it timed out, its socket failed, or it was
    /// cut [`MAX_CUTS`] times), and the seq it stopped at: the first it did not bring.
    failed: Option<(u64, String)>,
}

impl Shortfall {
    /// Why `from .. upto` is lost, when this replay's shortfall is why: a hole holding a cut
    /// batch lost it to the cut, and a hole reaching past where the replay stopped lost those
    /// batches to the failure. `None` for a hole the answer had closed on both sides.
    fn why(&self, from: u64, upto: u64, max_message_bytes: u64) -> Option<String> {
        let mut why = Vec::new();
        if self.cuts.iter().any(|&c| from <= c && c < upto) {
            why.push(format!(
                "the connection dropped while the engine sent them (a message over max_message_bytes, \
                 {max_message_bytes} bytes, drops it)"
            ));
        }
        if let Some((_, e)) = self.failed.as_ref().filter(|(stop, _)| upto > *stop) {
            why.push(format!("the replay ended before the engine sent them all ({e})"));
        }
        (!why.is_empty()).then(|| why.join("; "))
    }
}

/// How long a socket whose connection dropped is read for the messages libzmq read before the
/// drop (they are handed on within microseconds of it; the margin is for a loaded host).
const DROP_SETTLE: Duration = Duration::from_millis(100);

/// The value for `ZMQ_MAXMSGSIZE` (an `i64`; larger bounds mean no bound).
fn max_msg(bytes: u64) -> i64 {
    i64::try_from(bytes).unwrap_or(-1)
}

/// A socket and a monitor that says when its connection to the engine drops.
///
/// libzmq drops a connection whose peer sends a message over `ZMQ_MAXMSGSIZE` as a protocol
/// error, and does not connect it again: the socket is replaced (see [`Rank::replay`] and
/// [`Rank::on_drop`]).
struct Watched {
    socket: zmq::Socket,
    monitor: zmq::Socket,
}

impl Watched {
    /// A socket of `kind`, set up by `setup`, bounded to `max_message_bytes`, connected to
    /// `endpoint` and watched.
    fn open(
        ctx: &zmq::Context,
        kind: zmq::SocketType,
        endpoint: &str,
        max_message_bytes: u64,
        setup: impl FnOnce(&zmq::Socket) -> Result<(), zmq::Error>,
    ) -> Result<Watched, zmq::Error> {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let socket = ctx.socket(kind)?;
        socket.set_linger(0)?;
        socket.set_maxmsgsize(max_msg(max_message_bytes))?;
        setup(&socket)?;
        let name = format!("inproc://kv-relay-monitor-{}", NEXT.fetch_add(1, Ordering::Relaxed));
        socket.monitor(&name, zmq::SocketEvent::DISCONNECTED as i32)?;
        let monitor = ctx.socket(zmq::PAIR)?;
        monitor.set_linger(0)?;
        monitor.connect(&name)?;
        socket.connect(endpoint)?;
        Ok(Watched { socket, monitor })
    }

    /// Forgets drops reported before now (the engine restarted between two replays).
    fn forget_drops(&self) {
        while self.monitor.recv_multipart(zmq::DONTWAIT).is_ok() {}
    }

    /// After a drop: what the socket still hands on, each message until none comes for
    /// [`DROP_SETTLE`]. libzmq reports the drop before it hands on the messages it read
    /// before the one it refused. `take` returns true to stop early, and then so does this.
    fn settle(&self, mut take: impl FnMut(Vec<Vec<u8>>) -> bool) -> Result<bool, zmq::Error> {
        loop {
            let mut items = [self.socket.as_poll_item(zmq::POLLIN)];
            zmq::poll(&mut items, DROP_SETTLE.as_millis() as i64)?;
            if !items[0].is_readable() {
                return Ok(false);
            }
            if take(self.socket.recv_multipart(0)?) {
                return Ok(true);
            }
        }
    }
}

/// The rank's SUB socket on the engine's PUB endpoint.
fn open_sub(ctx: &zmq::Context, cfg: &RankConfig) -> Result<Watched, zmq::Error> {
    Watched::open(ctx, zmq::SUB, &cfg.pub_endpoint, cfg.max_message_bytes, |sub| {
        sub.set_rcvhwm(cfg.rcvhwm)?;
        sub.set_reconnect_ivl(100)?;
        sub.set_reconnect_ivl_max(2000)?;
        sub.set_subscribe(cfg.topic.as_bytes())
    })
}

struct Rank {
    cfg: RankConfig,
    ctx: zmq::Context,
    dealer: Option<Watched>,
    /// How the last replay fell short, and where: a hole it left is said to be lost that way.
    replay_short: Shortfall,
    out: Box<dyn Sink>,
    status: SharedRankStatus,
    normalizer: Normalizer,
    /// The block-hash check, when on.
    check: Option<RankCheck>,
    last: Option<(u64, f64)>,
    /// (seq, ts) of the batches handed on lately, newest last: a live batch with a seq not
    /// above `last` is a duplicate (already refilled from the replay socket) when it is here,
    /// and a publisher restart otherwise.
    recent: std::collections::VecDeque<(u64, f64)>,
    health: Health,
    /// When the SUB socket last delivered a message: the rank is quiet `tail_probe` after it.
    last_live: Instant,
    /// The warnings of a dropped SUB connection, and of a replay cut short or not refilled
    /// whole: a peer can cause one per message.
    drop_warn: Throttle,
    replay_warn: Throttle,
}

/// How often a warning that a peer can cause once per message is logged at most (its counters
/// count every one).
const WARN_EVERY: Duration = Duration::from_secs(10);

/// A warning logged the first time, then at most once every [`WARN_EVERY`], saying how many
/// were held back since the last one logged.
#[derive(Debug, Default)]
struct Throttle {
    /// When the next one may be logged.
    next: Option<Instant>,
    held: u64,
}

impl Throttle {
    /// `Some(held back since the last one logged)` when this one is to be logged at `now`.
    fn pass(&mut self, now: Instant) -> Option<u64> {
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

/// How many recent (seq, ts) pairs are remembered to tell duplicates from restarts. A replay
/// can refill at most the engine's buffer (10,000 batches by default).
const RECENT: usize = 16_384;

/// How long a tail probe that found batches past the last one waits for the SUB socket to
/// deliver them before refilling them as a lost tail. An engine buffers a batch when it sends it,
/// so a batch published while the probe was asking is in the SUB socket's queue or on its way;
/// taking it from the replay would count a gap (and could raise the frequent-gaps alert) where
/// nothing was lost. A tail really lost is refilled this much later, after the `tail_probe`
/// (3 s by default) of quiet that started the probe; the margin is for a loaded host, where the
/// engine's and the relay's threads may wait tens of milliseconds to run.
pub const LIVE_FIRST: Duration = Duration::from_millis(250);

/// Runs one rank until `stop` is set or its sink closes. Blocking: call on its own thread.
pub fn run(
    cfg: RankConfig,
    ctx: zmq::Context,
    resume: Option<Resume>,
    out: Box<dyn Sink>,
    status: SharedRankStatus,
    stop: Arc<AtomicBool>,
) -> Result<(), zmq::Error> {
    // A message over `max_message_bytes` drops the connection (without a bound libzmq would read
    // any size into memory): the socket is replaced, and the batch comes back as a gap.
    let sub = open_sub(&ctx, &cfg)?;
    let check = cfg.hash_check.clone().map(RankCheck::new);
    let check_on = check.is_some();
    let mut r = Rank {
        cfg,
        ctx,
        dealer: None,
        replay_short: Shortfall::default(),
        out,
        status,
        normalizer: Normalizer::new(),
        check,
        last: resume.map(|r| (r.last_seq, r.last_ts)),
        recent: resume.map(|r| (r.last_seq, r.last_ts)).into_iter().collect(),
        health: Health::Ok,
        last_live: Instant::now(),
        drop_warn: Throttle::default(),
        replay_warn: Throttle::default(),
    };
    {
        let mut s = r.status.lock().expect("rank status");
        s.last_seq = r.last.map(|l| l.0);
        s.last_ts = r.last.map(|l| l.1);
        s.hash_check = check_on.then(CheckCounts::default);
    }
    let result = r.main_loop(sub, resume, &stop);
    r.status.lock().expect("rank status").stopped = true;
    result
}

impl Rank {
    fn main_loop(&mut self, mut sub: Watched, resume: Option<Resume>, stop: &AtomicBool) -> Result<(), zmq::Error> {
        if self.prime(resume).is_err() {
            return Ok(());
        }
        let mut last_probe = Instant::now();
        while !stop.load(Ordering::Relaxed) {
            let mut items = [sub.socket.as_poll_item(zmq::POLLIN), sub.monitor.as_poll_item(zmq::POLLIN)];
            // While items are held, only look: they are committed as soon as nothing is ready.
            zmq::poll(&mut items, if self.out.holding() { 0 } else { 100 })?;
            if items[0].is_readable() {
                let frames = sub.socket.recv_multipart(0)?;
                if self.on_live(&frames).is_err() {
                    return Ok(());
                }
                continue;
            }
            if items[1].is_readable() {
                match self.on_drop(sub)? {
                    Some(s) => sub = s,
                    None => return Ok(()),
                }
                continue;
            }
            if self.out.holding() {
                if self.out.flush().is_err() {
                    return Ok(());
                }
                continue;
            }
            let quiet = self.last_live.elapsed() >= self.cfg.tail_probe;
            if quiet && last_probe.elapsed() >= self.cfg.tail_probe && self.cfg.replay_endpoint.is_some() {
                last_probe = Instant::now();
                if self.probe_tail(&sub.socket).is_err() {
                    return Ok(());
                }
            }
        }
        let _ = self.out.flush();
        Ok(())
    }

    /// The SUB's connection dropped: an engine restart, a network fault, or a message over
    /// `max_message_bytes`, after which libzmq would not connect again. What the old socket
    /// still holds is handed on, and a new socket replaces it; what the engine sent meanwhile
    /// comes back as a gap. `None` when the channel closed.
    fn on_drop(&mut self, sub: Watched) -> Result<Option<Watched>, zmq::Error> {
        m::disconnect(self.rank());
        self.update(|s| s.disconnects += 1);
        if let Some(held_back) = self.drop_warn.pass(Instant::now()) {
            tracing::warn!(
                dp_rank = self.rank(),
                endpoint = %self.cfg.pub_endpoint,
                max_message_bytes = self.cfg.max_message_bytes,
                held_back,
                "the engine's PUB connection dropped (an engine restart, or a message over max_message_bytes): connecting again"
            );
        }
        if sub.settle(|frames| self.on_live(&frames).is_err())? {
            return Ok(None);
        }
        drop(sub);
        open_sub(&self.ctx, &self.cfg).map(Some)
    }

    fn rank(&self) -> u32 {
        self.cfg.dp_rank
    }

    fn update(&self, f: impl FnOnce(&mut RankStatus)) {
        f(&mut self.status.lock().expect("rank status"));
    }

    fn send(&mut self, item: IngestItem) -> Result<(), Closed> {
        self.out.put(item)
    }

    fn control(&mut self, kind: ControlKind) -> Result<(), Closed> {
        let reason = match &kind {
            ControlKind::RankReset { reason }
            | ControlKind::RankDegraded { reason }
            | ControlKind::RankIncomplete { reason } => Some(reason.clone()),
            ControlKind::RankRecovered => None,
        };
        match &kind {
            ControlKind::RankDegraded { .. } => self.health = Health::Degraded,
            ControlKind::RankIncomplete { .. } if self.health == Health::Ok => self.health = Health::Incomplete,
            ControlKind::RankIncomplete { .. } => {}
            ControlKind::RankRecovered => self.health = Health::Ok,
            ControlKind::RankReset { .. } => {}
        }
        let health = self.health;
        tracing::warn!(dp_rank = self.rank(), ?kind, "rank state changed");
        self.update(|s| {
            s.health = health;
            if health == Health::Ok {
                s.reason = None;
            } else if reason.is_some() && !matches!(kind, ControlKind::RankReset { .. }) {
                s.reason = reason;
            }
        });
        m::rank_health(self.rank(), health);
        self.send(IngestItem::Control(Control { dp_rank: self.rank(), kind }))
    }

    /// A publisher restart: the rank's state is dropped, and a degraded or incomplete rank is
    /// known again from here on.
    fn reset(&mut self, reason: String) -> Result<(), Closed> {
        self.normalizer.reset_rank(self.rank());
        if let Some(c) = &mut self.check {
            c.reset();
        }
        self.last = None;
        self.recent.clear();
        self.update(|s| s.restarts += 1);
        m::restart(self.rank());
        self.control(ControlKind::RankReset { reason })?;
        if self.health != Health::Ok {
            self.control(ControlKind::RankRecovered)?;
        }
        Ok(())
    }

    /// Decodes, normalizes and hands on one batch with the next seq.
    fn apply(&mut self, seq: u64, payload: &[u8], refilled: bool) -> Result<(), Closed> {
        let raw = match wire::decode_batch(payload) {
            Ok(raw) => raw,
            Err(e) => {
                // The seq is consumed: the engine will never send this batch differently.
                m::message_error(self.rank(), e.as_str());
                self.update(|s| s.message_errors += 1);
                self.last = Some((seq, self.last.map_or(0.0, |l| l.1)));
                self.update(|s| s.last_seq = Some(seq));
                return Ok(());
            }
        };
        if raw.truncated {
            m::message_error(self.rank(), "truncated_batch");
            self.update(|s| s.message_errors += 1);
        }
        let ts = raw.ts;
        if self.recent.len() == RECENT {
            self.recent.pop_front();
        }
        self.recent.push_back((seq, ts));
        let n = self.normalizer.normalize(self.rank(), seq, raw);
        let clears = n.batch.events.iter().any(|e| matches!(e, crate::model::Event::Cleared(c) if c.tier.is_none()));
        m::batch(self.rank(), &n.batch, &n.drops, &n.rewrites, refilled);
        // A diagnostic: what it finds is counted, the batch goes on unchanged.
        let checked = self.check.as_mut().map(|c| c.check(&n.batch));
        if let Some(c) = &checked {
            m::hash_check(self.rank(), c);
        }
        self.last = Some((seq, ts));
        self.update(|s| {
            if let (Some(total), Some(c)) = (&mut s.hash_check, &checked) {
                total.add(c);
            }
            s.last_seq = Some(seq);
            s.last_ts = Some(ts);
            s.last_batch_at = Some(Instant::now());
            s.batches += 1;
            if refilled {
                s.refilled += 1;
            }
            for (reason, k) in &n.drops.0 {
                s.dropped.add(reason, *k);
            }
        });
        self.send(IngestItem::Batch { batch: n.batch, drops: n.drops, refilled })?;
        if clears && self.health != Health::Ok {
            self.control(ControlKind::RankRecovered)?;
        }
        Ok(())
    }

    fn on_live(&mut self, frames: &[Vec<u8>]) -> Result<(), Closed> {
        self.last_live = Instant::now();
        let refs: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
        let f = match wire::split_pub(&refs) {
            Ok(f) => f,
            Err(e) => {
                m::message_error(self.rank(), e.as_str());
                self.update(|s| s.message_errors += 1);
                return Ok(());
            }
        };
        match self.last {
            Some((last, _)) if f.seq == last.wrapping_add(1) => self.apply(f.seq, f.payload, false),
            Some((last, _)) if f.seq <= last => {
                let ts = wire::decode_batch(f.payload).map(|b| b.ts.to_bits()).ok();
                if ts.is_some_and(|ts| self.recent.iter().any(|(s, t)| *s == f.seq && t.to_bits() == ts)) {
                    // Already handed on from the replay socket.
                    m::duplicate(self.rank());
                    return Ok(());
                }
                self.reset(format!("publisher restarted: seq went back from {last} to {}", f.seq))?;
                if f.seq > 0 {
                    self.refill(0, f.seq)?;
                }
                self.apply(f.seq, f.payload, false)
            }
            Some((last, _)) => {
                self.refill(last + 1, f.seq)?;
                self.apply(f.seq, f.payload, false)
            }
            None => {
                if f.seq > 0 {
                    self.refill(0, f.seq)?;
                }
                self.apply(f.seq, f.payload, false)
            }
        }
    }

    /// Refills `from .. upto` from the replay socket, applying what it holds in order.
    fn refill(&mut self, from: u64, upto: u64) -> Result<(), Closed> {
        // What is held goes first: the replay may take up to `replay_timeout`.
        self.out.flush()?;
        m::gap(self.rank());
        self.update(|s| s.gaps += 1);
        let mut got = Vec::new();
        if let Err(e) = self.replay(from, &mut got) {
            if let Some(held_back) = self.replay_warn.pass(Instant::now()) {
                tracing::warn!(dp_rank = self.rank(), from, upto, refilled = got.len(), error = %e, held_back, "gap cannot be refilled whole");
            }
        }
        let mut next = from;
        for (seq, payload) in got.into_iter().filter(|(s, _)| *s >= from && *s < upto) {
            if seq != next {
                self.lost(next, seq)?;
            }
            self.apply(seq, &payload, true)?;
            next = seq + 1;
        }
        if next < upto {
            self.lost(next, upto)?;
        }
        Ok(())
    }

    /// `from .. upto` is gone for good.
    fn lost(&mut self, from: u64, upto: u64) -> Result<(), Closed> {
        let n = upto - from;
        m::lost(self.rank(), n);
        self.update(|s| s.lost += n);
        let lost = format!("{n} batches (seq {from}..{}) lost", upto - 1);
        let reason = if self.cfg.replay_endpoint.is_none() {
            format!("{lost}: no replay endpoint")
        } else {
            match self.replay_short.why(from, upto, self.cfg.max_message_bytes) {
                Some(why) => format!("{lost}: {why}"),
                None => format!("{lost} beyond the engine's replay buffer"),
            }
        };
        if self.last.is_none() && from == 0 {
            // Nothing known before this: old blocks may be missing, none is stale.
            self.control(ControlKind::RankIncomplete { reason })
        } else {
            self.control(ControlKind::RankDegraded { reason })
        }
    }

    fn prime(&mut self, resume: Option<Resume>) -> Result<(), Closed> {
        match self.replay_from(resume)? {
            Some(got) => self.prime_with(resume, got),
            None => Ok(()),
        }
    }

    /// What the replay socket holds from `resume`'s seq (from 0 without one); `None`, said in the
    /// log, when it cannot be read. What the sink holds is handed on first.
    fn replay_from(&mut self, resume: Option<Resume>) -> Result<Option<Replayed>, Closed> {
        if self.cfg.replay_endpoint.is_none() {
            return Ok(None);
        }
        self.out.flush()?;
        let mut got = Vec::new();
        Ok(match self.replay(resume.map_or(0, |r| r.last_seq), &mut got) {
            Ok(()) => Some(got),
            Err(e) => {
                tracing::warn!(dp_rank = self.rank(), read = got.len(), error = %e, "reading the replay socket failed");
                // What arrived before the failure is in order from the seq asked for.
                (!got.is_empty()).then_some(got)
            }
        })
    }

    /// The priming check over what the replay socket answered from `resume`'s seq.
    fn prime_with(&mut self, resume: Option<Resume>, got: Replayed) -> Result<(), Closed> {
        if let Some(r) = resume {
            match got.first() {
                Some((seq, payload)) if *seq == r.last_seq && same_batch(payload, r) => {
                    return self.apply_replayed(got.into_iter().skip(1).collect());
                }
                Some((seq, _)) if *seq > r.last_seq => {
                    // The buffer rolled past where the relay stopped: the same publisher or not,
                    // what came between is unknown.
                    let first = *seq;
                    self.lost(r.last_seq + 1, first)?;
                    return self.apply_replayed(got);
                }
                _ => {}
            }
            self.reset(format!(
                "publisher changed while the relay was not receiving (seq {} at ts {} is not in its replay buffer)",
                r.last_seq, r.last_ts
            ))?;
            let all = self.replay_from(None)?.unwrap_or_default();
            return self.apply_from_zero(all);
        }
        self.apply_from_zero(got)
    }

    fn apply_from_zero(&mut self, got: Replayed) -> Result<(), Closed> {
        if let Some((first, _)) = got.first() {
            if *first > 0 {
                let first = *first;
                m::lost(self.rank(), first);
                self.control(ControlKind::RankIncomplete {
                    reason: format!(
                        "the engine's replay buffer starts at seq {first}: blocks announced before are unknown"
                    ),
                })?;
            }
        }
        self.apply_replayed(got)
    }

    /// Applies replayed batches in order, with the gap and restart rules.
    fn apply_replayed(&mut self, got: Replayed) -> Result<(), Closed> {
        for (seq, payload) in got {
            match self.last {
                Some((last, _)) if seq <= last => continue,
                Some((last, _)) if seq > last + 1 => self.lost(last + 1, seq)?,
                _ => {}
            }
            self.apply(seq, &payload, true)?;
        }
        Ok(())
    }

    /// While the rank is quiet: asks the replay socket for the last batch handed on and what
    /// follows. The same publisher still has that batch (same seq, same timestamp): anything
    /// after it is a lost tail, refilled. A publisher that no longer has it has restarted (its
    /// batches were all missed while the SUB reconnected): the rank is reset and read again from
    /// seq 0. This is the same check as priming a rank the store already knows.
    ///
    /// Batches past the last one, from the same publisher, may be on their way on the SUB socket:
    /// it is read first, for up to [`LIVE_FIRST`], and the replay refills only what it did not
    /// deliver.
    fn probe_tail(&mut self, sub: &zmq::Socket) -> Result<(), Closed> {
        self.update(|s| s.tail_probes += 1);
        let resume = self.last.map(|(last_seq, last_ts)| Resume { last_seq, last_ts });
        let Some(got) = self.replay_from(resume)? else { return Ok(()) };
        let more = match resume {
            Some(r) => {
                got.len() > 1 && got.first().is_some_and(|(seq, payload)| *seq == r.last_seq && same_batch(payload, r))
            }
            None => !got.is_empty(),
        };
        let status = |r: &Self| {
            let s = r.status.lock().expect("rank status");
            (s.batches, s.restarts)
        };
        let (before, restarts) = status(self);
        if more {
            let newest = got.last().map_or(0, |b| b.0);
            self.live_first(sub, newest)?;
        }
        let (live, restarts_now) = status(self);
        if restarts_now != restarts {
            // The SUB socket brought a new publisher: what the replay answered was the old one's.
            return Ok(());
        }
        if live > before {
            // The SUB socket took over: the replay's batches past its newest are a lost tail.
            self.apply_replayed(got)?;
        } else {
            self.prime_with(resume, got)?;
        }
        let after = status(self).0;
        if after > live {
            tracing::info!(dp_rank = self.rank(), batches = after - live, "quiet rank: missed batches refilled");
            m::gap(self.rank());
            self.update(|s| s.gaps += 1);
        }
        Ok(())
    }

    /// Hands on what the SUB socket delivers until the rank's last seq reaches `newest` or
    /// [`LIVE_FIRST`] has passed. A socket error ends the wait; the main loop meets it again.
    fn live_first(&mut self, sub: &zmq::Socket, newest: u64) -> Result<(), Closed> {
        let deadline = Instant::now() + LIVE_FIRST;
        while self.last.is_none_or(|(last, _)| last < newest) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            let mut items = [sub.as_poll_item(zmq::POLLIN)];
            match zmq::poll(&mut items, left.as_millis().max(1) as i64) {
                Ok(_) if items[0].is_readable() => match sub.recv_multipart(0) {
                    Ok(frames) => self.on_live(&frames)?,
                    Err(_) => break,
                },
                Ok(_) => {}
                Err(_) => break,
            }
        }
        Ok(())
    }

    /// Asks the replay socket for every buffered batch from `from`, in order, into `out`; on an
    /// error `out` keeps what arrived before it.
    ///
    /// A batch larger than `max_message_bytes` drops the DEALER's connection (libzmq reads no
    /// further), and the engine's ROUTER drops the rest of its answer. The replay keeps the
    /// batches before it and asks again from the seq after it, at most [`MAX_CUTS`] times: the
    /// batch it could not take is a hole, which the caller's gap rule counts as lost, and the
    /// batches after it are still refilled.
    fn replay(&mut self, from: u64, out: &mut Replayed) -> Result<(), ReplayError> {
        self.replay_short = Shortfall::default();
        let mut ask = from;
        let mut cuts = 0;
        loop {
            let before = out.len();
            let reply = self.replay_once(ask, out);
            // Where this answer stopped: past the last batch it brought, else where it was asked.
            let stop = if out.len() > before { out[out.len() - 1].0 + 1 } else { ask };
            match reply {
                Err(e) => {
                    self.replay_short.failed = Some((stop, e.to_string()));
                    return Err(e);
                }
                Ok(Reply::End) => return Ok(()),
                Ok(Reply::Cut) => {
                    // The batch after the last one received did not arrive.
                    let cut_at = stop;
                    cuts += 1;
                    self.replay_short.cuts.push(cut_at);
                    m::replay_cut(self.rank());
                    self.update(|s| s.replay_cuts += 1);
                    if let Some(held_back) = self.replay_warn.pass(Instant::now()) {
                        tracing::warn!(
                            dp_rank = self.rank(),
                            seq = cut_at,
                            max_message_bytes = self.cfg.max_message_bytes,
                            held_back,
                            "the replay connection dropped while the engine sent a batch (a message over \
                             max_message_bytes drops it): asking again past it"
                        );
                    }
                    if cuts == MAX_CUTS {
                        let e = ReplayError::Cut(cuts);
                        self.replay_short.failed = Some((cut_at + 1, e.to_string()));
                        return Err(e);
                    }
                    ask = cut_at + 1;
                }
            }
        }
    }

    /// One replay request from `ask`: its batches are appended to `out`.
    fn replay_once(&mut self, ask: u64, out: &mut Replayed) -> Result<Reply, ReplayError> {
        let Some(endpoint) = self.cfg.replay_endpoint.clone() else {
            return Err(ReplayError::NoEndpoint);
        };
        if self.dealer.is_none() {
            let d = Watched::open(&self.ctx, zmq::DEALER, &endpoint, self.cfg.max_message_bytes, |d| d.set_rcvhwm(0))
                .map_err(ReplayError::Zmq)?;
            self.dealer = Some(d);
        }
        let d = self.dealer.as_ref().expect("dealer");
        d.forget_drops();
        d.socket.send_multipart([&b""[..], &ask.to_be_bytes()[..]], 0).map_err(ReplayError::Zmq)?;
        let take = |frames: Vec<Vec<u8>>, out: &mut Replayed| {
            let refs: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
            match wire::split_replay(&refs) {
                Ok(ReplayReply::End) => true,
                Ok(ReplayReply::Batch(f)) => {
                    out.push((f.seq, f.payload.to_vec()));
                    false
                }
                Err(e) => {
                    m::message_error(self.cfg.dp_rank, e.as_str());
                    self.status.lock().expect("rank status").message_errors += 1;
                    false
                }
            }
        };
        loop {
            let mut items = [d.socket.as_poll_item(zmq::POLLIN), d.monitor.as_poll_item(zmq::POLLIN)];
            zmq::poll(&mut items, self.cfg.replay_timeout.as_millis() as i64).map_err(ReplayError::Zmq)?;
            if items[0].is_readable() {
                // Replies first: what arrived before a drop is kept.
                if take(d.socket.recv_multipart(0).map_err(ReplayError::Zmq)?, out) {
                    return Ok(Reply::End);
                }
                continue;
            }
            if items[1].is_readable() {
                // Dropped: the replies read before the drop first.
                let end = d.settle(|frames| take(frames, out)).map_err(ReplayError::Zmq)?;
                self.dealer = None;
                return Ok(if end { Reply::End } else { Reply::Cut });
            }
            // Drop the socket so a late answer cannot be mistaken for the next one's.
            self.dealer = None;
            return Err(ReplayError::Timeout(self.cfg.replay_timeout));
        }
    }
}

/// Whether a replayed payload is the batch `r` names: the same seq was asked for, and the same
/// engine timestamp tells the same publisher from a restarted one.
fn same_batch(payload: &[u8], r: Resume) -> bool {
    wire::decode_batch(payload).is_ok_and(|b| b.ts.to_bits() == r.last_ts.to_bits())
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

    #[test]
    fn each_hole_a_short_replay_left_is_said_to_be_lost_for_its_own_cause() {
        const CUT: &str = "the connection dropped while the engine sent them (a message over max_message_bytes, \
                           1024 bytes, drops it)";
        let failed = "the replay ended before the engine sent them all (the replay socket did not answer within \
                      replay_timeout_ms, 300)";
        // Asked from 10; the answer began at 20 (the buffer had rolled past 10..19), batch 25 was
        // cut, the answer asked past it brought 26..29 and then timed out.
        let s = Shortfall {
            cuts: vec![25],
            failed: Some((30, ReplayError::Timeout(Duration::from_millis(300)).to_string())),
        };
        let why = |from, upto| s.why(from, upto, 1024);
        assert_eq!(why(10, 20), None);
        assert_eq!(why(25, 26).as_deref(), Some(CUT));
        assert_eq!(why(24, 27).as_deref(), Some(CUT));
        assert_eq!(why(26, 30), None);
        assert_eq!(why(30, 31).as_deref(), Some(failed));
        assert_eq!(why(29, 40).as_deref(), Some(failed));
        // One hole holding the cut and reaching past the stop names both.
        assert_eq!(why(25, 31), Some(format!("{CUT}; {failed}")));
        assert_eq!(Shortfall::default().why(0, u64::MAX, 1024), None);
        // Cut as often as it asks again: the batches past the last cut were not asked for.
        let e = ReplayError::Cut(MAX_CUTS).to_string();
        assert_eq!(e, "the replay connection dropped while sending a batch, 16 times");
        let s = Shortfall { cuts: (40..40 + u64::from(MAX_CUTS)).collect(), failed: Some((56, e)) };
        assert_eq!(s.why(55, 56, 1024).as_deref(), Some(CUT));
        assert_eq!(
            s.why(56, 60, 1024).as_deref(),
            Some(
                "the replay ended before the engine sent them all (the replay connection dropped while sending \
                 a batch, 16 times)"
            )
        );
    }

    #[test]
    fn a_bound_past_i64_is_no_bound_and_the_sockets_take_every_bound() {
        assert_eq!(max_msg(16 << 20), 16 << 20);
        assert_eq!(max_msg(i64::MAX as u64), i64::MAX);
        assert_eq!(max_msg(i64::MAX as u64 + 1), -1);
        assert_eq!(max_msg(u64::MAX), -1);
        // libzmq takes each of them (a negative other than -1 would be refused).
        let ctx = zmq::Context::new();
        for bytes in [64 << 10, 16 << 20, u64::MAX] {
            let w = Watched::open(&ctx, zmq::DEALER, "tcp://127.0.0.1:1", bytes, |_| Ok(())).unwrap();
            assert_eq!(w.socket.get_maxmsgsize().unwrap(), max_msg(bytes));
        }
    }
}
