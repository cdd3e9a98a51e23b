//! Kill -9 inside checkpoints.

use super::*;

const CKPT_CHILD_DIR: &str = "KV_RELAY_STORE_CKPT_CRASH_DIR";

/// The body at seq `seq` of the checkpoint crash test's one-rank stream: 64 blocks of 16 tokens
/// stored, and the 64 stored 300 batches before removed (a live set of about 19,000 blocks).
fn ckpt_body(seq: u64) -> RecordBody {
    let hashes = |s: u64| (0..64u64).map(move |j| (s * 64 + j + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let mut events = vec![Event::Stored(Stored {
        tier: Tier::Device,
        group: Group::default(),
        parent: seq.checked_sub(1).map(|p| hashes(p).next_back().unwrap()),
        block_size: 16,
        token_layout: TokenLayout::Single,
        blocks: hashes(seq)
            .map(|h| Block { hash: h, token_ids: (0..16).map(|t| (h as u32) ^ t).collect(), extra_keys: None })
            .collect(),
        namespace: Namespace::default(),
        session_id: None,
        ownership: None,
        lookahead_token_ids: None,
        block_mm_infos: None,
    })];
    if seq >= 300 {
        events.push(removed(Tier::Device, 0, &hashes(seq - 300).collect::<Vec<_>>()));
    }
    batch(0, seq, events)
}

fn ckpt_cfg(dir: &Path) -> StoreConfig {
    StoreConfig {
        checkpoint: CheckpointPolicy { every_records: u64::MAX, every_bytes: u64::MAX },
        ..cfg(dir, 200, u64::MAX)
    }
}

/// Not a test on its own: the child of `kill_9_inside_checkpoints_…`. It commits the stream from
/// where the store left it, while a second thread writes checkpoints one after another and says
/// when each begins and ends; it runs until it is killed.
#[test]
fn ckpt_crash_child() {
    let Ok(dir) = std::env::var(CKPT_CHILD_DIR) else { return };
    let s = Store::open(ckpt_cfg(Path::new(&dir))).unwrap();
    println!("open {}", s.newest_cursor());
    let writer = {
        let s = s.clone();
        std::thread::spawn(move || loop {
            println!("ckpt begin");
            let c = s.checkpoint_now().unwrap();
            println!("ckpt end {}", c.cursor);
            // A pause between checkpoints: some kills land outside one.
            std::thread::sleep(std::time::Duration::from_millis(30));
        })
    };
    let mut seq = s.rank_state(0).and_then(|c| c.last_seq).map_or(0, |q| q + 1);
    loop {
        s.commit(ckpt_body(seq)).unwrap();
        seq += 1;
        if writer.is_finished() {
            panic!("the checkpoint thread ended");
        }
    }
}

#[test]
fn kill_9_inside_checkpoints_leaves_the_previous_checkpoint_and_the_log_exact() {
    use std::io::BufRead;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    let dir = tempfile::tempdir().unwrap();
    let mut rng = StdRng::seed_from_u64(0xc0ffee);
    let (mut inside, mut checkpointed) = (0, 0);
    let rounds = 12;
    for round in 0..rounds {
        let mut child =
            child_test("checkpoint_kill::ckpt_crash_child").env(CKPT_CHILD_DIR, dir.path()).spawn().unwrap();
        // (opened, a checkpoint begun and not ended, checkpoints ended)
        let seen = Arc::new(Mutex::new((false, false, 0u32)));
        let reader = {
            let seen = seen.clone();
            let out = child.stdout.take().unwrap();
            std::thread::spawn(move || {
                for line in std::io::BufReader::new(out).lines() {
                    let Ok(line) = line else { break };
                    let mut s = seen.lock().unwrap();
                    if line.contains("open ") {
                        s.0 = true;
                    } else if line.ends_with("ckpt begin") {
                        s.1 = true;
                    } else if line.contains("ckpt end ") {
                        (s.1, s.2) = (false, s.2 + 1);
                    }
                }
            })
        };
        let t0 = std::time::Instant::now();
        while !seen.lock().unwrap().0 {
            assert!(t0.elapsed() < Duration::from_secs(60), "round {round}: the child did not open the store");
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(rng.random_range(150..700)));
        child.kill().unwrap();
        child.wait().unwrap();
        reader.join().unwrap();
        let (_, mid, ended) = *seen.lock().unwrap();
        inside += u32::from(mid);
        checkpointed += ended;
        // The store: its history contiguous and the stream's; its live set the stream's up to
        // the newest durable record.
        let s = Store::open(ckpt_cfg(dir.path())).unwrap();
        let newest = s.newest_cursor();
        assert!(newest > 0, "round {round}");
        let hist = all_history(&s);
        assert_eq!(hist.first().map(|r| r.cursor), s.oldest_cursor(), "round {round}");
        for (i, r) in hist.iter().enumerate() {
            assert_eq!(r.cursor, hist[0].cursor + i as u64, "round {round}: hole in the history");
            assert_eq!(r.body, ckpt_body(r.cursor - 1), "round {round}: cursor {}", r.cursor);
        }
        assert_eq!(hist.last().map(|r| r.cursor), Some(newest), "round {round}");
        let mut reference = Reference::default();
        (0..newest).for_each(|seq| reference.apply(&ckpt_body(seq)));
        assert_eq!(
            snapshot_all(&s, SnapshotFilter::all()),
            (newest, reference.snapshot(&SnapshotFilter::all())),
            "round {round}"
        );
        assert_eq!(s.rank_state(0).and_then(|c| c.last_seq), Some(newest - 1), "round {round}");
        eprintln!(
            "round {round}: durable {newest}, killed {} a checkpoint, newest whole checkpoint at {:?}, log from {:?}",
            if mid { "inside" } else { "outside" },
            s.checkpoint_state().map(|c| c.cursor),
            s.history_stats().log_oldest
        );
    }
    eprintln!("{inside} of {rounds} kills landed inside a checkpoint's write; {checkpointed} checkpoints ended");
    assert!(inside > 0, "no kill landed inside a checkpoint's write");
    assert!(checkpointed > 0);
}

fn log_segments(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(dir.join("log")).unwrap().map(|e| e.unwrap().path()).collect();
    v.sort();
    v
}

#[test]
fn the_log_is_cut_at_its_first_damaged_frame_and_the_segments_after_it_go() {
    let dir = tempfile::tempdir().unwrap();
    let s = Store::open(cfg_manual(dir.path(), 100)).unwrap();
    for seq in 0..10 {
        s.commit(batch(0, seq, vec![stored(Tier::Device, 0, None, &[seq])])).unwrap();
    }
    drop(s);
    // One commit per segment: the segment of cursor c is named c.
    let segs = log_segments(dir.path());
    let names: Vec<String> = segs.iter().map(|p| p.file_name().unwrap().to_string_lossy().into_owned()).collect();
    assert_eq!(names, (1..=10).map(|c| format!("{c:020}.log")).collect::<Vec<_>>());
    // A byte of cursor 5's frame changed (a write a power loss left in part): the log ends at 4.
    let mut b = std::fs::read(&segs[4]).unwrap();
    let at = b.len() - 3;
    b[at] ^= 0x01;
    std::fs::write(&segs[4], &b).unwrap();
    let s = Store::open(cfg_manual(dir.path(), 100)).unwrap();
    assert_eq!(s.newest_cursor(), 4);
    assert_eq!(all_history(&s).iter().map(|r| r.cursor).collect::<Vec<_>>(), vec![1, 2, 3, 4]);
    assert_eq!(copies(&s).iter().map(|c| c.3).collect::<Vec<_>>(), vec![0, 1, 2, 3]);
    assert_eq!(s.rank_state(0).map(|r| (r.last_seq, r.last_cursor)), Some((Some(3), 4)));
    // Cursor 5's segment is left empty (its header only), and the ones after it are gone.
    assert_eq!(log_segments(dir.path()).len(), 5);
    assert_eq!(std::fs::metadata(&segs[4]).unwrap().len(), 16);
    let r = s.commit(batch(0, 4, vec![stored(Tier::Device, 0, None, &[40])])).unwrap();
    assert_eq!((r.cursor, r.incarnation), (5, 2));
    s.commit(batch(0, 5, vec![stored(Tier::Device, 0, None, &[50])])).unwrap();
    drop(s);
    // A segment begun just before a power loss, its header never written: the log ends before it.
    let segs = log_segments(dir.path());
    assert_eq!(segs.len(), 6);
    std::fs::OpenOptions::new().write(true).open(&segs[5]).unwrap().set_len(0).unwrap();
    let s = Store::open(cfg_manual(dir.path(), 100)).unwrap();
    assert_eq!(s.newest_cursor(), 5);
    assert_eq!(copies(&s).iter().map(|c| c.3).collect::<Vec<_>>(), vec![0, 1, 2, 3, 40]);
    assert_eq!(log_segments(dir.path()).len(), 5);
    // A segment of another store is refused, never cut.
    drop(s);
    let mut b = std::fs::read(&segs[0]).unwrap();
    b[8] ^= 0xff;
    std::fs::write(&segs[0], &b).unwrap();
    let err = Store::open(cfg_manual(dir.path(), 100)).unwrap_err();
    assert!(matches!(err, StoreError::Decode { what: "log", .. }), "{err:?}");
    assert!(err.to_string().contains("belongs to the store of epoch"), "{err}");
}
