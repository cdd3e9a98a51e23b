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
fn a_page_left_sparse_is_compacted_when_pages_are_half_empty_and_its_blocks_still_match() {
    let mut p = pair();
    let s = seq(6, 136);
    // Pages: s[..64], s[64..128], and s[128..] (the one appended to).
    p.store(w(0), TierId::DEVICE, &s[..64]);
    p.store(w(0), TierId::DEVICE, &s[64..128]);
    p.store(w(0), TierId::DEVICE, &s[128..]);
    assert_eq!(p.index.stats().run_pages.0, 3);
    // Removing 48 of the first page's blocks leaves 16 in it and 88 in 3 pages (room for 192):
    // the 16 move to the last page and the first is freed.
    p.remove(w(0), TierId::DEVICE, &s[10..58]);
    assert_eq!(p.index.stats().run_pages.0, 2);
    assert_eq!(device(&p, 0, &s), (10, 10));
    assert_eq!(device(&p, 0, &s[58..]), (78, 78));
    p.store(w(0), TierId::DEVICE, &s[10..58]);
    assert_eq!(device(&p, 0, &s), (136, 136));
    p.check_blocks(&[w(0)]);
    p.check_counts();
}

#[test]
fn a_nearly_empty_page_is_always_compacted_and_a_sparse_one_only_when_pages_are_half_empty() {
    let mut p = pair();
    let s = seq(6, 200);
    // Pages: s[..64], s[64..128], s[128..192], and s[192..] (the one appended to).
    p.store(w(0), TierId::DEVICE, &s[..64]);
    p.store(w(0), TierId::DEVICE, &s[64..128]);
    p.store(w(0), TierId::DEVICE, &s[128..]);
    // 48 of the first page's blocks removed leave 16 in it and 152 in 4 pages (room for 256):
    // nothing moves.
    p.remove(w(0), TierId::DEVICE, &s[10..58]);
    assert_eq!(p.index.stats().run_pages.0, 4);
    assert_eq!(device(&p, 0, &s), (10, 10));
    assert_eq!(device(&p, 0, &s[58..]), (142, 142));
    // 12 more leave 4 in it (s[60..64]), and 140 live: a page left with 4 moves anyway.
    p.remove(w(0), TierId::DEVICE, &s[..10]);
    assert_eq!(p.index.stats().run_pages.0, 4);
    p.remove(w(0), TierId::DEVICE, &s[58..60]);
    assert_eq!(p.index.stats().run_pages.0, 3);
    assert_eq!(device(&p, 0, &s[60..]), (140, 140));
    // 48 of the second page's: at 16 left in it, 92 live in 3 pages (room for 192), under
    // half: it moves too.
    p.remove(w(0), TierId::DEVICE, &s[64..112]);
    assert_eq!(p.index.stats().run_pages.0, 2);
    assert_eq!(device(&p, 0, &s[60..]), (4, 4));
    assert_eq!(device(&p, 0, &s[112..]), (88, 88));
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
                // Mostly with the parent an engine would send; sometimes none.
                0..=4 => {
                    p.store_after(wk, tr, a.checked_sub(1).filter(|_| rng.random_bool(0.8)).map(|x| c[x]), &c[a..b])
                }
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
    // Other blocks between the two events: the second goes on through a link.
    index.store(w(9), TierId::DEVICE, &seq(78, 30));
    index.store_after(w(9), TierId::DEVICE, Some(request[99]), &request[100..250]);
    let writer = churn({
        let index = index.clone();
        let request = request.clone();
        move |i| {
            // Other holders fill pages and drop them: removed, cleared, replaced. They store
            // the static worker's blocks too, after the same parents, so freed pages come back
            // with the same hashes at the same places.
            let s = if i % 2 == 0 { seq(i % 40, 130) } else { request[100..230].to_vec() };
            let wk = w(1 + (i % 3) as u32);
            index.store_after(wk, TierId::DEVICE, Some(request[99]), &s);
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

/// A link is only a hint: one into a page that was freed and handed to another holder, who
/// wrote the same hash at the same place, must not count for the link's holder.
#[test]
fn a_link_into_a_page_now_anothers_with_the_same_hash_there_does_not_count() {
    let mut p = Pair::new(IndexConfig { shards: 1, initial_capacity: 0 });
    let (a, b) = (w(1), w(2));
    let [parent, x] = [seq(20, 1)[0], seq(21, 1)[0]];
    let fill = |n: u64, len: usize| seq(1000 + n, len);
    // Worker a: the parent at entry 0, then 63 other blocks (its first page is full), then x
    // after the parent: x opens a's second page, and the parent's entry links to it.
    p.store(a, TierId::DEVICE, &[parent]);
    p.store(a, TierId::DEVICE, &fill(0, 63));
    p.store_after(a, TierId::DEVICE, Some(parent), &[x]);
    assert_eq!(device(&p, 1, &[parent, x]), (2, 2));
    assert_eq!(p.index.stats().run_pages, (2, 0));
    // Fill a's second page and open a third, then drop everything in the second: it is freed.
    let more = fill(1, 64);
    p.store(a, TierId::DEVICE, &more);
    assert_eq!(p.index.stats().run_pages, (3, 0));
    p.remove(a, TierId::DEVICE, &[x]);
    p.remove(a, TierId::DEVICE, &more[..63]);
    assert_eq!(p.index.stats().run_pages, (2, 1));
    assert_eq!(device(&p, 1, &[parent, x]), (1, 1));
    // Two other holders take fresh pages while the freed one's grace ticket passes: each
    // allocation moves the numbered periods one step (and so did this thread's first removal,
    // which started one), and the period under way when the page was freed does not count
    // (one step to end it, then two for the next: its flip, and its end at b's allocation).
    for k in 0..2 {
        p.store(w(10 + k), TierId::DEVICE, &fill(10 + k as u64, 1));
    }
    let (used, free) = p.index.stats().run_pages;
    assert_eq!(free, 1, "the freed page waits to be reused");
    // Worker b's first page is the freed one, and x its first entry: where a's link points.
    p.store(b, TierId::DEVICE, &[x]);
    assert_eq!(p.index.stats().run_pages, (used + 1, 0));
    assert_eq!(device(&p, 1, &[parent, x]), (1, 1));
    assert_eq!(device(&p, 2, &[x]), (1, 1));
    // a stores x again (elsewhere): the match goes on, by a probe.
    p.store(a, TierId::DEVICE, &[x]);
    assert_eq!(device(&p, 1, &[parent, x]), (2, 2));
    p.check_blocks(&[a, b]);
    p.check_counts();
}

/// Stored events that continue earlier ones of their worker, with other events between them
/// and events longer than a page: lookups follow the links, and every kind of change of the
/// target (removed, stored again elsewhere, moved by a compaction, its page freed) is exact.
#[test]
fn events_continuing_earlier_ones_match_through_links() {
    let mut p = pair();
    let conv = seq(30, 400);
    let mut at = 0;
    // Turns of 1 to 90 blocks, each after its parent, with another conversation between.
    for (other, turn) in [3usize, 1, 20, 90, 7, 64, 65, 2, 40, 100].into_iter().enumerate() {
        let (from, to) = (at, (at + turn).min(conv.len()));
        p.store_after(w(0), TierId::DEVICE, from.checked_sub(1).map(|k| conv[k]), &conv[from..to]);
        p.store(w(0), TierId::DEVICE, &seq(500 + other as u64, 1 + other % 9));
        at = to;
        assert_eq!(device(&p, 0, &conv), (at as u32, at as u32), "after a turn of {turn}");
    }
    let held = at;
    // Removals at a turn's first block, its last, and in the middle; each restored after the
    // parent (a new link), or with no parent (a probe).
    for (k, cut) in [3usize, 24, 23, 114, 200, 185, 186, 250, 331].into_iter().enumerate() {
        p.remove(w(0), TierId::DEVICE, &conv[cut..=cut]);
        assert_eq!(device(&p, 0, &conv), (cut as u32, cut as u32), "cut at {cut}");
        let parent = (k % 2 == 0).then(|| conv[cut - 1]);
        p.store_after(w(0), TierId::DEVICE, parent, &conv[cut..=cut]);
        assert_eq!(device(&p, 0, &conv), (held as u32, held as u32), "restored {cut}");
    }
    // Thin the early pages out so that they are compacted or freed; the rest still matches.
    for k in (0..held).filter(|k| k % 4 != 0 && *k > 150) {
        p.remove(w(0), TierId::DEVICE, &conv[k..=k]);
    }
    assert_eq!(device(&p, 0, &conv), (151, 151));
    p.check_blocks(&[w(0)]);
    p.check_counts();
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
