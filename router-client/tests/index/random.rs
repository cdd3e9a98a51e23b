//! Random interleavings of every operation, checked against the reference after each one.
//!
//! The seeded run's total operation count is `KV_INDEX_PROPTEST_OPS` (default: 240,000 in
//! debug builds, 4,000,000 in release), split over seeds and index shapes; every operation is
//! followed by lookups that must equal the reference exactly.

use kv_router_client::index::{IndexConfig, StagedSnapshot, TierId, WorkerId};
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::util::{chain, t, w, Pair};

const DEPTH: usize = 9;
const ROOTS: u64 = 5;

/// A request drawn from a small tree of chained hashes, so requests share prefixes.
fn request(rng: &mut StdRng) -> Vec<u64> {
    let len = rng.random_range(1..=DEPTH);
    let mut h = rng.random_range(0..ROOTS);
    (0..len)
        .map(|_| {
            h = chain(h, rng.random_range(0..2));
            h
        })
        .collect()
}

/// A run of hashes taken from a request: its prefix mostly, sometimes a middle slice.
fn blocks(rng: &mut StdRng) -> Vec<u64> {
    chained(rng).1
}

/// [`blocks`] with the hash before them in their request (`None` for a prefix).
fn chained(rng: &mut StdRng) -> (Option<u64>, Vec<u64>) {
    let r = request(rng);
    if rng.random_bool(0.7) {
        (None, r)
    } else {
        let a = rng.random_range(0..r.len());
        let b = rng.random_range(a..r.len());
        (a.checked_sub(1).map(|p| r[p]), r[a..=b].to_vec())
    }
}

const WORKERS: [u32; 6] = [0, 1, 2, 3, 5000, 70_000];

fn worker(rng: &mut StdRng) -> WorkerId {
    w(WORKERS[rng.random_range(0..WORKERS.len())])
}

fn tier(rng: &mut StdRng) -> TierId {
    // Four fixed tiers, two "other" tiers, and the last possible id.
    const TIERS: [u8; 7] = [0, 1, 2, 3, 4, 5, 63];
    t(TIERS[rng.random_range(0..TIERS.len())])
}

/// A worker's new state: runs of requests' blocks, mostly with the parents they were stored
/// after (as a relay's snapshot gives them), sometimes without or with a wrong one, in order
/// or shuffled, so that the replace lays chains out every way.
fn snapshot(rng: &mut StdRng) -> StagedSnapshot {
    let mut staged: Vec<(TierId, u64, u32, Option<u64>)> = Vec::new();
    for _ in 0..rng.random_range(0..6) {
        let tier = tier(rng);
        let (mut parent, hashes) = chained(rng);
        for h in hashes {
            let given = match rng.random_range(0..8) {
                0 => None,
                1 => Some(rng.random_range(0..1u64 << 20)),
                _ => parent,
            };
            staged.push((tier, h, rng.random_range(0..3), given));
            parent = Some(h);
        }
    }
    if rng.random_bool(0.5) {
        for i in (1..staged.len()).rev() {
            staged.swap(i, rng.random_range(0..=i));
        }
    }
    let mut snap = StagedSnapshot::new();
    for (tier, h, copies, parent) in staged {
        snap.push_after(tier, h, copies, parent);
    }
    snap
}

fn total_ops() -> usize {
    let default = if cfg!(debug_assertions) { 240_000 } else { 4_000_000 };
    std::env::var("KV_INDEX_PROPTEST_OPS").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Runs `ops` random operations from `seed`; returns how many lookups were compared.
fn run(seed: u64, ops: usize, config: IndexConfig) -> usize {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut p = Pair::new(config);
    let mut recent: Vec<Vec<u64>> = Vec::new();
    let mut lookups = 0;
    for op in 0..ops {
        let roll = rng.random_range(0..100);
        let (wk, tr) = (worker(&mut rng), tier(&mut rng));
        match roll {
            0..=34 => {
                // The parent the engine would send, mostly; else one of another request (held
                // or not, by this holder or others), or none.
                let (parent, b) = chained(&mut rng);
                let parent = match rng.random_range(0..10) {
                    0..=5 => parent,
                    6..=7 => recent.last().and_then(|r| r.last().copied()),
                    _ => None,
                };
                p.store_after(wk, tr, parent, &b);
                recent.push(b);
            }
            35..=44 => {
                // Duplicate store: the same blocks again, often in the same place.
                if let Some(b) = recent.last().cloned() {
                    p.store(wk, tr, &b);
                }
            }
            45..=76 => {
                let b = blocks(&mut rng);
                p.remove(wk, tr, &b);
            }
            77..=81 => {
                // Removal of hashes nobody ever stored.
                let missing: Vec<u64> = (0..3).map(|_| rng.random::<u64>() | 1 << 63).collect();
                let out = p.remove(wk, tr, &missing);
                assert_eq!(out.missing, 3);
            }
            82..=85 => p.clear(wk, Some(tr)),
            86..=87 => p.clear(wk, None),
            88..=96 => {
                let snap = snapshot(&mut rng);
                p.replace(wk, &snap);
            }
            _ => p.remove_worker(wk),
        }
        if recent.len() > 64 {
            recent.drain(..32);
        }
        // Lookups: a fresh request, and one just stored (likely to match deep).
        p.lookup(&request(&mut rng));
        if let Some(b) = recent.last() {
            p.lookup(b);
            // Exact copy counts of those blocks, for one (worker, tier).
            let (wk, tr) = (worker(&mut rng), tier(&mut rng));
            for &h in b {
                assert_eq!(p.index.copies(wk, tr, h), p.reference.copies(wk, tr, h), "copies of {h:x}");
            }
        }
        lookups += 2;
        if op % 1024 == 0 {
            p.check_counts();
            p.check_blocks(&WORKERS.map(w));
        }
    }
    p.check_counts();
    p.check_blocks(&WORKERS.map(w));
    lookups
}

fn run_seeds(seeds: std::ops::Range<u64>, share: usize) {
    let configs = [
        IndexConfig { shards: 1, initial_capacity: 0 },
        IndexConfig { shards: 4, initial_capacity: 0 },
        IndexConfig::default(),
        IndexConfig { shards: 2, initial_capacity: 10_000 },
    ];
    let n = seeds.end - seeds.start;
    let per_seed = share / n as usize;
    let mut lookups = 0;
    for seed in seeds {
        lookups += run(seed, per_seed, configs[seed as usize % configs.len()]);
    }
    eprintln!("random ops: {} operations, {lookups} lookups compared", per_seed * n as usize);
}

#[test]
fn random_operations_match_reference_seeds_0_to_7() {
    run_seeds(0..8, total_ops() / 2);
}

#[test]
fn random_operations_match_reference_seeds_8_to_15() {
    run_seeds(8..16, total_ops() / 2);
}

/// Small shrinkable cases: proptest finds a minimal failing sequence if the seeded run fails.
#[derive(Clone, Debug)]
enum Op {
    Store(u32, u8, Option<u64>, Vec<u64>),
    Remove(u32, u8, Vec<u64>),
    Clear(u32, Option<u8>),
    Replace(u32, Vec<(u8, u64, u32)>),
    RemoveWorker(u32),
}

fn hashes() -> impl Strategy<Value = Vec<u64>> {
    prop::collection::vec(0u64..12, 1..6)
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u32..3, 0u8..3, prop::option::of(0u64..12), hashes()).prop_map(|(w, t, p, h)| Op::Store(w, t, p, h)),
        3 => (0u32..3, 0u8..3, hashes()).prop_map(|(w, t, h)| Op::Remove(w, t, h)),
        1 => (0u32..3, prop::option::of(0u8..3)).prop_map(|(w, t)| Op::Clear(w, t)),
        1 => (0u32..3, prop::collection::vec((0u8..3, 0u64..12, 0u32..3), 0..8))
            .prop_map(|(w, e)| Op::Replace(w, e)),
        1 => (0u32..3).prop_map(Op::RemoveWorker),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn small_sequences_match_reference(ops in prop::collection::vec(op(), 1..40)) {
        let mut p = Pair::new(IndexConfig { shards: 2, initial_capacity: 0 });
        for op in ops {
            match op {
                Op::Store(wk, tr, parent, h) => p.store_after(w(wk), t(tr), parent, &h),
                Op::Remove(wk, tr, h) => { p.remove(w(wk), t(tr), &h); }
                Op::Clear(wk, tr) => p.clear(w(wk), tr.map(t)),
                Op::Replace(wk, e) => {
                    let mut snap = StagedSnapshot::new();
                    for (tr, h, c) in e { snap.push(t(tr), h, c); }
                    p.replace(w(wk), &snap);
                }
                Op::RemoveWorker(wk) => p.remove_worker(w(wk)),
            }
            for start in 0..12u64 {
                let req: Vec<u64> = (start..12).collect();
                p.lookup(&req);
                p.lookup(&[start, (start * 7) % 12]);
            }
            p.check_counts();
            p.check_blocks(&[w(0), w(1), w(2)]);
        }
    }
}

/// A snapshot of thousands of blocks, as a relay sends one: chains of several tiers (forks off
/// their middles, blocks staged twice or without copies, parents not staged), some longer than
/// a replace writes under one taking of a lock, shuffled; replaced again over itself and beside
/// another worker's, its lookups equal the reference's.
#[test]
fn large_shuffled_snapshots_with_parents_match_reference() {
    let mut rng = StdRng::seed_from_u64(28);
    let mut p = Pair::new(IndexConfig { shards: 4, initial_capacity: 0 });
    let mut requests: Vec<Vec<u64>> = Vec::new();
    for round in 0..3u64 {
        let mut staged: Vec<(TierId, u64, u32, Option<u64>)> = Vec::new();
        for c in 0..40u64 {
            let tier = t([0, 1, 63][(c % 3) as usize]);
            // A fork: the chain starts after a block of an earlier chain of the same tier.
            let mut parent = (c >= 3 && c % 4 == 0).then(|| requests[(c - 3) as usize][60]);
            let chain: Vec<u64> = (0..rng.random_range(if c % 10 == 0 { 1500..2500 } else { 100..300 }))
                .map(|_| rng.random::<u64>() >> 1)
                .collect();
            let start = staged.len();
            for &h in &chain {
                let copies = match rng.random_range(0..50) {
                    0 => 0,
                    1 => 3,
                    _ => 1,
                };
                staged.push((tier, h, copies, parent));
                if rng.random_range(0..40) == 0 {
                    staged.push((tier, h, 1, parent));
                }
                parent = Some(h);
            }
            if c == 7 {
                // A chain whose first block's parent is not staged.
                staged[start].3 = Some(u64::MAX - 1);
            }
            let mut request: Vec<u64> = match (c >= 3 && c % 4 == 0).then(|| &requests[(c - 3) as usize]) {
                Some(from) => from[..=60].to_vec(),
                None => Vec::new(),
            };
            request.extend(&chain);
            requests.push(request);
        }
        for i in (1..staged.len()).rev() {
            staged.swap(i, rng.random_range(0..=i));
        }
        let mut snap = StagedSnapshot::new();
        for &(tier, h, copies, parent) in &staged {
            snap.push_after(tier, h, copies, parent);
        }
        // Worker 1 first, then worker 0 over it (its state of the round before, if any).
        p.replace(w(1 + round as u32 % 2), &snap);
        p.replace(w(0), &snap);
        for r in &requests {
            p.lookup(r);
            p.lookup(&r[r.len() / 2..]);
        }
        p.check_counts();
        p.check_blocks(&[w(0), w(1), w(2)]);
        requests.clear();
    }
}
