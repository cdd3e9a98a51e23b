//! A fleet of relays in one process, for routers to follow: N endpoints, each on its own port of
//! 127.0.0.1, each the relay's own server code (`kv_relay::server::serve`) over its own `Store` on
//! a tempdir: the real `kv_relay.v1` contract, not a synthetic one. Each relay holds a synthetic
//! live set (chains of stored blocks of one rank) and takes more records on demand; faults: a
//! relay restarts with a new epoch (a fresh store on the same port), or disappears.

use std::net::SocketAddr;
use std::time::Duration;

use kv_relay::model::{Batch, Block, Event, Group, Namespace, RecordBody, Stored, Tier, TokenLayout};
use kv_relay::server::{notice_channel, serve, RelayStatusHandle, ServerConfig};
use kv_relay::store::{Store, StoreConfig};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// One relay of the fleet.
pub struct FleetRelay {
    /// Where it listens.
    pub addr: SocketAddr,
    /// Its store (commit to it to send records).
    pub store: Store,
    dir: tempfile::TempDir,
    seq: u64,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

/// N relays on 127.0.0.1.
pub struct Fleet {
    /// The relays, by index.
    pub relays: Vec<FleetRelay>,
    blocks_per_record: usize,
}

fn store_in(dir: &std::path::Path) -> Store {
    let mut cfg = StoreConfig::new(dir);
    cfg.cache_bytes = 1 << 20;
    Store::open(cfg).expect("open the relay's store")
}

/// Serves `store` with the relay's server code on `addr` (port 0: a new one), retrying the bind
/// for up to 20 s while a previous server's socket closes: the address bound, what stops it, and
/// its task (which panics if serving fails).
pub async fn serve_store(store: &Store, addr: SocketAddr) -> (SocketAddr, oneshot::Sender<()>, JoinHandle<()>) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let listener = loop {
        match tokio::net::TcpListener::bind(addr).await {
            Ok(l) => break l,
            // The previous server on this port may still be closing.
            Err(e) if tokio::time::Instant::now() < deadline => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("bind {addr}: {e}"),
        }
    };
    let addr = listener.local_addr().expect("local address");
    let cfg = ServerConfig {
        rate_per_second: 100_000,
        rate_burst: 100_000,
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

    /// Commits one batch of rank 0 storing `blocks` new blocks (hashes unique to this relay and
    /// batch: `relay << 32 | n`).
    pub fn commit(&mut self, relay: usize, blocks: usize) {
        self.seq += 1;
        let first = self.seq * blocks as u64;
        let stored = Stored {
            tier: Tier::Device,
            group: Group { idx: 0, kind: None, sliding_window: None },
            parent: None,
            block_size: 16,
            token_layout: TokenLayout::Single,
            blocks: (first..first + blocks as u64)
                .map(|n| Block { hash: (relay as u64) << 32 | n, token_ids: vec![], extra_keys: None })
                .collect(),
            namespace: Namespace::default(),
            session_id: None,
            ownership: None,
            lookahead_token_ids: None,
            block_mm_infos: None,
        };
        let batch = Batch { dp_rank: 0, seq: self.seq, ts: 0.0, events: vec![Event::Stored(stored)] };
        self.store.commit(RecordBody::Batch { batch, load: None }).expect("commit");
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

impl Fleet {
    /// `n` relays, each holding `records` batches of `blocks_per_record` blocks.
    pub async fn start(n: usize, records: usize, blocks_per_record: usize) -> Fleet {
        let mut relays = Vec::with_capacity(n);
        for i in 0..n {
            let dir = tempfile::tempdir().expect("tempdir");
            let store = store_in(dir.path());
            let (addr, stop, task) = serve_store(&store, "127.0.0.1:0".parse().expect("addr")).await;
            let mut r = FleetRelay { addr, store, dir, seq: 0, stop: Some(stop), task: Some(task) };
            for _ in 0..records {
                r.commit(i, blocks_per_record);
            }
            relays.push(r);
        }
        Fleet { relays, blocks_per_record }
    }

    /// Every relay's URL, by index.
    pub fn urls(&self) -> Vec<String> {
        self.relays.iter().map(FleetRelay::url).collect()
    }

    /// One more batch on every relay.
    pub fn tick(&mut self) {
        let blocks = self.blocks_per_record;
        for (i, r) in self.relays.iter_mut().enumerate() {
            r.commit(i, blocks);
        }
    }

    /// Relay `i` restarts with a new epoch: a fresh store (holding `records` new batches) on the
    /// same port.
    pub async fn restart_new_epoch(&mut self, i: usize, records: usize) {
        let blocks = self.blocks_per_record;
        let r = &mut self.relays[i];
        r.halt().await;
        r.dir = tempfile::tempdir().expect("tempdir");
        r.store = store_in(r.dir.path());
        r.seq = 1_000_000;
        for _ in 0..records {
            r.commit(i, blocks);
        }
        let (addr, stop, task) = serve_store(&r.store, r.addr).await;
        (r.addr, r.stop, r.task) = (addr, Some(stop), Some(task));
    }

    /// Relay `i` disappears (its server stops; its store stays).
    pub async fn disappear(&mut self, i: usize) {
        self.relays[i].halt().await;
    }

    /// Stops every relay.
    pub async fn stop(mut self) {
        for r in &mut self.relays {
            r.halt().await;
        }
    }
}
