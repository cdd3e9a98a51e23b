//! A match's answer, built for its cost to be what the answer holds.
//!
//! Each relay's task publishes a `RelayView` of its workers (rank, id, load, last heard of,
//! flags) after every change it applies, under the relay's admission lock; a match reads the
//! views without taking any relay's lock, computes each worker's state from them, and pairs
//! the workers with the index's [`LookupResult`] by binary search. [`Matches`] keeps the views,
//! the lookup result and the tier names it read, and serializes (or lends [`MatchRef`]s) from
//! them: no per-worker map, string or clone.

use std::collections::BTreeMap;
use std::fmt;
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::Duration;

use serde::ser::{SerializeMap, SerializeSeq, SerializeStruct};
use serde::{Serialize, Serializer};
use tokio::time::Instant;

use crate::index::{LookupResult, TierId, TierRun, WorkerId};
use crate::worker::{EngineLiveness, Load, WorkerState};

/// One relay's workers as a match reads them.
#[derive(Debug)]
pub(crate) struct RelayView {
    pub(crate) url: Arc<str>,
    /// The engine's base URL, from the relay's Status.
    pub(crate) engine_url: Option<Arc<str>>,
    pub(crate) syncing: bool,
    pub(crate) connected: bool,
    /// By rank.
    pub(crate) workers: Vec<WorkerSlot>,
}

impl RelayView {
    /// A relay of no worker yet.
    pub(crate) fn empty(url: Arc<str>) -> Self {
        RelayView { url, engine_url: None, syncing: false, connected: false, workers: Vec::new() }
    }
}

/// One worker of a [`RelayView`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct WorkerSlot {
    pub(crate) dp_rank: u32,
    pub(crate) id: WorkerId,
    pub(crate) load: Option<Load>,
    pub(crate) last_seen: Option<Instant>,
    pub(crate) degraded: bool,
    pub(crate) incomplete: bool,
    pub(crate) engine_stopped: bool,
    pub(crate) liveness: EngineLiveness,
    pub(crate) held_blocks: u64,
}

/// Which workers a match lists ([`crate::Follower::matches`], `POST /match`).
///
/// The default lists every ready worker, by relay URL then rank.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MatchOptions {
    /// Only the workers holding at least the request's first block (`matched_blocks > 0`).
    pub matched_only: bool,
    /// At most this many workers: those with the most matched blocks, ties by relay URL then
    /// rank, listed in that order (best first). `None`: no bound.
    pub limit: Option<NonZeroUsize>,
}

/// A worker chosen for the answer.
#[derive(Clone, Copy, Debug)]
struct Row {
    /// Its relay's view, in `Matches::relays`.
    relay: u32,
    /// Its slot in the view.
    slot: u32,
    /// Its match in `Matches::result`, `NONE` when it holds nothing.
    entry: u32,
    blocks: u32,
    state: WorkerState,
}

const NONE: u32 = u32::MAX;

/// The tier names a match read, and their ids in name order (how `by_tier` lists them).
#[derive(Debug)]
struct TierNames {
    names: Vec<Arc<str>>,
    by_name: Vec<TierId>,
}

impl TierNames {
    /// `names` by id, extended to cover every tier of `result` (a tier without a name is
    /// named by its number).
    fn new(mut names: Vec<Arc<str>>, result: &LookupResult) -> Self {
        let top = result.iter().flat_map(|m| m.tiers.iter()).map(|r| r.tier.get() as usize + 1).max().unwrap_or(0);
        while names.len() < top {
            names.push(Arc::from(names.len().to_string()));
        }
        let mut by_name: Vec<TierId> = (0..names.len()).filter_map(|i| TierId::new(i as u8)).collect();
        by_name.sort_by(|a, b| names[a.get() as usize].cmp(&names[b.get() as usize]));
        TierNames { names, by_name }
    }
}

/// One worker's answer to a lookup.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Match {
    /// The relay's URL.
    #[serde(serialize_with = "crate::worker::ser_arc_str")]
    pub relay: Arc<str>,
    /// The DP rank.
    pub dp_rank: u32,
    /// Leading blocks of the request held in any tier.
    pub matched_blocks: u32,
    /// Leading blocks held within each tier alone (tiers with 0 left out).
    pub by_tier: BTreeMap<String, u32>,
    /// The worker's latest load.
    pub load: Option<Load>,
    /// The worker's state.
    pub state: WorkerState,
}

/// The workers of a match, in the answer's order, read from the relays' views and the index's
/// lookup result. Lends [`MatchRef`]s ([`Matches::iter`]), serializes as the JSON array of
/// `POST /match`'s `workers`, and gives owned [`Match`]es ([`Matches::to_vec`]).
pub struct Matches {
    relays: Vec<Arc<RelayView>>,
    rows: Vec<Row>,
    result: LookupResult,
    tiers: TierNames,
}

impl Matches {
    /// The answer over `relays` (by URL) of the lookup `result`, with each worker's state at
    /// `now`; `tier_names` by tier id.
    pub(crate) fn new(
        relays: Vec<Arc<RelayView>>,
        result: LookupResult,
        tier_names: Vec<Arc<str>>,
        now: Instant,
        stale_after: Duration,
        opts: MatchOptions,
    ) -> Self {
        let mut rows = Vec::with_capacity(if opts.matched_only {
            result.len()
        } else {
            relays.iter().map(|r| r.workers.len()).sum()
        });
        for (ri, r) in relays.iter().enumerate() {
            if r.syncing {
                continue;
            }
            for (si, w) in r.workers.iter().enumerate() {
                let entry = result.position(w.id);
                if opts.matched_only && entry.is_none() {
                    continue;
                }
                let ago = w.last_seen.map(|t| now.saturating_duration_since(t));
                rows.push(Row {
                    relay: ri as u32,
                    slot: si as u32,
                    entry: entry.map_or(NONE, |k| k as u32),
                    blocks: entry.map_or(0, |k| result.at(k).blocks),
                    state: WorkerState::of(false, r.connected, ago, stale_after, w.degraded, w.incomplete),
                });
            }
        }
        if let Some(k) = opts.limit {
            // Best first; the walk's order (relay URL, then rank) breaks ties.
            let order = |a: &Row, b: &Row| b.blocks.cmp(&a.blocks).then((a.relay, a.slot).cmp(&(b.relay, b.slot)));
            let k = k.get();
            if rows.len() > k {
                rows.select_nth_unstable_by(k - 1, order);
                rows.truncate(k);
            }
            rows.sort_unstable_by(order);
        }
        Matches { relays, rows, tiers: TierNames::new(tier_names, &result), result }
    }

    /// How many workers the answer lists.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// True when the answer lists no worker.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The workers, in the answer's order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = MatchRef<'_>> + '_ {
        self.rows.iter().map(|row| self.at(row))
    }

    /// The `i`-th worker of the answer.
    pub fn get(&self, i: usize) -> Option<MatchRef<'_>> {
        self.rows.get(i).map(|row| self.at(row))
    }

    fn at(&self, row: &Row) -> MatchRef<'_> {
        {
            let r = &self.relays[row.relay as usize];
            let w = &r.workers[row.slot as usize];
            let runs = if row.entry == NONE { &[][..] } else { self.result.at(row.entry as usize).tiers };
            MatchRef {
                relay: &r.url,
                dp_rank: w.dp_rank,
                matched_blocks: row.blocks,
                by_tier: ByTier { runs, tiers: &self.tiers },
                load: w.load,
                state: row.state,
                id: w.id,
                liveness: w.liveness,
                engine_stopped: w.engine_stopped,
                held_blocks: w.held_blocks,
                last_seen: w.last_seen,
                engine_url: r.engine_url.as_ref(),
            }
        }
    }

    /// The workers as owned [`Match`]es (a map of tier names each).
    pub fn to_vec(&self) -> Vec<Match> {
        self.iter().map(|m| m.to_match()).collect()
    }
}

impl fmt::Debug for Matches {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl Serialize for Matches {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(self.rows.len()))?;
        for m in self.iter() {
            seq.serialize_element(&m)?;
        }
        seq.end()
    }
}

/// One worker of a [`Matches`]: what a [`Match`] says, borrowed.
#[derive(Clone, Copy, Debug)]
pub struct MatchRef<'a> {
    /// The relay's URL.
    pub relay: &'a Arc<str>,
    /// The DP rank.
    pub dp_rank: u32,
    /// Leading blocks of the request held in any tier.
    pub matched_blocks: u32,
    /// Leading blocks held within each tier alone (tiers with 0 left out).
    pub by_tier: ByTier<'a>,
    /// The worker's latest load.
    pub load: Option<Load>,
    /// The worker's state.
    pub state: WorkerState,
    /// The worker's id in the prefix index.
    pub id: WorkerId,
    /// The engine's liveness as its relay last reported it.
    pub liveness: EngineLiveness,
    /// The relay reports the rank `STOPPED` (it does not follow the rank's engine).
    pub engine_stopped: bool,
    /// Block copies the index holds for the worker (see [`crate::WorkerInfo::held_blocks`]).
    pub held_blocks: u64,
    /// When the worker was last heard of (batch, heartbeat, control), `None`: never.
    pub last_seen: Option<Instant>,
    /// The engine's base URL, from the relay's Status.
    pub engine_url: Option<&'a Arc<str>>,
}

impl MatchRef<'_> {
    /// The owned [`Match`].
    pub fn to_match(&self) -> Match {
        Match {
            relay: self.relay.clone(),
            dp_rank: self.dp_rank,
            matched_blocks: self.matched_blocks,
            by_tier: self.by_tier.iter().map(|(name, n)| (name.to_string(), n)).collect(),
            load: self.load,
            state: self.state,
        }
    }
}

impl Serialize for MatchRef<'_> {
    /// As [`Match`] serializes.
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut st = s.serialize_struct("Match", 6)?;
        st.serialize_field("relay", &**self.relay)?;
        st.serialize_field("dp_rank", &self.dp_rank)?;
        st.serialize_field("matched_blocks", &self.matched_blocks)?;
        st.serialize_field("by_tier", &self.by_tier)?;
        st.serialize_field("load", &self.load)?;
        st.serialize_field("state", &self.state)?;
        st.end()
    }
}

/// A worker's leading blocks per tier, by tier name (tiers with 0 left out).
#[derive(Clone, Copy)]
pub struct ByTier<'a> {
    /// By tier id.
    runs: &'a [TierRun],
    tiers: &'a TierNames,
}

impl<'a> ByTier<'a> {
    /// `(tier name, leading blocks)`, by name.
    pub fn iter(&self) -> impl Iterator<Item = (&'a str, u32)> + 'a {
        let (runs, tiers) = (self.runs, self.tiers);
        // A worker holds few tiers: when none, nothing is walked.
        let ids: &'a [TierId] = if runs.is_empty() { &[] } else { &tiers.by_name };
        ids.iter().filter_map(move |&t| {
            let run = runs.iter().find(|r| r.tier == t)?;
            Some((&*tiers.names[t.get() as usize], run.blocks))
        })
    }

    /// The leading blocks within tier `tier` (0 if none), without reading names.
    pub fn of(&self, tier: TierId) -> u32 {
        self.runs.iter().find(|r| r.tier == tier).map_or(0, |r| r.blocks)
    }

    /// The leading blocks within tier `name` (0 if none).
    pub fn get(&self, name: &str) -> u32 {
        self.iter().find(|&(n, _)| n == name).map_or(0, |(_, b)| b)
    }

    /// How many tiers hold at least the first block.
    pub fn len(&self) -> usize {
        self.runs.len()
    }

    /// True when no tier holds the first block.
    pub fn is_empty(&self) -> bool {
        self.runs.is_empty()
    }
}

impl fmt::Debug for ByTier<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl Serialize for ByTier<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.runs.len()))?;
        for (name, blocks) in self.iter() {
            map.serialize_entry(name, &blocks)?;
        }
        map.end()
    }
}
