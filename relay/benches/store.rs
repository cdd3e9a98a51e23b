//! The durable store's cost: commits per second (the log write, the live set in memory, the
//! checkpoints beside them) against two peers in this run that write only the history records:
//! appended to a file (the log's write alone), and in sled, one sled write per record; bytes on
//! disk per live block; RSS at a million live blocks; the pause a snapshot costs commits, and
//! the longest commit while a snapshot of every block is read; a checkpoint's time; reopen
//! (recovery) time with the log a crash can leave after the newest checkpoint.
//!
//! `cargo bench -p kv-relay --bench store` (full: 1,000,000 live blocks, about a minute);
//! `KV_RELAY_BENCH_QUICK=1 cargo bench -p kv-relay --bench store` (CI: seconds).

use kv_relay::model::*;
use kv_relay::store::*;
use std::path::Path;
use std::time::{Duration, Instant};

const BLOCKS_PER_BATCH: u64 = 32;
const TOKENS_PER_BLOCK: u32 = 16;
const RANKS: u64 = 4;

fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn stored(i: u64) -> Event {
    let base = i * BLOCKS_PER_BATCH;
    let blocks = (0..BLOCKS_PER_BATCH)
        .map(|j| {
            Block::new(mix(base + j), (0..TOKENS_PER_BLOCK).map(|t| (mix(base + j) as u32).wrapping_add(t)).collect())
        })
        .collect();
    Event::Stored(Stored {
        parent: (i > 0).then(|| mix(base - 1)),
        ..Stored::plain(Tier::Device, 0, TOKENS_PER_BLOCK, blocks)
    })
}

/// Batch `i` of the fill: 32 new blocks on rank `i % 4`.
fn fill_batch(i: u64) -> RecordBody {
    RecordBody::Batch {
        batch: Batch { dp_rank: (i % RANKS) as u32, seq: i / RANKS, ts: i as f64, events: vec![stored(i)] },
        load: Some(Load { running: 3.0, waiting: 1.0, kv_usage: 0.5, scraped_at_ms: i }),
        liveness: None,
    }
}

/// Churn batch: 16 blocks of batch `i` (new) stored, and 16 blocks of fill batch `old` removed.
fn churn_batch(i: u64, old: u64) -> RecordBody {
    let Event::Stored(mut s) = stored(i) else { unreachable!() };
    s.blocks.truncate(BLOCKS_PER_BATCH as usize / 2);
    let removed = Removed {
        tier: Tier::Device,
        group: 0,
        block_hashes: (0..BLOCKS_PER_BATCH / 2).map(|j| mix(old * BLOCKS_PER_BATCH + j)).collect(),
        ownership: None,
    };
    RecordBody::Batch {
        batch: Batch {
            dp_rank: (old % RANKS) as u32,
            seq: i,
            ts: i as f64,
            events: vec![Event::Stored(s), Event::Removed(removed)],
        },
        load: None,
        liveness: None,
    }
}

/// Batch `i` of the log after the last checkpoint: 16 new blocks of batch `i` stored on rank 0,
/// and the 16 batch `i - 1` stored removed, so the live set keeps its size.
fn replace_batch(i: u64, remove_previous: bool) -> RecordBody {
    let Event::Stored(mut s) = stored(i) else { unreachable!() };
    s.blocks.truncate(BLOCKS_PER_BATCH as usize / 2);
    let mut events = vec![Event::Stored(s)];
    if remove_previous {
        let Event::Stored(prev) = stored(i - 1) else { unreachable!() };
        let block_hashes = prev.blocks.iter().take(BLOCKS_PER_BATCH as usize / 2).map(|b| b.hash).collect();
        events.push(Event::Removed(Removed { tier: Tier::Device, group: 0, block_hashes, ownership: None }));
    }
    RecordBody::Batch { batch: Batch { dp_rank: 0, seq: i, ts: i as f64, events }, load: None, liveness: None }
}

fn rss_kib() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

fn du(p: &Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(p) else { return 0 };
    rd.flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => du(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}

fn per_sec(n: u64, d: Duration) -> f64 {
    n as f64 / d.as_secs_f64()
}

/// Writes the fill's records to a fresh sled at `dir`, one batch per record: the record under
/// `prefix ++ cursor` in tree `tree`, the record 10,000 before it removed, and whatever `extra`
/// adds for record `i`. The peers below differ only in the tree, the prefix and `extra`.
fn sled_peer(dir: &Path, batches: u64, tree: &str, prefix: &[u8], extra: impl Fn(u64, &mut sled::Batch)) -> Duration {
    let db = sled::Config::new().path(dir).cache_capacity(64 << 20).open().unwrap();
    let t = db.open_tree(tree).unwrap();
    let key = |cursor: u64| [prefix, &cursor.to_be_bytes()].concat();
    let start = Instant::now();
    for i in 0..batches {
        let rec = Record { cursor: i + 1, incarnation: 1, body: fill_batch(i) };
        let mut b = sled::Batch::default();
        b.insert(key(i + 1), rmp_serde::to_vec_named(&rec).unwrap());
        if i >= 10_000 {
            b.remove(key(i + 1 - 10_000));
        }
        extra(i, &mut b);
        t.apply_batch(b).unwrap();
    }
    db.flush().unwrap();
    start.elapsed()
}

/// The sled peer: the same records written to sled as the history alone (one key per record,
/// the oldest removed past 10,000), no snapshot, no totals.
fn history_only(dir: &Path, batches: u64) -> Duration {
    sled_peer(dir, batches, "history", b"", |_, _| {})
}

/// The file peer: the same records encoded and appended to one file, one `write` per record,
/// synced at the end: the log's write alone, without framing, live set or publishing.
fn file_only(path: &Path, batches: u64) -> Duration {
    use std::io::Write;
    let mut f = std::fs::File::create(path).unwrap();
    let start = Instant::now();
    for i in 0..batches {
        let rec = Record { cursor: i + 1, incarnation: 1, body: fill_batch(i) };
        f.write_all(&rmp_serde::to_vec_named(&rec).unwrap()).unwrap();
    }
    f.sync_data().unwrap();
    start.elapsed()
}

fn main() {
    let quick = std::env::var_os("KV_RELAY_BENCH_QUICK").is_some();
    let live_target: u64 = if quick { 20_000 } else { 1_000_000 };
    let fill = live_target / BLOCKS_PER_BATCH;
    let churn = if quick { 200 } else { 10_000 };
    let root = tempfile::tempdir_in(std::env::var_os("KV_RELAY_BENCH_DIR").unwrap_or_else(|| ".".into())).unwrap();
    println!("store benchmark ({}): {live_target} live blocks, {fill} fill batches of {BLOCKS_PER_BATCH} blocks with {TOKENS_PER_BLOCK} tokens each, {churn} churn batches", if quick { "quick" } else { "full" });

    // Peers first, then drop them.
    let peer = history_only(&root.path().join("peer"), fill);
    let peer_bps = per_sec(fill, peer);
    std::fs::remove_dir_all(root.path().join("peer")).unwrap();
    let file_peer_bps = per_sec(fill, file_only(&root.path().join("file-peer"), fill));
    std::fs::remove_file(root.path().join("file-peer")).unwrap();

    let dir = root.path().join("store");
    let store_cfg = StoreConfig::new(&dir);
    let store = Store::open(store_cfg.clone()).unwrap();
    let start = Instant::now();
    for i in 0..fill {
        store.commit(fill_batch(i)).unwrap();
    }
    store.flush().unwrap();
    let fill_time = start.elapsed();
    let fill_bps = per_sec(fill, fill_time);
    let live = store.live_stats();
    assert_eq!(live.blocks, live_target);

    // Steady state: each batch stores 16 new blocks and removes 16 of the oldest.
    let start = Instant::now();
    for k in 0..churn {
        store.commit(churn_batch(fill + k, k)).unwrap();
    }
    store.flush().unwrap();
    let churn_time = start.elapsed();
    let churn_bps = per_sec(churn, churn_time);

    // Batched commits (the ingest commits a refill in one call).
    let start = Instant::now();
    let groups = churn / 10;
    for g in 0..groups {
        let bodies = (0..10).map(|j| churn_batch(fill + churn + g * 10 + j, churn + g * 10 + j)).collect();
        store.commit_many(bodies).unwrap();
    }
    store.flush().unwrap();
    let many_time = start.elapsed();
    let many_bps = per_sec(groups * 10, many_time);

    let (rss, hwm) = rss_kib();
    let heap = store.live_heap_bytes();

    // Snapshot: the pause commits see, and reading it all while a second thread commits (the
    // longest of those commits is what a subscriber's resync costs ingest).
    let snap_tokens = store.snapshot(SnapshotFilter::all()).unwrap();
    let pause_tokens = snap_tokens.pause;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let committer = {
        let (store, stop) = (store.clone(), stop.clone());
        let base = fill + churn + groups * 10;
        std::thread::spawn(move || {
            let (mut longest, mut n) = (Duration::ZERO, 0u64);
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let t = Instant::now();
                store.commit(churn_batch(base + n, base - fill + n)).unwrap();
                longest = longest.max(t.elapsed());
                n += 1;
            }
            (longest, n)
        })
    };
    let start = Instant::now();
    let mut read = 0usize;
    for chunk in snap_tokens {
        read += chunk.unwrap().len();
    }
    let stream_tokens = start.elapsed();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (longest_commit, during) = committer.join().unwrap();
    assert_eq!(read as u64, live.blocks);
    let snap_bare = store.snapshot(SnapshotFilter { include_token_ids: false, ..SnapshotFilter::all() }).unwrap();
    let pause_bare = snap_bare.pause;
    drop(snap_bare);
    let (rss_after_snap, _) = rss_kib();
    let start = Instant::now();
    let ckpt = store.checkpoint_now().unwrap();
    let ckpt_time = start.elapsed();
    // The worst log a crash leaves: all the policy lets pass before the next checkpoint (as
    // many records, or as many bytes as the larger of its bytes and the checkpoint's size).
    let policy = CheckpointPolicy::default();
    let max_bytes = policy.every_bytes.max(ckpt.bytes);
    let base = fill + churn + groups * 10 + during;
    let (mut after, mut after_bytes) = (0u64, 0u64);
    while after + 1 < policy.every_records && after_bytes < max_bytes && (!quick || after < 500) {
        let c = store.commit_many(vec![replace_batch(base + after, after > 0)]).unwrap();
        after_bytes += c[0].size();
        after += 1;
    }
    let live = store.live_stats();
    let disk = du(&dir);

    let hist = store.history_stats();
    drop(store);
    let start = Instant::now();
    let store = Store::open(store_cfg).unwrap();
    let reopen = start.elapsed();
    assert_eq!(store.live_stats(), live);
    assert_eq!(store.checkpoint_state().map(|c| c.cursor), Some(ckpt.cursor));
    let (rss_reopen, _) = rss_kib();

    let m = live.blocks as f64 / 1e6;
    println!();
    println!("| measure | value |");
    println!("|---|---|");
    println!("| fill: committed batches/s (32 stores each) | {fill_bps:.0} |");
    println!("| fill: block ops/s | {:.0} |", fill_bps * BLOCKS_PER_BATCH as f64);
    println!("| file peer, the records appended to a file: batches/s | {file_peer_bps:.0} |");
    println!(
        "| fill vs file peer (the store's cost over the log write alone) | {:.2}x the peer's time |",
        file_peer_bps / fill_bps
    );
    println!("| sled peer, one sled write per record: batches/s | {peer_bps:.0} |");
    println!("| fill vs sled peer | {:.2}x the peer's time |", peer_bps / fill_bps);
    println!("| churn at {} live: batches/s (16 stores + 16 removals) | {churn_bps:.0} |", live.blocks);
    println!("| churn: block ops/s | {:.0} |", churn_bps * BLOCKS_PER_BATCH as f64);
    println!("| churn, 10 batches per commit_many: batches/s | {many_bps:.0} ({:.2}x single) |", many_bps / churn_bps);
    println!("| history kept | {} batches, {:.1} MiB |", hist.batches, hist.bytes as f64 / (1 << 20) as f64);
    println!("| bytes on disk (state directory, after flush) | {:.1} MiB |", disk as f64 / (1 << 20) as f64);
    println!("| bytes on disk per live block (history included) | {:.0} |", disk as f64 / live.blocks as f64);
    println!(
        "| RSS at {} live blocks (peak) | {:.0} MiB ({:.0} MiB) |",
        live.blocks,
        rss as f64 / 1024.0,
        hwm as f64 / 1024.0
    );
    println!("| RSS after the snapshots | {:.0} MiB |", rss_after_snap as f64 / 1024.0);
    println!(
        "| snapshot pause, with token ids | {:.0} ms ({:.0} ms per 1M blocks) |",
        pause_tokens.as_secs_f64() * 1e3,
        pause_tokens.as_secs_f64() * 1e3 / m
    );
    println!("| snapshot pause, without token ids | {:.0} ms per 1M blocks |", pause_bare.as_secs_f64() * 1e3 / m);
    println!(
        "| snapshot read-out (every block, token ids), beside commits | {:.0} ms |",
        stream_tokens.as_secs_f64() * 1e3
    );
    println!(
        "| longest commit while it was read ({during} commits of 16 stores + 16 removals) | {:.2} ms |",
        longest_commit.as_secs_f64() * 1e3
    );
    println!(
        "| checkpoint of {} blocks | {:.0} ms, {:.1} MiB ({:.0} bytes per block) |",
        live.blocks,
        ckpt_time.as_secs_f64() * 1e3,
        ckpt.bytes as f64 / (1 << 20) as f64,
        ckpt.bytes as f64 / live.blocks as f64
    );
    println!(
        "| live set in memory (maps, token slabs) | {:.1} MiB ({:.0} bytes per block) |",
        heap as f64 / (1 << 20) as f64,
        heap as f64 / live.blocks as f64
    );
    println!(
        "| reopen: the checkpoint, then {after} records ({:.1} MiB) of log after it | {:.0} ms |",
        after_bytes as f64 / (1 << 20) as f64,
        reopen.as_secs_f64() * 1e3
    );
    println!("| RSS after reopen | {:.0} MiB |", rss_reopen as f64 / 1024.0);
    println!("| fill time / churn time | {:.1} s / {:.1} s |", fill_time.as_secs_f64(), churn_time.as_secs_f64());
}
