//! Admission: what one relay's stream does to the index, record by record. Pure: no sockets,
//! no clocks (the caller passes `now`), so tests script a stream message by message.
//!
//! # Rules
//!
//! - **Per relay, exactly once, in cursor order.** The relay's cursor is one `u64` across all its
//!   ranks. A record (batch or control) whose cursor is at most the last applied is a duplicate:
//!   ignored and counted. One beyond `last + 1` is a gap: nothing of it is applied and the stream
//!   is left ([`Verdict::Resume`]) to resubscribe after the last applied cursor (the relay then
//!   resends, or sends a snapshot when it cannot).
//! - **Per worker** (relay, DP rank): a rank reset clears that worker's blocks (atomically) before
//!   the records after it apply; degraded, incomplete and recovered set and clear the worker's
//!   flags and are reported as [`ClientEvent`]s.
//! - **Snapshots are staged.** `SnapshotBegin` starts collecting the blocks per rank outside the
//!   index; lookups keep seeing the old state. At `SnapshotEnd` each worker of the snapshot's
//!   ranks (every rank of the relay when the snapshot covers all) is swapped to its staged state
//!   with the index's atomic replace, and the position becomes (snapshot epoch, end cursor, end
//!   incarnation); the records after it apply on top. An epoch change always comes as a
//!   snapshot. A stream that ends mid-snapshot discards the staging.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use kv_relay_proto::pb;
use kv_relay_proto::pb::subscribe_response::Message as M;
use tokio::time::Instant;

use crate::index::{PrefixIndex, StagedSnapshot, TierId, WorkerId};
use crate::matches::{RelayView, WorkerSlot};
use crate::worker::{EngineLiveness, Liveness, Load, WorkerInfo, WorkerState};

/// Where a client stands in one relay's history: what it sends back to resume.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Position {
    /// The relay epoch the cursor belongs to (0: none yet).
    pub epoch: u64,
    /// The cursor of the last record applied (or of the last snapshot's end).
    pub cursor: u64,
    /// The incarnation of that record.
    pub incarnation: u32,
}

/// What the stream's reader does after a message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Keep reading.
    Continue,
    /// Leave this stream and resubscribe from [`RelayAdmission::position`] (a gap, a message out
    /// of protocol, or the relay asked for a resync).
    Resume(String),
    /// The relay was removed: stop following it.
    Stop,
}

/// Something a router may want to act on, broadcast by the follower
/// ([`crate::Follower::events`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClientEvent {
    /// A Subscribe stream to the relay is open.
    Connected { relay: Arc<str> },
    /// The stream to the relay ended; the follower reconnects with backoff.
    Disconnected { relay: Arc<str>, error: String },
    /// The rank's publisher restarted: its blocks were cleared.
    RankReset { relay: Arc<str>, dp_rank: u32, reason: String },
    /// A gap the relay could not refill: stale blocks may be held.
    RankDegraded { relay: Arc<str>, dp_rank: u32, reason: String },
    /// Blocks announced before the relay started may be missing.
    RankIncomplete { relay: Arc<str>, dp_rank: u32, reason: String },
    /// The rank's state is known again.
    RankRecovered { relay: Arc<str>, dp_rank: u32 },
    /// A snapshot was swapped in.
    SnapshotApplied { relay: Arc<str>, epoch: u64, cursor: u64, reason: String, blocks: u64, ranks: Vec<u32> },
    /// A record arrived beyond the next cursor; the client resumes from `after`.
    Gap { relay: Arc<str>, after: u64, got: u64 },
    /// The relay said this client fell behind its history.
    ResyncRequested { relay: Arc<str>, reason: String },
}

/// Counters of one relay's stream. Summed over relays (and kept for removed ones) in the
/// follower's metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct RelayCounters {
    /// Records (batches and controls) applied.
    pub records_applied: u64,
    /// Records ignored because their cursor was already applied.
    pub duplicates: u64,
    /// Records beyond the next cursor (each makes the client resume).
    pub gaps: u64,
    /// Snapshots swapped in.
    pub snapshots: u64,
    /// Snapshots that came with another epoch than the one held.
    pub epoch_changes: u64,
    /// `Resync` messages (the client fell behind the relay's history).
    pub resyncs: u64,
    /// Heartbeats received.
    pub heartbeats: u64,
    /// Messages out of protocol (a record inside a snapshot, an end without a begin, ...).
    pub protocol_errors: u64,
    /// Events skipped because their tier was unspecified, or an id could not be interned.
    pub skipped_events: u64,
    /// Subscribe attempts after the first.
    pub reconnects: u64,
    /// Streams left because nothing arrived within the receive timeout.
    pub receive_timeouts: u64,
}

impl std::ops::AddAssign for RelayCounters {
    fn add_assign(&mut self, o: Self) {
        self.records_applied += o.records_applied;
        self.duplicates += o.duplicates;
        self.gaps += o.gaps;
        self.snapshots += o.snapshots;
        self.epoch_changes += o.epoch_changes;
        self.resyncs += o.resyncs;
        self.heartbeats += o.heartbeats;
        self.protocol_errors += o.protocol_errors;
        self.skipped_events += o.skipped_events;
        self.reconnects += o.reconnects;
        self.receive_timeouts += o.receive_timeouts;
    }
}

#[derive(Clone, Debug)]
struct Worker {
    id: WorkerId,
    load: Option<Load>,
    last_seen: Option<Instant>,
    degraded: Option<String>,
    incomplete: Option<String>,
    engine_stopped: bool,
    applied: u64,
    resets: u64,
    /// The newest liveness observation the relay sent (batch, heartbeat or Status).
    liveness: Option<Liveness>,
    /// Block copies held, per tier, as the applied events count them.
    held: Vec<(TierId, u64)>,
}

impl Worker {
    fn new(id: WorkerId) -> Self {
        Worker {
            id,
            load: None,
            last_seen: None,
            degraded: None,
            incomplete: None,
            engine_stopped: false,
            applied: 0,
            resets: 0,
            liveness: None,
            held: Vec::new(),
        }
    }

    /// Keeps `l` when it is the newest observation seen: a batch replayed from the relay's
    /// history carries the liveness of its commit, older than what a heartbeat or Status said.
    fn observe(&mut self, l: Option<&pb::Liveness>) {
        let Some(l) = l else { return };
        if self.liveness.as_ref().is_none_or(|held| l.observed_at_ms >= held.observed_at_ms) {
            self.liveness = Some(Liveness::from(l));
        }
    }

    fn held_in(&mut self, tier: TierId) -> &mut u64 {
        let i = match self.held.iter().position(|(t, _)| *t == tier) {
            Some(i) => i,
            None => {
                self.held.push((tier, 0));
                self.held.len() - 1
            }
        };
        &mut self.held[i].1
    }

    /// Copies held over every tier.
    fn held_total(&self) -> u64 {
        self.held.iter().map(|(_, n)| n).sum()
    }

    /// Empties the count of one tier, or of every tier.
    fn clear_held(&mut self, tier: Option<TierId>) {
        match tier {
            None => self.held.clear(),
            Some(t) => self.held.retain(|(held, _)| *held != t),
        }
    }
}

/// A snapshot being received: its header and the blocks collected so far, per rank.
#[derive(Debug)]
struct Staging {
    begin: pb::SnapshotBegin,
    ranks: BTreeMap<u32, StagedSnapshot>,
    /// Copies staged, per rank and tier (the workers' held counts after the swap).
    held: BTreeMap<u32, Vec<(TierId, u64)>>,
    blocks: u64,
}

/// The relay's own view of a rank, from its Status RPC.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct RankHealth {
    degraded: Option<String>,
    incomplete: Option<String>,
    stopped: bool,
}

/// One relay's admission state: position, staged snapshot, workers, counters.
#[derive(Debug)]
pub struct RelayAdmission {
    url: Arc<str>,
    pos: Position,
    staging: Option<Staging>,
    workers: BTreeMap<u32, Worker>,
    counters: RelayCounters,
    /// A Subscribe stream is open.
    connected: bool,
    /// Waiting for a resync slot, or subscribed and not yet past a snapshot (set by the follower).
    syncing: bool,
    /// Set by [`RelayAdmission::remove`]: nothing is applied any more.
    removed: bool,
    last_error: Option<String>,
    /// The relay's newest cursor, from its last heartbeat or status.
    relay_newest: u64,
    /// Per rank, the relay's last reported health (Status RPC): the flags after a snapshot.
    health: BTreeMap<u32, RankHealth>,
    /// The engine's base URL, from the relay's Status.
    engine_url: Option<Arc<str>>,
}

fn tier_of(index: &PrefixIndex, tier: i32, name: &str) -> Option<TierId> {
    match pb::Tier::try_from(tier).ok()? {
        pb::Tier::Unspecified => None,
        pb::Tier::Device => Some(TierId::DEVICE),
        pb::Tier::Host => Some(TierId::HOST),
        pb::Tier::Disk => Some(TierId::DISK),
        pb::Tier::External => Some(TierId::EXTERNAL),
        pb::Tier::Other => index.tier(if name.is_empty() { "other" } else { name }).ok(),
    }
}

impl RelayAdmission {
    /// A relay followed from scratch.
    pub fn new(url: impl Into<Arc<str>>) -> Self {
        RelayAdmission {
            url: url.into(),
            pos: Position::default(),
            staging: None,
            workers: BTreeMap::new(),
            counters: RelayCounters::default(),
            connected: false,
            syncing: false,
            removed: false,
            last_error: None,
            relay_newest: 0,
            health: BTreeMap::new(),
            engine_url: None,
        }
    }

    /// The relay's URL.
    pub fn url(&self) -> &Arc<str> {
        &self.url
    }

    /// The position to resume from.
    pub fn position(&self) -> Position {
        self.pos
    }

    /// The counters.
    pub fn counters(&self) -> RelayCounters {
        self.counters
    }

    /// Counts a Subscribe attempt after the first.
    pub fn count_reconnect(&mut self) {
        self.counters.reconnects += 1;
    }

    /// Counts a stream left for silence.
    pub fn count_receive_timeout(&mut self) {
        self.counters.receive_timeouts += 1;
    }

    /// A snapshot is being received.
    pub fn is_staging(&self) -> bool {
        self.staging.is_some()
    }

    /// Whether [`RelayAdmission::remove`] was called.
    pub fn is_removed(&self) -> bool {
        self.removed
    }

    /// Whether the relay is being resynced (its workers are [`WorkerState::Syncing`]).
    pub fn is_syncing(&self) -> bool {
        self.syncing
    }

    /// Marks the relay as being resynced, or done.
    pub fn set_syncing(&mut self, syncing: bool) {
        self.syncing = syncing;
    }

    /// Whether a stream is open.
    pub fn is_connected(&self) -> bool {
        self.connected
    }

    /// Why the last stream ended.
    pub fn last_error(&self) -> Option<&str> {
        self.last_error.as_deref()
    }

    /// The relay's newest cursor as last heard (heartbeat or status).
    pub fn relay_newest(&self) -> u64 {
        self.relay_newest
    }

    /// The request that resumes from the position. `allow_snapshot` lets the relay answer with
    /// a snapshot when it cannot continue the cursor; `lean` asks for records without token ids
    /// (`omit_token_ids`: the index never reads them; a relay that predates it sends full ones).
    pub fn subscribe_request(&self, allow_snapshot: bool, lean: bool) -> pb::SubscribeRequest {
        pb::SubscribeRequest {
            epoch: self.pos.epoch,
            after_cursor: self.pos.cursor,
            incarnation: self.pos.incarnation,
            allow_snapshot,
            ranks: Vec::new(),
            snapshot_token_ids: false,
            omit_token_ids: lean,
        }
    }

    /// Takes in the relay's Status: its ranks become workers, their health is remembered (and
    /// becomes their flags after a snapshot), `STOPPED` marks the engine stopped. When nothing
    /// was applied yet, the relay's epoch is adopted, so the first stream (which starts at
    /// cursor 1 without naming its epoch) can be resumed later.
    pub fn apply_status(&mut self, st: &pb::StatusResponse, index: &PrefixIndex) {
        if self.pos == Position::default() && self.staging.is_none() {
            self.pos.epoch = st.epoch;
        }
        if st.epoch == self.pos.epoch {
            self.relay_newest = st.newest_cursor;
        }
        let url = st.engine_url.trim();
        if self.engine_url.as_deref() != Some(url) {
            self.engine_url = (!url.is_empty()).then(|| Arc::from(url));
        }
        for r in &st.ranks {
            let state = pb::RankState::try_from(r.state).unwrap_or(pb::RankState::Unspecified);
            let h = RankHealth {
                degraded: (state == pb::RankState::Degraded).then(|| r.reason.clone()),
                incomplete: (state == pb::RankState::Incomplete).then(|| r.reason.clone()),
                stopped: state == pb::RankState::Stopped,
            };
            if let Some(w) = self.worker(r.dp_rank, index) {
                w.engine_stopped = h.stopped;
                if w.load.is_none() {
                    w.load = r.load.as_ref().map(Load::from);
                }
                w.observe(r.liveness.as_ref());
            }
            self.health.insert(r.dp_rank, h);
        }
    }

    /// A stream opened.
    pub fn on_connected(&mut self, events: &mut Vec<ClientEvent>) {
        self.connected = true;
        self.last_error = None;
        events.push(ClientEvent::Connected { relay: self.url.clone() });
    }

    /// The stream ended (or could not be opened): a snapshot half received is dropped.
    pub fn on_disconnected(&mut self, error: String, events: &mut Vec<ClientEvent>) {
        self.staging = None;
        if self.connected {
            events.push(ClientEvent::Disconnected { relay: self.url.clone(), error: error.clone() });
        }
        self.connected = false;
        self.last_error = Some(error);
    }

    /// Stops applying anything and drops every worker of the relay from the index.
    pub fn remove(&mut self, index: &PrefixIndex) {
        self.removed = true;
        self.staging = None;
        self.connected = false;
        for w in self.workers.values() {
            index.remove_worker(w.id);
        }
        self.workers.clear();
    }

    fn worker(&mut self, dp_rank: u32, index: &PrefixIndex) -> Option<&mut Worker> {
        if !self.workers.contains_key(&dp_rank) {
            let id = index.worker(&self.url, dp_rank).ok()?;
            self.workers.insert(dp_rank, Worker::new(id));
        }
        self.workers.get_mut(&dp_rank)
    }

    /// Checks a record's cursor: `Ok(true)` to apply it, `Ok(false)` for a duplicate, `Err` to
    /// leave the stream.
    fn admit(&mut self, cursor: u64, events: &mut Vec<ClientEvent>) -> Result<bool, Verdict> {
        if self.staging.is_some() {
            self.counters.protocol_errors += 1;
            return Err(Verdict::Resume(format!("record {cursor} inside a snapshot")));
        }
        if cursor <= self.pos.cursor {
            self.counters.duplicates += 1;
            return Ok(false);
        }
        if cursor > self.pos.cursor + 1 {
            self.counters.gaps += 1;
            events.push(ClientEvent::Gap { relay: self.url.clone(), after: self.pos.cursor, got: cursor });
            return Err(Verdict::Resume(format!("gap: after cursor {} came {cursor}", self.pos.cursor)));
        }
        Ok(true)
    }

    /// Applies one stream message.
    pub fn apply(
        &mut self,
        msg: pb::SubscribeResponse,
        index: &PrefixIndex,
        now: Instant,
        events: &mut Vec<ClientEvent>,
    ) -> Verdict {
        if self.removed {
            return Verdict::Stop;
        }
        let Some(msg) = msg.message else {
            self.counters.protocol_errors += 1;
            return Verdict::Continue;
        };
        match msg {
            M::Batch(b) => self.apply_batch(b, index, now, events),
            M::Control(c) => self.apply_control(c, index, now, events),
            M::Heartbeat(h) => {
                self.counters.heartbeats += 1;
                self.relay_newest = self.relay_newest.max(h.newest_cursor);
                if let Some(w) = self.worker(h.dp_rank, index) {
                    w.last_seen = Some(now);
                    if let Some(l) = &h.load {
                        w.load = Some(Load::from(l));
                    }
                    w.observe(h.liveness.as_ref());
                }
                Verdict::Continue
            }
            M::SnapshotBegin(b) => {
                if self.staging.is_some() {
                    self.counters.protocol_errors += 1;
                }
                self.staging = Some(Staging { begin: b, ranks: BTreeMap::new(), held: BTreeMap::new(), blocks: 0 });
                Verdict::Continue
            }
            M::SnapshotChunk(c) => self.stage_chunk(c, index),
            M::SnapshotEnd(e) => self.swap_in(e, index, now, events),
            M::Resync(r) => {
                self.counters.resyncs += 1;
                events.push(ClientEvent::ResyncRequested { relay: self.url.clone(), reason: r.reason.clone() });
                Verdict::Resume(format!("relay asked for a resync: {}", r.reason))
            }
        }
    }

    fn apply_batch(
        &mut self,
        b: pb::Batch,
        index: &PrefixIndex,
        now: Instant,
        events: &mut Vec<ClientEvent>,
    ) -> Verdict {
        match self.admit(b.cursor, events) {
            Ok(true) => {}
            Ok(false) => return Verdict::Continue,
            Err(v) => return v,
        }
        self.pos.cursor = b.cursor;
        self.pos.incarnation = b.incarnation;
        self.counters.records_applied += 1;
        let mut skipped = 0;
        let Some(w) = self.worker(b.dp_rank, index) else {
            self.counters.skipped_events += b.events.len() as u64;
            return Verdict::Continue;
        };
        w.last_seen = Some(now);
        w.applied += 1;
        if let Some(l) = &b.load {
            w.load = Some(Load::from(l));
        }
        w.observe(b.liveness.as_ref());
        let id = w.id;
        let mut hashes = Vec::new();
        for ev in b.events {
            use pb::event::Event as E;
            match ev.event {
                Some(E::Stored(s)) => {
                    let Some(tier) = tier_of(index, s.tier, &s.tier_name) else {
                        skipped += 1;
                        continue;
                    };
                    hashes.clear();
                    hashes.extend(s.blocks.iter().map(|b| b.hash));
                    index.store_after(id, tier, s.parent, &hashes);
                    *w.held_in(tier) += hashes.len() as u64;
                }
                Some(E::Removed(r)) => {
                    let Some(tier) = tier_of(index, r.tier, &r.tier_name) else {
                        skipped += 1;
                        continue;
                    };
                    index.remove(id, tier, &r.block_hashes);
                    let held = w.held_in(tier);
                    *held = held.saturating_sub(r.block_hashes.len() as u64);
                }
                Some(E::Cleared(c)) => {
                    if c.tier == pb::Tier::Unspecified as i32 {
                        index.clear(id, None);
                        w.clear_held(None);
                    } else if let Some(tier) = tier_of(index, c.tier, &c.tier_name) {
                        index.clear(id, Some(tier));
                        w.clear_held(Some(tier));
                    } else {
                        skipped += 1;
                    }
                }
                None => skipped += 1,
            }
        }
        self.counters.skipped_events += skipped;
        Verdict::Continue
    }

    fn apply_control(
        &mut self,
        c: pb::Control,
        index: &PrefixIndex,
        now: Instant,
        events: &mut Vec<ClientEvent>,
    ) -> Verdict {
        match self.admit(c.cursor, events) {
            Ok(true) => {}
            Ok(false) => return Verdict::Continue,
            Err(v) => return v,
        }
        self.pos.cursor = c.cursor;
        self.pos.incarnation = c.incarnation;
        self.counters.records_applied += 1;
        let relay = self.url.clone();
        let Some(w) = self.worker(c.dp_rank, index) else {
            self.counters.skipped_events += 1;
            return Verdict::Continue;
        };
        w.last_seen = Some(now);
        w.applied += 1;
        let (dp_rank, reason) = (c.dp_rank, c.reason);
        match pb::ControlKind::try_from(c.kind).unwrap_or(pb::ControlKind::Unspecified) {
            pb::ControlKind::RankReset => {
                index.clear(w.id, None);
                w.clear_held(None);
                w.resets += 1;
                w.degraded = None;
                w.incomplete = None;
                events.push(ClientEvent::RankReset { relay, dp_rank, reason });
            }
            pb::ControlKind::RankDegraded => {
                w.degraded = Some(reason.clone());
                events.push(ClientEvent::RankDegraded { relay, dp_rank, reason });
            }
            pb::ControlKind::RankIncomplete => {
                w.incomplete = Some(reason.clone());
                events.push(ClientEvent::RankIncomplete { relay, dp_rank, reason });
            }
            pb::ControlKind::RankRecovered => {
                w.degraded = None;
                w.incomplete = None;
                events.push(ClientEvent::RankRecovered { relay, dp_rank });
            }
            pb::ControlKind::Unspecified => self.counters.skipped_events += 1,
        }
        Verdict::Continue
    }

    fn stage_chunk(&mut self, c: pb::SnapshotChunk, index: &PrefixIndex) -> Verdict {
        let Some(st) = self.staging.as_mut() else {
            self.counters.protocol_errors += 1;
            return Verdict::Resume("snapshot chunk without a begin".into());
        };
        let mut skipped = 0;
        for b in c.blocks {
            let Some(tier) = tier_of(index, b.tier, &b.tier_name) else {
                skipped += 1;
                continue;
            };
            st.ranks.entry(b.dp_rank).or_default().push_after(tier, b.hash, b.copies.max(1), b.parent);
            let held = st.held.entry(b.dp_rank).or_default();
            match held.iter_mut().find(|(t, _)| *t == tier) {
                Some((_, n)) => *n += u64::from(b.copies.max(1)),
                None => held.push((tier, u64::from(b.copies.max(1)))),
            }
            st.blocks += 1;
        }
        self.counters.skipped_events += skipped;
        Verdict::Continue
    }

    fn swap_in(
        &mut self,
        e: pb::SnapshotEnd,
        index: &PrefixIndex,
        now: Instant,
        events: &mut Vec<ClientEvent>,
    ) -> Verdict {
        let Some(st) = self.staging.take() else {
            self.counters.protocol_errors += 1;
            return Verdict::Resume("snapshot end without a begin".into());
        };
        if e.cursor != st.begin.cursor {
            self.counters.protocol_errors += 1;
            return Verdict::Resume(format!("snapshot began at cursor {} and ended at {}", st.begin.cursor, e.cursor));
        }
        // The ranks the snapshot speaks for: the ones it names, or every rank (known or in it).
        let mut ranks: BTreeSet<u32> = st.begin.ranks.iter().copied().collect();
        if ranks.is_empty() {
            ranks.extend(self.workers.keys().copied());
        }
        ranks.extend(st.ranks.keys().copied());
        let empty = StagedSnapshot::new();
        for &r in &ranks {
            let health = self.health.get(&r).cloned().unwrap_or_default();
            let Some(w) = self.worker(r, index) else {
                self.counters.skipped_events += 1;
                continue;
            };
            index.replace_worker(w.id, st.ranks.get(&r).unwrap_or(&empty));
            w.held = st.held.get(&r).cloned().unwrap_or_default();
            w.last_seen = Some(now);
            w.degraded = health.degraded;
            w.incomplete = health.incomplete;
        }
        if self.pos.epoch != 0 && self.pos.epoch != st.begin.epoch {
            self.counters.epoch_changes += 1;
        }
        self.pos = Position { epoch: st.begin.epoch, cursor: e.cursor, incarnation: e.incarnation };
        self.relay_newest = self.relay_newest.max(e.cursor);
        self.counters.snapshots += 1;
        let reason = pb::SnapshotReason::try_from(st.begin.reason)
            .map(|r| r.as_str_name().to_ascii_lowercase())
            .unwrap_or_default();
        events.push(ClientEvent::SnapshotApplied {
            relay: self.url.clone(),
            epoch: st.begin.epoch,
            cursor: e.cursor,
            reason,
            blocks: st.blocks,
            ranks: ranks.into_iter().collect(),
        });
        Verdict::Continue
    }

    /// Every worker of the relay, with its state at `now`.
    pub fn workers(&self, now: Instant, stale_after: Duration) -> Vec<WorkerInfo> {
        self.workers
            .iter()
            .map(|(&dp_rank, w)| {
                let ago = w.last_seen.map(|t| now.saturating_duration_since(t));
                let state = WorkerState::of(
                    self.syncing,
                    self.connected,
                    ago,
                    stale_after,
                    w.degraded.is_some(),
                    w.incomplete.is_some(),
                );
                WorkerInfo {
                    relay: self.url.clone(),
                    dp_rank,
                    id: w.id,
                    state,
                    load: w.load,
                    last_seen_ago: ago,
                    degraded: w.degraded.clone(),
                    incomplete: w.incomplete.clone(),
                    engine_stopped: w.engine_stopped,
                    records_applied: w.applied,
                    resets: w.resets,
                    liveness: w.liveness.clone(),
                    held_blocks: w.held_total(),
                    engine_url: self.engine_url.clone(),
                }
            })
            .collect()
    }

    /// What a match reads of the relay's workers, by rank (see [`RelayView`]).
    pub(crate) fn view(&self) -> RelayView {
        RelayView {
            url: self.url.clone(),
            engine_url: self.engine_url.clone(),
            syncing: self.syncing,
            connected: self.connected,
            workers: self
                .workers
                .iter()
                .map(|(&dp_rank, w)| WorkerSlot {
                    dp_rank,
                    id: w.id,
                    load: w.load,
                    last_seen: w.last_seen,
                    degraded: w.degraded.is_some(),
                    incomplete: w.incomplete.is_some(),
                    engine_stopped: w.engine_stopped,
                    liveness: w.liveness.as_ref().map_or(EngineLiveness::Unknown, |l| l.state),
                    held_blocks: w.held_total(),
                })
                .collect(),
        }
    }
}
