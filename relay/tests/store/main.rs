//! The durable store: bounds, copies, clears, epoch and format, snapshot against the reference
//! semantics ([`LiveBlocks`]), filters, history ranges, the crash protocol, and a kill -9 drill.

use kv_relay::live::{LiveBlocks, LiveKey};
use kv_relay::model::*;
use kv_relay::store::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use std::path::Path;

// ---------------------------------------------------------------- fixtures

fn cfg(dir: &Path, max_batches: u64, max_bytes: u64) -> StoreConfig {
    StoreConfig {
        dir: dir.to_path_buf(),
        limits: HistoryLimits { max_batches, max_bytes },
        cache_bytes: 8 << 20,
        // A short tail in memory: reads exercise both it and the log's files.
        recent: RecentLimits { max_records: 4, max_bytes: 1 << 20 },
        checkpoint: CheckpointPolicy::default(),
        // Small segments: the log begins a new file every few commits.
        segment_bytes: 4096,
    }
}

fn open(dir: &Path) -> Store {
    Store::open(cfg(dir, u64::MAX, u64::MAX)).unwrap()
}

fn stored(tier: Tier, group: u32, parent: Option<u64>, hashes: &[u64]) -> Event {
    let blocks = hashes.iter().map(|&h| Block::new(h, vec![h as u32, 7])).collect();
    Event::Stored(Stored { parent, ..Stored::plain(tier, group, 2, blocks) })
}

fn removed(tier: Tier, group: u32, hashes: &[u64]) -> Event {
    Event::Removed(Removed { tier, group, block_hashes: hashes.to_vec(), ownership: None })
}

fn cleared(tier: Option<Tier>) -> Event {
    Event::Cleared(Cleared { tier })
}

fn batch(dp_rank: u32, seq: u64, events: Vec<Event>) -> RecordBody {
    RecordBody::Batch { batch: Batch { dp_rank, seq, ts: seq as f64, events }, load: None, liveness: None }
}

fn control(dp_rank: u32, kind: ControlKind) -> RecordBody {
    RecordBody::Control(Control { dp_rank, kind })
}

fn snapshot_all(s: &Store, filter: SnapshotFilter) -> (u64, Vec<SnapshotBlock>) {
    let snap = s.snapshot(filter).unwrap();
    let cursor = snap.cursor;
    let mut out: Vec<SnapshotBlock> = Vec::new();
    for chunk in snap {
        out.extend(chunk.unwrap());
    }
    sort(&mut out);
    (cursor, out)
}

fn sort(v: &mut [SnapshotBlock]) {
    v.sort_by(|a, b| (a.dp_rank, &a.tier, a.group, a.hash).cmp(&(b.dp_rank, &b.tier, b.group, b.hash)));
}

/// (rank, tier, group, hash, copies)
fn copies(s: &Store) -> Vec<(u32, Tier, u32, u64, u32)> {
    snapshot_all(s, SnapshotFilter::all())
        .1
        .into_iter()
        .map(|b| (b.dp_rank, b.tier, b.group, b.hash, b.copies))
        .collect()
}

/// A block's parent, block size, namespace, token ids and layout.
type Attrs = (Option<u64>, u32, Namespace, Vec<u32>, TokenLayout);

/// The reference: [`LiveBlocks`] for what is live and its copies, plus each block's attributes
/// as its latest store gave them.
#[derive(Default)]
struct Reference {
    live: LiveBlocks,
    attrs: BTreeMap<(LiveKey, u64), Attrs>,
}

impl Reference {
    fn apply(&mut self, body: &RecordBody) {
        match body {
            RecordBody::Batch { batch, .. } => {
                for e in &batch.events {
                    if let Event::Stored(s) = e {
                        let key = LiveKey { dp_rank: batch.dp_rank, tier: s.tier.clone(), group: s.group.idx };
                        let mut parent = s.parent;
                        for b in &s.blocks {
                            let a = (parent, s.block_size, s.namespace.clone(), b.token_ids.clone(), s.token_layout);
                            self.attrs.insert((key.clone(), b.hash), a);
                            parent = Some(b.hash);
                        }
                    }
                    self.live.apply_event(batch.dp_rank, e);
                }
            }
            RecordBody::Control(Control { dp_rank, kind: ControlKind::RankReset { .. } }) => {
                self.live.reset_rank(*dp_rank)
            }
            RecordBody::Control(_) => {}
        }
    }

    fn snapshot(&self, filter: &SnapshotFilter) -> Vec<SnapshotBlock> {
        let mut out = Vec::new();
        for (key, set) in &self.live.blocks {
            if filter.ranks.as_ref().is_some_and(|r| !r.contains(&key.dp_rank))
                || filter.tiers.as_ref().is_some_and(|t| !t.contains(&key.tier))
            {
                continue;
            }
            for (&hash, &copies) in set {
                let (parent, block_size, namespace, token_ids, token_layout) = self.attrs[&(key.clone(), hash)].clone();
                out.push(SnapshotBlock {
                    dp_rank: key.dp_rank,
                    tier: key.tier.clone(),
                    group: key.group,
                    hash,
                    parent,
                    block_size,
                    namespace,
                    copies,
                    token_ids: if filter.include_token_ids { token_ids } else { Vec::new() },
                    token_layout,
                });
            }
        }
        sort(&mut out);
        out
    }

    /// (rank, tier, group) -> (blocks, copies, distinct namespaces)
    fn summary(&self) -> Vec<(u32, Tier, u32, u64, u64, u64)> {
        let mut out: Vec<_> = self
            .live
            .blocks
            .iter()
            .map(|(k, set)| {
                let ns: std::collections::BTreeSet<_> =
                    set.keys().map(|h| format!("{:?}", self.attrs[&(k.clone(), *h)].2)).collect();
                (
                    k.dp_rank,
                    k.tier.clone(),
                    k.group,
                    set.len() as u64,
                    set.values().map(|&c| c as u64).sum(),
                    ns.len() as u64,
                )
            })
            .collect();
        out.sort();
        out
    }
}

fn summary(s: &Store) -> Vec<(u32, Tier, u32, u64, u64, u64)> {
    let mut v: Vec<_> =
        s.live_summary().into_iter().map(|g| (g.dp_rank, g.tier, g.group, g.blocks, g.copies, g.namespaces)).collect();
    v.sort();
    v
}

const TIERS: [fn() -> Tier; 4] = [|| Tier::Device, || Tier::Host, || Tier::Disk, || Tier::Other("LMCache".into())];

/// A seeded random record: stores, removals and clears over few hashes (so copies and removals of
/// absent blocks happen), several ranks, tiers, groups and namespaces, and rank controls.
fn random_body(rng: &mut StdRng, dp_rank: u32, seq: u64, resets: bool) -> RecordBody {
    let roll = rng.random_range(0..1000);
    if resets && roll < 2 {
        return control(dp_rank, ControlKind::RankReset { reason: "restart".into() });
    }
    if roll < 10 {
        let kind = match rng.random_range(0..3) {
            0 => ControlKind::RankDegraded { reason: "gap".into() },
            1 => ControlKind::RankIncomplete { reason: "late".into() },
            _ => ControlKind::RankRecovered,
        };
        return control(dp_rank, kind);
    }
    let n = rng.random_range(1..4);
    let mut events = Vec::new();
    for _ in 0..n {
        let tier = TIERS[rng.random_range(0..TIERS.len())]();
        let group = rng.random_range(0..2);
        let k = rng.random_range(0..100);
        if k < 55 {
            let hashes: Vec<u64> =
                (0..rng.random_range(1..5)).map(|_| rng.random_range(0..60u64) * 0x9e37_79b9).collect();
            let namespace = match rng.random_range(0..4) {
                0 => Namespace { lora_name: Some("adapter".into()), ..Default::default() },
                1 => Namespace { cache_salt: Some(format!("salt{}", rng.random_range(0..3))), ..Default::default() },
                2 => Namespace { lora_id: Some(-3), lora_name: Some("x".into()), cache_salt: Some("s".into()) },
                _ => Namespace::default(),
            };
            let layout = if rng.random_bool(0.2) { TokenLayout::Bigram } else { TokenLayout::Single };
            events.push(Event::Stored(Stored {
                tier,
                group: Group { idx: group, kind: Some("full_attention".into()), sliding_window: None },
                parent: rng.random_bool(0.7).then(|| rng.random_range(0..1000)),
                block_size: rng.random_range(1..32),
                token_layout: layout,
                blocks: hashes
                    .iter()
                    .map(|&hash| Block {
                        hash,
                        token_ids: (0..rng.random_range(0..6)).map(|_| rng.random()).collect(),
                        extra_keys: rng.random_bool(0.1).then(|| KeyPart::List(vec![KeyPart::Str("ab".into())])),
                    })
                    .collect(),
                namespace,
                session_id: None,
                ownership: None,
                lookahead_token_ids: None,
                block_mm_infos: None,
            }));
        } else if k < 95 {
            let hashes: Vec<u64> =
                (0..rng.random_range(1..5)).map(|_| rng.random_range(0..60u64) * 0x9e37_79b9).collect();
            events.push(removed(tier, group, &hashes));
        } else if k < 99 {
            events.push(removed(tier, group, &[rng.random_range(0..60u64) * 0x9e37_79b9]));
        } else if rng.random_bool(0.3) {
            events.push(cleared(None));
        } else {
            events.push(cleared(Some(tier)));
        }
    }
    batch(dp_rank, seq, events)
}

fn all_history(s: &Store) -> Vec<Record> {
    let mut out = Vec::new();
    let mut after = 0;
    loop {
        let page = s.history(after, 1000).unwrap();
        let Some(last) = page.last() else { return out };
        after = last.cursor;
        out.extend(page);
    }
}

/// A store that checkpoints only when asked, each commit in a segment of its own (so that the
/// log can be removed a record at a time).
fn cfg_manual(dir: &Path, max_batches: u64) -> StoreConfig {
    StoreConfig {
        checkpoint: CheckpointPolicy { every_records: u64::MAX, every_bytes: u64::MAX },
        segment_bytes: 1,
        ..cfg(dir, max_batches, u64::MAX)
    }
}

/// This test binary run again for the one test `name` (a crash child), its stdout piped and
/// its stderr dropped; the caller adds the child's environment and spawns it.
fn child_test(name: &str) -> std::process::Command {
    let mut c = std::process::Command::new(std::env::current_exe().unwrap());
    c.args([name, "--exact", "--nocapture", "--test-threads", "1"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null());
    c
}

mod bounds;
mod checkpoint_kill;
mod disk;
mod epoch;
mod history;
mod kill;
mod log;
mod snapshot;
