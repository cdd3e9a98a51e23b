//! The durable store: bounds, copies, clears, epoch and format, snapshot against the reference
//! semantics ([`LiveBlocks`]), filters, history ranges, the crash protocol, and a kill -9 drill.

use kv_relay::live::{LiveBlocks, LiveKey};
use kv_relay::model::*;
use kv_relay::store::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use std::path::Path;

// ---------------------------------------------------------------- fixtures

fn cfg(dir: &Path, max_batches: u64, max_bytes: u64) -> StoreConfig {
    StoreConfig {
        dir: dir.to_path_buf(),
        limits: HistoryLimits { max_batches, max_bytes },
        cache_bytes: 8 << 20,
        // A short tail in memory: reads exercise both it and the log's files.
        recent: RecentLimits { max_records: 4, max_bytes: 1 << 20 },
        checkpoint: CheckpointPolicy::default(),
        // Small segments: the log begins a new file every few commits.
        segment_bytes: 4096,
    }
}

fn open(dir: &Path) -> Store {
    Store::open(cfg(dir, u64::MAX, u64::MAX)).unwrap()
}

fn stored(tier: Tier, group: u32, parent: Option<u64>, hashes: &[u64]) -> Event {
    Event::Stored(Stored {
        tier,
        group: Group { idx: group, kind: None, sliding_window: None },
        parent,
        block_size: 2,
        token_layout: TokenLayout::Single,
        blocks: hashes.iter().map(|&h| Block { hash: h, token_ids: vec![h as u32, 7], extra_keys: None }).collect(),
        namespace: Namespace::default(),
        session_id: None,
        ownership: None,
        lookahead_token_ids: None,
        block_mm_infos: None,
    })
}

fn removed(tier: Tier, group: u32, hashes: &[u64]) -> Event {
    Event::Removed(Removed { tier, group, block_hashes: hashes.to_vec(), ownership: None })
}

fn cleared(tier: Option<Tier>) -> Event {
    Event::Cleared(Cleared { tier })
}

fn batch(dp_rank: u32, seq: u64, events: Vec<Event>) -> RecordBody {
    RecordBody::Batch { batch: Batch { dp_rank, seq, ts: seq as f64, events }, load: None, liveness: None }
}

fn control(dp_rank: u32, kind: ControlKind) -> RecordBody {
    RecordBody::Control(Control { dp_rank, kind })
}

fn snapshot_all(s: &Store, filter: SnapshotFilter) -> (u64, Vec<SnapshotBlock>) {
    let snap = s.snapshot(filter).unwrap();
    let cursor = snap.cursor;
    let mut out: Vec<SnapshotBlock> = Vec::new();
    for chunk in snap {
        out.extend(chunk.unwrap());
    }
    sort(&mut out);
    (cursor, out)
}

fn sort(v: &mut [SnapshotBlock]) {
    v.sort_by(|a, b| (a.dp_rank, &a.tier, a.group, a.hash).cmp(&(b.dp_rank, &b.tier, b.group, b.hash)));
}

/// (rank, tier, group, hash, copies)
fn copies(s: &Store) -> Vec<(u32, Tier, u32, u64, u32)> {
    snapshot_all(s, SnapshotFilter::all())
        .1
        .into_iter()
        .map(|b| (b.dp_rank, b.tier, b.group, b.hash, b.copies))
        .collect()
}

/// A block's parent, block size, namespace, token ids and layout.
type Attrs = (Option<u64>, u32, Namespace, Vec<u32>, TokenLayout);

/// The reference: [`LiveBlocks`] for what is live and its copies, plus each block's attributes
/// as its latest store gave them.
#[derive(Default)]
struct Reference {
    live: LiveBlocks,
    attrs: BTreeMap<(LiveKey, u64), Attrs>,
}

impl Reference {
    fn apply(&mut self, body: &RecordBody) {
        match body {
            RecordBody::Batch { batch, .. } => {
                for e in &batch.events {
                    if let Event::Stored(s) = e {
                        let key = LiveKey { dp_rank: batch.dp_rank, tier: s.tier.clone(), group: s.group.idx };
                        let mut parent = s.parent;
                        for b in &s.blocks {
                            let a = (parent, s.block_size, s.namespace.clone(), b.token_ids.clone(), s.token_layout);
                            self.attrs.insert((key.clone(), b.hash), a);
                            parent = Some(b.hash);
                        }
                    }
                    self.live.apply_event(batch.dp_rank, e);
                }
            }
            RecordBody::Control(Control { dp_rank, kind: ControlKind::RankReset { .. } }) => {
                self.live.reset_rank(*dp_rank)
            }
            RecordBody::Control(_) => {}
        }
    }

    fn snapshot(&self, filter: &SnapshotFilter) -> Vec<SnapshotBlock> {
        let mut out = Vec::new();
        for (key, set) in &self.live.blocks {
            if filter.ranks.as_ref().is_some_and(|r| !r.contains(&key.dp_rank))
                || filter.tiers.as_ref().is_some_and(|t| !t.contains(&key.tier))
            {
                continue;
            }
            for (&hash, &copies) in set {
                let (parent, block_size, namespace, token_ids, token_layout) = self.attrs[&(key.clone(), hash)].clone();
                out.push(SnapshotBlock {
                    dp_rank: key.dp_rank,
                    tier: key.tier.clone(),
                    group: key.group,
                    hash,
                    parent,
                    block_size,
                    namespace,
                    copies,
                    token_ids: if filter.include_token_ids { token_ids } else { Vec::new() },
                    token_layout,
                });
            }
        }
        sort(&mut out);
        out
    }

    /// (rank, tier, group) -> (blocks, copies, distinct namespaces)
    fn summary(&self) -> Vec<(u32, Tier, u32, u64, u64, u64)> {
        let mut out: Vec<_> = self
            .live
            .blocks
            .iter()
            .map(|(k, set)| {
                let ns: std::collections::BTreeSet<_> =
                    set.keys().map(|h| format!("{:?}", self.attrs[&(k.clone(), *h)].2)).collect();
                (
                    k.dp_rank,
                    k.tier.clone(),
                    k.group,
                    set.len() as u64,
                    set.values().map(|&c| c as u64).sum(),
                    ns.len() as u64,
                )
            })
            .collect();
        out.sort();
        out
    }
}

fn summary(s: &Store) -> Vec<(u32, Tier, u32, u64, u64, u64)> {
    let mut v: Vec<_> =
        s.live_summary().into_iter().map(|g| (g.dp_rank, g.tier, g.group, g.blocks, g.copies, g.namespaces)).collect();
    v.sort();
    v
}

const TIERS: [fn() -> Tier; 4] = [|| Tier::Device, || Tier::Host, || Tier::Disk, || Tier::Other("LMCache".into())];

/// A seeded random record: stores, removals and clears over few hashes (so copies and removals of
/// absent blocks happen), several ranks, tiers, groups and namespaces, and rank controls.
fn random_body(rng: &mut StdRng, dp_rank: u32, seq: u64, resets: bool) -> RecordBody {
    let roll = rng.random_range(0..1000);
    if resets && roll < 2 {
        return control(dp_rank, ControlKind::RankReset { reason: "restart".into() });
    }
    if roll < 10 {
        let kind = match rng.random_range(0..3) {
            0 => ControlKind::RankDegraded { reason: "gap".into() },
            1 => ControlKind::RankIncomplete { reason: "late".into() },
            _ => ControlKind::RankRecovered,
        };
        return control(dp_rank, kind);
    }
    let n = rng.random_range(1..4);
    let mut events = Vec::new();
    for _ in 0..n {
        let tier = TIERS[rng.random_range(0..TIERS.len())]();
        let group = rng.random_range(0..2);
        let k = rng.random_range(0..100);
        if k < 55 {
            let hashes: Vec<u64> =
                (0..rng.random_range(1..5)).map(|_| rng.random_range(0..60u64) * 0x9e37_79b9).collect();
            let namespace = match rng.random_range(0..4) {
                0 => Namespace { lora_name: Some("adapter".into()), ..Default::default() },
                1 => Namespace { cache_salt: Some(format!("salt{}", rng.random_range(0..3))), ..Default::default() },
                2 => Namespace { lora_id: Some(-3), lora_name: Some("x".into()), cache_salt: Some("s".into()) },
                _ => Namespace::default(),
            };
            let layout = if rng.random_bool(0.2) { TokenLayout::Bigram } else { TokenLayout::Single };
            events.push(Event::Stored(Stored {
                tier,
                group: Group { idx: group, kind: Some("full_attention".into()), sliding_window: None },
                parent: rng.random_bool(0.7).then(|| rng.random_range(0..1000)),
                block_size: rng.random_range(1..32),
                token_layout: layout,
                blocks: hashes
                    .iter()
                    .map(|&hash| Block {
                        hash,
                        token_ids: (0..rng.random_range(0..6)).map(|_| rng.random()).collect(),
                        extra_keys: rng.random_bool(0.1).then(|| KeyPart::List(vec![KeyPart::Str("ab".into())])),
                    })
                    .collect(),
                namespace,
                session_id: None,
                ownership: None,
                lookahead_token_ids: None,
                block_mm_infos: None,
            }));
        } else if k < 95 {
            let hashes: Vec<u64> =
                (0..rng.random_range(1..5)).map(|_| rng.random_range(0..60u64) * 0x9e37_79b9).collect();
            events.push(removed(tier, group, &hashes));
        } else if k < 99 {
            events.push(removed(tier, group, &[rng.random_range(0..60u64) * 0x9e37_79b9]));
        } else if rng.random_bool(0.3) {
            events.push(cleared(None));
        } else {
            events.push(cleared(Some(tier)));
        }
    }
    batch(dp_rank, seq, events)
}

fn all_history(s: &Store) -> Vec<Record> {
    let mut out = Vec::new();
    let mut after = 0;
    loop {
        let page = s.history(after, 1000).unwrap();
        let Some(last) = page.last() else { return out };
        after = last.cursor;
        out.extend(page);
    }
}

// ---------------------------------------------------------------- bounds, copies, clears

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

// ---------------------------------------------------------------- epoch, format, errors

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

// ---------------------------------------------------------------- snapshot

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

// ---------------------------------------------------------------- history, cursors, ranks

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

// ---------------------------------------------------------------- kill -9

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
    use std::process::{Command, Stdio};
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    let dir = tempfile::tempdir().unwrap();
    let seed = 20_261_130u64;
    let mut rng = StdRng::seed_from_u64(seed);
    let mut prev_incarnation = 0u32;
    let mut rounds_with_lost_tail = 0;
    let rounds = 20;
    for round in 0..rounds {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["crash_child", "--exact", "--nocapture", "--test-threads", "1"])
            .env(CHILD_DIR, dir.path())
            .env(CHILD_SEED, seed.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
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

// ---------------------------------------------------------------- a full disk, a read-only disk

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
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["disk_fill_child", "--exact", "--nocapture", "--test-threads", "1"])
        .env(FILL_DIR, &path)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
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

// ---------------------------------------------------------------- log, checkpoints, format 1

/// A store that checkpoints only when asked, each commit in a segment of its own (so that the
/// log can be removed a record at a time).
fn cfg_manual(dir: &Path, max_batches: u64) -> StoreConfig {
    StoreConfig {
        checkpoint: CheckpointPolicy { every_records: u64::MAX, every_bytes: u64::MAX },
        segment_bytes: 1,
        ..cfg(dir, max_batches, u64::MAX)
    }
}

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

// ---------------------------------------------------------------- kill -9 inside checkpoints

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
    use std::process::{Command, Stdio};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    let dir = tempfile::tempdir().unwrap();
    let mut rng = StdRng::seed_from_u64(0xc0ffee);
    let (mut inside, mut checkpointed) = (0, 0);
    let rounds = 12;
    for round in 0..rounds {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["ckpt_crash_child", "--exact", "--nocapture", "--test-threads", "1"])
            .env(CKPT_CHILD_DIR, dir.path())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
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
