//! The follower against a real relay server (`kv_relay::server::serve` over a `Store` on a
//! tempdir, on `127.0.0.1:0`): its index equals the store's snapshot and a naive reference
//! rebuilt from the committed records, through disconnects, relay restarts, wiped stores,
//! trimmed histories, and the example router's HTTP API.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use kv_relay::model::{Batch, Block, Control, ControlKind, Event, Group, Load, Namespace, Record, RecordBody};
use kv_relay::model::{Removed, Stored, Tier, TokenLayout};
use kv_relay::store::{HistoryLimits, SnapshotFilter, Store, StoreConfig};
use kv_relay_proto::hash::{block_event_hashes, EngineHashConfig, RequestKeys};
use kv_router::http;
use kv_router_client::backoff::BackoffConfig;
use kv_router_client::index::reference::ReferenceIndex;
use kv_router_client::index::{PrefixIndex, StagedSnapshot, TierId};
use kv_router_client::{ClientEvent, FollowConfig, Follower, RelayInfo, WorkerState};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// Generous: nothing here should take more than a fraction of it.
const T: Duration = Duration::from_secs(20);

// ---- fixtures ---------------------------------------------------------------------------------

/// Seeded engine traffic over a few ranks: chains stored in the device or host tier (sometimes
/// a second copy of a live block), removals of live copies, and now and then a rank reset.
struct Traffic {
    rng: StdRng,
    ranks: u32,
    /// Live copies: (rank, tier, hash).
    live: Vec<(u32, Tier, u64)>,
    next: u64,
    seq: BTreeMap<u32, u64>,
    /// Every chain stored, for lookups.
    chains: Vec<Vec<u64>>,
}

impl Traffic {
    fn new(seed: u64, ranks: u32) -> Self {
        Traffic { rng: StdRng::seed_from_u64(seed), ranks, live: vec![], next: 0, seq: BTreeMap::new(), chains: vec![] }
    }

    fn body(&mut self) -> RecordBody {
        let dp_rank = self.rng.random_range(0..self.ranks);
        if self.rng.random_ratio(1, 30) {
            self.live.retain(|l| l.0 != dp_rank);
            return RecordBody::Control(Control { dp_rank, kind: ControlKind::RankReset { reason: "restart".into() } });
        }
        let mut events = Vec::new();
        for _ in 0..self.rng.random_range(1..4) {
            let mine: Vec<usize> = (0..self.live.len()).filter(|&i| self.live[i].0 == dp_rank).collect();
            if !mine.is_empty() && self.rng.random_ratio(1, 3) {
                let (_, tier, hash) = self.live.swap_remove(mine[self.rng.random_range(0..mine.len())]);
                events.push(Event::Removed(Removed { tier, group: 0, block_hashes: vec![hash], ownership: None }));
                continue;
            }
            let tier = if self.rng.random_ratio(1, 4) { Tier::Host } else { Tier::Device };
            // Chains often extend an earlier one (shared prefixes across ranks and tiers).
            let mut chain = match self.chains.len() {
                0 => vec![],
                n if self.rng.random_ratio(1, 2) => {
                    let c = &self.chains[self.rng.random_range(0..n)];
                    c[..self.rng.random_range(0..=c.len())].to_vec()
                }
                _ => vec![],
            };
            let prefix = chain.len();
            for _ in 0..self.rng.random_range(1..5) {
                self.next += 1;
                chain.push(self.next.wrapping_mul(0x9e37_79b9_7f4a_7c15));
            }
            let stored = &chain[self.rng.random_range(0..=prefix)..];
            for &h in stored {
                self.live.push((dp_rank, tier.clone(), h));
            }
            events.push(Event::Stored(Stored {
                tier,
                group: Group { idx: 0, kind: None, sliding_window: None },
                parent: None,
                block_size: 4,
                token_layout: TokenLayout::Single,
                blocks: stored.iter().map(|&hash| Block { hash, token_ids: vec![], extra_keys: None }).collect(),
                namespace: Namespace::default(),
                session_id: None,
                ownership: None,
                lookahead_token_ids: None,
                block_mm_infos: None,
            }));
            self.chains.push(chain);
        }
        let seq = self.seq.entry(dp_rank).or_insert(0);
        *seq += 1;
        let load = Load { running: dp_rank as f64, waiting: 0.0, kv_usage: 0.5, scraped_at_ms: *seq };
        RecordBody::Batch { batch: Batch { dp_rank, seq: *seq, ts: 0.0, events }, load: Some(load), liveness: None }
    }

    fn commit(&mut self, store: &Store, n: usize, records: &mut Vec<Record>) {
        for _ in 0..n {
            records.push(store.commit(self.body()).expect("commit"));
        }
    }

    /// Lookups that cover every block: every chain stored, and every single hash.
    fn queries(&self) -> Vec<Vec<u64>> {
        let mut q: Vec<Vec<u64>> = self.chains.clone();
        let mut singles: Vec<u64> = self.chains.iter().flatten().copied().collect();
        singles.sort_unstable();
        singles.dedup();
        q.extend(singles.into_iter().map(|h| vec![h]));
        q
    }
}

pub(crate) fn open_store(dir: &Path, limits: HistoryLimits) -> Store {
    let mut cfg = StoreConfig::new(dir);
    cfg.limits = limits;
    cfg.cache_bytes = 4 << 20;
    let deadline = std::time::Instant::now() + T;
    loop {
        // The previous server's streams may hold the store for a moment after it stopped.
        match Store::open(cfg.clone()) {
            Ok(s) => return s,
            Err(e) if std::time::Instant::now() < deadline => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => panic!("open store: {e}"),
        }
    }
}

pub(crate) struct Server {
    pub(crate) addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

impl Server {
    /// Serves `store` on `addr` (or a new port), retrying the bind while the old socket closes.
    pub(crate) async fn start(store: &Store, addr: Option<SocketAddr>) -> Server {
        let addr = addr.unwrap_or_else(|| "127.0.0.1:0".parse().unwrap());
        let (addr, stop, task) = kv_relay_testkit::fleet::serve_store(store, addr).await;
        Server { addr, stop: Some(stop), task }
    }

    pub(crate) fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub(crate) async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        tokio::time::timeout(T, self.task).await.expect("server stops in time").unwrap();
    }
}

pub(crate) fn follow_cfg() -> FollowConfig {
    FollowConfig {
        backoff: BackoffConfig {
            initial: Duration::from_millis(20),
            max: Duration::from_millis(200),
            multiplier: 2.0,
            jitter: 0.5,
        },
        ..FollowConfig::default()
    }
}

fn relay_info(f: &Follower, url: &str) -> RelayInfo {
    f.relays().into_iter().find(|r| &*r.url == url).expect("relay followed")
}

/// Waits until the follower has applied everything up to the store's newest cursor (in the
/// store's epoch).
async fn caught_up(f: &Follower, url: &str, store: &Store) -> RelayInfo {
    let deadline = tokio::time::Instant::now() + T;
    loop {
        let r = relay_info(f, url);
        if r.epoch == store.epoch() && r.cursor == store.newest_cursor() && !r.staging {
            return r;
        }
        assert!(tokio::time::Instant::now() < deadline, "not caught up: {r:?}, store at {}", store.newest_cursor());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

pub(crate) async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + T;
    while !cond() {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The store's live blocks at its newest cursor, as a reference index with the follower's ids.
fn from_snapshot(index: &PrefixIndex, url: &str, store: &Store) -> ReferenceIndex {
    let mut per_rank: BTreeMap<u32, StagedSnapshot> = BTreeMap::new();
    let snap = store.snapshot(SnapshotFilter { include_token_ids: false, ..SnapshotFilter::all() }).unwrap();
    for chunk in snap {
        for b in chunk.unwrap() {
            let tier = index.tier(b.tier.as_str()).unwrap();
            per_rank.entry(b.dp_rank).or_default().push(tier, b.hash, b.copies);
        }
    }
    let mut r = ReferenceIndex::new();
    for (rank, staged) in per_rank {
        r.replace_worker(index.worker(url, rank).unwrap(), &staged);
    }
    r
}

/// The committed records applied naively, in order.
fn from_records(index: &PrefixIndex, url: &str, records: &[Record]) -> ReferenceIndex {
    let mut r = ReferenceIndex::new();
    for rec in records {
        match &rec.body {
            RecordBody::Batch { batch, .. } => {
                let w = index.worker(url, batch.dp_rank).unwrap();
                for e in &batch.events {
                    match e {
                        Event::Stored(s) => {
                            let hashes: Vec<u64> = s.blocks.iter().map(|b| b.hash).collect();
                            r.store(w, index.tier(s.tier.as_str()).unwrap(), &hashes);
                        }
                        Event::Removed(x) => {
                            r.remove(w, index.tier(x.tier.as_str()).unwrap(), &x.block_hashes);
                        }
                        Event::Cleared(c) => {
                            r.clear(w, c.tier.as_ref().map(|t| index.tier(t.as_str()).unwrap()));
                        }
                    }
                }
            }
            RecordBody::Control(Control { dp_rank, kind: ControlKind::RankReset { .. } }) => {
                r.clear(index.worker(url, *dp_rank).unwrap(), None)
            }
            RecordBody::Control(_) => {}
        }
    }
    r
}

/// The follower's index equals the store's snapshot and the naive reference on every query.
fn assert_exact(f: &Follower, url: &str, store: &Store, records: &[Record], traffic: &Traffic) {
    let index = f.index();
    let snap = from_snapshot(index, url, store);
    let naive = from_records(index, url, records);
    assert_eq!(index.stats().blocks, snap.len(), "indexed (worker, tier, hash) keys");
    let queries = traffic.queries();
    assert!(queries.len() > 100);
    for q in &queries {
        let got = index.lookup(q);
        assert_eq!(got, snap.lookup(q), "index vs store snapshot for {q:?}");
        assert_eq!(got, naive.lookup(q), "index vs naive reference for {q:?}");
    }
    // Copies too, for every block ever stored, in every worker and tier.
    let workers: Vec<_> = f.workers().iter().filter(|w| &*w.relay == url).map(|w| w.id).collect();
    for q in queries.iter().filter(|q| q.len() == 1) {
        for &w in &workers {
            for tier in [TierId::DEVICE, TierId::HOST] {
                let got = index.copies(w, tier, q[0]);
                assert_eq!(got, snap.copies(w, tier, q[0]), "copies of {} in {w:?} {tier:?} vs snapshot", q[0]);
                assert_eq!(got, naive.copies(w, tier, q[0]), "copies of {} in {w:?} {tier:?} vs naive", q[0]);
            }
        }
    }
}

// ---- tests ------------------------------------------------------------------------------------

#[tokio::test]
async fn follows_history_then_live_and_equals_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let store = open_store(dir.path(), HistoryLimits::default());
    let server = Server::start(&store, None).await;
    let (mut traffic, mut records) = (Traffic::new(1, 3), Vec::new());
    traffic.commit(&store, 300, &mut records);

    let f = Follower::new(follow_cfg());
    f.add_relay(&server.url()).unwrap();
    caught_up(&f, &server.url(), &store).await;
    // Live, while following.
    for _ in 0..10 {
        traffic.commit(&store, 20, &mut records);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let r = caught_up(&f, &server.url(), &store).await;
    assert_exact(&f, &server.url(), &store, &records, &traffic);
    assert_eq!((r.counters.snapshots, r.counters.duplicates, r.counters.gaps), (0, 0, 0));
    assert_eq!(r.counters.records_applied, 500);
    assert_eq!(r.epoch, store.epoch());
    let ranks: Vec<u32> = f.workers().iter().map(|w| w.dp_rank).collect();
    assert_eq!(ranks, [0, 1, 2]);
    f.shutdown().await;
    server.stop().await;
}

#[tokio::test]
async fn small_http2_windows_still_follow_every_record() {
    let dir = tempfile::tempdir().unwrap();
    let store = open_store(dir.path(), HistoryLimits::default());
    let server = Server::start(&store, None).await;
    let (mut traffic, mut records) = (Traffic::new(9, 2), Vec::new());
    traffic.commit(&store, 3000, &mut records);

    // 16 KiB windows: the history (far more than 16 KiB) arrives a window at a time.
    let f = Follower::new(FollowConfig { http2_window_bytes: Some(16 << 10), ..follow_cfg() });
    f.add_relay(&server.url()).unwrap();
    let r = caught_up(&f, &server.url(), &store).await;
    assert_exact(&f, &server.url(), &store, &records, &traffic);
    assert_eq!((r.counters.records_applied, r.counters.snapshots, r.counters.gaps), (3000, 0, 0));
    f.shutdown().await;
    server.stop().await;
}

#[tokio::test]
async fn resumes_after_a_disconnect_without_a_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let store = open_store(dir.path(), HistoryLimits::default());
    let server = Server::start(&store, None).await;
    let url = server.url();
    let (mut traffic, mut records) = (Traffic::new(2, 2), Vec::new());
    traffic.commit(&store, 100, &mut records);
    let f = Follower::new(follow_cfg());
    f.add_relay(&url).unwrap();
    caught_up(&f, &url, &store).await;

    let addr = server.addr;
    server.stop().await;
    until("the relay reported unreachable", || f.workers().iter().all(|w| w.state == WorkerState::RelayUnreachable))
        .await;
    // Commits go on while the router is cut off.
    traffic.commit(&store, 100, &mut records);
    let server = Server::start(&store, Some(addr)).await;
    let r = caught_up(&f, &url, &store).await;
    assert_exact(&f, &url, &store, &records, &traffic);
    assert_eq!((r.counters.snapshots, r.counters.duplicates), (0, 0), "resumed from the cursor");
    assert!(r.counters.reconnects >= 1);
    assert_eq!(r.counters.records_applied, 200);
    f.shutdown().await;
    server.stop().await;
}

#[tokio::test]
async fn relay_restart_with_the_same_store_resumes_without_a_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let store = open_store(dir.path(), HistoryLimits::default());
    let epoch = store.epoch();
    let server = Server::start(&store, None).await;
    let url = server.url();
    let (mut traffic, mut records) = (Traffic::new(3, 2), Vec::new());
    traffic.commit(&store, 120, &mut records);
    let f = Follower::new(follow_cfg());
    f.add_relay(&url).unwrap();
    caught_up(&f, &url, &store).await;

    let addr = server.addr;
    server.stop().await;
    store.flush().unwrap();
    drop(store);
    let store = open_store(dir.path(), HistoryLimits::default());
    assert_eq!(store.epoch(), epoch, "a restart keeps the epoch");
    traffic.commit(&store, 80, &mut records);
    let server = Server::start(&store, Some(addr)).await;
    let r = caught_up(&f, &url, &store).await;
    assert_exact(&f, &url, &store, &records, &traffic);
    assert_eq!(r.counters.snapshots, 0);
    assert_eq!(r.incarnation, store.incarnation(), "the newest records are the new incarnation's");
    f.shutdown().await;
    server.stop().await;
}

#[tokio::test]
async fn wiped_store_forces_a_snapshot_of_the_new_epoch() {
    let dir = tempfile::tempdir().unwrap();
    let store = open_store(dir.path(), HistoryLimits::default());
    let server = Server::start(&store, None).await;
    let url = server.url();
    let mut traffic = Traffic::new(4, 2);
    let mut records = Vec::new();
    traffic.commit(&store, 150, &mut records);
    let f = Follower::new(follow_cfg());
    f.add_relay(&url).unwrap();
    caught_up(&f, &url, &store).await;
    let old_epoch = store.epoch();

    let addr = server.addr;
    server.stop().await;
    drop(store);
    // The relay comes back with an empty store: a new epoch, cursors from 1 again, and the
    // engine's state rebuilt (here: fewer records than the router already applied).
    let dir2 = tempfile::tempdir().unwrap();
    let store = open_store(dir2.path(), HistoryLimits::default());
    assert_ne!(store.epoch(), old_epoch);
    let mut traffic = Traffic::new(5, 2);
    let mut records = Vec::new();
    traffic.commit(&store, 60, &mut records);
    let server = Server::start(&store, Some(addr)).await;
    let r = caught_up(&f, &url, &store).await;
    assert_eq!((r.counters.snapshots, r.counters.epoch_changes), (1, 1));
    assert_exact(&f, &url, &store, &records, &traffic);
    // And live on top of the snapshot.
    traffic.commit(&store, 40, &mut records);
    caught_up(&f, &url, &store).await;
    assert_exact(&f, &url, &store, &records, &traffic);
    f.shutdown().await;
    server.stop().await;
}

#[tokio::test]
async fn cursor_trimmed_from_the_history_resyncs_by_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let limits = HistoryLimits { max_batches: 40, max_bytes: 256 << 20 };
    let store = open_store(dir.path(), limits);
    let server = Server::start(&store, None).await;
    let url = server.url();
    let (mut traffic, mut records) = (Traffic::new(6, 3), Vec::new());
    // The history no longer starts at 1 when the router first comes: it starts by a snapshot.
    traffic.commit(&store, 100, &mut records);
    let f = Follower::new(follow_cfg());
    let mut events = f.events();
    f.add_relay(&url).unwrap();
    let r = caught_up(&f, &url, &store).await;
    assert_eq!(r.counters.snapshots, 1);
    assert_exact(&f, &url, &store, &records, &traffic);

    let addr = server.addr;
    server.stop().await;
    traffic.commit(&store, 100, &mut records);
    let server = Server::start(&store, Some(addr)).await;
    let r = caught_up(&f, &url, &store).await;
    assert_eq!((r.counters.snapshots, r.counters.epoch_changes), (2, 0));
    assert_exact(&f, &url, &store, &records, &traffic);
    // Every snapshot the counters show was already sent as an event, with its reason and cursor.
    let mut snapshots = Vec::new();
    while let Ok(e) = events.try_recv() {
        if let ClientEvent::SnapshotApplied { reason, cursor, .. } = e {
            snapshots.push((reason, cursor));
        }
    }
    assert_eq!(
        snapshots,
        [("snapshot_reason_new_client".to_string(), 100), ("snapshot_reason_cursor_trimmed".to_string(), 200)]
    );
    f.shutdown().await;
    server.stop().await;
}

/// One HTTP/1.1 exchange; returns (status, body).
pub(crate) async fn http_call(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         connection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = String::new();
    tokio::time::timeout(T, s.read_to_string(&mut out)).await.unwrap().unwrap();
    let (head, body) = out.split_once("\r\n\r\n").expect("a response");
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, body.to_string())
}

#[tokio::test]
async fn router_http_api_answers_exactly_over_two_relays() {
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (s1, s2) = (open_store(d1.path(), HistoryLimits::default()), open_store(d2.path(), HistoryLimits::default()));
    let (r1, r2) = (Server::start(&s1, None).await, Server::start(&s2, None).await);
    let mut t1 = Traffic::new(7, 2);
    let (mut rec1, mut rec2) = (Vec::new(), Vec::new());
    t1.commit(&s1, 150, &mut rec1);
    // The second engine holds some of the same chains.
    let shared: Vec<Vec<u64>> = t1.chains.iter().take(20).cloned().collect();
    // And the first two pages of an SGLang request, as that engine hashes them.
    let sglang = EngineHashConfig::sglang("0.5.23".parse().unwrap(), 4, false).unwrap();
    let tokens: Vec<u64> = (1..=12).collect();
    let pages =
        block_event_hashes(&sglang, &RequestKeys { token_ids: &tokens[..8], ..RequestKeys::default() }).unwrap();
    assert_eq!(pages.len(), 2);
    for (i, c) in shared.iter().chain([&pages]).enumerate() {
        let body = RecordBody::Batch {
            batch: Batch {
                dp_rank: 0,
                seq: i as u64 + 1,
                ts: 0.0,
                events: vec![Event::Stored(Stored {
                    tier: Tier::Device,
                    group: Group { idx: 0, kind: None, sliding_window: None },
                    parent: None,
                    block_size: 4,
                    token_layout: TokenLayout::Single,
                    blocks: c.iter().map(|&hash| Block { hash, token_ids: vec![], extra_keys: None }).collect(),
                    namespace: Namespace::default(),
                    session_id: None,
                    ownership: None,
                    lookahead_token_ids: None,
                    block_mm_infos: None,
                })],
            },
            load: Some(Load { running: 9.0, waiting: 2.0, kv_usage: 0.75, scraped_at_ms: 1 }),
            liveness: None,
        };
        rec2.push(s2.commit(body).unwrap());
    }

    let f = Follower::new(follow_cfg());
    f.add_relay(&r1.url()).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http_addr = listener.local_addr().unwrap();
    let (stop_http, http_stopped) = oneshot::channel::<()>();
    let http_task = tokio::spawn(http::serve(listener, f.clone(), async {
        let _ = http_stopped.await;
    }));
    caught_up(&f, &r1.url(), &s1).await;
    assert_exact(&f, &r1.url(), &s1, &rec1, &t1);
    // A relay added at run time.
    f.add_relay(&r2.url()).unwrap();
    assert!(f.add_relay(&r2.url()).is_err(), "already followed");
    caught_up(&f, &r2.url(), &s2).await;

    let index = f.index();
    let naive1 = from_records(index, &r1.url(), &rec1);
    let naive2 = from_records(index, &r2.url(), &rec2);
    for (i, q) in shared.iter().chain(t1.chains.iter().skip(100).take(20)).enumerate() {
        let body = serde_json::json!({ "block_hashes": q }).to_string();
        let (status, text) = http_call(http_addr, "POST", "/match", &body).await;
        assert_eq!(status, 200, "{text}");
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["blocks"], q.len());
        let workers = v["workers"].as_array().unwrap();
        // Every known worker is listed: ranks 0 and 1 of the first relay, rank 0 of the second.
        assert_eq!(workers.len(), 3, "{text}");
        for w in workers {
            let (relay, rank) = (w["relay"].as_str().unwrap(), w["dp_rank"].as_u64().unwrap() as u32);
            let id = index.worker(relay, rank).unwrap();
            let naive = if relay == r1.url() { &naive1 } else { &naive2 };
            let want = naive.lookup(q);
            assert_eq!(w["matched_blocks"], want.blocks(id), "{relay} rank {rank} for {q:?}");
            let mut by_tier = serde_json::Map::new();
            if let Some(m) = want.get(id) {
                for run in m.tiers {
                    by_tier.insert(index.tiers().name(run.tier).unwrap().to_string(), run.blocks.into());
                }
            }
            assert_eq!(w["by_tier"], serde_json::Value::Object(by_tier));
            assert_eq!(w["state"], "fresh");
        }
        let w2 = workers.iter().find(|w| w["relay"] == r2.url()).unwrap();
        assert_eq!(w2["load"]["running"], 9.0);
        if i < shared.len() {
            assert_eq!(w2["matched_blocks"], q.len(), "the second relay holds the shared chains whole");
        }
    }

    // Token ids with the engine's hash settings (SGLang's chained SHA-256, page size 4): the
    // second relay holds the first two of the request's three pages.
    let m = f.match_tokens(&sglang, &RequestKeys { token_ids: &tokens, ..RequestKeys::default() }).unwrap();
    let held: Vec<(String, u32, u32)> =
        m.iter().filter(|m| m.matched_blocks > 0).map(|m| (m.relay.to_string(), m.dp_rank, m.matched_blocks)).collect();
    assert_eq!(held, [(r2.url(), 0, 2)]);
    let body = serde_json::json!({
        "token_ids": tokens,
        "hash": {"engine": "sglang", "version": "0.5.23", "page_size": 4}
    });
    let (status, text) = http_call(http_addr, "POST", "/match", &body.to_string()).await;
    assert_eq!(status, 200, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["blocks"], 3);
    let w2 = v["workers"].as_array().unwrap().iter().find(|w| w["relay"] == r2.url()).unwrap();
    assert_eq!((w2["matched_blocks"].as_u64(), w2["by_tier"]["device"].as_u64()), (Some(2), Some(2)));
    let (status, text) = http_call(http_addr, "POST", "/match", r#"{"token_ids": [1, 2]}"#).await;
    assert_eq!(status, 400, "{text}");

    let (status, text) = http_call(http_addr, "GET", "/workers", "").await;
    assert_eq!(status, 200);
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let w = v["workers"].as_array().unwrap().iter().find(|w| w["relay"] == r2.url()).unwrap().clone();
    assert_eq!((w["cursor"].as_u64(), w["epoch"].as_u64()), (Some(s2.newest_cursor()), Some(s2.epoch())));
    assert_eq!(w["state"], "fresh");
    assert_eq!(w["routing"]["routing"], "routable");

    // POST /route: the worker that holds the whole chain in its device tier, at the least
    // expected wait.
    let device = |q: &Vec<u64>, k: u32| {
        let got = naive1.lookup(q);
        let m = got.get(index.worker(&r1.url(), k).unwrap());
        m.and_then(|m| m.tiers.iter().find(|r| r.tier == TierId::DEVICE).map(|r| r.blocks)).unwrap_or(0)
    };
    let q = t1
        .chains
        .iter()
        .find(|q| (0..2).any(|k| device(q, k) == q.len() as u32))
        .expect("the first relay still holds a shared chain whole in its device tier");
    // A chain only the second relay holds goes to an idle worker of the first: 13 queued requests
    // outweigh its few blocks of prefill.
    let only2 = shared.iter().find(|q| naive1.lookup(q).is_empty()).expect("a chain the first relay evicted");
    let (status, text) =
        http_call(http_addr, "POST", "/route", &serde_json::json!({ "block_hashes": only2 }).to_string()).await;
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        (status, v["relay"].as_str(), &v["reason"]),
        (200, Some(r1.url().as_str()), &"least_wait".into()),
        "{text}"
    );
    let first = v["request_id"].as_u64().unwrap();
    let (status, _) =
        http_call(http_addr, "POST", "/route/report", &format!("{{\"request_id\": {first}, \"outcome\": \"done\"}}"))
            .await;
    assert_eq!(status, 200);
    let body = serde_json::json!({ "block_hashes": q }).to_string();
    let (status, text) = http_call(http_addr, "POST", "/route", &body).await;
    assert_eq!(status, 200, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!((v["relay"].as_str(), v["blocks"].as_u64()), (Some(r1.url().as_str()), Some(q.len() as u64)), "{text}");
    let rank = v["dp_rank"].as_u64().unwrap() as u32;
    assert_eq!(device(q, rank), q.len() as u32);
    assert_eq!(
        (&v["matched_blocks"], &v["device_blocks"], &v["reason"], &v["policy"], &v["engine_url"]),
        (&q.len().into(), &q.len().into(), &"cached_prefix".into(), &"cache_aware".into(), &serde_json::Value::Null)
    );
    let id = v["request_id"].as_u64().unwrap();
    let (_, text) = http_call(http_addr, "GET", "/metrics", "").await;
    assert!(text.contains("kv_router_in_flight 1\n"), "{text}");
    let report = serde_json::json!({
        "request_id": id, "outcome": "done", "prompt_tokens": 64, "completion_tokens": 8, "cached_tokens": 48
    })
    .to_string();
    let (status, text) = http_call(http_addr, "POST", "/route/report", &report).await;
    assert_eq!((status, text), (200, format!("{{\"relay\":\"{}\",\"dp_rank\":{rank}}}", r1.url())));
    let (status, text) = http_call(http_addr, "POST", "/route/report", &report).await;
    assert_eq!(
        (status, text),
        (
            404,
            format!("{{\"error\":\"no routed request {id} is in flight (unknown, already reported, or forgotten)\"}}")
        )
    );
    let (status, text) =
        http_call(http_addr, "POST", "/route/report", &format!("{{\"request_id\": {id}, \"outcome\": \"lost\"}}"))
            .await;
    assert_eq!(status, 400, "{text}");
    let (status, text) = http_call(http_addr, "POST", "/route", r#"{"token_ids": [1, 2]}"#).await;
    assert_eq!(status, 400, "{text}");

    let (status, text) = http_call(http_addr, "GET", "/metrics", "").await;
    assert!(text.contains("kv_router_routed_total{reason=\"cached_prefix\"} 1\n"), "{text}");
    assert!(text.contains("kv_router_routed_total{reason=\"least_wait\"} 1\n"), "{text}");
    assert!(text.contains("kv_router_reports_done_total 2\n"), "{text}");
    assert!(text.contains("kv_router_prompt_tokens_total 64\n"), "{text}");
    assert!(text.contains("kv_router_cached_tokens_total 48\n"), "{text}");
    assert!(text.contains("kv_router_in_flight 0\n"), "{text}");
    assert!(text.contains("kv_router_workers_routing{routing=\"routable\"} 3\n"), "{text}");
    assert_eq!(status, 200);
    assert!(text.contains(&format!("kv_router_records_applied_total {}\n", rec1.len() + rec2.len())), "{text}");
    assert!(text.contains("kv_router_workers{state=\"fresh\"} 3\n"), "{text}");
    let stats = index.stats();
    assert!(text.contains(&format!("kv_router_index_blocks {}\n", stats.blocks)), "{text}");
    assert!(text.contains("kv_router_index_missing_removes_total 0\n"), "{text}");
    assert!(text.contains(&format!("kv_router_index_rebuilds_total {}\n", stats.rebuilds)), "{text}");
    assert!(text.contains(&format!("kv_router_index_sweeps_total {}\n", stats.sweeps)), "{text}");
    assert!(text.contains(&format!("kv_router_index_dead_slots {}\n", stats.tombstones)), "{text}");
    assert!(stats.rebuilds > 0, "the tables grew from empty: {stats:?}");

    // Removing a relay drops its workers from the answers and the index.
    f.remove_relay(&r2.url()).unwrap();
    let m = f.match_blocks(&shared[0]);
    assert!(m.iter().all(|m| *m.relay == r1.url()));
    assert_eq!(index.lookup(&shared[0]), naive1.lookup(&shared[0]));

    let _ = stop_http.send(());
    http_task.await.unwrap().unwrap();
    f.shutdown().await;
    r1.stop().await;
    r2.stop().await;
}

#[tokio::test]
async fn dropping_the_follower_ends_its_streams() {
    let dir = tempfile::tempdir().unwrap();
    let store = open_store(dir.path(), HistoryLimits::default());
    let server = Server::start(&store, None).await;
    let (mut traffic, mut records) = (Traffic::new(8, 1), Vec::new());
    traffic.commit(&store, 10, &mut records);
    let f = Follower::new(follow_cfg());
    f.add_relay(&server.url()).unwrap();
    caught_up(&f, &server.url(), &store).await;
    let ep = tonic::transport::Endpoint::from_shared(server.url()).unwrap();
    let mut client = kv_relay_proto::pb::relay_client::RelayClient::new(ep.connect().await.unwrap());
    let subscribers = |st: kv_relay_proto::pb::StatusResponse| st.subscribers;
    let st = client.status(kv_relay_proto::pb::StatusRequest {}).await.unwrap().into_inner();
    assert_eq!(subscribers(st), 1);
    let g = f.clone();
    drop(f);
    // A clone keeps it alive.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let st = client.status(kv_relay_proto::pb::StatusRequest {}).await.unwrap().into_inner();
    assert_eq!(subscribers(st), 1);
    drop(g);
    let deadline = tokio::time::Instant::now() + T;
    loop {
        let st = client.status(kv_relay_proto::pb::StatusRequest {}).await.unwrap().into_inner();
        if subscribers(st) == 0 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the stream outlived the follower");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    server.stop().await;
}
