//! A full disk, a read-only disk.

use super::*;

/// A small tmpfs for the store (needs root and `mount`: the tests that use it are ignored by
/// default, and `scripts/test.sh` runs them when it runs as root).
struct SmallDisk {
    dir: tempfile::TempDir,
}

impl SmallDisk {
    fn mount(size: &str) -> SmallDisk {
        let dir = tempfile::tempdir().unwrap();
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir.path())
            .output()
            .expect("run mount");
        assert!(
            out.status.success(),
            "cannot mount a tmpfs (this test needs root): {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
        SmallDisk { dir }
    }

    /// Remounts with `opts`, trying again while the kernel answers busy: a store just dropped
    /// closes its files from sled's background threads, and a read-only remount fails while any
    /// file is open for writing (the same wait as an open's for the store's lock).
    fn remount(&self, opts: &str) {
        let started = std::time::Instant::now();
        loop {
            let out = std::process::Command::new("mount")
                .args(["-o", &format!("remount,{opts}")])
                .arg(self.dir.path())
                .output()
                .unwrap();
            if out.status.success() {
                return;
            }
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(
                err.contains("busy") && started.elapsed() < std::time::Duration::from_secs(30),
                "remount,{opts} of {} failed after {:?}: {err}",
                self.dir.path().display(),
                started.elapsed()
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(self.dir.path()).status();
    }
}

const FILL_DIR: &str = "KV_RELAY_STORE_FILL_DIR";

/// A large record (64 blocks of 64 random tokens) of the disk-full test's stream.
fn fill_body(rng: &mut StdRng, seq: u64) -> RecordBody {
    let hashes: Vec<u64> = (0..64).map(|j| seq * 64 + j).collect();
    let mut body = batch(0, seq, vec![stored(Tier::Device, 0, None, &hashes)]);
    if let RecordBody::Batch { batch, .. } = &mut body {
        if let Event::Stored(st) = &mut batch.events[0] {
            st.blocks.iter_mut().for_each(|b| b.token_ids = (0..64).map(|_| rng.random()).collect());
        }
    }
    body
}

/// Not a test on its own: the child process of `a_full_disk_…`. It commits the stream,
/// flushing after every fourth commit, until a write fails; it prints the last cursor
/// committed, the error and what the next commit answered. Told on stdin that there is room
/// again, it commits the record refused and ten more, prints the last cursor, and exits without
/// closing the store.
#[test]
fn disk_fill_child() {
    let Ok(dir) = std::env::var(FILL_DIR) else { return };
    let s = open(Path::new(&dir));
    let mut rng = StdRng::seed_from_u64(3);
    let mut committed = 0;
    for seq in 0..100_000u64 {
        let mut group = vec![fill_body(&mut rng, seq)];
        let flushed = |r: Record| if seq % 4 == 3 { s.flush().map(|_| r) } else { Ok(r) };
        match s.commit_group(&mut group).map(|mut v| v.pop().unwrap().record.clone()).and_then(flushed) {
            Ok(r) => committed = r.cursor,
            Err(e) => {
                // While the disk is full, the record is refused again (and given back again).
                let again = s.commit_group(&mut group).unwrap_err();
                println!("\nfill committed={committed}\nfill disk_full={}", matches!(e, StoreError::DiskFull { .. }));
                println!("fill refused_again={}", matches!(again, StoreError::DiskFull { .. }));
                println!("fill given_back={}\nfill error={e}", group.len());
                let mut go = String::new();
                std::io::stdin().read_line(&mut go).unwrap();
                // The record refused (given back by `commit_group`), then ten more.
                let mut last = s.commit_group(&mut group).unwrap().pop().unwrap().record.cursor;
                for seq in seq + 1..seq + 11 {
                    last = s.commit(fill_body(&mut rng, seq)).unwrap().cursor;
                }
                println!("fill resumed_to={last}");
                std::process::exit(0);
            }
        }
    }
    println!("\nfill never_full");
    std::process::exit(0);
}

#[test]
#[ignore = "needs root (mounts a tmpfs); scripts/test.sh runs it as root"]
fn a_full_disk_refuses_commits_until_there_is_room_and_loses_nothing() {
    use std::io::{BufRead, Write};
    use std::time::{Duration, Instant};
    let disk = SmallDisk::mount("6m");
    let path = disk.dir.path().join("state");
    let mut child =
        child_test("disk::disk_fill_child").env(FILL_DIR, &path).stdin(std::process::Stdio::piped()).spawn().unwrap();
    // The child fills the disk until a write fails, then waits for room.
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let mut out = String::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        out.push_str(&line);
        out.push('\n');
        if line.starts_with("fill error=") || line.starts_with("fill never_full") {
            break;
        }
    }
    let said = |out: &str| -> BTreeMap<String, String> {
        out.lines()
            .filter_map(|l| l.strip_prefix("fill "))
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    };
    let first = said(&out);
    assert_eq!(first.get("disk_full").map(String::as_str), Some("true"), "{out}");
    assert_eq!(first.get("refused_again").map(String::as_str), Some("true"), "{out}");
    assert_eq!(first.get("given_back").map(String::as_str), Some("1"), "{out}");
    let msg = &first["error"];
    assert_eq!(
        msg,
        &format!(
            "disk full in {} during commit: free space in the state directory (every commit before this one is kept)",
            path.display()
        )
    );
    let committed: u64 = first["committed"].parse().unwrap();
    assert!(committed > 0);
    // With room again, the same store takes the refused record and more, without a reopen.
    disk.remount("size=64m");
    writeln!(child.stdin.take().unwrap(), "go").unwrap();
    let rest: String = lines.map(|l| l.unwrap() + "\n").collect();
    let t0 = Instant::now();
    while child.try_wait().unwrap().is_none() {
        assert!(t0.elapsed() < Duration::from_secs(60), "the filling process did not end");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(said(&rest).get("resumed_to"), Some(&(committed + 11).to_string()), "{rest}");
    // The reopened store holds exactly the stream: a snapshot equal to its history, and to the
    // stream up to there.
    let s = open(&path);
    let newest = s.newest_cursor();
    assert_eq!(newest, committed + 11);
    let hist = all_history(&s);
    assert_eq!(hist.len() as u64, newest);
    let mut reference = Reference::default();
    let mut rng = StdRng::seed_from_u64(3);
    for (seq, r) in hist.iter().enumerate() {
        let want = fill_body(&mut rng, seq as u64);
        assert_eq!(r.body, want, "cursor {}", r.cursor);
        reference.apply(&want);
    }
    let snap = snapshot_all(&s, SnapshotFilter::all()).1;
    assert_eq!(snap, reference.snapshot(&SnapshotFilter::all()));
    s.commit(control(0, ControlKind::RankRecovered)).unwrap();
    drop(s);
    let s = open(&path);
    assert_eq!(s.newest_cursor(), newest + 1);
    assert_eq!(snapshot_all(&s, SnapshotFilter::all()).1, snap);
}

#[test]
#[ignore = "needs root (mounts a tmpfs); scripts/test.sh runs it as root"]
fn a_read_only_state_directory_is_a_clear_error() {
    let disk = SmallDisk::mount("16m");
    let path = disk.dir.path().join("state");
    drop(open(&path));
    disk.remount("ro");
    let err = Store::open(cfg(&path, 10, 1 << 20)).unwrap_err();
    assert!(matches!(err, StoreError::ReadOnly { .. }), "{err:?}");
    assert!(
        err.to_string().starts_with(&format!("store directory {} is read-only or not writable", path.display())),
        "{err}"
    );
    disk.remount("rw");
    let s = open(&path);
    assert_eq!(s.incarnation(), 2);
}

#[test]
fn a_store_in_use_is_refused_and_opens_once_closed() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path());
    let err = Store::open(cfg(dir.path(), 10, 1 << 20)).unwrap_err();
    assert!(matches!(&err, StoreError::Locked { dir: d } if d == dir.path()), "{err:?}");
    assert!(err.to_string().contains(&dir.path().display().to_string()), "{err}");
    // The lock goes with the store (sled releases it from its background threads: the open waits).
    drop(s);
    assert_eq!(open(dir.path()).newest_cursor(), 0);
}
