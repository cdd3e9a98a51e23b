//! Lookups racing snapshot swaps see exactly the old or the new state of the swapped worker;
//! lookups racing writers, and writers racing each other, leave every answer exact.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_router_client::index::reference::ReferenceIndex;
use kv_router_client::index::{IndexConfig, PrefixIndex, StagedSnapshot, TierId};

use crate::util::{churn, held_by, seq, w};

#[test]
fn lookups_during_snapshot_swaps_see_one_whole_state() {
    let index = Arc::new(PrefixIndex::new(IndexConfig { shards: 4, initial_capacity: 0 }));
    let requests: Vec<Vec<u64>> = (0..8).map(|r| seq(r, 48)).collect();

    // Two states of worker 0 that differ on every request: different lengths and tiers.
    let mut a = StagedSnapshot::new();
    let mut b = StagedSnapshot::new();
    for (i, r) in requests.iter().enumerate() {
        a.extend_blocks(TierId::DEVICE, &r[..8 + i * 4]);
        a.extend_blocks(TierId::HOST, &r[..4]);
        b.extend_blocks(TierId::DISK, &r[..40 - i * 3]);
        b.extend_blocks(TierId::DEVICE, &r[..2 + i]);
        b.push(TierId::DEVICE, r[0], 3);
    }
    // Bulk for worker 0 beyond the requests, so staging and deleting take a while and
    // force rebuilds.
    let bulk = seq(1000, 20_000);
    a.extend_blocks(TierId::DEVICE, &bulk[..10_000]);
    b.extend_blocks(TierId::DEVICE, &bulk[5_000..]);

    // Static workers 1 and 2 around it.
    let mut base = ReferenceIndex::new();
    for r in &requests {
        index.store(w(1), TierId::DEVICE, &r[..20]);
        base.store(w(1), TierId::DEVICE, &r[..20]);
        index.store(w(2), TierId::HOST, &r[..10]);
        base.store(w(2), TierId::HOST, &r[..10]);
    }
    let answers = |snap: &StagedSnapshot| {
        let mut r = base.clone();
        r.replace_worker(w(0), snap);
        requests.iter().map(|q| r.lookup(q)).collect::<Vec<_>>()
    };
    let (want_a, want_b) = (answers(&a), answers(&b));
    for (x, y) in want_a.iter().zip(&want_b) {
        assert_ne!(x, y, "the two states must be distinguishable");
    }
    index.replace_worker(w(0), &a);

    let stop = Arc::new(AtomicBool::new(false));
    let seen_b = Arc::new(AtomicUsize::new(0));
    let readers: Vec<_> = (0..3)
        .map(|k| {
            let (index, stop, seen_b) = (index.clone(), stop.clone(), seen_b.clone());
            let (requests, want_a, want_b) = (requests.clone(), want_a.clone(), want_b.clone());
            std::thread::spawn(move || {
                let mut n = 0usize;
                while !stop.load(Ordering::Relaxed) {
                    let q = (n + k) % requests.len();
                    let got = index.lookup(&requests[q]);
                    if got == want_b[q] {
                        seen_b.fetch_add(1, Ordering::Relaxed);
                    } else {
                        assert_eq!(got, want_a[q], "request {q}: neither state A nor B");
                    }
                    n += 1;
                }
                n
            })
        })
        .collect();

    let swaps = if cfg!(debug_assertions) { 40 } else { 400 };
    for i in 0..swaps {
        index.replace_worker(w(0), if i % 2 == 0 { &b } else { &a });
    }
    stop.store(true, Ordering::Relaxed);
    let lookups: usize = readers.into_iter().map(|r| r.join().unwrap()).sum();
    eprintln!("{swaps} swaps, {lookups} concurrent lookups ({} saw state B)", seen_b.load(Ordering::Relaxed));
    assert!(lookups > 0);
    // Quiescent: the final state is A, exactly, and nothing of B is left behind.
    for (q, r) in requests.iter().enumerate() {
        assert_eq!(index.lookup(r), want_a[q]);
    }
    let mut full = base.clone();
    full.replace_worker(w(0), &a);
    assert_eq!(index.stats().blocks, full.len());
}

#[test]
fn lookups_during_incremental_writes_of_other_workers_stay_exact_for_a_static_one() {
    let index = Arc::new(PrefixIndex::new(IndexConfig { shards: 2, initial_capacity: 0 }));
    let request = seq(77, 32);
    index.store(w(9), TierId::HOST, &request[..17]);
    let writer = churn({
        let index = index.clone();
        move |i| {
            // Churn through the shared shards: grows, tombstones and rebuilds tables.
            let s = seq(i % 50, 64);
            index.store(w(1 + (i % 3) as u32), TierId::DEVICE, &s);
            index.remove(w(1 + ((i + 1) % 3) as u32), TierId::DEVICE, &s);
        }
    });
    for _ in 0..20_000 {
        let got = index.lookup(&request);
        let m = got.get(w(9)).expect("worker 9 holds block 0");
        assert_eq!((m.blocks, m.tier(TierId::HOST)), (17, 17));
    }
    writer.stop();
}

/// A static worker whose runs break (its blocks stored in two events, with no parent between
/// them) shares a prefix with a worker whose whole chain is one run, removed and stored again
/// over and over: the lookups follow both workers' runs together, probe where the static
/// worker's run breaks (while the other's slots come and go), and go on; whatever the race,
/// the static worker's match is its own, exactly.
#[test]
fn a_static_worker_whose_runs_break_keeps_its_exact_match_beside_a_churning_co_holder() {
    let index = Arc::new(PrefixIndex::new(IndexConfig { shards: 2, initial_capacity: 0 }));
    let request = seq(91, 40);
    index.store(w(1), TierId::DEVICE, &request[..6]);
    index.store(w(1), TierId::DEVICE, &seq(5_000, 3));
    index.store(w(1), TierId::DEVICE, &request[6..12]);
    let writer = churn({
        let index = index.clone();
        let request = request.clone();
        move |_| {
            index.store(w(2), TierId::DEVICE, &request[..30]);
            index.remove(w(2), TierId::DEVICE, &request[..30]);
        }
    });
    // The churning worker's whole chain is there only between a store and the next removal:
    // on a busy machine the two threads may not run at once for a while, so the lookups go on
    // past 100,000 until one has seen it (for at most a minute).
    let (mut both, mut lookups, started) = (0, 0, Instant::now());
    while lookups < 100_000 || (both == 0 && started.elapsed() < Duration::from_secs(60)) {
        let got = index.lookup(&request);
        assert_eq!(got.blocks(w(1)), 12, "the static worker");
        let other = got.blocks(w(2));
        assert!(other <= 30, "the churning worker matched {other}");
        both += (other == 30) as usize;
        lookups += 1;
    }
    writer.stop();
    // Both workers were seen holding their whole prefixes: the lookups raced a live writer.
    assert!(both > 0, "no lookup of {lookups} saw the churning worker's whole chain");
}

#[test]
fn writers_of_different_workers_on_the_same_shards_leave_the_index_exact() {
    // Four writer threads, one worker each, store and remove the same chains: every block's
    // key is in one of two shards, so the writers meet on the shards' locks and tables (their
    // growth, sweeps and rebuilds). Each worker's final state depends only on its own
    // operations, so it must equal theirs applied in order to the reference.
    const WRITERS: u32 = 4;
    const OPS: u64 = 3_000;
    let index = Arc::new(PrefixIndex::new(IndexConfig { shards: 2, initial_capacity: 0 }));
    let ops = |wk: u32, i: u64| -> (Vec<u64>, Option<Vec<u64>>) {
        let stored = seq((i + wk as u64) % 40, 48);
        let removed = (i % 3 == 2).then(|| seq((i + 1) % 40, 48));
        (stored, removed)
    };
    let threads: Vec<_> = (0..WRITERS)
        .map(|wk| {
            let index = index.clone();
            std::thread::spawn(move || {
                for i in 0..OPS {
                    let (stored, removed) = ops(wk, i);
                    index.store_after(w(1 + wk), TierId::DEVICE, None, &stored);
                    if let Some(r) = removed {
                        index.remove(w(1 + wk), TierId::DEVICE, &r);
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("a writer thread panicked");
    }
    let mut reference = ReferenceIndex::new();
    for wk in 0..WRITERS {
        for i in 0..OPS {
            let (stored, removed) = ops(wk, i);
            reference.store(w(1 + wk), TierId::DEVICE, &stored);
            if let Some(r) = removed {
                reference.remove(w(1 + wk), TierId::DEVICE, &r);
            }
        }
    }
    for wk in 0..WRITERS {
        assert_eq!(index.blocks(w(1 + wk)), reference.blocks(w(1 + wk)), "blocks of worker {}", 1 + wk);
    }
    let stats = index.stats();
    assert_eq!((stats.blocks, stats.missing_removes), (reference.len(), reference.missing_removes()));
    for root in 0..40 {
        let request = seq(root, 48);
        assert_eq!(index.lookup(&request), reference.lookup(&request), "lookup of chain {root}");
    }
}

/// Holders of a popular prefix come and go (its blocks' crowd records are rewritten under the
/// lookups), one static holder's second tier comes and goes (its first block's record is
/// dropped and taken again), and other blocks make the tables grow and rebuild: every static
/// holder's match stays exact, and the churning ones never match past what they store.
#[test]
fn a_popular_prefix_stays_exact_while_its_records_change_under_lookups() {
    let s = seq(4, 6);
    let index = held_by(10, &s);
    let writer = churn({
        let index = index.clone();
        let s = s.clone();
        move |i| {
            let worker = w(20 + (i % 100) as u32);
            index.store(worker, TierId::DEVICE, &s[..3]);
            if i % 7 == 0 {
                index.store(w(3), TierId::HOST, &s[..1]);
                index.remove(w(3), TierId::HOST, &s[..1]);
            }
            index.remove(worker, TierId::DEVICE, &s[..3]);
            index.store(worker, TierId::DEVICE, &[0x5000 + i % 3000]);
        }
    });
    for _ in 0..20_000 {
        let r = index.lookup(&s);
        for k in 0..10u32 {
            let m = r.get(w(k)).expect("a static holder");
            assert_eq!((m.blocks, m.tier(TierId::DEVICE)), (6, 6), "static worker {k}");
        }
        assert!(r.iter().all(|m| m.worker.get() < 10 || m.blocks <= 3));
    }
    writer.stop();
}
