//! History, cursors, ranks.

use super::*;

#[test]
fn history_ranges_are_ascending_and_clamped_to_what_is_kept() {
    let dir = tempfile::tempdir().unwrap();
    let s = Store::open(cfg(dir.path(), 6, u64::MAX)).unwrap();
    assert_eq!(s.history(0, 10).unwrap(), vec![]);
    let recs: Vec<Record> = s
        .commit_many((0..10).map(|seq| batch(0, seq, vec![])).collect())
        .unwrap()
        .iter()
        .map(|c| c.record.clone())
        .collect();
    assert_eq!(recs.iter().map(|r| r.cursor).collect::<Vec<_>>(), (1..=10).collect::<Vec<_>>());
    let cur = |after, limit| s.history(after, limit).unwrap().iter().map(|r| r.cursor).collect::<Vec<_>>();
    assert_eq!(cur(0, 3), vec![5, 6, 7]);
    assert_eq!(cur(6, 2), vec![7, 8]);
    assert_eq!(cur(8, 100), vec![9, 10]);
    assert_eq!(cur(10, 100), Vec::<u64>::new());
    assert_eq!(cur(99, 100), Vec::<u64>::new());
    assert_eq!(cur(u64::MAX, 1), Vec::<u64>::new());
    assert_eq!(cur(4, 0), Vec::<u64>::new());
    assert_eq!(s.history(9, 1).unwrap(), vec![recs[9].clone()]);
}

#[test]
fn a_refused_group_is_given_back_whole_and_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path());
    s.commit(batch(0, 0, vec![stored(Tier::Device, 0, None, &[1])])).unwrap();
    // A tier name the store cannot hold (its keys give a name 16 bits of length).
    let unholdable = || batch(0, 9, vec![stored(Tier::Other("m".repeat(70_000)), 0, None, &[3])]);
    let good =
        [batch(0, 1, vec![stored(Tier::Device, 0, Some(1), &[2])]), batch(0, 2, vec![removed(Tier::Device, 0, &[1])])];
    // The refused record first, between the others, and last (when every record was taken).
    for at in 0..=2 {
        let mut group = good.to_vec();
        group.insert(at, unholdable());
        let want = group.clone();
        let err = s.commit_group(&mut group).unwrap_err();
        assert_eq!(err.to_string(), "cannot store this tier: tier name of 70000 bytes", "at {at}");
        assert_eq!(group, want, "at {at}");
        // Nothing of the group was committed, and the store goes on.
        assert_eq!(s.newest_cursor(), 1);
        assert_eq!(copies(&s), vec![(0, Tier::Device, 0, 1, 1)]);
    }
    let mut group = good.to_vec();
    let done = s.commit_group(&mut group).unwrap();
    assert_eq!(group, vec![]);
    assert_eq!(
        done.iter().map(|c| (c.record.cursor, c.record.body.clone())).collect::<Vec<_>>(),
        vec![(2, good[0].clone()), (3, good[1].clone())]
    );
    assert_eq!(copies(&s), vec![(0, Tier::Device, 0, 2, 1)]);
    assert_eq!(all_history(&s).iter().map(|r| r.cursor).collect::<Vec<_>>(), vec![1, 2, 3]);
}

#[test]
fn cursor_matches_tells_same_lost_and_trimmed() {
    let dir = tempfile::tempdir().unwrap();
    {
        let s = Store::open(cfg(dir.path(), 4, u64::MAX)).unwrap();
        s.commit_many((0..3).map(|seq| batch(0, seq, vec![])).collect()).unwrap();
        assert_eq!(s.cursor_matches(0, 1), CursorCheck::Same);
        assert_eq!(s.cursor_matches(3, 1), CursorCheck::Same);
        assert_eq!(s.cursor_matches(4, 1), CursorCheck::Lost);
    }
    // Cursors 4.. of incarnation 1 were never committed; incarnation 2 commits them.
    let s = Store::open(cfg(dir.path(), 4, u64::MAX)).unwrap();
    assert_eq!(s.incarnations(), BTreeMap::from([(1, 1), (2, 4)]));
    s.commit_many((3..6).map(|seq| batch(0, seq, vec![])).collect()).unwrap();
    assert_eq!(s.oldest_cursor(), Some(3));
    let cases = [
        (0, 7, CursorCheck::Same),
        (1, 1, CursorCheck::Trimmed),
        (2, 1, CursorCheck::Trimmed),
        (3, 1, CursorCheck::Same),
        (3, 2, CursorCheck::Lost),
        (4, 1, CursorCheck::Lost),
        (4, 2, CursorCheck::Same),
        (6, 2, CursorCheck::Same),
        (7, 2, CursorCheck::Lost),
        (1, 2, CursorCheck::Lost),
    ];
    for (cursor, inc, want) in cases {
        assert_eq!(s.cursor_matches(cursor, inc), want, "cursor {cursor} of incarnation {inc}");
    }
}

#[test]
fn rank_state_keeps_the_ingest_position_and_health() {
    let dir = tempfile::tempdir().unwrap();
    {
        let s = open(dir.path());
        assert_eq!(s.rank_state(0), None);
        s.commit(batch(0, 41, vec![])).unwrap();
        s.commit(batch(1, 7, vec![])).unwrap();
        s.commit(control(0, ControlKind::RankDegraded { reason: "gap of 3".into() })).unwrap();
        s.commit(batch(0, 42, vec![])).unwrap();
    }
    let s = open(dir.path());
    let want = RankCursor {
        last_seq: Some(42),
        last_ts: Some(42.0),
        last_cursor: 4,
        health: RankHealth::Degraded { reason: "gap of 3".into() },
    };
    assert_eq!(s.rank_state(0), Some(want));
    assert_eq!(s.rank_state(1).unwrap().last_seq, Some(7));
    s.commit(control(0, ControlKind::RankReset { reason: "seq went back".into() })).unwrap();
    s.commit(control(0, ControlKind::RankRecovered)).unwrap();
    let want = RankCursor { last_seq: None, last_ts: None, last_cursor: 6, health: RankHealth::Ok };
    assert_eq!(s.rank_state(0), Some(want));
    assert_eq!(s.rank_states().len(), 2);
}

#[tokio::test]
async fn watch_newest_follows_commits() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path());
    let mut rx = s.watch_newest();
    assert_eq!(*rx.borrow(), 0);
    s.commit_many(vec![batch(0, 0, vec![]), batch(0, 1, vec![])]).unwrap();
    rx.changed().await.unwrap();
    assert_eq!(*rx.borrow_and_update(), 2);
}
