//! Kill -9.

use super::*;

const CHILD_DIR: &str = "KV_RELAY_STORE_CRASH_DIR";
const CHILD_SEED: &str = "KV_RELAY_STORE_CRASH_SEED";
const CRASH_RANKS: u32 = 3;
/// A rank's publisher "restarts" (a `RankReset`, then seq 0 again) every this many batches.
const RESET_EVERY: u64 = 700;

/// The body the deterministic stream holds for (rank, seq): the same in every run of the child.
/// Always a batch, except a `RankReset` at [`RESET_EVERY`] (after which the rank starts at seq 0).
fn crash_body(seed: u64, rank: u32, seq: u64) -> RecordBody {
    if seq == RESET_EVERY {
        return control(rank, ControlKind::RankReset { reason: "publisher restarted".into() });
    }
    let mut rng = StdRng::seed_from_u64(seed ^ ((rank as u64) << 40) ^ seq.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    match random_body(&mut rng, rank, seq, false) {
        RecordBody::Control(_) => batch(rank, seq, vec![]),
        RecordBody::Batch { batch, load, liveness } => {
            RecordBody::Batch { batch: Batch { seq, ..batch }, load, liveness }
        }
    }
}

/// The (rank, seq) a record of the stream is at.
fn stream_pos(r: &Record) -> (u32, u64) {
    match &r.body {
        RecordBody::Batch { batch, .. } => (batch.dp_rank, batch.seq),
        RecordBody::Control(c) => (c.dp_rank, RESET_EVERY),
    }
}

/// The next seq of a rank's stream, as a restarted relay computes it from the store.
fn next_seq(st: Option<RankCursor>) -> u64 {
    match st.and_then(|c| c.last_seq) {
        Some(s) if s + 1 < RESET_EVERY => s + 1,
        Some(_) => RESET_EVERY,
        None => 0,
    }
}

/// Not a test on its own: the child process of `kill_9_at_random_moments_…`. It commits the
/// deterministic stream from where the store left each rank (as the relay refills from the
/// engine), prints each committed cursor, and runs until it is killed.
#[test]
fn crash_child() {
    let (Ok(dir), Ok(seed)) = (std::env::var(CHILD_DIR), std::env::var(CHILD_SEED)) else { return };
    let seed: u64 = seed.parse().unwrap();
    let s = open(Path::new(&dir));
    let mut next: BTreeMap<u32, u64> = (0..CRASH_RANKS).map(|r| (r, next_seq(s.rank_state(r)))).collect();
    println!("open {} {}", s.incarnation(), s.newest_cursor());
    let mut step: u64 = s.newest_cursor();
    loop {
        step += 1;
        let mut rng = StdRng::seed_from_u64(seed ^ step);
        let n = rng.random_range(1..4);
        let mut bodies = Vec::new();
        for _ in 0..n {
            let rank = rng.random_range(0..CRASH_RANKS);
            let seq = next[&rank];
            bodies.push(crash_body(seed, rank, seq));
            next.insert(rank, if seq == RESET_EVERY { 0 } else { seq + 1 });
        }
        let recs = if n == 1 {
            vec![s.commit(bodies.pop().unwrap()).unwrap()]
        } else {
            s.commit_many(bodies).unwrap().iter().map(|c| c.record.clone()).collect()
        };
        println!("c {}", recs.last().unwrap().cursor);
        if step.is_multiple_of(300) {
            s.flush().unwrap();
        }
    }
}

#[test]
fn kill_9_at_random_moments_keeps_the_store_consistent() {
    use std::io::BufRead;
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    let dir = tempfile::tempdir().unwrap();
    let seed = 20_261_130u64;
    let mut rng = StdRng::seed_from_u64(seed);
    let mut prev_incarnation = 0u32;
    let mut rounds_with_lost_tail = 0;
    let rounds = 20;
    for round in 0..rounds {
        let mut child = child_test("kill::crash_child")
            .env(CHILD_DIR, dir.path())
            .env(CHILD_SEED, seed.to_string())
            .spawn()
            .unwrap();
        // (incarnation, newest at open, newest cursor the child saw committed)
        let seen = Arc::new(Mutex::new((0u32, 0u64, 0u64)));
        let (opened_tx, opened_rx) = std::sync::mpsc::channel();
        let reader = {
            let seen = seen.clone();
            let out = child.stdout.take().unwrap();
            std::thread::spawn(move || {
                for line in std::io::BufReader::new(out).lines() {
                    let Ok(line) = line else { break };
                    // The harness prints `test crash_child ... ` before the first line.
                    let line = line.find("open ").map_or(line.as_str(), |i| &line[i..]);
                    let mut it = line.split(' ');
                    match (it.next(), it.next(), it.next()) {
                        (Some("open"), Some(i), Some(n)) => {
                            let n = n.parse().unwrap();
                            *seen.lock().unwrap() = (i.parse().unwrap(), n, n);
                            let _ = opened_tx.send(());
                        }
                        (Some("c"), Some(c), None) => seen.lock().unwrap().2 = c.parse().unwrap(),
                        _ => {}
                    }
                }
            })
        };
        opened_rx.recv_timeout(Duration::from_secs(60)).expect("child opened the store");
        let wait = Duration::from_millis(rng.random_range(0..500));
        let t0 = Instant::now();
        std::thread::sleep(wait);
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        reader.join().unwrap();
        let (child_inc, child_open_newest, child_newest) = *seen.lock().unwrap();
        assert_eq!(child_inc, prev_incarnation + 1, "round {round}: the child's open is a new incarnation");
        // Every other round, a power loss as well: the log's last segment loses its end (what
        // the kernel had not written to the disk yet), cut anywhere, in a frame or between.
        let power_loss = round % 2 == 1;
        if power_loss {
            let mut segments: Vec<_> = std::fs::read_dir(dir.path().join("log"))
                .unwrap()
                .map(|e| e.unwrap().path())
                .filter(|p| p.extension().is_some_and(|x| x == "log"))
                .collect();
            segments.sort();
            let last = std::fs::OpenOptions::new().write(true).open(segments.last().unwrap()).unwrap();
            let len = last.metadata().unwrap().len();
            let cut = rng.random_range(1..=2000u64).min(len.saturating_sub(16));
            last.set_len(len - cut).unwrap();
        }

        let s = open(dir.path());
        assert_eq!(s.incarnation(), child_inc + 1, "round {round}");
        prev_incarnation = s.incarnation();
        let newest = s.newest_cursor();
        if !power_loss {
            // A killed process loses no commit: each was in the kernel once its write returned.
            assert!(newest >= child_newest, "round {round}: the kill lost a commit ({newest} < {child_newest})");
            assert!(newest >= child_open_newest, "round {round}");
        }
        // History: contiguous from cursor 1 (never trimmed here) to the newest.
        let hist = all_history(&s);
        assert_eq!(hist.len() as u64, newest, "round {round}");
        for (i, r) in hist.iter().enumerate() {
            assert_eq!(r.cursor, i as u64 + 1, "round {round}: hole in the history");
            assert!(r.incarnation >= 1 && r.incarnation <= child_inc, "round {round}");
        }
        // Every record is the stream's (rank, seq) element: nothing garbled, nothing reordered.
        let mut last: BTreeMap<u32, u64> = BTreeMap::new();
        for r in hist.iter().filter(|r| !matches!(&r.body, RecordBody::Control(c) if c.dp_rank == 99)) {
            let (rank, seq) = stream_pos(r);
            let expect_seq = last.get(&rank).map_or(0, |&s| if s == RESET_EVERY { 0 } else { s + 1 });
            assert_eq!(seq, expect_seq, "round {round}: rank {rank} at cursor {}", r.cursor);
            assert_eq!(r.body, crash_body(seed, rank, seq), "round {round}: cursor {}", r.cursor);
            last.insert(rank, seq);
        }
        // The snapshot equals the replay of every durable record.
        let mut reference = Reference::default();
        hist.iter().for_each(|r| reference.apply(&r.body));
        let (cursor, got) = snapshot_all(&s, SnapshotFilter::all());
        assert_eq!(cursor, newest);
        assert_eq!(got, reference.snapshot(&SnapshotFilter::all()), "round {round}");
        assert_eq!(summary(&s), reference.summary(), "round {round}");
        // Every rank's resume point is its last durable record.
        for rank in 0..CRASH_RANKS {
            let last_rec = hist.iter().rev().find(|r| stream_pos(r).0 == rank);
            assert_eq!(s.rank_state(rank).map(|c| c.last_cursor), last_rec.map(|r| r.cursor), "round {round}");
        }
        // What a power loss took from the child is Lost for a subscriber that saw it.
        if child_newest > newest {
            rounds_with_lost_tail += 1;
        }
        for c in (newest + 1)..=child_newest.max(newest + 1) {
            assert_eq!(s.cursor_matches(c, child_inc), CursorCheck::Lost, "round {round}: cursor {c}");
        }
        for r in hist.iter().rev().take(20) {
            assert_eq!(s.cursor_matches(r.cursor, r.incarnation), CursorCheck::Same, "round {round}");
        }
        // The next commit takes the first lost cursor, under the new incarnation.
        let r = s.commit(control(99, ControlKind::RankRecovered)).unwrap();
        assert_eq!((r.cursor, r.incarnation), (newest + 1, s.incarnation()));
        assert_eq!(s.cursor_matches(r.cursor, child_inc), CursorCheck::Lost);
        assert_eq!(s.cursor_matches(r.cursor, s.incarnation()), CursorCheck::Same);
        drop(s);
        eprintln!(
            "round {round}: killed after {:?}, child committed up to {child_newest}, durable {newest}",
            t0.elapsed()
        );
    }
    eprintln!("{rounds_with_lost_tail} of {rounds} rounds lost a tail");
    assert!(rounds_with_lost_tail > 0, "no power loss cut a commit the child had seen");
}
