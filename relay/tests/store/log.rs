//! Log, checkpoints, format 1.

use super::*;

#[test]
fn the_log_keeps_what_the_newest_checkpoint_does_not_cover_and_serves_only_the_history() {
    let dir = tempfile::tempdir().unwrap();
    let s = Store::open(cfg_manual(dir.path(), 10)).unwrap();
    for seq in 0..30 {
        s.commit(batch(0, seq, vec![stored(Tier::Device, 0, None, &[seq])])).unwrap();
    }
    // The history is the last 10 records; the log on disk still starts at 1 (no checkpoint).
    let st = s.history_stats();
    assert_eq!((st.batches, st.oldest, st.newest, st.log_oldest), (10, Some(21), 30, Some(1)));
    assert_eq!(s.history(0, 100).unwrap().first().map(|r| r.cursor), Some(21));
    assert_eq!(s.checkpoint_state(), None);
    let c = s.checkpoint_now().unwrap();
    assert_eq!((c.id, c.cursor), (1, 30));
    assert_eq!(s.history_stats().log_oldest, Some(21));
    // Commits after it: the log keeps the history (the checkpoint covers what is older).
    for seq in 30..35 {
        s.commit(batch(0, seq, vec![removed(Tier::Device, 0, &[seq - 30])])).unwrap();
    }
    let st = s.history_stats();
    assert_eq!((st.batches, st.oldest, st.newest, st.log_oldest), (10, Some(26), 35, Some(26)));
    let want = copies(&s);
    assert_eq!(want.len(), 25);
    drop(s);
    // Reopened: checkpoint 1 plus the 5 records after it.
    let s = Store::open(cfg_manual(dir.path(), 10)).unwrap();
    assert_eq!(s.checkpoint_state().map(|c| (c.id, c.cursor)), Some((1, 30)));
    assert_eq!(copies(&s), want);
    assert_eq!(s.live_stats(), LiveStats { blocks: 25, copies: 25, removed_not_live: 0, stored_already_live: 0 });
    let st = s.history_stats();
    assert_eq!((st.batches, st.oldest, st.newest, st.log_oldest), (10, Some(26), 35, Some(26)));
    // A second checkpoint replaces the first.
    assert_eq!(s.checkpoint_now().unwrap().id, 2);
    drop(s);
    let s = Store::open(cfg_manual(dir.path(), 10)).unwrap();
    assert_eq!(s.checkpoint_state().map(|c| (c.id, c.cursor)), Some((2, 35)));
    assert_eq!(copies(&s), want);
}

#[test]
fn checkpoints_follow_the_policy_and_the_log_after_them_rebuilds_the_live_set() {
    let dir = tempfile::tempdir().unwrap();
    let c = StoreConfig {
        checkpoint: CheckpointPolicy { every_records: 50, every_bytes: u64::MAX },
        ..cfg(dir.path(), 20, u64::MAX)
    };
    let s = Store::open(c.clone()).unwrap();
    let mut rng = StdRng::seed_from_u64(0xc4ec);
    let mut reference = Reference::default();
    for seq in 0..400 {
        let body = random_body(&mut rng, (seq % 3) as u32, seq, true);
        reference.apply(&body);
        s.commit(body).unwrap();
        // Paced as ingest is, so that each checkpoint (a few small files synced) ends before the
        // policy asks for the next: a commit that finds one running begins none.
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    // The checkpoint thread keeps up: one began at least every 50 records.
    let t0 = std::time::Instant::now();
    while s.checkpoint_state().is_none_or(|c| c.cursor < 350) {
        assert!(t0.elapsed().as_secs() < 60, "no checkpoint: {:?}", s.checkpoint_state());
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let want = reference.snapshot(&SnapshotFilter::all());
    assert!(want.len() > 20);
    assert_eq!(snapshot_all(&s, SnapshotFilter::all()).1, want);
    drop(s);
    let s = Store::open(c).unwrap();
    let ckpt = s.checkpoint_state().unwrap().cursor;
    assert!((350..=400).contains(&ckpt), "{ckpt}");
    assert_eq!(snapshot_all(&s, SnapshotFilter::all()), (400, want));
    assert_eq!(summary(&s), reference.summary());
    let st = s.live_stats();
    assert_eq!(
        (st.removed_not_live, st.stored_already_live),
        (reference.live.removed_not_live, reference.live.stored_already_live)
    );
}

/// The file of checkpoint `id` in a state directory.
fn checkpoint_file(dir: &Path, id: u64) -> std::path::PathBuf {
    dir.join("checkpoints").join(format!("{id:020}.ckpt"))
}

#[test]
fn a_checkpoint_that_is_not_whole_is_passed_over_for_the_previous_one_and_its_log() {
    let dir = tempfile::tempdir().unwrap();
    let body = |seq: u64| {
        let hashes: Vec<u64> = (0..3000).map(|j| (seq * 3000 + j).wrapping_mul(0x9e37_79b9_7f4a_7c15)).collect();
        batch(0, seq, vec![stored(Tier::Device, 0, None, &hashes)])
    };
    let s = Store::open(cfg_manual(dir.path(), 2)).unwrap();
    s.commit(body(0)).unwrap();
    assert_eq!(s.checkpoint_now().unwrap().cursor, 1);
    s.commit(body(1)).unwrap();
    s.commit(body(2)).unwrap();
    let want = copies(&s);
    assert_eq!(want.len(), 9000);
    drop(s);
    // A copy of the store as it is now (checkpoint 1, and the log after it).
    let copy = tempfile::tempdir().unwrap();
    copy_tree(dir.path(), copy.path());
    // The store itself takes checkpoint 2, whole, and removes checkpoint 1.
    let s = Store::open(cfg_manual(dir.path(), 2)).unwrap();
    assert_eq!(s.checkpoint_now().unwrap().id, 2);
    drop(s);
    assert!(!checkpoint_file(dir.path(), 1).exists());
    let whole = std::fs::read(checkpoint_file(dir.path(), 2)).unwrap();
    // 9,000 blocks (3 chunks), each at least its hash, parent, copies, size and 2 token ids.
    assert!(whole.len() > 9000 * 20, "{} bytes", whole.len());
    // In the copy, checkpoint 2 as a crash or a failed write could leave it: a byte changed in a
    // chunk, then cut short. Each time the open takes checkpoint 1 and the log after it, the same
    // live set, and removes the damaged file.
    let mut damaged = whole.clone();
    damaged[whole.len() / 2] ^= 0x40;
    for bad in [damaged, whole[..whole.len() - 100].to_vec()] {
        std::fs::write(checkpoint_file(copy.path(), 2), &bad).unwrap();
        let s = Store::open(cfg_manual(copy.path(), 2)).unwrap();
        assert_eq!(s.checkpoint_state().map(|c| (c.id, c.cursor)), Some((1, 1)));
        assert_eq!(copies(&s), want);
        drop(s);
        assert!(!checkpoint_file(copy.path(), 2).exists());
        assert!(checkpoint_file(copy.path(), 1).exists());
    }
    let s = Store::open(cfg_manual(dir.path(), 2)).unwrap();
    assert_eq!(s.checkpoint_state().map(|c| (c.id, c.cursor)), Some((2, 3)));
    assert_eq!(copies(&s), want);
}

fn block_json(b: &SnapshotBlock) -> serde_json::Value {
    serde_json::json!({
        "dp_rank": b.dp_rank, "tier": b.tier.as_str(), "group": b.group, "hash": b.hash,
        "parent": b.parent, "block_size": b.block_size, "namespace": b.namespace, "copies": b.copies,
        "token_ids": b.token_ids, "token_layout": b.token_layout,
    })
}

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            copy_tree(&e.path(), &to.join(e.file_name()));
        } else {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}

#[test]
fn a_format_1_store_is_upgraded_on_open_keeping_epoch_history_live_blocks_and_ranks() {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/store-format1");
    let want: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture.join("expected.json")).unwrap()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    copy_tree(&fixture.join("sled"), &dir.path().join("sled"));
    let v1_live_keys = {
        let db = sled::open(dir.path().join("sled")).unwrap();
        assert_eq!(db.open_tree("meta").unwrap().get("format").unwrap().unwrap(), 1u32.to_be_bytes()[..]);
        db.open_tree("data").unwrap().scan_prefix(b"l").count()
    };
    // Keys of the cleared tier are still there, for the upgrade to tell apart.
    assert!(v1_live_keys > 409, "{v1_live_keys}");
    let c = cfg(dir.path(), 150, 1 << 20);
    let newest = want["newest"].as_u64().unwrap();
    assert_eq!((newest, want["history"].as_array().unwrap().len()), (309, 150));
    let check = |s: &Store, incarnation: u32| {
        assert_eq!(s.epoch(), want["epoch"].as_u64().unwrap());
        assert_eq!(s.incarnation(), incarnation);
        assert_eq!(serde_json::to_value(s.incarnations()).unwrap().as_object().unwrap().len(), incarnation as usize);
        assert_eq!(s.newest_cursor(), newest);
        assert_eq!(s.oldest_cursor(), want["oldest"].as_u64());
        let hs = s.history_stats();
        assert_eq!(serde_json::json!({"batches": hs.batches, "bytes": hs.bytes}), want["history_stats"]);
        let st = s.live_stats();
        assert_eq!(
            serde_json::json!({"blocks": st.blocks, "copies": st.copies, "removed_not_live": st.removed_not_live, "stored_already_live": st.stored_already_live}),
            want["live_stats"]
        );
        assert_eq!(serde_json::to_value(s.rank_states()).unwrap(), want["rank_states"]);
        let groups: Vec<serde_json::Value> = summary(s)
            .into_iter()
            .map(|(r, t, g, b, c, n)| serde_json::json!({"dp_rank": r, "tier": t.as_str(), "group": g, "blocks": b, "copies": c, "namespaces": n}))
            .collect();
        assert_eq!(serde_json::Value::from(groups), want["summary"]);
        let (cursor, blocks) = snapshot_all(s, SnapshotFilter::all());
        assert_eq!(cursor, newest);
        assert_eq!(serde_json::Value::from(blocks.iter().map(block_json).collect::<Vec<_>>()), want["blocks"]);
        assert_eq!(serde_json::to_value(all_history(s)).unwrap(), want["history"]);
    };
    let s = Store::open(c.clone()).unwrap();
    check(&s, 3);
    assert_eq!(serde_json::to_value(s.incarnations()).unwrap(), want["incarnations"]);
    assert_eq!(s.checkpoint_state().map(|c| c.cursor), Some(newest));
    drop(s);
    {
        let db = sled::open(dir.path().join("sled")).unwrap();
        assert_eq!(db.open_tree("meta").unwrap().get("format").unwrap().unwrap(), FORMAT_VERSION.to_be_bytes()[..]);
        let data = db.open_tree("data").unwrap();
        for p in [b"c", b"l", b"n", b"r", b"s", b"w"] {
            assert_eq!(data.scan_prefix(p).count(), 0, "format 1's {:?} keys", p[0] as char);
        }
    }
    // Opened again as format 2, the same; and commits go on after it.
    let s = Store::open(c).unwrap();
    check(&s, 4);
    let r = s.commit(control(2, ControlKind::RankRecovered)).unwrap();
    assert_eq!((r.cursor, r.incarnation), (newest + 1, 4));
    assert_eq!(s.rank_state(2).unwrap().health, RankHealth::Ok);
}
