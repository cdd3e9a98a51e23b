//! One DP rank's ingest: a SUB socket on the rank's PUB endpoint (`watched.rs`) and a
//! DEALER to its replay ROUTER (`replay.rs`), run on a thread of its own (ZeroMQ sockets
//! are blocking). Which batch is next, a duplicate, a gap or a restart is decided by the
//! sequencer (`sequencer.rs`, without I/O, tested case by case and against a model); this
//! thread does what it says.
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
use super::replay::{Heard, ReplayClient, ReplayError, Replayed};
use super::sequencer::{Fill, Live, Primed, Sequencer};
use super::throttle::Throttle;
use super::watched::{open_sub, Watched};
use super::{Closed, Sink};
use crate::drops::Tally;
use crate::hashcheck::{CheckCounts, HashCheckConfig, RankCheck};
use crate::model::{Batch, Control, ControlKind, RankHealth};
use crate::normalize::Normalizer;
use crate::shutdown::Shutdown;
use crate::sync::Locked;
use crate::wire;
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

/// What the rank thread shares with status readers.
#[derive(Debug, Clone, Default)]
pub struct RankStatus {
    pub health: RankHealth,
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
    /// Times the replay connection dropped while sending a batch (see `ReplayClient::fetch`).
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

/// One rank's thread: it does what the [`Sequencer`]'s rules say with the SUB socket, the
/// replay client and the sink.
struct Rank {
    cfg: RankConfig,
    ctx: zmq::Context,
    replay: ReplayClient,
    out: Box<dyn Sink>,
    status: SharedRankStatus,
    normalizer: Normalizer,
    /// The block-hash check, when on.
    check: Option<RankCheck>,
    seq: Sequencer,
    health: RankHealth,
    /// When the SUB socket last delivered a message: the rank is quiet `tail_probe` after it.
    last_live: Instant,
    /// The warnings of a dropped SUB connection, and of a replay cut short or not refilled
    /// whole: a peer can cause one per message.
    drop_warn: Throttle,
    replay_warn: Throttle,
}

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
    stop: Shutdown,
) -> Result<(), zmq::Error> {
    // A message over `max_message_bytes` drops the connection (without a bound libzmq would read
    // any size into memory): the socket is replaced, and the batch comes back as a gap.
    let sub = open_sub(&ctx, &cfg)?;
    let check = cfg.hash_check.clone().map(RankCheck::new);
    let check_on = check.is_some();
    let mut r = Rank {
        replay: ReplayClient::new(&cfg),
        cfg,
        ctx,
        out,
        status,
        normalizer: Normalizer::new(),
        check,
        seq: Sequencer::new(resume),
        health: RankHealth::Ok,
        last_live: Instant::now(),
        drop_warn: Throttle::default(),
        replay_warn: Throttle::default(),
    };
    {
        let mut s = r.status.locked();
        s.last_seq = r.seq.last().map(|l| l.0);
        s.last_ts = r.seq.last().map(|l| l.1);
        s.hash_check = check_on.then(CheckCounts::default);
    }
    let result = r.main_loop(sub, resume, &stop);
    r.status.locked().stopped = true;
    result
}

impl Rank {
    fn main_loop(&mut self, mut sub: Watched, resume: Option<Resume>, stop: &Shutdown) -> Result<(), zmq::Error> {
        if self.prime(resume).is_err() {
            return Ok(());
        }
        let mut last_probe = Instant::now();
        while !stop.is_shutdown() {
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
        f(&mut self.status.locked());
    }

    fn send(&mut self, item: IngestItem) -> Result<(), Closed> {
        self.out.put(item)
    }

    fn control(&mut self, kind: ControlKind) -> Result<(), Closed> {
        self.health = self.health.after(&kind);
        tracing::warn!(dp_rank = self.rank(), ?kind, "rank state changed");
        let health = self.health.clone();
        m::rank_health(self.rank(), &health);
        self.update(|s| s.health = health);
        self.send(IngestItem::Control(Control { dp_rank: self.rank(), kind }))
    }

    /// A publisher restart: the rank's state is dropped, and a degraded or incomplete rank is
    /// known again from here on.
    fn reset(&mut self, reason: String) -> Result<(), Closed> {
        self.normalizer.reset_rank(self.rank());
        if let Some(c) = &mut self.check {
            c.reset();
        }
        self.seq.reset();
        self.update(|s| s.restarts += 1);
        m::restart(self.rank());
        self.control(ControlKind::RankReset { reason })?;
        if !self.health.is_ok() {
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
                self.seq.consumed(seq);
                self.update(|s| s.last_seq = Some(seq));
                return Ok(());
            }
        };
        if raw.truncated {
            m::message_error(self.rank(), "truncated_batch");
            self.update(|s| s.message_errors += 1);
        }
        let ts = raw.ts;
        self.seq.handed_on(seq, ts);
        let n = self.normalizer.normalize(self.rank(), seq, raw);
        let clears = n.batch.events.iter().any(|e| matches!(e, crate::model::Event::Cleared(c) if c.tier.is_none()));
        m::batch(self.rank(), &n.batch, &n.drops, &n.rewrites, refilled);
        // A diagnostic: what it finds is counted, the batch goes on unchanged.
        let checked = self.check.as_mut().map(|c| c.check(&n.batch));
        if let Some(c) = &checked {
            m::hash_check(self.rank(), c);
        }
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
        if clears && !self.health.is_ok() {
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
        let refill = match self.seq.live(f.seq, || wire::decode_batch(f.payload).ok().map(|b| b.ts)) {
            Live::Next => None,
            Live::Duplicate => {
                m::duplicate(self.rank());
                return Ok(());
            }
            Live::Restart { last, refill } => {
                self.reset(format!("publisher restarted: seq went back from {last} to {}", f.seq))?;
                Some(refill)
            }
            Live::Gap { refill } | Live::First { refill } => Some(refill),
        };
        if let Some(r) = refill.filter(|r| !r.is_empty()) {
            self.refill(r.start, r.end)?;
        }
        self.apply(f.seq, f.payload, false)
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
        let seqs: Vec<u64> = got.iter().map(|b| b.0).collect();
        self.fill(Sequencer::fill(from, Some(upto), &seqs), &got)
    }

    /// Does what the steps over a replay's answer say.
    fn fill(&mut self, steps: Vec<Fill>, got: &Replayed) -> Result<(), Closed> {
        for step in steps {
            match step {
                Fill::Apply(i) => self.apply(got[i].0, &got[i].1, true)?,
                Fill::Lost(r) => self.lost(r.start, r.end)?,
            }
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
            match self.replay.shortfall().why(from, upto, self.cfg.max_message_bytes) {
                Some(why) => format!("{lost}: {why}"),
                None => format!("{lost} beyond the engine's replay buffer"),
            }
        };
        if self.seq.lost_is_incomplete(from) {
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
            match primed(r, &got) {
                Primed::Resumed => return self.apply_replayed(got.into_iter().skip(1).collect()),
                // The hole between is lost (the same publisher or not, it is unknown).
                Primed::RolledPast => return self.apply_replayed(got),
                Primed::Changed => {}
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
        let seqs: Vec<u64> = got.iter().map(|b| b.0).collect();
        self.fill(self.seq.replayed(&seqs), &got)
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
        let resume = self.seq.resume();
        let Some(got) = self.replay_from(resume)? else { return Ok(()) };
        let more = match resume {
            Some(r) => got.len() > 1 && primed(r, &got) == Primed::Resumed,
            None => !got.is_empty(),
        };
        let status = |r: &Self| {
            let s = r.status.locked();
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
        while self.seq.last().is_none_or(|(last, _)| last < newest) {
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

    /// [`ReplayClient::fetch`], with what it meets counted and logged for this rank.
    fn replay(&mut self, from: u64, out: &mut Replayed) -> Result<(), ReplayError> {
        let (rank, max_message_bytes, status, warn) =
            (self.cfg.dp_rank, self.cfg.max_message_bytes, &self.status, &mut self.replay_warn);
        self.replay.fetch(&self.ctx, from, out, |heard| match heard {
            Heard::Cut(seq) => {
                m::replay_cut(rank);
                status.locked().replay_cuts += 1;
                if let Some(held_back) = warn.pass(Instant::now()) {
                    tracing::warn!(
                        dp_rank = rank,
                        seq,
                        max_message_bytes,
                        held_back,
                        "the replay connection dropped while the engine sent a batch (a message over \
                         max_message_bytes drops it): asking again past it"
                    );
                }
            }
            Heard::Bad(e) => {
                m::message_error(rank, e);
                status.locked().message_errors += 1;
            }
        })
    }
}

/// What a replay answer from `r`'s seq says of its publisher (its first batch's timestamp
/// decoded for the check).
fn primed(r: Resume, got: &Replayed) -> Primed {
    let first = got.first().map(|(seq, payload)| (*seq, wire::decode_batch(payload).ok().map(|b| b.ts)));
    Sequencer::primed(r, first)
}
