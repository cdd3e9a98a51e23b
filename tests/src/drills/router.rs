//! The drills' router: `kv-router-client`'s [`Follower`] following one relay, observed only
//! through its public surface: the index's [`blocks`](kv_router_client::index::PrefixIndex::blocks)
//! per worker, [`Follower::relays`] (cursor, position), [`Follower::counters`] (gaps, resyncs,
//! snapshots, records), [`Follower::workers`] (degraded ranks) and [`Follower::events`]
//! (snapshots by reason, controls in stream order).

use crate::truth::Truth;
use kv_relay::model::Tier;
use kv_router_client::{ClientEvent, FollowConfig, Follower, Position, RelayCounters};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use tokio::sync::broadcast::{self, error::TryRecvError};

/// What a worker holds, for every worker: `(dp_rank, tier name)` to each hash's copy count.
/// Tiers are named as the client's index names them (`device`, `host`, ...); empty sets are
/// left out.
pub type Held = BTreeMap<(u32, String), BTreeMap<u64, u32>>;

/// The engine's truth as a router should hold it: per rank and tier (KV-cache groups summed, as
/// the index keeps no group), copies counted.
pub fn truth_held(t: &Truth) -> Held {
    let mut out = Held::new();
    for (k, set) in &t.blocks {
        let tier = Tier::from_medium(k.medium.as_deref());
        let into = out.entry((k.rank, tier.as_str().to_string())).or_default();
        for (h, c) in set {
            *into.entry(*h).or_default() += c;
        }
    }
    out.retain(|_, s| !s.is_empty());
    out
}

/// Held blocks summed: (worker/tier sets, blocks, copies), for reports.
pub fn size_of_held(b: &Held) -> (usize, usize, u64) {
    (b.len(), b.values().map(BTreeMap::len).sum(), b.values().flat_map(|s| s.values()).map(|&c| u64::from(c)).sum())
}

/// The events a router saw, in order.
#[derive(Debug, Clone, Default)]
struct Seen {
    snapshots: BTreeMap<String, u64>,
    controls: Vec<(u32, &'static str)>,
    /// Events the collector missed (the follower never waits for a slow receiver).
    lost: u64,
}

/// The follower's event receiver and what was drained from it.
struct Events {
    rx: broadcast::Receiver<ClientEvent>,
    seen: Seen,
}

impl Events {
    /// Takes every event sent so far.
    fn drain(&mut self) {
        loop {
            let s = &mut self.seen;
            match self.rx.try_recv() {
                Ok(ClientEvent::SnapshotApplied { reason, .. }) => *s.snapshots.entry(reason).or_default() += 1,
                Ok(ClientEvent::RankReset { dp_rank, .. }) => s.controls.push((dp_rank, "rank_reset")),
                Ok(ClientEvent::RankDegraded { dp_rank, .. }) => s.controls.push((dp_rank, "rank_degraded")),
                Ok(ClientEvent::RankIncomplete { dp_rank, .. }) => s.controls.push((dp_rank, "rank_incomplete")),
                Ok(ClientEvent::RankRecovered { dp_rank, .. }) => s.controls.push((dp_rank, "rank_recovered")),
                Ok(_) => {}
                Err(TryRecvError::Lagged(n)) => s.lost += n,
                Err(TryRecvError::Empty | TryRecvError::Closed) => return,
            }
        }
    }
}

/// What one router holds and has seen, read at one moment.
#[derive(Debug, Clone, Default)]
pub struct RouterState {
    /// Its index, for every worker of the relay.
    pub held: Held,
    /// Where it stands in the relay's history.
    pub position: Position,
    /// The stream's counters (records, duplicates, gaps, snapshots, resyncs, reconnects, ...).
    pub counters: RelayCounters,
    /// Snapshots swapped in, by reason (`snapshot_reason_cursor_trimmed`, ...).
    pub snapshots: BTreeMap<String, u64>,
    /// Every control applied, as (rank, kind): `rank_reset`, `rank_degraded`,
    /// `rank_incomplete`, `rank_recovered`.
    pub controls: Vec<(u32, &'static str)>,
    /// Ranks the router reports degraded now.
    pub degraded: BTreeSet<u32>,
    /// Why its last stream ended.
    pub last_error: Option<String>,
    /// Events its collector missed (0 unless the drill's runtime starved it).
    pub events_lost: u64,
}

impl RouterState {
    pub fn cursor(&self) -> u64 {
        self.position.cursor
    }

    /// Snapshots swapped in for `reason` (a `SnapshotReason` name, any case).
    pub fn snapshots_for(&self, reason: &str) -> u64 {
        self.snapshots.get(&reason.to_ascii_lowercase()).copied().unwrap_or(0)
    }
}

/// A router following one relay (a [`Follower`] on the drill's runtime).
pub struct Router {
    pub follower: Follower,
    url: String,
    events: Arc<Mutex<Events>>,
}

impl Router {
    /// Follows the relay at `url` (`http://127.0.0.1:port`) with `cfg`, from nothing.
    pub fn start(rt: &tokio::runtime::Handle, url: String, cfg: FollowConfig) -> Router {
        let _in_rt = rt.enter();
        let follower = Follower::new(cfg);
        let events = Arc::new(Mutex::new(Events { rx: follower.events(), seen: Seen::default() }));
        // Drained here often enough that the receiver never lags, and by every read.
        let weak = Arc::downgrade(&events);
        rt.spawn(async move {
            while let Some(ev) = weak.upgrade() {
                ev.lock().expect("router events").drain();
                drop(ev);
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        });
        follower.add_relay(&url).expect("follow the relay");
        Router { follower, url, events }
    }

    /// The router's index for every worker of the relay.
    pub fn held(&self) -> Held {
        let index = self.follower.index();
        let mut out = Held::new();
        for w in self.follower.workers().iter().filter(|w| *w.relay == *self.url) {
            for (tier, blocks) in index.blocks(w.id) {
                let name = index.tiers().name(tier).map_or_else(|| format!("tier {}", tier.get()), |n| n.to_string());
                out.insert((w.dp_rank, name), blocks);
            }
        }
        out
    }

    /// The last cursor it applied.
    pub fn cursor(&self) -> u64 {
        self.follower.relays().iter().find(|r| *r.url == *self.url).map_or(0, |r| r.cursor)
    }

    pub fn get(&self) -> RouterState {
        let relay = self.follower.relays().into_iter().find(|r| *r.url == *self.url).expect("relay followed");
        let degraded =
            self.follower.workers().iter().filter(|w| w.degraded.is_some()).map(|w| w.dp_rank).collect::<BTreeSet<_>>();
        // Drained after reading the relay's state: every event of a change that state shows was
        // sent before it (`Follower::events`).
        let seen = {
            let mut ev = self.events.lock().expect("router events");
            ev.drain();
            ev.seen.clone()
        };
        RouterState {
            held: self.held(),
            position: relay.position(),
            counters: relay.counters,
            snapshots: seen.snapshots,
            controls: seen.controls,
            degraded,
            last_error: relay.last_error,
            events_lost: seen.lost,
        }
    }

    /// Stops following (the router goes away) and returns what it held.
    pub fn stop(self) -> RouterState {
        let s = self.get();
        drop(self);
        s
    }
}
