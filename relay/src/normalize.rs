//! From [`RawBatch`] to the relay's model ([`Batch`]): tiers, groups and the hybrid policy,
//! locality, namespaces, per-block token ids.
//!
//! Pure: no I/O, no clocks. The only state is what a rank's stores have said about its KV-cache
//! groups (which group is a sliding window, whether a main-attention group exists), kept per rank
//! in [`Normalizer`] and forgotten when the rank resets.
//!
//! Rules (see `docs/architecture.md`):
//! * `medium` → [`Tier`] (absent → device).
//! * `locality: REMOTE` → dropped (`remote_locality`): another worker's copy.
//! * Hybrid models: a group is a *window* group when its `kv_cache_spec_kind` is
//!   `sliding_window`, `sliding_window_mla` or `chunked_local_attention`, or it carries a sliding
//!   window; a *main* group when the kind is `full_attention`, `mla_attention`,
//!   `sink_full_attention`, or absent. Roles are learned only from stores that carry both a
//!   `group_idx` and a kind (or window), and only events that carry a `group_idx` fall to the
//!   policy (offload stores name no group). On a rank with a main group, window-group stores and
//!   removals are dropped (`window_group_beside_main`): the main group alone decides prefix reuse.
//!   A rank whose only groups are window groups keeps them, and reads each store tail-aligned
//!   (the hashes cover the last blocks of `token_ids`). Group roles are learned from every store
//!   of a batch before any event of that batch is judged, since vLLM stores all groups of a
//!   request in the same scheduler step.
//! * Stores and removals stay one for one: nothing is merged or deduplicated.

use crate::drops::{DropReason, Rewrite, Tally};
use crate::model::{Batch, Block, Cleared, Event, Group, Namespace, Removed, Stored, Tier, TokenLayout};
use crate::wire::{RawBatch, RawEvent, RawStored};
use std::collections::HashMap;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Main,
    Window,
    Other,
}

fn role_of(kind: Option<&str>, window: Option<u32>) -> Role {
    match kind {
        Some("sliding_window" | "sliding_window_mla" | "chunked_local_attention") => Role::Window,
        _ if window.is_some() => Role::Window,
        None | Some("full_attention" | "mla_attention" | "sink_full_attention") => Role::Main,
        Some(_) => Role::Other,
    }
}

#[derive(Debug, Default, Clone)]
struct RankGroups {
    roles: HashMap<u32, Role>,
    has_main: bool,
}

/// One event's fate.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Kept (possibly rewritten).
    Kept,
    /// Dropped.
    Dropped(DropReason),
}

/// A normalized batch with what happened to each wire event.
#[derive(Debug, Clone, PartialEq)]
pub struct Normalized {
    pub batch: Batch,
    /// One entry per wire event, in order.
    pub outcomes: Vec<Outcome>,
    /// Drops by reason (decode and normalization).
    pub drops: Tally,
    /// Rewrites by kind.
    pub rewrites: Tally,
}

/// Normalizes batches; holds per-rank group knowledge.
#[derive(Debug, Default, Clone)]
pub struct Normalizer {
    ranks: HashMap<u32, RankGroups>,
}

impl Normalizer {
    pub fn new() -> Self {
        Self::default()
    }

    /// Forgets what a rank's stores said about its groups (publisher restart).
    pub fn reset_rank(&mut self, dp_rank: u32) {
        self.ranks.remove(&dp_rank);
    }

    /// Normalizes one batch of `dp_rank` with the engine's `seq`.
    pub fn normalize(&mut self, dp_rank: u32, seq: u64, raw: RawBatch) -> Normalized {
        let groups = self.ranks.entry(dp_rank).or_default();
        for e in raw.events.iter().flatten() {
            // Only a store that names its group and says what the group is teaches anything:
            // offload stores (no group, no kind) say nothing about the device groups.
            if let RawEvent::Stored(s) = e {
                if let (Some(g), true) =
                    (s.group_idx, s.kv_cache_spec_kind.is_some() || s.kv_cache_spec_sliding_window.is_some())
                {
                    let role = role_of(s.kv_cache_spec_kind.as_deref(), s.kv_cache_spec_sliding_window);
                    groups.roles.insert(g, role);
                    groups.has_main |= role == Role::Main;
                }
            }
        }
        let mut out = Normalized {
            batch: Batch { dp_rank, seq, ts: raw.ts, events: Vec::with_capacity(raw.events.len()) },
            outcomes: Vec::with_capacity(raw.events.len()),
            drops: Tally::default(),
            rewrites: Tally::default(),
        };
        for e in raw.events {
            match e.and_then(|e| normalize_event(groups, e, &mut out.rewrites)) {
                Ok(ev) => {
                    out.batch.events.push(ev);
                    out.outcomes.push(Outcome::Kept);
                }
                Err(reason) => {
                    out.drops.add(reason.as_str(), 1);
                    out.outcomes.push(Outcome::Dropped(reason));
                }
            }
        }
        out
    }
}

fn is_remote(locality: Option<&str>) -> bool {
    locality.is_some_and(|l| l.eq_ignore_ascii_case("remote"))
}

/// Whether an event of this group falls to the hybrid policy. Events that name no group are
/// never window events.
fn window_dropped(groups: &RankGroups, group: Option<u32>) -> bool {
    groups.has_main && group.is_some_and(|g| groups.roles.get(&g) == Some(&Role::Window))
}

fn normalize_event(groups: &RankGroups, e: RawEvent, rewrites: &mut Tally) -> Result<Event, DropReason> {
    match e {
        RawEvent::Cleared(c) => {
            Ok(Event::Cleared(Cleared { tier: c.medium.as_deref().map(|m| Tier::from_medium(Some(m))) }))
        }
        RawEvent::Removed(r) => {
            if is_remote(r.locality.as_deref()) {
                return Err(DropReason::RemoteLocality);
            }
            if window_dropped(groups, r.group_idx) {
                return Err(DropReason::WindowGroupBesideMain);
            }
            if r.block_hashes.is_empty() {
                return Err(DropReason::NoBlockHashes);
            }
            Ok(Event::Removed(Removed {
                tier: Tier::from_medium(r.medium.as_deref()),
                group: r.group_idx.unwrap_or(0),
                block_hashes: r.block_hashes,
                ownership: r.ownership,
            }))
        }
        RawEvent::Stored(s) => normalize_store(groups, s, rewrites).map(Event::Stored),
    }
}

fn normalize_store(groups: &RankGroups, s: RawStored, rewrites: &mut Tally) -> Result<Stored, DropReason> {
    if is_remote(s.locality.as_deref()) {
        return Err(DropReason::RemoteLocality);
    }
    if window_dropped(groups, s.group_idx) {
        return Err(DropReason::WindowGroupBesideMain);
    }
    if s.block_hashes.is_empty() {
        return Err(DropReason::NoBlockHashes);
    }
    let group = s.group_idx.unwrap_or(0);
    let tail_aligned = s.group_idx.is_some_and(|g| groups.roles.get(&g) == Some(&Role::Window));
    let n = s.block_hashes.len();
    let per_pos = if s.token_ids.layout == TokenLayout::Bigram { 2 } else { 1 };
    let bs = s.block_size as usize;
    let ids = &s.token_ids.ids;
    let chunk = bs * per_pos;
    // Which slice of `ids` each block covers.
    let ranges: Vec<(usize, usize)> = if s.token_ids.wide {
        rewrites.add(Rewrite::TokenIdsWide.as_str(), 1);
        vec![(0, 0); n]
    } else if ids.is_empty() || chunk == 0 {
        rewrites.add(Rewrite::TokenIdsAbsent.as_str(), 1);
        vec![(0, 0); n]
    } else if tail_aligned {
        rewrites.add(Rewrite::TailAligned.as_str(), 1);
        let len = ids.len();
        (0..n)
            .map(|i| {
                let end = len.saturating_sub((n - 1 - i) * chunk);
                (end.saturating_sub(chunk), end)
            })
            .collect()
    } else {
        // Head-aligned. The last block may be short (SGLang's last page of a node).
        let fits = ids.len() > (n - 1) * chunk && ids.len() <= n * chunk;
        if !fits {
            rewrites.add(Rewrite::TokenIdsMismatch.as_str(), 1);
        }
        (0..n)
            .map(|i| {
                let start = (i * chunk).min(ids.len());
                (start, ((i + 1) * chunk).min(ids.len()))
            })
            .collect()
    };
    let mut extra = s.extra_keys.map(|v| v.into_iter());
    let blocks = s
        .block_hashes
        .iter()
        .zip(ranges)
        .map(|(&hash, (a, b))| Block {
            hash,
            token_ids: ids[a..b].to_vec(),
            extra_keys: extra.as_mut().and_then(|it| it.next()).flatten(),
        })
        .collect();
    Ok(Stored {
        tier: Tier::from_medium(s.medium.as_deref()),
        group: Group { idx: group, kind: s.kv_cache_spec_kind, sliding_window: s.kv_cache_spec_sliding_window },
        parent: s.parent_block_hash,
        block_size: s.block_size,
        token_layout: s.token_ids.layout,
        blocks,
        namespace: Namespace { lora_name: s.lora_name, lora_id: s.lora_id, cache_salt: s.cache_salt },
        session_id: s.session_id,
        ownership: s.ownership,
        lookahead_token_ids: s.lookahead_token_ids,
        block_mm_infos: s.block_mm_infos,
    })
}
