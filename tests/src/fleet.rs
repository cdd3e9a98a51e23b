//! A fleet of relays in one process, for routers to follow: N endpoints, each on its own port of
//! 127.0.0.1, each the relay's own server code (`kv_relay::server::serve`) over its own `Store` on
//! a tempdir: the real `kv_relay.v1` contract, not a synthetic one. Each relay holds a synthetic
//! live set (blocks of rank 0, hashes `relay << 32 | n`) and takes more records on demand or from
//! a steady [`Stream`] (one thread committing into every relay's store in turn at an aggregate
//! rate). Faults: a relay restarts with a new epoch (a fresh store on the same port), disappears,
//! or is slow (its stream stalled or throttled by a proxy on its port: the drills' [`Proxy`]).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use kv_relay::model::{Batch, Block, Event, RecordBody, Removed, Stored, Tier};
use kv_relay::server::{notice_channel, serve, RelayStatusHandle, ServerConfig};
use kv_relay::store::{HistoryLimits, Store, StoreConfig};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::drills::proxy::Proxy;

/// Hashes of a relay's blocks after a restart with a new epoch start here (those before stay
/// below), so a new epoch never reuses a hash of the old one.
const NEW_EPOCH_BLOCKS: u64 = 1 << 31;

/// How a fleet is made.
#[derive(Clone, Debug)]
pub struct FleetOptions {
    /// Relays.
    pub relays: usize,
    /// Batches committed into each relay before it serves.
    pub records: usize,
    /// Blocks stored by each of those batches (and by [`Fleet::tick`]).
    pub blocks_per_record: usize,
    /// Each relay's history bound (a history shorter than its records makes a router that
    /// starts from nothing take a snapshot).
    pub history: HistoryLimits,
    /// Each relay's snapshots at once (`[server] max_snapshots`).
    pub max_snapshots: usize,
}

impl FleetOptions {
    /// `relays` relays of `records` batches of `blocks_per_record` blocks; the relay's default
    /// history and snapshot bounds.
    pub fn new(relays: usize, records: usize, blocks_per_record: usize) -> Self {
        FleetOptions {
            relays,
            records,
            blocks_per_record,
            history: HistoryLimits::default(),
            max_snapshots: ServerConfig::default().max_snapshots,
        }
    }
}

/// What commits into one relay's store: the store and the blocks it holds.
struct Writer {
    relay: usize,
    store: Store,
    /// The store's folder (a new one per epoch).
    _dir: tempfile::TempDir,
    seq: u64,
    /// The next block number to store.
    next: u64,
    /// The oldest block number still live (blocks `oldest..next` are).
    oldest: u64,
}

impl Writer {
    fn new(relay: usize, history: HistoryLimits, first_block: u64) -> Writer {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut cfg = StoreConfig::new(dir.path());
        cfg.cache_bytes = 1 << 20;
        cfg.limits = history;
        // Small segments: a thousand relays' logs stay small on disk.
        cfg.segment_bytes = 1 << 20;
        let store = Store::open(cfg).expect("open the relay's store");
        Writer { relay, store, _dir: dir, seq: 0, next: first_block, oldest: first_block }
    }

    fn hash(&self, n: u64) -> u64 {
        (self.relay as u64) << 32 | n
    }

    /// Commits one batch of rank 0: `stores` new blocks, then the `removes` oldest live ones
    /// (fewer when fewer are live).
    fn commit(&mut self, stores: usize, removes: usize) {
        self.seq += 1;
        let mut events = Vec::with_capacity(2);
        if stores > 0 {
            let blocks = (self.next..self.next + stores as u64)
                .map(|n| Block { hash: self.hash(n), token_ids: vec![], extra_keys: None })
                .collect();
            self.next += stores as u64;
            events.push(Event::Stored(Stored::plain(Tier::Device, 0, 16, blocks)));
        }
        let removes = (removes as u64).min(self.next - self.oldest);
        if removes > 0 {
            let block_hashes = (self.oldest..self.oldest + removes).map(|n| self.hash(n)).collect();
            self.oldest += removes;
            events.push(Event::Removed(Removed { tier: Tier::Device, group: 0, block_hashes, ownership: None }));
        }
        let batch = Batch { dp_rank: 0, seq: self.seq, ts: 0.0, events };
        self.store.commit(RecordBody::Batch { batch, load: None, liveness: None }).expect("commit");
    }
}

fn lock(w: &Mutex<Writer>) -> MutexGuard<'_, Writer> {
    w.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One relay of the fleet.
pub struct FleetRelay {
    /// Where routers connect (the proxy's address, the same port, once the relay is slowed).
    pub addr: SocketAddr,
    /// Where its server listens: `addr`, or behind the proxy.
    server_addr: SocketAddr,
    writer: Arc<Mutex<Writer>>,
    proxy: Option<Proxy>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

/// Binds `addr` (port 0: a new one), retrying for up to 20 s while a previous socket on it
/// closes.
async fn bind_retrying(addr: SocketAddr) -> TcpListener {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        match TcpListener::bind(addr).await {
            Ok(l) => return l,
            // The previous server on this port may still be closing.
            Err(_) if tokio::time::Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(20)).await,
            Err(e) => panic!("bind {addr}: {e}"),
        }
    }
}

/// Serves `store` with the relay's server code on `addr` (port 0: a new one), retrying the bind
/// for up to 20 s while a previous server's socket closes: the address bound, what stops it, and
/// its task (which panics if serving fails).
pub async fn serve_store(store: &Store, addr: SocketAddr) -> (SocketAddr, oneshot::Sender<()>, JoinHandle<()>) {
    serve_store_with(store, addr, ServerConfig::default().max_snapshots).await
}

async fn serve_store_with(
    store: &Store,
    addr: SocketAddr,
    max_snapshots: usize,
) -> (SocketAddr, oneshot::Sender<()>, JoinHandle<()>) {
    let listener = bind_retrying(addr).await;
    let addr = listener.local_addr().expect("local address");
    let cfg = ServerConfig {
        rate_per_second: 100_000,
        rate_burst: 100_000,
        max_snapshots,
        shutdown_grace: Duration::from_millis(100),
        ..ServerConfig::default()
    };
    let (stop, stopped) = oneshot::channel::<()>();
    let fut = serve(cfg, store.clone(), RelayStatusHandle::new("fleet-engine"), notice_channel(), listener, async {
        let _ = stopped.await;
    });
    (addr, stop, tokio::spawn(async move { fut.await.expect("serve") }))
}

impl FleetRelay {
    /// Its URL.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Its store now (a new one after a restart with a new epoch).
    pub fn store(&self) -> Store {
        lock(&self.writer).store.clone()
    }

    /// The block numbers live now: blocks `relay << 32 | n` for `n` in the range.
    pub fn live(&self) -> std::ops::Range<u64> {
        let w = lock(&self.writer);
        w.oldest..w.next
    }

    /// Commits one batch of rank 0 storing `blocks` new blocks.
    pub fn commit(&self, blocks: usize) {
        lock(&self.writer).commit(blocks, 0);
    }

    /// Commits one batch of rank 0 storing `stores` new blocks and removing the `removes` oldest.
    pub fn churn(&self, stores: usize, removes: usize) {
        lock(&self.writer).commit(stores, removes);
    }

    async fn halt(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            tokio::time::timeout(Duration::from_secs(20), task).await.expect("relay stops").expect("relay task");
        }
    }
}

/// N relays on 127.0.0.1.
pub struct Fleet {
    /// The relays, by index.
    pub relays: Vec<FleetRelay>,
    opts: FleetOptions,
}

impl Fleet {
    /// `n` relays, each holding `records` batches of `blocks_per_record` blocks.
    pub async fn start(n: usize, records: usize, blocks_per_record: usize) -> Fleet {
        Fleet::start_with(FleetOptions::new(n, records, blocks_per_record)).await
    }

    /// A fleet as `opts` say.
    pub async fn start_with(opts: FleetOptions) -> Fleet {
        let mut relays = Vec::with_capacity(opts.relays);
        for i in 0..opts.relays {
            let mut w = Writer::new(i, opts.history, 0);
            for _ in 0..opts.records {
                w.commit(opts.blocks_per_record, 0);
            }
            let (addr, stop, task) =
                serve_store_with(&w.store, "127.0.0.1:0".parse().expect("addr"), opts.max_snapshots).await;
            relays.push(FleetRelay {
                addr,
                server_addr: addr,
                writer: Arc::new(Mutex::new(w)),
                proxy: None,
                stop: Some(stop),
                task: Some(task),
            });
        }
        Fleet { relays, opts }
    }

    /// Every relay's URL, by index.
    pub fn urls(&self) -> Vec<String> {
        self.relays.iter().map(FleetRelay::url).collect()
    }

    /// One more batch of `blocks_per_record` new blocks on every relay.
    pub fn tick(&self) {
        for r in &self.relays {
            r.commit(self.opts.blocks_per_record);
        }
    }

    /// Starts a steady stream of records into every relay (see [`StreamConfig`]).
    pub fn stream(&self, cfg: StreamConfig) -> Stream {
        let writers: Vec<_> = self.relays.iter().map(|r| r.writer.clone()).collect();
        let stop = Arc::new(AtomicBool::new(false));
        let records = Arc::new(AtomicU64::new(0));
        let (s, n) = (stop.clone(), records.clone());
        let thread = std::thread::Builder::new()
            .name("fleet-stream".into())
            .spawn(move || stream_records(&writers, cfg, &s, &n))
            .expect("spawn the stream thread");
        Stream { stop, records, started: Instant::now(), thread: Some(thread) }
    }

    /// Relay `i` restarts with a new epoch: a fresh store (holding `records` new batches) on the
    /// same port.
    pub async fn restart_new_epoch(&mut self, i: usize, records: usize) {
        let (blocks, history, max_snapshots) =
            (self.opts.blocks_per_record, self.opts.history, self.opts.max_snapshots);
        let r = &mut self.relays[i];
        r.halt().await;
        let store = {
            let mut w = lock(&r.writer);
            *w = Writer::new(i, history, NEW_EPOCH_BLOCKS);
            for _ in 0..records {
                w.commit(blocks, 0);
            }
            w.store.clone()
        };
        let (addr, stop, task) = serve_store_with(&store, r.server_addr, max_snapshots).await;
        (r.server_addr, r.stop, r.task) = (addr, Some(stop), Some(task));
    }

    /// Relay `i` disappears (its server stops; its store stays).
    pub async fn disappear(&mut self, i: usize) {
        let r = &mut self.relays[i];
        r.halt().await;
        if let Some(p) = &r.proxy {
            p.set_cut(true);
        }
    }

    /// Relay `i` becomes slow: what it sends is throttled to `bytes_per_second`, or stalled
    /// (nothing sent, connections open) at 0. The first time, its server moves behind a proxy
    /// bound on its port, so its routers see their stream end once and resume.
    pub async fn slow(&mut self, i: usize, bytes_per_second: u64) {
        let max_snapshots = self.opts.max_snapshots;
        let r = &mut self.relays[i];
        if r.proxy.is_none() {
            r.halt().await;
            let store = r.store();
            let (inner, stop, task) =
                serve_store_with(&store, "127.0.0.1:0".parse().expect("addr"), max_snapshots).await;
            (r.server_addr, r.stop, r.task) = (inner, Some(stop), Some(task));
            r.proxy = Some(Proxy::serve(bind_retrying(r.addr).await, inner));
        }
        let p = r.proxy.as_ref().expect("the proxy");
        p.set_paused(bytes_per_second == 0);
        p.set_rate(bytes_per_second);
    }

    /// Relay `i` sends at full speed again (a relay never slowed is unchanged).
    pub fn recover(&self, i: usize) {
        if let Some(p) = &self.relays[i].proxy {
            p.set_paused(false);
            p.set_rate(0);
        }
    }

    /// Stops every relay (all told first, so their grace periods run together).
    pub async fn stop(mut self) {
        for r in &mut self.relays {
            if let Some(stop) = r.stop.take() {
                let _ = stop.send(());
            }
        }
        for r in &mut self.relays {
            r.halt().await;
        }
    }
}

/// A steady stream of records into every relay of a fleet ([`Fleet::stream`]): batches of
/// `stores` new blocks and `removes` removals of the oldest (the live set stays the same size
/// when they are equal), committed by one thread into each relay's store in turn.
#[derive(Clone, Copy, Debug)]
pub struct StreamConfig {
    /// Records per second over the whole fleet (`relays x` each relay's rate); the thread
    /// commits as fast as it can when it cannot keep up (see [`StreamReport::rate`]).
    pub records_per_second: f64,
    /// New blocks stored by each record.
    pub stores: usize,
    /// Oldest blocks removed by each record.
    pub removes: usize,
    /// Stop after this many records (`None`: until [`Stream::stop`]).
    pub limit: Option<u64>,
}

/// What a stream committed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StreamReport {
    /// Records committed.
    pub records: u64,
    /// Over this long.
    pub elapsed: Duration,
}

impl StreamReport {
    /// Records per second achieved.
    pub fn rate(&self) -> f64 {
        self.records as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// A running [`Fleet::stream`].
pub struct Stream {
    stop: Arc<AtomicBool>,
    records: Arc<AtomicU64>,
    started: Instant,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Stream {
    /// Records committed so far.
    pub fn records(&self) -> u64 {
        self.records.load(Ordering::Relaxed)
    }

    /// Waits for a stream with a limit to commit it all.
    pub fn wait(mut self) -> StreamReport {
        self.join()
    }

    /// Stops the stream.
    pub fn stop(mut self) -> StreamReport {
        self.stop.store(true, Ordering::Relaxed);
        self.join()
    }

    fn join(&mut self) -> StreamReport {
        if let Some(t) = self.thread.take() {
            t.join().expect("the stream thread");
        }
        StreamReport { records: self.records(), elapsed: self.started.elapsed() }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.join();
    }
}

/// The stream thread: record k goes to relay `k % relays` no earlier than `k / rate` seconds
/// after the start (so a stream that fell behind catches up as fast as it can, never bursts
/// beyond that).
fn stream_records(writers: &[Arc<Mutex<Writer>>], cfg: StreamConfig, stop: &AtomicBool, records: &AtomicU64) {
    let pace = crate::pace::Pace::new(cfg.records_per_second.max(1e-9));
    let mut k = 0u64;
    while !stop.load(Ordering::Relaxed) && cfg.limit.is_none_or(|l| k < l) && !writers.is_empty() {
        let due = pace.due(k);
        let now = Instant::now();
        if due > now {
            std::thread::sleep((due - now).min(Duration::from_millis(50)));
            continue;
        }
        lock(&writers[(k % writers.len() as u64) as usize]).commit(cfg.stores, cfg.removes);
        k += 1;
        records.store(k, Ordering::Relaxed);
    }
}
