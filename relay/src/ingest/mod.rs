//! The engine side: one SUB + DEALER pair per DP rank ([`rank`]), the engine's load
//! ([`load`]), and per-rank endpoints ([`endpoint`]).
//!
//! Each rank's thread hands its [`IngestItem`]s, in order, to a [`Sink`] of its own. The relay's
//! sink commits them on that same thread (`crate::commit`): what the thread decoded since its
//! SUB socket last had nothing ready goes to the store as one group, at most
//! [`IngestConfig::group_batches`] batches. While a commit waits (a full disk, a slow store) the thread
//! reads nothing, its SUB queue fills and the engine's PUB socket drops at its high-water mark:
//! those batches come back through gap refill. The ingest never drops a batch silently.

pub mod endpoint;
pub mod liveness;
pub mod load;
mod metrics;
pub mod rank;
mod replay;
mod sequencer;
mod throttle;
mod watched;

pub use rank::{IngestItem, RankConfig, RankStatus, Resume, SharedRankStatus};

use crate::hashcheck::HashCheckConfig;
use crate::shutdown::ShutdownTrigger;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;
use tokio::sync::mpsc;

/// The sink is closed: the relay is stopping, or its store failed for good. The rank's thread
/// stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Closed;

/// Where a rank's thread hands its items, in order. The relay's sink commits them on the rank's
/// own thread (`crate::commit`); tests collect them through a channel.
pub trait Sink: Send {
    /// Takes one item. It may hold it until [`Sink::flush`], and may hand on what it holds (and
    /// block until the store takes it) when it holds [`IngestConfig::group_batches`] batches.
    fn put(&mut self, item: IngestItem) -> Result<(), Closed>;
    /// Hands on everything held. The rank's thread calls it when its SUB socket has nothing
    /// more ready, before it waits on the replay socket, and when it stops.
    fn flush(&mut self) -> Result<(), Closed>;
    /// Whether items are held.
    fn holding(&self) -> bool;
}

/// A channel sink: each item is sent as it comes (blocking while the channel is full).
impl Sink for mpsc::Sender<IngestItem> {
    fn put(&mut self, item: IngestItem) -> Result<(), Closed> {
        self.blocking_send(item).map_err(|_| Closed)
    }

    fn flush(&mut self) -> Result<(), Closed> {
        if self.is_closed() {
            return Err(Closed);
        }
        Ok(())
    }

    fn holding(&self) -> bool {
        false
    }
}

/// The default bound on one engine message: far above any batch an engine sends (a step that
/// stores 128k new tokens, with their token ids, is under 1 MiB; engines' chunked prefill
/// keeps steps to a few thousand tokens), and it keeps one message from a faulty peer from
/// taking the relay's memory. A batch costs the relay more than its size while it is decoded
/// and committed (the model's structs, the log's frame, the live set's entries), so the bound
/// is not set higher than real batches need.
pub const DEFAULT_MAX_MESSAGE_BYTES: u64 = 16 << 20;

/// The ingest's settings.
#[derive(Debug, Clone)]
pub struct IngestConfig {
    /// Rank 0's PUB endpoint; rank r's is derived ([`endpoint::for_rank`]).
    pub endpoint: String,
    /// Rank 0's replay endpoint, if the engine has one.
    pub replay_endpoint: Option<String>,
    pub dp_ranks: Vec<u32>,
    pub topic: String,
    pub replay_timeout: Duration,
    pub tail_probe: Duration,
    pub rcvhwm: i32,
    /// The largest message the SUB and DEALER sockets take, in bytes (`ZMQ_MAXMSGSIZE`): libzmq
    /// drops the connection of a peer that sends a larger one, before it is read into memory.
    pub max_message_bytes: u64,
    /// The most batches a rank's thread holds before it commits them (one group commit); it
    /// commits sooner, as soon as its socket has nothing more ready.
    pub group_batches: usize,
    /// The engine's hash settings when the relay checks its block hashes.
    pub hash_check: Option<Arc<HashCheckConfig>>,
}

impl Default for IngestConfig {
    fn default() -> Self {
        IngestConfig {
            endpoint: "tcp://127.0.0.1:5557".into(),
            replay_endpoint: None,
            dp_ranks: vec![0],
            topic: String::new(),
            replay_timeout: Duration::from_secs(2),
            tail_probe: Duration::from_secs(3),
            rcvhwm: 100_000,
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            group_batches: 256,
            hash_check: None,
        }
    }
}

impl IngestConfig {
    /// Each rank's settings, with derived endpoints.
    pub fn ranks(&self) -> Result<Vec<RankConfig>, endpoint::EndpointError> {
        self.dp_ranks
            .iter()
            .map(|&r| {
                Ok(RankConfig {
                    dp_rank: r,
                    pub_endpoint: endpoint::for_rank(&self.endpoint, r)?,
                    replay_endpoint: self.replay_endpoint.as_deref().map(|e| endpoint::for_rank(e, r)).transpose()?,
                    topic: self.topic.clone(),
                    replay_timeout: self.replay_timeout,
                    tail_probe: self.tail_probe,
                    rcvhwm: self.rcvhwm,
                    max_message_bytes: self.max_message_bytes,
                    hash_check: self.hash_check.clone(),
                })
            })
            .collect()
    }
}

/// The running ingest: one thread per rank.
pub struct Ingest {
    stop: ShutdownTrigger,
    threads: Vec<JoinHandle<()>>,
    /// Each rank's status, for the status RPC and metrics.
    pub status: BTreeMap<u32, SharedRankStatus>,
}

impl Ingest {
    /// Starts a thread per rank, each handing its items to the sink `sink_for(rank)` makes.
    /// `resume` holds where the store left each rank.
    pub fn start(
        cfg: &IngestConfig,
        ctx: zmq::Context,
        resume: &BTreeMap<u32, Resume>,
        mut sink_for: impl FnMut(u32) -> Box<dyn Sink>,
    ) -> Result<Ingest, endpoint::EndpointError> {
        let stop = ShutdownTrigger::new();
        let mut status = BTreeMap::new();
        let mut threads = Vec::new();
        for rc in cfg.ranks()? {
            let st = SharedRankStatus::default();
            status.insert(rc.dp_rank, st.clone());
            let (ctx, out, stop, resume) =
                (ctx.clone(), sink_for(rc.dp_rank), stop.subscribe(), resume.get(&rc.dp_rank).copied());
            let rank = rc.dp_rank;
            let t = std::thread::Builder::new()
                .name(format!("ingest-rank-{rank}"))
                .spawn(move || {
                    if let Err(e) = rank::run(rc, ctx, resume, out, st, stop) {
                        tracing::error!(dp_rank = rank, error = %e, "rank ingest stopped on a socket error");
                    }
                })
                .expect("spawning an ingest thread");
            threads.push(t);
        }
        Ok(Ingest { stop, threads, status })
    }

    /// Asks every rank thread to stop and waits for them.
    pub fn stop(self) {
        self.stop.trigger();
        for t in self.threads {
            let _ = t.join();
        }
    }
}
