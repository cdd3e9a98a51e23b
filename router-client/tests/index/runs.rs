//! Lookups that follow a holder's stored runs must answer exactly as block-by-block probes
//! would: runs broken by removals, runs longer than a page, the same hash in several runs,
//! stores whose parents other workers hold, pages freed and reused, and large copy counts.

use std::sync::Arc;

use kv_router_client::index::{IndexConfig, PrefixIndex, StagedSnapshot, TierId};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::util::{churn, seq, t, w, Pair};

fn pair() -> Pair {
    Pair::new(IndexConfig { shards: 4, initial_capacity: 0 })
}

/// `(blocks, run in DEVICE)` of `worker` for `request`.
fn device(p: &Pair, worker: u32, request: &[u64]) -> (u32, u32) {
    let r = p.lookup(request);
    r.get(w(worker)).map_or((0, 0), |m| (m.blocks, m.tier(TierId::DEVICE)))
}

#[test]
fn a_removal_in_the_middle_of_a_run_ends_the_match_there_and_a_restore_resumes_it() {
    let mut p = pair();
    let s = seq(1, 10);
    p.store(w(0), TierId::DEVICE, &s);
    assert_eq!(device(&p, 0, &s), (10, 10));
    p.remove(w(0), TierId::DEVICE, &s[4..5]);
    assert_eq!(device(&p, 0, &s), (4, 4));
    // Stored again, block 4 sits elsewhere in the worker's pages; the match goes on past it.
    p.store(w(0), TierId::DEVICE, &s[4..5]);
    assert_eq!(device(&p, 0, &s), (10, 10));
    // Held in another tier only: the any-tier run goes on, the device run stops.
    p.remove(w(0), TierId::DEVICE, &s[6..7]);
    p.store(w(0), TierId::HOST, &s[6..7]);
    let r = p.lookup(&s);
    let m = r.get(w(0)).unwrap();
    assert_eq!((m.blocks, m.tier(TierId::DEVICE), m.tier(TierId::HOST)), (10, 6, 0));
    p.check_counts();
}

#[test]
fn runs_longer_than_a_page_match_across_page_ends() {
    let mut p = pair();
    let s = seq(2, 300);
    p.store(w(3), TierId::DEVICE, &s[..150]);
    p.store(w(3), TierId::DEVICE, &s[150..]);
    assert_eq!(device(&p, 3, &s), (300, 300));
    // Removals right before, at and after page ends (entries 63, 64, 127, 128).
    for cut in [63, 64, 127, 128, 191, 299] {
        p.remove(w(3), TierId::DEVICE, &s[cut..=cut]);
        assert_eq!(device(&p, 3, &s), (cut as u32, cut as u32), "cut at {cut}");
        p.store(w(3), TierId::DEVICE, &s[cut..=cut]);
        assert_eq!(device(&p, 3, &s), (300, 300), "restored {cut}");
    }
    p.check_counts();
}

#[test]
fn the_same_hash_in_several_runs_and_requests_that_leave_a_run() {
    let mut p = pair();
    // Not chained: block 1 of both runs is the same hash, and a request may take either way.
    p.store(w(0), TierId::DEVICE, &[10, 11, 12, 13]);
    p.store(w(0), TierId::DEVICE, &[20, 11, 22, 23]);
    assert_eq!(device(&p, 0, &[10, 11, 22, 23]), (4, 4));
    assert_eq!(device(&p, 0, &[20, 11, 12, 13]), (4, 4));
    assert_eq!(device(&p, 0, &[10, 11, 12, 23, 13]), (5, 5));
    // Stored twice: two copies, one slot; one removal leaves it held.
    p.remove(w(0), TierId::DEVICE, &[11]);
    assert_eq!(device(&p, 0, &[20, 11, 12]), (3, 3));
    p.remove(w(0), TierId::DEVICE, &[11]);
    assert_eq!(device(&p, 0, &[20, 11, 12]), (1, 1));
    p.check_counts();
}

#[test]
fn stores_whose_parents_other_workers_hold_match_only_from_their_first_block() {
    let mut p = pair();
    let s = seq(3, 8);
    p.store(w(1), TierId::DEVICE, &s[..5]);
    // Worker 2 holds a suffix only (its parent, block 2, is worker 1's).
    p.store(w(2), TierId::DEVICE, &s[3..]);
    let r = p.lookup(&s);
    assert_eq!(r.len(), 1);
    assert_eq!(r.blocks(w(1)), 5);
    assert_eq!(device(&p, 2, &s[3..]), (5, 5));
    // Worker 2 then stores the prefix: one chain over two runs.
    p.store(w(2), TierId::DEVICE, &s[..3]);
    assert_eq!(device(&p, 2, &s), (8, 8));
    p.check_counts();
}

#[test]
fn pages_of_dropped_runs_are_reused_and_answers_stay_exact() {
    let mut p = Pair::new(IndexConfig { shards: 2, initial_capacity: 0 });
    let keep = seq(4, 100);
    p.store(w(9), TierId::HOST, &keep);
    let mut high = 0;
    for round in 0..60u64 {
        let s = seq(100 + round, 200);
        let wk = w((round % 3) as u32);
        p.store(wk, TierId::DEVICE, &s);
        p.lookup(&s);
        match round % 3 {
            0 => {
                p.remove(wk, TierId::DEVICE, &s);
            }
            1 => p.clear(wk, Some(TierId::DEVICE)),
            _ => {
                let mut snap = StagedSnapshot::new();
                snap.extend_blocks(TierId::DISK, &s[..round as usize]);
                p.replace(wk, &snap);
            }
        }
        p.lookup(&s);
        assert_eq!(device(&p, 9, &keep), (100, 0));
        assert_eq!(p.lookup(&keep).get(w(9)).unwrap().tier(TierId::HOST), 100);
        high = high.max(p.index.stats().run_pages.0);
    }
    p.check_counts();
    p.check_blocks(&[w(0), w(1), w(2), w(9)]);
    // Freed pages come back: 60 rounds of 200 blocks did not take 60 rounds' worth of pages.
    let (used, free) = p.index.stats().run_pages;
    assert!(high < 60 * 200 / 64, "pages in use peaked at {high}");
    assert!(used + free < 60 * 200 / 64, "{used} pages used, {free} free");
}

#[test]
fn a_page_left_sparse_is_compacted_and_its_blocks_still_match() {
    let mut p = pair();
    let s = seq(6, 200);
    // Pages: s[..64], s[64..128], s[128..192], and s[192..] (the one appended to).
    p.store(w(0), TierId::DEVICE, &s[..64]);
    p.store(w(0), TierId::DEVICE, &s[64..128]);
    p.store(w(0), TierId::DEVICE, &s[128..]);
    assert_eq!(p.index.stats().run_pages.0, 4);
    // Removing 48 of the first page's blocks leaves 16: they move to the last page and the
    // first is freed.
    p.remove(w(0), TierId::DEVICE, &s[10..58]);
    assert_eq!(p.index.stats().run_pages.0, 3);
    assert_eq!(device(&p, 0, &s), (10, 10));
    assert_eq!(device(&p, 0, &s[58..]), (142, 142));
    p.store(w(0), TierId::DEVICE, &s[10..58]);
    assert_eq!(device(&p, 0, &s), (200, 200));
    p.check_blocks(&[w(0)]);
    p.check_counts();
}

#[test]
fn copy_counts_beyond_a_slots_field_are_exact() {
    let mut p = pair();
    let s = seq(5, 3);
    for _ in 0..70 {
        p.store(w(0), TierId::DEVICE, &s[..2]);
    }
    p.store(w(0), TierId::DEVICE, &s[2..]);
    assert_eq!(p.index.copies(w(0), TierId::DEVICE, s[0]), 70);
    for n in (1..70).rev() {
        p.remove(w(0), TierId::DEVICE, &s[..1]);
        assert_eq!(p.index.copies(w(0), TierId::DEVICE, s[0]), n);
        assert_eq!(device(&p, 0, &s), (3, 3));
    }
    p.remove(w(0), TierId::DEVICE, &s[..1]);
    assert_eq!(device(&p, 0, &s), (0, 0));
    let mut snap = StagedSnapshot::new();
    snap.push(t(7), s[1], 64);
    snap.push(t(7), s[1], 2);
    p.replace(w(0), &snap);
    p.check_blocks(&[w(0)]);
    p.remove(w(0), t(7), &[s[1], s[1], s[1]]);
    p.check_blocks(&[w(0)]);
    p.check_counts();
}

/// Requests over a few long chains; stores are runs of them (often continuing an earlier run),
/// removals hit the middle of runs; several workers and tiers share blocks.
#[test]
fn random_long_runs_match_reference() {
    let ops = if cfg!(debug_assertions) { 3_000 } else { 40_000 };
    for seed in 0..4u64 {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut p = Pair::new(IndexConfig { shards: 1 << (seed % 3), initial_capacity: 0 });
        let chains: Vec<Vec<u64>> = (0..6).map(|c| seq(1000 + c, 160)).collect();
        let span = |rng: &mut StdRng| {
            let c = &chains[rng.random_range(0..chains.len())];
            let a = if rng.random_bool(0.5) { 0 } else { rng.random_range(0..c.len()) };
            let b = rng.random_range(a..c.len().min(a + 90)) + 1;
            (c.clone(), a, b)
        };
        for _ in 0..ops {
            let wk = w(rng.random_range(0..4));
            let tr = t(rng.random_range(0..3));
            let (c, a, b) = span(&mut rng);
            match rng.random_range(0..10) {
                0..=4 => p.store(wk, tr, &c[a..b]),
                5..=7 => {
                    let x = rng.random_range(a..b);
                    p.remove(wk, tr, &c[x..b.min(x + rng.random_range(1..4))]);
                }
                8 => {
                    p.remove(wk, tr, &c[a..b]);
                }
                _ => {
                    if rng.random_bool(0.5) {
                        p.clear(wk, Some(tr));
                    } else {
                        let mut snap = StagedSnapshot::new();
                        snap.extend_blocks(tr, &c[a..b]);
                        p.replace(wk, &snap);
                    }
                }
            }
            let (c, _, b) = span(&mut rng);
            p.lookup(&c[..b]);
            p.lookup(&c);
        }
        p.check_counts();
        p.check_blocks(&[w(0), w(1), w(2), w(3)]);
    }
}

#[test]
fn lookups_following_a_static_workers_long_runs_stay_exact_while_pages_churn() {
    let index = Arc::new(PrefixIndex::new(IndexConfig { shards: 2, initial_capacity: 0 }));
    let request = seq(77, 260);
    index.store(w(9), TierId::DEVICE, &request[..100]);
    index.store(w(9), TierId::DEVICE, &request[100..250]);
    let writer = churn({
        let index = index.clone();
        move |i| {
            // Other holders fill pages and drop them: removed, cleared, replaced.
            let s = seq(i % 40, 130);
            let wk = w(1 + (i % 3) as u32);
            index.store(wk, TierId::DEVICE, &s);
            match i % 3 {
                0 => {
                    index.remove(wk, TierId::DEVICE, &s);
                }
                1 => index.clear(wk, Some(TierId::DEVICE)),
                _ => index.remove_worker(wk),
            }
        }
    });
    for _ in 0..if cfg!(debug_assertions) { 5_000 } else { 50_000 } {
        let got = index.lookup(&request);
        let m = got.get(w(9)).expect("worker 9 holds block 0");
        assert_eq!((m.blocks, m.tier(TierId::DEVICE)), (250, 250));
    }
    writer.stop();
}

/// A popular prefix: block 0 held by every worker (over a thousand, so the lookup sorts its
/// holders by worker id in two radix passes), in one tier or several, with each worker's
/// tiers ending at different blocks and some workers holding later blocks only in another tier.
#[test]
fn a_block_held_by_many_workers_in_several_tiers_answers_exactly() {
    let mut p = pair();
    let s = seq(9, 12);
    let mut rng = StdRng::seed_from_u64(7);
    // Ids up to 1,100 (the radix sort's digit is 10 bits), interleaved so that the table's
    // order of block 0's holders is not the workers' order.
    for k in 0..1100u32 {
        let worker = (k * 7) % 1100;
        let depth = rng.random_range(1..=s.len());
        p.store(w(worker), TierId::DEVICE, &s[..depth]);
        if worker % 3 == 0 {
            // A second tier holding a shorter or longer run.
            let host = rng.random_range(1..=s.len());
            p.store(w(worker), TierId::HOST, &s[..host]);
        }
        if worker % 5 == 0 && depth < s.len() {
            // The any-tier run goes on in a tier that did not hold block 0.
            let more = rng.random_range(depth + 1..=s.len());
            p.store(w(worker), t(9), &s[depth..more]);
        }
    }
    for len in [1, 2, 3, 7, 12] {
        let r = p.lookup(&s[..len]);
        assert_eq!(r.len(), 1100, "every worker holds block 0 (request of {len} blocks)");
    }
    // Fewer holders than the radix path's threshold, and holders with ids under 1,024 only.
    let u = seq(10, 5);
    for worker in [5u32, 900, 17, 3] {
        p.store(w(worker), TierId::HOST, &u[..(worker as usize % 5) + 1]);
    }
    let r = p.lookup(&u);
    let got: Vec<(u32, u32)> = r.iter().map(|m| (m.worker.get(), m.blocks)).collect();
    assert_eq!(got, vec![(3, 4), (5, 1), (17, 3), (900, 1)]);
    p.check_counts();
}
