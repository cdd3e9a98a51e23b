//! Snapshot.

use super::*;

#[test]
fn snapshot_equals_live_blocks_after_thousands_of_random_batches() {
    let dir = tempfile::tempdir().unwrap();
    let s = Store::open(cfg(dir.path(), 500, u64::MAX)).unwrap();
    let mut rng = StdRng::seed_from_u64(0x5eed);
    let mut reference = Reference::default();
    let mut seqs = [0u64; 3];
    for i in 0..3000 {
        let rank = rng.random_range(0..3u32);
        let n = if i % 7 == 0 { rng.random_range(1..4) } else { 1 };
        let bodies: Vec<RecordBody> = (0..n)
            .map(|_| {
                seqs[rank as usize] += 1;
                random_body(&mut rng, rank, seqs[rank as usize], true)
            })
            .collect();
        bodies.iter().for_each(|b| reference.apply(b));
        if n == 1 {
            s.commit(bodies.into_iter().next().unwrap()).unwrap();
        } else {
            s.commit_many(bodies).unwrap();
        }
        if i % 500 == 499 {
            assert_eq!(
                snapshot_all(&s, SnapshotFilter::all()).1,
                reference.snapshot(&SnapshotFilter::all()),
                "after {i}"
            );
        }
    }
    let (cursor, got) = snapshot_all(&s, SnapshotFilter::all());
    assert_eq!(cursor, s.newest_cursor());
    let want = reference.snapshot(&SnapshotFilter::all());
    assert!(want.len() > 100, "a meaningful live set: {}", want.len());
    assert!(want.iter().any(|b| b.copies > 1) && want.iter().any(|b| b.token_layout == TokenLayout::Bigram));
    assert_eq!(got, want);
    assert_eq!(summary(&s), reference.summary());
    let st = s.live_stats();
    assert_eq!(
        (st.removed_not_live, st.stored_already_live),
        (reference.live.removed_not_live, reference.live.stored_already_live)
    );
    // The same after a reopen.
    drop(s);
    let s = open(dir.path());
    assert_eq!(snapshot_all(&s, SnapshotFilter::all()).1, want);
    assert_eq!(summary(&s), reference.summary());
}

#[test]
fn snapshot_filters_select_ranks_tiers_and_token_ids() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path());
    let mut rng = StdRng::seed_from_u64(7);
    let mut reference = Reference::default();
    for seq in 0..400 {
        let b = random_body(&mut rng, (seq % 3) as u32, seq, false);
        reference.apply(&b);
        s.commit(b).unwrap();
    }
    let filters = [
        SnapshotFilter { ranks: Some(vec![1]), tiers: None, include_token_ids: true },
        SnapshotFilter {
            ranks: Some(vec![0, 2]),
            tiers: Some(vec![Tier::Host, Tier::Other("LMCache".into())]),
            include_token_ids: true,
        },
        SnapshotFilter { ranks: None, tiers: Some(vec![Tier::Disk]), include_token_ids: false },
        SnapshotFilter { ranks: Some(vec![9]), tiers: None, include_token_ids: true },
        SnapshotFilter { ranks: None, tiers: None, include_token_ids: false },
    ];
    for f in filters {
        let (_, got) = snapshot_all(&s, f.clone());
        let want = reference.snapshot(&f);
        assert_eq!(got.len(), want.len(), "{f:?}");
        assert_eq!(got, want, "{f:?}");
    }
    // Chunks are bounded.
    let mut snap = s.snapshot(SnapshotFilter::all()).unwrap();
    snap.chunk_blocks = 7;
    let total = snap.blocks;
    let sizes: Vec<usize> = snap.map(|c| c.unwrap().len()).collect();
    assert!(sizes.iter().all(|&n| n <= 7));
    assert_eq!(sizes.iter().sum::<usize>() as u64, total);
}

#[test]
fn a_snapshot_is_the_state_at_its_cursor_while_commits_go_on() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path());
    let writer = {
        let s = s.clone();
        std::thread::spawn(move || {
            let mut rng = StdRng::seed_from_u64(11);
            for seq in 0..1500 {
                s.commit(random_body(&mut rng, (seq % 2) as u32, seq, true)).unwrap();
            }
        })
    };
    let mut taken = Vec::new();
    while !writer.is_finished() {
        taken.push(snapshot_all(&s, SnapshotFilter::all()));
        std::thread::sleep(std::time::Duration::from_millis(3));
    }
    writer.join().unwrap();
    assert!(taken.len() >= 2);
    // Replay the (untrimmed) history up to each snapshot's cursor.
    let hist = all_history(&s);
    let mut reference = Reference::default();
    let mut applied = 0;
    for (cursor, got) in taken {
        while applied < cursor {
            reference.apply(&hist[applied as usize].body);
            applied += 1;
        }
        assert_eq!(got, reference.snapshot(&SnapshotFilter::all()), "snapshot at {cursor}");
    }
}
