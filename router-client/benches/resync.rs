//! A relay's snapshot resync on the client side, in one process: what a subscriber does with a
//! snapshot of a million live blocks (the relay bench's `footprint` resync, without the relay
//! and the network), timed by part.
//!
//! ```text
//! cargo bench --locked -p kv-router-client --bench resync                      # 1M blocks, 3 runs
//! cargo bench --locked -p kv-router-client --bench resync -- --blocks 200000 --runs 1
//! ```
//!
//! **Snapshot.** As the relay bench's fill leaves it: chains of 128 blocks (each block's parent
//! the one before it, the first without one), alternating between 2 ranks, one tier, 16 tokens a
//! block, sent in the relay's order (rank, then hash) as `SubscribeResponse`s of 1,024 blocks,
//! encoded once up front (a relay sends the same bytes). Two kinds of hashes: `sequential` (the
//! relay bench's: consecutive integers, so hash order is chain order) and `random` (an engine's:
//! hash order is no order). Options: `--blocks N` (1,000,000), `--runs N` (3; medians are
//! printed), `--chunk N` (1,024), `--hashes sequential,random` (both).
//!
//! **Parts.** Message by message, as a subscriber does: `decode`, each message decoded from
//! its bytes (what tonic does for the subscriber); `stage`: `RelayAdmission::apply` of the begin and the chunks (the blocks staged
//! per rank); `swap`: its apply of the end (each rank's worker swapped in by
//! `PrefixIndex::replace_worker`, into a new index as a new subscriber's is); `total`, from the
//! first message's decode to the end's apply.
//! After each run a lookup of every 97th chain is checked against what it must find (the
//! chain's worker, all 128 blocks).

use std::time::{Duration, Instant};

use kv_relay_proto::encoded::SubscribeOut;
use kv_relay_proto::pb;
use kv_router_client::admission::{ClientEvent, RelayAdmission};
use kv_router_client::index::{IndexConfig, PrefixIndex};
use kv_router_client::Verdict;

const URL: &str = "http://relay-bench:50051";
const CHAIN: u64 = 128;
const RANKS: u64 = 2;

struct Opts {
    blocks: u64,
    runs: usize,
    chunk: usize,
    hashes: Vec<String>,
}

impl Opts {
    fn parse() -> Opts {
        let mut o =
            Opts { blocks: 1_000_000, runs: 3, chunk: 1024, hashes: vec!["sequential".into(), "random".into()] };
        let args: Vec<String> = std::env::args().skip(1).collect();
        let mut i = 0;
        while i < args.len() {
            let value = || args.get(i + 1).cloned().unwrap_or_default();
            match args[i].as_str() {
                "--blocks" => o.blocks = value().parse().expect("--blocks N"),
                "--runs" => o.runs = value().parse().expect("--runs N"),
                "--chunk" => o.chunk = value().parse().expect("--chunk N"),
                "--hashes" => o.hashes = value().split(',').map(str::to_string).collect(),
                // Flags cargo passes to every bench target (`--bench`), and anything else.
                _ => {
                    i += 1;
                    continue;
                }
            }
            i += 2;
        }
        o
    }
}

fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The snapshot's blocks, `(rank, hash, parent)`, in the relay's order, and its chains (rank,
/// hashes), in the order they were stored.
#[allow(clippy::type_complexity)]
fn blocks(n: u64, random: bool) -> (Vec<(u32, u64, Option<u64>)>, Vec<(u32, Vec<u64>)>) {
    let mut out = Vec::with_capacity(n as usize);
    let mut chains = Vec::new();
    let mut next = 1u64 << 62;
    let mut sent = 0;
    while sent < n {
        let rank = (chains.len() as u64 % RANKS) as u32;
        let len = CHAIN.min(n - sent);
        let chain: Vec<u64> = (next..next + len).map(|h| if random { splitmix64(h) } else { h }).collect();
        next += len;
        sent += len;
        let mut parent = None;
        for &h in &chain {
            out.push((rank, h, parent));
            parent = Some(h);
        }
        chains.push((rank, chain));
    }
    out.sort_unstable_by_key(|&(rank, hash, _)| (rank, hash));
    (out, chains)
}

/// The stream's messages, encoded: begin, chunks of `chunk` blocks, end.
fn encode(blocks: &[(u32, u64, Option<u64>)], chunk: usize) -> Vec<SubscribeOut> {
    use pb::subscribe_response::Message as M;
    let (cursor, epoch, incarnation) = (1_000, 7, 1);
    let wrap = |m: M| SubscribeOut::Encoded(SubscribeOut::encode(&pb::SubscribeResponse { message: Some(m) }));
    let mut out = vec![wrap(M::SnapshotBegin(pb::SnapshotBegin {
        cursor,
        epoch,
        incarnation,
        block_count: Some(blocks.len() as u64),
        reason: pb::SnapshotReason::Unspecified as i32,
        ranks: Vec::new(),
    }))];
    for c in blocks.chunks(chunk) {
        let blocks = c
            .iter()
            .map(|&(dp_rank, hash, parent)| pb::SnapshotBlock {
                dp_rank,
                tier: pb::Tier::Device as i32,
                hash,
                parent,
                block_size: 16,
                namespace: Some(pb::Namespace::default()),
                copies: 1,
                ..Default::default()
            })
            .collect();
        out.push(wrap(M::SnapshotChunk(pb::SnapshotChunk { blocks })));
    }
    out.push(wrap(M::SnapshotEnd(pb::SnapshotEnd { cursor, incarnation, block_count: blocks.len() as u64 })));
    out
}

fn decode(m: &SubscribeOut) -> pb::SubscribeResponse {
    m.to_message().expect("a message the bench encoded")
}

fn len(m: &SubscribeOut) -> usize {
    match m {
        SubscribeOut::Encoded(b) => b.len(),
        SubscribeOut::Message(_) => 0,
    }
}

#[derive(Default, Clone, Copy)]
struct Parts {
    decode: Duration,
    stage: Duration,
    swap: Duration,
    total: Duration,
}

/// One resync into a new index; checks its lookups.
fn run(messages: &[SubscribeOut], chains: &[(u32, Vec<u64>)]) -> Parts {
    let mut parts = Parts::default();
    let index = PrefixIndex::new(IndexConfig::default());
    let mut admission = RelayAdmission::new(URL);
    let mut events: Vec<ClientEvent> = Vec::new();
    let now = tokio::time::Instant::now();
    let t = Instant::now();
    let last = messages.len() - 1;
    for (i, m) in messages.iter().enumerate() {
        let d = Instant::now();
        let msg = decode(m);
        let a = Instant::now();
        parts.decode += a - d;
        let verdict = admission.apply(msg, &index, now, &mut events);
        *if i == last { &mut parts.swap } else { &mut parts.stage } += a.elapsed();
        assert!(matches!(verdict, Verdict::Continue), "{verdict:?}");
    }
    parts.total = t.elapsed();
    assert!(events.iter().any(|e| matches!(e, ClientEvent::SnapshotApplied { .. })), "{events:?}");
    let live: usize = chains.iter().map(|(_, c)| c.len()).sum();
    assert_eq!(index.stats().blocks, live);
    for (rank, chain) in chains.iter().step_by(97) {
        let worker = index.worker(URL, *rank).expect("worker");
        let found = index.lookup(chain);
        assert_eq!(found.iter().map(|m| (m.worker, m.blocks)).collect::<Vec<_>>(), vec![(worker, chain.len() as u32)]);
    }
    parts
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort_unstable();
    v[v.len() / 2]
}

fn main() {
    let o = Opts::parse();
    let load = std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split(' ').take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default();
    println!(
        "snapshot resync, client side: {} blocks in chains of {CHAIN} over {RANKS} ranks, chunks of {}, {} run(s); load average {load}",
        o.blocks, o.chunk, o.runs
    );
    for kind in &o.hashes {
        let (blocks, chains) = blocks(o.blocks, kind == "random");
        let messages = encode(&blocks, o.chunk);
        let bytes: usize = messages.iter().map(len).sum();
        drop(blocks);
        let mut runs = Vec::new();
        for r in 0..o.runs {
            let p = run(&messages, &chains);
            println!(
                "  {kind} hashes, run {}: decode {:.0?}, stage {:.0?}, swap {:.0?}; total {:.0?}",
                r + 1,
                p.decode,
                p.stage,
                p.swap,
                p.total
            );
            runs.push(p);
        }
        let m = |f: fn(&Parts) -> Duration| median(runs.iter().map(f).collect());
        println!(
            "{kind} hashes ({:.1} MiB of messages), median of {}: decode {:.0?}, stage {:.0?}, swap {:.0?}; total {:.0?}",
            bytes as f64 / (1 << 20) as f64,
            o.runs,
            m(|p| p.decode),
            m(|p| p.stage),
            m(|p| p.swap),
            m(|p| p.total)
        );
    }
}
