//! Popular blocks (eight holders and more): lookups read them from their crowd records, which
//! must follow every change of their holders. Random operations over many workers sharing a
//! few prefixes, checked against the reference after each one.

use kv_router_client::index::{IndexConfig, StagedSnapshot, TierId};
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::util::{seq, t, w, Pair};

/// Three prefixes of 6 blocks that every worker may hold.
fn prefixes() -> Vec<Vec<u64>> {
    (0..3).map(|r| seq(0xc0 + r, 6)).collect()
}

/// Workers 0..20 mostly; 127 (the bitsets' last) and 128 and 70,000 (past them) sometimes.
fn worker(rng: &mut StdRng) -> u32 {
    match rng.random_range(0..40) {
        0 => 127,
        1 => 128,
        2 => 70_000,
        k => k % 20,
    }
}

/// The device tier mostly: a second tier makes a block's record go.
fn tier(rng: &mut StdRng) -> TierId {
    if rng.random_range(0..12) == 0 {
        TierId::HOST
    } else {
        TierId::DEVICE
    }
}

fn check(p: &Pair, prefixes: &[Vec<u64>]) {
    for q in prefixes {
        for end in [1, 2, 4, 6] {
            p.lookup(&q[..end]);
        }
        p.lookup(&q[1..]);
    }
}

/// `ops` random operations from `seed`, every lookup compared.
fn run(seed: u64, ops: usize, config: IndexConfig) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut p = Pair::new(config);
    let prefixes = prefixes();
    for op in 0..ops {
        let (wk, tr) = (w(worker(&mut rng)), tier(&mut rng));
        let q = &prefixes[rng.random_range(0..prefixes.len())];
        let end = rng.random_range(1..=q.len());
        match rng.random_range(0..100) {
            0..=49 => p.store_after(wk, tr, None, &q[..end]),
            50..=84 => {
                p.remove(wk, tr, &q[rng.random_range(0..end)..end]);
            }
            85..=88 => p.clear(wk, Some(tr)),
            89..=96 => {
                let mut snap = StagedSnapshot::new();
                snap.extend_blocks(tr, &q[..end]);
                if rng.random_bool(0.3) {
                    snap.extend_blocks(tier(&mut rng), &prefixes[0][..rng.random_range(1..=6)]);
                }
                p.replace(wk, &snap);
            }
            _ => p.remove_worker(wk),
        }
        check(&p, &prefixes);
        if op % 256 == 0 {
            p.check_counts();
        }
    }
    p.check_counts();
    p.check_blocks(&[0, 1, 2, 19, 127, 128, 70_000].map(w));
}

#[test]
fn popular_blocks_match_the_reference_through_random_changes() {
    let ops = if cfg!(debug_assertions) { 4_000 } else { 60_000 };
    for seed in 0..4 {
        let shards = [1, 2, 16, 4][seed as usize];
        run(seed, ops, IndexConfig { shards, initial_capacity: 0 });
    }
}

/// Twelve workers hold a prefix at different depths; the first block's record answers for
/// all of them, and the lookup's values are the depths each stored.
#[test]
fn a_lookup_over_a_popular_prefix_gives_every_holders_depth() {
    let mut p = Pair::new(IndexConfig { shards: 1, initial_capacity: 0 });
    let q = seq(0xd0, 8);
    for k in 0..12u32 {
        p.store(w(k), t(0), &q[..1 + k as usize % 8]);
    }
    let found = p.lookup(&q);
    let depths: Vec<(u32, u32)> = found.iter().map(|m| (m.worker.get(), m.blocks)).collect();
    assert_eq!(
        depths,
        [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6), (6, 7), (7, 8), (8, 1), (9, 2), (10, 3), (11, 4)]
    );
    // A hole in one worker's middle block ends it there; others go on.
    p.remove(w(7), t(0), &q[3..4]);
    assert_eq!(p.lookup(&q).blocks(w(7)), 3);
    assert_eq!(p.lookup(&q).blocks(w(6)), 7);
}

#[derive(Clone, Debug)]
enum Op {
    Store(u32, u8, usize, usize),
    Remove(u32, u8, usize, usize),
    Replace(u32, u8, usize),
}

fn op() -> impl Strategy<Value = Op> {
    let worker = prop_oneof![8 => 0u32..12, 1 => Just(127u32), 1 => Just(128u32)];
    prop_oneof![
        5 => (worker.clone(), 0u8..2, 0usize..2, 1usize..6).prop_map(|(w, t, q, n)| Op::Store(w, t, q, n)),
        3 => (worker.clone(), 0u8..2, 0usize..2, 1usize..6).prop_map(|(w, t, q, n)| Op::Remove(w, t, q, n)),
        1 => (worker, 0u8..2, 0usize..6).prop_map(|(w, t, n)| Op::Replace(w, t, n)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]
    /// Shrinkable: a failing sequence is cut down to a minimal one.
    #[test]
    fn small_sequences_over_popular_blocks_match_reference(ops in prop::collection::vec(op(), 1..80)) {
        let mut p = Pair::new(IndexConfig { shards: 1, initial_capacity: 0 });
        let prefixes = prefixes();
        for op in ops {
            match op {
                Op::Store(wk, tr, q, n) => p.store(w(wk), t(tr), &prefixes[q][..n]),
                Op::Remove(wk, tr, q, n) => { p.remove(w(wk), t(tr), &prefixes[q][n - 1..n]); }
                Op::Replace(wk, tr, n) => {
                    let mut snap = StagedSnapshot::new();
                    snap.extend_blocks(t(tr), &prefixes[0][..n]);
                    p.replace(w(wk), &snap);
                }
            }
            check(&p, &prefixes);
        }
    }
}
