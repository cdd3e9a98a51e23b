//! Bounds, copies, clears.

use super::*;

#[test]
fn history_is_bounded_by_count_oldest_first() {
    let dir = tempfile::tempdir().unwrap();
    let s = Store::open(cfg(dir.path(), 5, u64::MAX)).unwrap();
    for seq in 0..12 {
        s.commit(batch(0, seq, vec![stored(Tier::Device, 0, None, &[seq])])).unwrap();
    }
    let st = s.history_stats();
    assert_eq!((st.batches, st.oldest, st.newest), (5, Some(8), 12));
    assert_eq!(s.oldest_cursor(), Some(8));
    let cursors: Vec<u64> = s.history(0, 100).unwrap().iter().map(|r| r.cursor).collect();
    assert_eq!(cursors, vec![8, 9, 10, 11, 12]);
    // The snapshot keeps every block: trimming the history never touches it.
    assert_eq!(copies(&s).len(), 12);
}

#[test]
fn history_is_bounded_by_bytes_and_keeps_the_newest() {
    let dir = tempfile::tempdir().unwrap();
    let rec = control(0, ControlKind::RankRecovered);
    let one = {
        let s = Store::open(cfg(&dir.path().join("probe"), 10, u64::MAX)).unwrap();
        s.commit(rec.clone()).unwrap();
        s.history_stats().bytes
    };
    // The layout, the cursor, the incarnation, the body, the rank and the kind: a byte each.
    assert_eq!(one, 6);
    let s = Store::open(cfg(&dir.path().join("a"), 100, 3 * one + one / 2)).unwrap();
    for _ in 0..10 {
        s.commit(rec.clone()).unwrap();
    }
    let st = s.history_stats();
    assert_eq!((st.batches, st.bytes, st.oldest, st.newest), (3, 3 * one, Some(8), 10));
    // Count and bytes: whichever bound is hit first.
    let s = Store::open(cfg(&dir.path().join("b"), 2, 3 * one)).unwrap();
    for _ in 0..10 {
        s.commit(rec.clone()).unwrap();
    }
    assert_eq!(s.history_stats().batches, 2);
    // A record larger than the byte bound stays, alone, as the newest.
    let s = Store::open(cfg(&dir.path().join("c"), 100, 1)).unwrap();
    for _ in 0..3 {
        s.commit(rec.clone()).unwrap();
    }
    let st = s.history_stats();
    assert_eq!((st.batches, st.bytes, st.oldest, st.newest), (1, one, Some(3), 3));
}

#[test]
fn copies_are_counted_and_removals_of_absent_blocks_are_counted() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path());
    s.commit(batch(0, 0, vec![stored(Tier::Device, 0, None, &[1, 2]), stored(Tier::Device, 0, None, &[1])])).unwrap();
    assert_eq!(copies(&s), vec![(0, Tier::Device, 0, 1, 2), (0, Tier::Device, 0, 2, 1)]);
    s.commit(batch(0, 1, vec![removed(Tier::Device, 0, &[1])])).unwrap();
    assert_eq!(copies(&s), vec![(0, Tier::Device, 0, 1, 1), (0, Tier::Device, 0, 2, 1)]);
    s.commit(batch(0, 2, vec![removed(Tier::Device, 0, &[1, 1, 3]), removed(Tier::Host, 0, &[2])])).unwrap();
    assert_eq!(copies(&s), vec![(0, Tier::Device, 0, 2, 1)]);
    assert_eq!(s.live_stats(), LiveStats { blocks: 1, copies: 1, removed_not_live: 3, stored_already_live: 1 });
    assert_eq!(summary(&s), vec![(0, Tier::Device, 0, 1, 1, 1)]);
}

#[test]
fn clears_by_rank_and_tier_and_rank_reset() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path());
    let fill = || {
        let mut ev = Vec::new();
        for t in [Tier::Device, Tier::Host] {
            ev.push(stored(t.clone(), 0, None, &[10, 11]));
            ev.push(stored(t, 1, None, &[12]));
        }
        ev
    };
    s.commit(batch(0, 0, fill())).unwrap();
    s.commit(batch(1, 0, fill())).unwrap();
    assert_eq!(copies(&s).len(), 12);
    // AllBlocksCleared scoped to a tier: that tier of that rank only.
    s.commit(batch(0, 1, vec![cleared(Some(Tier::Host))])).unwrap();
    let left = copies(&s);
    assert_eq!(left.len(), 9);
    assert!(!left.iter().any(|b| b.0 == 0 && b.1 == Tier::Host));
    // AllBlocksCleared without a tier: the rank.
    s.commit(batch(1, 1, vec![cleared(None)])).unwrap();
    assert_eq!(copies(&s).iter().map(|b| b.0).collect::<Vec<_>>(), vec![0, 0, 0]);
    // A rank reset: the rank.
    s.commit(control(0, ControlKind::RankReset { reason: "restart".into() })).unwrap();
    assert_eq!(copies(&s), vec![]);
    assert_eq!(summary(&s), vec![]);
    // Blocks stored after a clear in the same commit live; before it, not.
    s.commit_many(vec![
        batch(
            0,
            0,
            vec![stored(Tier::Host, 0, None, &[1]), cleared(Some(Tier::Host)), stored(Tier::Host, 0, None, &[2])],
        ),
        batch(0, 1, vec![stored(Tier::Host, 0, None, &[2])]),
    ])
    .unwrap();
    assert_eq!(copies(&s), vec![(0, Tier::Host, 0, 2, 2)]);
    assert_eq!(summary(&s), vec![(0, Tier::Host, 0, 1, 2, 1)]);
    // And the same after a reopen (dead keys swept or not, they never show).
    drop(s);
    let s = open(dir.path());
    assert_eq!(copies(&s), vec![(0, Tier::Host, 0, 2, 2)]);
}
