//! NVIDIA Dynamo's indexes (`dynamo-kv-router` 1.6.1), driven as its router drives them.

use super::*;
use dynamo_kv_router::indexer::{SyncIndexer, ThreadPoolIndexer};
use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, RouterEvent,
};
use dynamo_kv_router::{ConcurrentRadixTreeCompressed, RadixTree};

/// A KV event as Dynamo's router receives it: worker id, DP rank 0, device tier; each block
/// with its sequence hash and (the trace's hashes being chained already) the same value as
/// its local hash, which is what Dynamo's trees match requests by.
fn event(id: u64, op: &Op) -> RouterEvent {
    let data = match op {
        Op::Store { parent, hashes, .. } => KvCacheEventData::Stored(KvCacheStoreData {
            parent_hash: parent.map(ExternalSequenceBlockHash),
            start_position: None,
            blocks: hashes
                .iter()
                .map(|&h| KvCacheStoredBlockData {
                    block_hash: ExternalSequenceBlockHash(h),
                    tokens_hash: LocalBlockHash(h),
                    mm_extra_info: None,
                })
                .collect(),
        }),
        Op::Remove { hashes, .. } => KvCacheEventData::Removed(KvCacheRemoveData {
            block_hashes: hashes.iter().map(|&h| ExternalSequenceBlockHash(h)).collect(),
        }),
    };
    RouterEvent::new(op.worker() as u64, KvCacheEvent { event_id: id, data, dp_rank: 0 })
}

fn query(hashes: &[u64]) -> Vec<LocalBlockHash> {
    hashes.iter().map(|&h| LocalBlockHash(h)).collect()
}

/// `ConcurrentRadixTreeCompressed` behind `ThreadPoolIndexer` with `threads` apply threads,
/// its events enqueued as fast as it takes them or paced at `pace` block ops a second;
/// lookups inline on the reader thread (as `find_matches` does).
pub fn crtc(w: &Workload, threads: usize, pace: Option<f64>) -> Row {
    let queries: Vec<Vec<LocalBlockHash>> = w.lookups.iter().map(|q| query(q)).collect();
    let rt = tokio::runtime::Builder::new_current_thread().build().expect("tokio runtime");
    let before = ALLOCATOR.allocated();
    let events: Vec<RouterEvent> = w.ops.iter().enumerate().map(|(i, op)| event(i as u64, op)).collect();
    let pool = ThreadPoolIndexer::new(ConcurrentRadixTreeCompressed::new(), threads, 512);
    let done = AtomicBool::new(false);
    let (elapsed, lat) = std::thread::scope(|s| {
        let reader = s.spawn(|| {
            let mut k = 0usize;
            lookup_loop(w, &done, |_| {
                k += 1;
                let q = &queries[(k - 1) % queries.len()];
                pool.backend().find_matches(q, false).scores.values().map(|&v| v as u64).sum()
            })
        });
        let t0 = Instant::now();
        for (i, ev) in events.into_iter().enumerate() {
            wait_due(w, i, t0, pace);
            pool.enqueue_event(ev).expect("enqueue");
            if i % 4096 == 4095 {
                rt.block_on(pool.flush_and_wait()).expect("flush");
            }
        }
        rt.block_on(pool.flush_and_wait()).expect("flush");
        let elapsed = t0.elapsed();
        done.store(true, Ordering::Relaxed);
        (elapsed, reader.join().expect("reader"))
    });
    let mut r = row(w.block_ops, elapsed, lat, before);
    // The tree keeps nodes whose workers all left until a sweep it runs at most every 5
    // minutes (`dynamo_kv_router::cleanup`), longer than a run: its memory is also read
    // after that sweep, run here.
    pool.backend().run_cleanup_task();
    r.swept = ALLOCATOR.allocated().saturating_sub(before) as f64;
    drop(pool);
    r
}

/// `RadixTree`: one thread applies the events and looks up once every 8 events.
pub fn radix(w: &Workload) -> Row {
    let queries: Vec<Vec<LocalBlockHash>> = w.lookups.iter().map(|q| query(q)).collect();
    let before = ALLOCATOR.allocated();
    let events: Vec<RouterEvent> = w.ops.iter().enumerate().map(|(i, op)| event(i as u64, op)).collect();
    let mut tree = RadixTree::new();
    let mut lat = Vec::with_capacity(events.len() / 8 + 1);
    let mut apply = Duration::ZERO;
    let mut sink = 0u64;
    for (i, ev) in events.into_iter().enumerate() {
        let t0 = Instant::now();
        tree.apply_event(ev).expect("a well-formed event");
        apply += t0.elapsed();
        if i % 8 == 7 {
            let q = queries[(i / 8) % queries.len()].clone();
            let t0 = Instant::now();
            sink = sink.wrapping_add(tree.find_matches(q, false).scores.values().map(|&v| v as u64).sum());
            lat.push(t0.elapsed().as_nanos() as u64);
        }
    }
    black_box(sink);
    lat.sort_unstable();
    let r = row(w.block_ops, apply, (lat, timer_cost()), before);
    drop(tree);
    r
}
