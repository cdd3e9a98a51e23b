//! One test per rule, with exact expected values, checked against the reference as well.

use std::collections::BTreeMap;

use kv_router_client::index::{IndexConfig, LookupResult, StagedSnapshot, TierId, TierRun};

use crate::util::{seq, t, w, Pair};

fn pair() -> Pair {
    Pair::new(IndexConfig::default())
}

/// `(worker, blocks, [(tier, run)])`.
type Flat = (u32, u32, Vec<(u8, u32)>);

/// One [`Flat`] for each worker of a result.
fn flat(r: &LookupResult) -> Vec<Flat> {
    r.iter()
        .map(|m| {
            let tiers = m.tiers.iter().map(|r| (r.tier.get(), r.blocks)).collect();
            (m.worker.get(), m.blocks, tiers)
        })
        .collect()
}

#[test]
fn store_twice_remove_once_is_still_held() {
    let mut p = pair();
    let s = seq(1, 3);
    p.store(w(0), TierId::DEVICE, &s);
    p.store(w(0), TierId::DEVICE, &s[..1]);
    assert_eq!(p.index.copies(w(0), TierId::DEVICE, s[0]), 2);
    let out = p.remove(w(0), TierId::DEVICE, &s[..1]);
    assert_eq!((out.removed, out.missing), (1, 0));
    assert_eq!(p.index.copies(w(0), TierId::DEVICE, s[0]), 1);
    assert_eq!(flat(&p.lookup(&s)), vec![(0, 3, vec![(0, 3)])]);
    // The second removal takes the last copy: the run stops before block 0.
    p.remove(w(0), TierId::DEVICE, &s[..1]);
    assert!(p.lookup(&s).is_empty());
    assert_eq!(p.index.stats().blocks, 2);
    p.check_counts();
}

#[test]
fn remove_of_absent_hash_is_a_counted_no_op() {
    let mut p = pair();
    let s = seq(2, 2);
    p.store(w(1), TierId::HOST, &s[..1]);
    let out = p.remove(w(1), TierId::HOST, &[s[1], s[1], s[0], s[0]]);
    assert_eq!((out.removed, out.missing), (1, 3));
    // Absent in another tier or for another worker is missing too.
    p.store(w(1), TierId::HOST, &s[..1]);
    let out = p.remove(w(2), TierId::HOST, &s[..1]);
    assert_eq!((out.removed, out.missing), (0, 1));
    let out = p.remove(w(1), TierId::DISK, &s[..1]);
    assert_eq!((out.removed, out.missing), (0, 1));
    assert_eq!(p.index.stats().missing_removes, 5);
    // Nothing underflowed: one copy is still there, and one removal takes it.
    assert_eq!(flat(&p.lookup(&s)), vec![(1, 1, vec![(1, 1)])]);
    let out = p.remove(w(1), TierId::HOST, &s[..1]);
    assert_eq!((out.removed, out.missing), (1, 0));
    assert!(p.lookup(&s).is_empty());
    p.check_counts();
}

#[test]
fn clear_tier_leaves_other_tiers_and_workers() {
    let mut p = pair();
    let s = seq(3, 4);
    p.store(w(0), TierId::DEVICE, &s);
    p.store(w(0), TierId::HOST, &s[..2]);
    p.store(w(1), TierId::DEVICE, &s[..3]);
    p.clear(w(0), Some(TierId::DEVICE));
    assert_eq!(flat(&p.lookup(&s)), vec![(0, 2, vec![(1, 2)]), (1, 3, vec![(0, 3)])]);
    p.clear(w(0), None);
    assert_eq!(flat(&p.lookup(&s)), vec![(1, 3, vec![(0, 3)])]);
    p.check_counts();
}

#[test]
fn leading_run_stops_at_the_first_gap() {
    let mut p = pair();
    let s = seq(4, 6);
    // Holds blocks 0, 1, 3, 4, 5: the run is 2 even though later blocks are held.
    p.store(w(3), TierId::DEVICE, &[s[0], s[1], s[3], s[4], s[5]]);
    assert_eq!(flat(&p.lookup(&s)), vec![(3, 2, vec![(0, 2)])]);
    // A worker without block 0 is omitted even if it holds the rest.
    p.store(w(4), TierId::DEVICE, &s[1..]);
    assert_eq!(flat(&p.lookup(&s)), vec![(3, 2, vec![(0, 2)])]);
    // Lookups of a prefix, and of nothing.
    assert_eq!(flat(&p.lookup(&s[..1])), vec![(3, 1, vec![(0, 1)])]);
    assert!(p.lookup(&[]).is_empty());
    p.check_counts();
}

#[test]
fn any_tier_run_spans_tiers_while_tier_runs_are_separate() {
    let mut p = pair();
    let s = seq(5, 6);
    let other = p.index.tier("nvme-pool").unwrap();
    assert_eq!(other.get(), 4);
    // device: 0 1 2 . . . ; host: . . 2 3 . . ; other: 0 . . . 4 .
    p.store(w(7), TierId::DEVICE, &s[..3]);
    p.store(w(7), TierId::HOST, &s[2..4]);
    p.store(w(7), other, &[s[0], s[4]]);
    let r = p.lookup(&s);
    // Any tier: blocks 0..=4 each held somewhere; block 5 nowhere.
    assert_eq!(flat(&r), vec![(7, 5, vec![(0, 3), (4, 1)])]);
    let m = r.get(w(7)).unwrap();
    assert_eq!(m.tier(TierId::DEVICE), 3);
    assert_eq!(m.tier(TierId::HOST), 0, "host's run does not start at block 0");
    assert_eq!(m.tier(other), 1);
    assert_eq!(m.tiers, &[TierRun { tier: TierId::DEVICE, blocks: 3 }, TierRun { tier: other, blocks: 1 }]);
    p.check_counts();
}

#[test]
fn workers_are_sorted_and_each_gets_its_own_runs() {
    let mut p = pair();
    let s = seq(6, 4);
    for raw in [9, 2, 5] {
        p.store(w(raw), TierId::DISK, &s[..raw as usize % 4 + 1]);
    }
    assert_eq!(flat(&p.lookup(&s)), vec![(2, 3, vec![(2, 3)]), (5, 2, vec![(2, 2)]), (9, 2, vec![(2, 2)])]);
}

#[test]
fn replace_worker_swaps_the_whole_state_and_sums_duplicates() {
    let mut p = pair();
    let s = seq(7, 5);
    p.store(w(0), TierId::DEVICE, &s);
    p.store(w(1), TierId::DEVICE, &s[..2]);
    let mut snap = StagedSnapshot::new();
    snap.extend_blocks(TierId::HOST, &s[..3]);
    snap.push(TierId::HOST, s[0], 2);
    snap.push(TierId::EXTERNAL, s[0], 0);
    p.replace(w(0), &snap);
    assert_eq!(flat(&p.lookup(&s)), vec![(0, 3, vec![(1, 3)]), (1, 2, vec![(0, 2)])]);
    assert_eq!(p.reference.copies(w(0), TierId::HOST, s[0]), 3);
    // Three copies of block 0: two removals leave it held.
    p.remove(w(0), TierId::HOST, &[s[0], s[0]]);
    assert_eq!(p.lookup(&s).blocks(w(0)), 3);
    // Stores after a replace land in the new state.
    p.store(w(0), TierId::HOST, &s[3..]);
    assert_eq!(p.lookup(&s).blocks(w(0)), 5);
    p.remove_worker(w(0));
    assert_eq!(flat(&p.lookup(&s)), vec![(1, 2, vec![(0, 2)])]);
    assert_eq!(p.index.stats().replaces, 2);
    p.check_counts();
}

#[test]
fn blocks_lists_a_workers_whole_state_by_tier_with_copies() {
    let mut p = pair();
    let s = seq(3, 4);
    p.store(w(0), TierId::DEVICE, &s);
    p.store(w(0), TierId::DEVICE, &s[..1]);
    p.store(w(0), t(9), &s[2..]);
    p.store(w(1), TierId::HOST, &s[..2]);
    p.remove(w(0), TierId::DEVICE, &[s[3]]);
    let want = BTreeMap::from([
        (TierId::DEVICE, BTreeMap::from([(s[0], 2), (s[1], 1), (s[2], 1)])),
        (t(9), BTreeMap::from([(s[2], 1), (s[3], 1)])),
    ]);
    assert_eq!(p.index.blocks(w(0)), want);
    assert_eq!(p.index.blocks(w(1)), BTreeMap::from([(TierId::HOST, BTreeMap::from([(s[0], 1), (s[1], 1)]))]));
    assert_eq!(p.index.blocks(w(2)), BTreeMap::new());
    // A replace is listed whole; a tier cleared is gone.
    let mut snap = StagedSnapshot::new();
    snap.push(TierId::DISK, s[1], 3);
    p.replace(w(1), &snap);
    p.clear(w(0), Some(t(9)));
    assert_eq!(p.index.blocks(w(1)), BTreeMap::from([(TierId::DISK, BTreeMap::from([(s[1], 3)]))]));
    assert_eq!(p.index.blocks(w(0)).keys().copied().collect::<Vec<_>>(), vec![TierId::DEVICE]);
    p.check_blocks(&[w(0), w(1), w(2)]);
}

#[test]
fn hash_values_zero_and_max_are_ordinary_keys() {
    let mut p = pair();
    let s = [0, u64::MAX, 1];
    p.store(w(0), TierId::DEVICE, &s);
    p.store(w(0), t(5), &s[..1]);
    assert_eq!(flat(&p.lookup(&s)), vec![(0, 3, vec![(0, 3), (5, 1)])]);
    p.check_counts();
}

#[test]
fn many_holders_of_one_hash_and_growth_keep_answers_exact() {
    // One shard with no initial room: every store path goes through rebuilds.
    let mut p = Pair::new(IndexConfig { shards: 1, initial_capacity: 0 });
    let s = seq(8, 40);
    for raw in 0..300 {
        let tier = t((raw % 5) as u8);
        p.store(w(raw), tier, &s[..(raw as usize % 40) + 1]);
    }
    let r = p.lookup(&s);
    assert_eq!(r.len(), 300);
    assert_eq!(r.blocks(w(299)), 299 % 40 + 1);
    for raw in (0..300).step_by(3) {
        p.remove_worker(w(raw));
    }
    assert_eq!(p.lookup(&s).len(), 200);
    p.check_counts();
    assert!(p.index.stats().tombstones <= p.index.stats().slots);
}

#[test]
fn interners_hand_out_dense_stable_ids() {
    let p = pair();
    let a = p.index.worker("http://relay-a:50051", 0).unwrap();
    let b = p.index.worker("http://relay-a:50051", 1).unwrap();
    let a2 = p.index.worker("http://relay-a:50051", 0).unwrap();
    assert_eq!((a.get(), b.get(), a2), (0, 1, a));
    assert_eq!(&*p.index.workers().key(b).unwrap().0, "http://relay-a:50051");
    assert_eq!(p.index.tier("host").unwrap(), TierId::HOST);
    assert_eq!(p.index.tier("cpu_pinned_x").unwrap().get(), 4);
    assert_eq!(p.index.tier("cpu_pinned_x").unwrap().get(), 4);
    assert_eq!(&*p.index.tiers().name(TierId::DISK).unwrap(), "disk");
    for i in 5..64 {
        assert_eq!(p.index.tier(&format!("tier{i}")).unwrap().get() as usize, i);
    }
    assert!(p.index.tier("one-too-many").is_err());
}

#[test]
fn copies_saturate_instead_of_wrapping() {
    let mut p = pair();
    let mut snap = StagedSnapshot::new();
    snap.push(TierId::DEVICE, 42, u32::MAX);
    p.replace(w(0), &snap);
    p.store(w(0), TierId::DEVICE, &[42]);
    assert_eq!(p.index.stats().saturated_stores, 1);
    assert_eq!(p.reference.copies(w(0), TierId::DEVICE, 42), u32::MAX);
    assert_eq!(p.index.copies(w(0), TierId::DEVICE, 42), u32::MAX);
    p.remove(w(0), TierId::DEVICE, &[42]);
    assert_eq!(p.index.copies(w(0), TierId::DEVICE, 42), u32::MAX - 1);
    assert_eq!(p.lookup(&[42]).blocks(w(0)), 1);
}

/// A million chained blocks stored by one worker into an empty index of `shards` shards, 64 a
/// call, and the blocks.
fn a_million_blocks_stored(shards: usize) -> (kv_router_client::index::PrefixIndex, Vec<u64>) {
    let index = kv_router_client::index::PrefixIndex::new(IndexConfig { shards, initial_capacity: 0 });
    let s = seq(9, 1_000_000);
    for chunk in s.chunks(64) {
        index.store(w(1), TierId::DEVICE, chunk);
    }
    (index, s)
}

#[test]
fn memory_per_block_is_compact_for_a_million_blocks() {
    let (index, _) = a_million_blocks_stored(IndexConfig::default().shards);
    let stats = index.stats();
    assert_eq!(stats.blocks, 1_000_000);
    let per_block = index.memory_bytes() as f64 / 1e6;
    eprintln!("memory_bytes per block for 1M blocks: {per_block:.1} ({stats:?})");
    assert!(per_block < 40.0, "{per_block} bytes per block");
}

#[test]
fn a_growing_index_grows_each_table_by_half_or_more_at_each_rebuild() {
    // A million stores into an empty index, no removals: every rebuild is a table growing.
    // Each grows by at least half (`Table::grown`), so a shard that went from 14 slots to
    // `slots / shards` took at most log1.5 of that ratio rebuilds, plus one. Tables rebuilt
    // for one more slot at 72% grew by 4-16% a rebuild and took 624 here.
    let shards = 16;
    let (index, s) = a_million_blocks_stored(shards);
    let stats = index.stats();
    assert_eq!((stats.blocks, stats.sweeps, stats.tombstones), (1_000_000, 0, 0));
    let per_shard = (stats.slots as f64 / shards as f64 / 14.0).ln() / 1.5f64.ln() + 1.0;
    let most = (shards as f64 * per_shard) as u64;
    assert!(stats.rebuilds <= most, "{} rebuilds, at most {most} for {} slots", stats.rebuilds, stats.slots);
    assert!(stats.rebuilds >= shards as u64, "{} rebuilds: every shard grew", stats.rebuilds);
    assert_eq!(index.lookup(&s[..300]).get(w(1)).map(|m| m.blocks), Some(300));
}

#[test]
fn steady_churn_frees_dead_slots_in_place_and_stays_exact() {
    // One shard at a steady live set: requests of 8 blocks stored and, 64 requests later,
    // removed, by 4 workers. The table fills with dead slots; those whose grace has passed,
    // in groups no live slot went past, are freed in place (sweeps), and the table is rebuilt
    // only when too few are.
    let mut p = Pair::new(IndexConfig { shards: 1, initial_capacity: 0 });
    let req = |i: u64| seq(1_000 + i, 8);
    for i in 0..3_000u64 {
        let worker = w((i % 4) as u32);
        p.store(worker, TierId::DEVICE, &req(i));
        if i >= 64 {
            assert_eq!(p.remove(w(((i - 64) % 4) as u32), TierId::DEVICE, &req(i - 64)).removed, 8);
        }
        if i % 97 == 0 {
            for k in i.saturating_sub(80)..=i {
                p.lookup(&req(k));
            }
        }
    }
    let stats = p.index.stats();
    assert_eq!(stats.blocks, 64 * 8);
    let grown = stats.rebuilds;
    assert!(stats.sweeps > 0, "the churn should fill the table with dead slots: {stats:?}");
    // More churn at the same live set: no rebuild, only sweeps.
    for i in 3_000..6_000u64 {
        p.store(w((i % 4) as u32), TierId::DEVICE, &req(i));
        assert_eq!(p.remove(w(((i - 64) % 4) as u32), TierId::DEVICE, &req(i - 64)).removed, 8);
    }
    let after = p.index.stats();
    // Most times the table was full, a sweep made room (a small table's dead slots
    // are still in their grace period or in passed groups the other times).
    assert!(after.sweeps - stats.sweeps > after.rebuilds - grown, "{stats:?} then {after:?}");
    for k in 5_900..6_000u64 {
        assert_eq!(p.lookup(&req(k)).blocks(w((k % 4) as u32)), if k >= 5_936 { 8 } else { 0 });
    }
    p.check_blocks(&[w(0), w(1), w(2), w(3)]);
    p.check_counts();
}
