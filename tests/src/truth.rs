//! The engine's truth: which blocks each rank holds, per medium and KV-cache group, with a
//! copy count per hash, exactly as the published batches say (whether or not a subscriber
//! received them).
//!
//! The walk is the fixtures README's reference rule, refcounted: a store adds one copy of each
//! hash, a removal takes one copy (a hash that is not live is ignored), `AllBlocksCleared`
//! clears every key of the rank, and a publisher restart clears the rank too. Keys are the
//! medium and group exactly as carried on the wire (`None` when absent), so a release without
//! `medium` (vLLM < 0.10.2, SGLang < 0.5.9) keys by `None`.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{json, Value as Json};

use crate::decode::WireEvent;

/// (rank, medium, group) as carried on the wire.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TruthKey {
    pub rank: u32,
    pub medium: Option<String>,
    pub group: Option<u32>,
}

impl TruthKey {
    pub fn new(rank: u32, medium: Option<&str>, group: Option<u32>) -> Self {
        TruthKey { rank, medium: medium.map(str::to_string), group }
    }
}

/// Live blocks with copy counts. Empty keys are never kept, so two truths compare equal
/// exactly when they hold the same copies.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Truth {
    pub blocks: BTreeMap<TruthKey, BTreeMap<u64, u32>>,
}

impl Truth {
    pub fn new() -> Self {
        Truth::default()
    }

    /// Apply one event published by `rank`.
    pub fn apply(&mut self, rank: u32, ev: &WireEvent) {
        match ev {
            WireEvent::Cleared => self.clear_rank(rank),
            WireEvent::Stored { hashes, medium, group_idx } => {
                if hashes.is_empty() {
                    return;
                }
                let key = TruthKey { rank, medium: medium.clone(), group: *group_idx };
                let live = self.blocks.entry(key).or_default();
                for h in hashes {
                    *live.entry(*h).or_insert(0) += 1;
                }
            }
            WireEvent::Removed { hashes, medium, group_idx } => {
                let key = TruthKey { rank, medium: medium.clone(), group: *group_idx };
                if let Some(live) = self.blocks.get_mut(&key) {
                    for h in hashes {
                        if let Some(n) = live.get_mut(h) {
                            *n -= 1;
                            if *n == 0 {
                                live.remove(h);
                            }
                        }
                    }
                    if live.is_empty() {
                        self.blocks.remove(&key);
                    }
                }
            }
        }
    }

    /// Forget everything `rank` holds (AllBlocksCleared, publisher restart, rank stopped).
    pub fn clear_rank(&mut self, rank: u32) {
        self.blocks.retain(|k, _| k.rank != rank);
    }

    /// The live hashes per key, without counts.
    pub fn live_sets(&self) -> BTreeMap<TruthKey, BTreeSet<u64>> {
        self.blocks.iter().map(|(k, v)| (k.clone(), v.keys().copied().collect())).collect()
    }

    /// Only the blocks of one rank.
    pub fn rank(&self, rank: u32) -> Truth {
        Truth {
            blocks: self.blocks.iter().filter(|(k, _)| k.rank == rank).map(|(k, v)| (k.clone(), v.clone())).collect(),
        }
    }

    /// Total live copies.
    pub fn copies(&self) -> u64 {
        self.blocks.values().flat_map(|m| m.values()).map(|&n| u64::from(n)).sum()
    }

    /// The manifests' `expected_refcounted` shape: `[{dp_rank, medium, group_idx,
    /// block_hashes (sorted), counts}]`.
    pub fn to_json(&self) -> Json {
        Json::Array(
            self.blocks
                .iter()
                .map(|(k, v)| {
                    json!({
                        "dp_rank": k.rank,
                        "medium": k.medium,
                        "group_idx": k.group,
                        "block_hashes": v.keys().collect::<Vec<_>>(),
                        "counts": v.values().collect::<Vec<_>>(),
                    })
                })
                .collect(),
        )
    }

    /// Read a manifest's `expected_refcounted` (counts given) or `expected` (count 1 each).
    pub fn from_json(j: &Json) -> Option<Truth> {
        let mut t = Truth::new();
        for entry in j.as_array()? {
            let key = TruthKey {
                rank: entry["dp_rank"].as_u64()? as u32,
                medium: entry["medium"].as_str().map(str::to_string),
                group: entry["group_idx"].as_u64().map(|g| g as u32),
            };
            let hashes = entry["block_hashes"].as_array()?;
            let counts = entry.get("counts").and_then(Json::as_array);
            let live = t.blocks.entry(key).or_default();
            for (i, h) in hashes.iter().enumerate() {
                let n = counts.and_then(|c| c.get(i)).and_then(Json::as_u64).unwrap_or(1);
                live.insert(h.as_u64()?, n as u32);
            }
        }
        t.blocks.retain(|_, v| !v.is_empty());
        Some(t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(h: &[u64]) -> WireEvent {
        WireEvent::Stored { hashes: h.to_vec(), medium: Some("GPU".into()), group_idx: Some(0) }
    }

    fn removed(h: &[u64]) -> WireEvent {
        WireEvent::Removed { hashes: h.to_vec(), medium: Some("GPU".into()), group_idx: Some(0) }
    }

    #[test]
    fn copies_are_counted_and_removed_one_at_a_time() {
        let mut t = Truth::new();
        t.apply(0, &stored(&[1, 2]));
        t.apply(0, &stored(&[1]));
        t.apply(0, &removed(&[1, 9]));
        let key = TruthKey::new(0, Some("GPU"), Some(0));
        assert_eq!(t.blocks[&key], BTreeMap::from([(1, 1), (2, 1)]));
        t.apply(0, &removed(&[1, 2]));
        assert!(t.blocks.is_empty());
    }

    #[test]
    fn clear_touches_only_its_rank() {
        let mut t = Truth::new();
        t.apply(0, &stored(&[1]));
        t.apply(1, &stored(&[1]));
        t.apply(1, &WireEvent::Cleared);
        assert_eq!(t.copies(), 1);
        assert_eq!(Truth::from_json(&t.to_json()), Some(t));
    }
}
