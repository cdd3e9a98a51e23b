//! A lookup keeps the candidates of a crowded first block (one held by many workers) for the
//! next lookups of that block in its thread. These tests change such a block in every way
//! that matters and check each following lookup against the reference: a kept answer must
//! never outlive a change.

use kv_router_client::index::{IndexConfig, StagedSnapshot, TierId};

use crate::util::{churn, held_by, seq, w, Pair};

fn pair() -> Pair {
    Pair::new(IndexConfig { shards: 4, initial_capacity: 0 })
}

/// 40 workers hold the first 1..=6 blocks of `s` (block 0 is crowded).
fn crowded(p: &mut Pair, s: &[u64]) {
    for k in 0..40u32 {
        p.store(w(k), TierId::DEVICE, &s[..1 + k as usize % s.len()]);
    }
}

#[test]
fn kept_candidates_of_a_crowded_first_block_follow_every_change() {
    let mut p = pair();
    let s = seq(1, 6);
    crowded(&mut p, &s);
    let workers = |p: &Pair| p.lookup(&s).iter().map(|m| (m.worker.get(), m.blocks)).collect::<Vec<_>>();
    assert_eq!(workers(&p).len(), 40);
    // Twice: the second lookup uses what the first kept.
    assert_eq!(workers(&p), workers(&p));

    // A new holder of block 0.
    p.store(w(77), TierId::DEVICE, &s[..3]);
    assert!(workers(&p).contains(&(77, 3)));
    // A holder's last copy of block 0 goes.
    p.remove(w(5), TierId::DEVICE, &s[..1]);
    assert!(!workers(&p).iter().any(|&(k, _)| k == 5));
    // Copies only: a second copy, then one taken; worker 6 still holds block 0.
    p.store(w(6), TierId::DEVICE, &s[..1]);
    p.remove(w(6), TierId::DEVICE, &s[..1]);
    assert!(workers(&p).contains(&(6, 1)));
    // Another tier: stored, then cleared.
    p.store(w(8), TierId::HOST, &s);
    assert_eq!(p.lookup(&s).get(w(8)).unwrap().tier(TierId::HOST), 6);
    p.clear(w(8), Some(TierId::HOST));
    assert_eq!(p.lookup(&s).get(w(8)).unwrap().tier(TierId::HOST), 0);
    // A resync with another state, and a worker dropped.
    let mut snapshot = StagedSnapshot::new();
    snapshot.extend_blocks(TierId::DISK, &s[..4]);
    p.replace(w(9), &snapshot);
    assert_eq!(p.lookup(&s).get(w(9)).unwrap().tier(TierId::DISK), 4);
    p.remove_worker(w(10));
    assert!(!workers(&p).iter().any(|&(k, _)| k == 10));
    // The shard's table rebuilt many times over (new tables), with block 0 kept throughout.
    for k in 0..20_000u64 {
        p.store(w(200), TierId::DEVICE, &[k.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1]);
        if k % 2_000 == 0 {
            p.lookup(&s);
        }
    }
    p.remove(w(11), TierId::DEVICE, &s[..1]);
    assert!(!workers(&p).iter().any(|&(k, _)| k == 11));
    p.check_counts();
}

#[test]
fn two_indexes_in_one_thread_never_share_kept_candidates() {
    // The same writes in another tier: the same key versions and swap sequence, other answers.
    let mut a = pair();
    let mut b = pair();
    let s = seq(2, 4);
    for k in 0..30u32 {
        a.store(w(k), TierId::DEVICE, &s[..2]);
        b.store(w(k), TierId::HOST, &s[..2]);
    }
    for _ in 0..3 {
        assert_eq!(a.lookup(&s).get(w(0)).unwrap().tier(TierId::DEVICE), 2);
        assert_eq!(b.lookup(&s).get(w(0)).unwrap().tier(TierId::HOST), 2);
    }
}

/// A writer adds and drops holders of a crowded first block while this thread looks it up
/// over and over: the static holders are always there with their exact match, and once the
/// writer stops, the next lookup is exactly the final state.
#[test]
fn kept_candidates_stay_exact_while_a_crowded_first_block_churns() {
    let s = seq(3, 5);
    let index = held_by(20, &s);
    let writer = {
        let index = index.clone();
        let s = s.clone();
        churn(move |i| {
            let worker = w(100 + (i % 50) as u32);
            index.store(worker, TierId::DEVICE, &s[..2]);
            index.remove(worker, TierId::DEVICE, &s[..2]);
        })
    };
    for _ in 0..20_000 {
        let r = index.lookup(&s);
        for k in 0..20u32 {
            assert_eq!(r.blocks(w(k)), 5, "static worker {k}");
        }
        assert!(r.iter().all(|m| m.worker.get() < 20 || m.blocks <= 2));
    }
    writer.stop();
    let r = index.lookup(&s);
    let got: Vec<(u32, u32)> = r.iter().map(|m| (m.worker.get(), m.blocks)).collect();
    assert_eq!(got, (0..20u32).map(|k| (k, 5)).collect::<Vec<_>>());
}

/// Eight holders, the fewest whose candidates are kept (one more than a group's slots).
#[test]
fn kept_candidates_of_a_block_with_eight_holders_follow_changes() {
    let mut p = pair();
    let s = seq(4, 3);
    for k in 0..8u32 {
        p.store(w(k), TierId::DEVICE, &s[..1 + k as usize % 3]);
    }
    assert_eq!(p.lookup(&s).len(), 8);
    assert_eq!(p.lookup(&s).len(), 8);
    p.remove(w(3), TierId::DEVICE, &s[..1]);
    assert_eq!(p.lookup(&s).len(), 7);
    p.store(w(3), TierId::HOST, &s[..1]);
    p.store(w(50), TierId::DEVICE, &s);
    let r = p.lookup(&s);
    assert_eq!((r.len(), r.blocks(w(50)), r.get(w(3)).unwrap().tier(TierId::HOST)), (9, 3, 1));
}

/// A lookup finds block 1's holders among the kept candidates by a table indexed by worker id
/// when the ids are dense (the other tests), and by a binary search when they are sparse, as
/// here: both give the reference's answer.
#[test]
fn kept_candidates_of_workers_with_sparse_ids_follow_changes() {
    let mut p = pair();
    let s = seq(5, 4);
    let ids: Vec<u32> = (0..12u32).map(|k| 1_000 * k + 7).collect();
    for (k, &id) in ids.iter().enumerate() {
        p.store(w(id), TierId::DEVICE, &s[..1 + k % 4]);
    }
    let blocks = |p: &Pair| p.lookup(&s).iter().map(|m| (m.worker.get(), m.blocks)).collect::<Vec<_>>();
    let want: Vec<(u32, u32)> = ids.iter().enumerate().map(|(k, &id)| (id, 1 + (k % 4) as u32)).collect();
    // Twice: the second lookup starts from the kept candidates.
    assert_eq!(blocks(&p), want);
    assert_eq!(blocks(&p), want);
    // A holder with a lower id than all: the candidates are kept again, and reused.
    p.store(w(3), TierId::DEVICE, &s);
    let mut want = want;
    want.insert(0, (3, 4));
    assert_eq!(blocks(&p), want);
    assert_eq!(blocks(&p), want);
}
