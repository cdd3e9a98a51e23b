//! Epoch, format, errors.

use super::*;

#[test]
fn epoch_is_kept_across_a_clean_reopen_and_renewed_on_a_wiped_directory() {
    let dir = tempfile::tempdir().unwrap();
    let (epoch, hist) = {
        let s = open(dir.path());
        assert_eq!((s.incarnation(), s.newest_cursor(), s.oldest_cursor()), (1, 0, None));
        for seq in 0..3 {
            s.commit(batch(0, seq, vec![stored(Tier::Device, 0, None, &[seq])])).unwrap();
        }
        (s.epoch(), s.history(0, 10).unwrap())
    };
    let s = open(dir.path());
    assert_eq!(s.epoch(), epoch);
    assert_eq!(s.incarnation(), 2);
    assert_eq!(s.newest_cursor(), 3);
    assert_eq!(s.history(0, 10).unwrap(), hist);
    assert_eq!(copies(&s).len(), 3);
    let next = s.commit(control(0, ControlKind::RankRecovered)).unwrap();
    assert_eq!((next.cursor, next.incarnation), (4, 2));
    drop(s);
    std::fs::remove_dir_all(dir.path()).unwrap();
    let s = open(dir.path());
    assert_ne!(s.epoch(), epoch);
    assert_eq!((s.incarnation(), s.newest_cursor()), (1, 0));
}

#[test]
fn a_store_of_a_future_format_is_refused_with_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    drop(open(dir.path()));
    {
        let db = sled::open(dir.path().join("sled")).unwrap();
        db.open_tree("meta").unwrap().insert("format", &(FORMAT_VERSION + 1).to_be_bytes()[..]).unwrap();
        db.flush().unwrap();
    }
    let err = Store::open(cfg(dir.path(), 10, 1 << 20)).unwrap_err();
    assert!(
        matches!(err, StoreError::IncompatibleFormat { found, supported, .. } if found == FORMAT_VERSION + 1 && supported == FORMAT_VERSION),
        "{err:?}"
    );
    let msg = err.to_string();
    assert_eq!(
        msg,
        format!(
            "store in {} has format version 3, this relay reads versions 1 to 2 (it upgrades version 1): refusing to \
             open it (move the directory aside to start a new store)",
            dir.path().display()
        )
    );
    // Refused means untouched: still refused, nothing moved aside.
    assert!(Store::open(cfg(dir.path(), 10, 1 << 20)).is_err());
    assert!(dir.path().join("sled").exists());
}

#[test]
fn an_unreadable_store_is_moved_aside_and_gets_a_new_epoch() {
    let dir = tempfile::tempdir().unwrap();
    {
        // Data but no meta: not a store this relay wrote.
        let db = sled::open(dir.path().join("sled")).unwrap();
        db.open_tree("data").unwrap().insert("x", "y").unwrap();
        db.flush().unwrap();
    }
    // A redo left beside it belongs to it: it goes aside too, unread.
    std::fs::write(dir.path().join("redo"), b"the old store's").unwrap();
    let s = open(dir.path());
    assert_eq!((s.incarnation(), s.newest_cursor()), (1, 0));
    let aside: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("unreadable-"))
        .collect();
    assert_eq!(aside.len(), 1, "{aside:?}");
    assert!(!dir.path().join("redo").exists());
    assert_eq!(std::fs::read(dir.path().join(&aside[0]).join("redo")).unwrap(), b"the old store's");
}

#[test]
fn disk_errors_are_clear() {
    let dir = tempfile::tempdir().unwrap();
    // The state directory is a file: creating it fails.
    let file = dir.path().join("not-a-dir");
    std::fs::write(&file, b"x").unwrap();
    let err = Store::open(cfg(&file, 10, 1 << 20)).unwrap_err();
    assert!(matches!(err, StoreError::Io { .. }), "{err:?}");
    assert!(
        err.to_string().starts_with(&format!("i/o error in {} during create the state directory: ", file.display())),
        "{err}"
    );
    // Open twice: the second is told the store is in use.
    let s = open(&dir.path().join("s"));
    let err = Store::open(cfg(&dir.path().join("s"), 10, 1 << 20)).unwrap_err();
    assert_eq!(err.to_string(), format!("store in {} is in use by another process", dir.path().join("s").display()));
    drop(s);
}
