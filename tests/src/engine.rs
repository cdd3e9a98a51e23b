//! The mock engine: DP ranks (publisher threads), the engine's truth, load gauges, faults.
//!
//! Every batch goes through [`MockEngine`], which applies it to the truth (by decoding the
//! payload it is about to publish, so the truth is keyed exactly as the wire says) and hands
//! it to the rank's publisher thread, both under the rank's lock so a restart or stop never
//! interleaves with a half-applied batch. The truth is the engine's state: a batch dropped on
//! the wire or lost from the buffer still changed it.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rmpv::Value;

use crate::decode::decode_batch;
use crate::face::{Face, Served};
use crate::metrics::Load;
use crate::publisher::{offset_endpoint, Cmd, PublishRecord, PublisherError, RankConfig, RankHandle, RankStats};
use crate::traffic::CacheSim;
use crate::truth::Truth;
use crate::wire::{
    encode_batch, encode_batch_raw, encode_event_bytes, Batch, BlockHash, EngineEvent, ReplayLayout, Stored, TokenIds,
    WireVersion,
};

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Publisher(#[from] PublisherError),
    #[error("no rank {0} (dp size {1})")]
    NoRank(u32, u32),
    #[error("rank {0} is stopped")]
    Stopped(u32),
    #[error("metrics listener: {0}")]
    Metrics(#[from] std::io::Error),
    #[error("zmq: {0}")]
    Zmq(#[from] zmq::Error),
}

/// Settings of a mock engine.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub wire: WireVersion,
    pub dp_size: u32,
    /// PUB endpoint of rank 0 (rank r: port + r, or `_dp{r}` for inproc). Port 0: ephemeral
    /// per rank (see [`MockEngine::endpoints`]).
    pub endpoint: String,
    /// ROUTER endpoint of rank 0, if replay is enabled (offset like `endpoint`).
    pub replay_endpoint: Option<String>,
    pub topic: String,
    /// Replay buffer bound in batches (engines: 10,000).
    pub buffer_steps: usize,
    /// Reply layout; `None`: the layout of `wire`'s release.
    pub replay_layout: Option<ReplayLayout>,
    pub hwm: i32,
    /// The HTTP face's listen address (port 0: ephemeral), or none: `/metrics`, `/health` and
    /// the OpenAI routes (see [`crate::face`]).
    pub metrics_listen: Option<SocketAddr>,
    pub model_name: String,
    /// Keep every publish record (tests).
    pub record: bool,
    /// Generated traffic: tokens per block and cache capacity in blocks, per rank.
    pub block_size: u32,
    pub cache_blocks: usize,
    /// Generated traffic: offload GPU evictions to a host tier of this many blocks per rank
    /// (vLLM medium `CPU`, SGLang `CPU_PINNED`); 0: no host tier.
    pub host_tier_blocks: usize,
    /// vLLM: publish hashes as raw 32-byte digests (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`).
    pub bytes_hashes: bool,
    /// SGLang: EAGLE bigram pages in generated traffic.
    pub eagle: bool,
}

impl EngineConfig {
    pub fn new(wire: WireVersion) -> Self {
        EngineConfig {
            wire,
            dp_size: 1,
            endpoint: "tcp://127.0.0.1:5557".to_string(),
            replay_endpoint: None,
            topic: String::new(),
            buffer_steps: 10_000,
            replay_layout: None,
            hwm: 100_000,
            metrics_listen: None,
            model_name: "mock-model".to_string(),
            record: false,
            block_size: 16,
            cache_blocks: 1024,
            host_tier_blocks: 0,
            bytes_hashes: false,
            eagle: false,
        }
    }
}

/// Garbage the engine can put on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Garbage {
    /// A 2-frame message `[topic, seq8]` (no seq consumed).
    WrongFrameCount,
    /// `[topic, 4-byte seq, valid empty batch]` (no seq consumed).
    ShortSeq,
    /// A batch whose payload is not msgpack (takes a seq, buffered).
    NotMsgpack,
    /// A valid batch cut in half (takes a seq, buffered; changes nothing).
    TruncatedMsgpack,
    /// A batch of three stores where the middle one is malformed (`block_hashes` is a
    /// string): the two good ones are part of the truth.
    MalformedEvent,
}

impl Garbage {
    pub const ALL: [Garbage; 5] = [
        Garbage::WrongFrameCount,
        Garbage::ShortSeq,
        Garbage::NotMsgpack,
        Garbage::TruncatedMsgpack,
        Garbage::MalformedEvent,
    ];

    pub fn parse(s: &str) -> Option<Garbage> {
        Some(match s {
            "frames" | "wrong-frame-count" => Garbage::WrongFrameCount,
            "short-seq" => Garbage::ShortSeq,
            "not-msgpack" | "garbage" => Garbage::NotMsgpack,
            "truncated" => Garbage::TruncatedMsgpack,
            "malformed-event" => Garbage::MalformedEvent,
            _ => return None,
        })
    }
}

/// Where one rank can be reached.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct RankEndpoints {
    pub rank: u32,
    pub publisher: String,
    pub replay: Option<String>,
}

pub(crate) struct RankState {
    running: bool,
    /// SGLang: the next batch must start with AllBlocksCleared.
    needs_clear: bool,
    /// Bumped on every restart or start: traffic sources notice a new engine.
    epoch: u64,
    pub(crate) cache: CacheSim,
}

struct Rank {
    handle: RankHandle,
    state: Mutex<RankState>,
}

/// A mock engine with `dp_size` ranks. Share it across threads (`Arc`); every method takes
/// `&self`.
pub struct MockEngine {
    cfg: EngineConfig,
    ranks: Vec<Rank>,
    /// Lock order: a rank's `state`, then `truth`.
    truth: Mutex<Truth>,
    loads: Arc<Mutex<Vec<Load>>>,
    metrics: Option<Face>,
    paused: Mutex<bool>,
    unpaused: Condvar,
    garbage_counter: AtomicU64,
    ctx: zmq::Context,
}

/// The frame of [`MockEngine::probe`].
pub const PROBE: &[u8] = b"\0mock-engine-probe";

fn now_ts() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

impl MockEngine {
    /// Bind every rank's sockets (and `/metrics`) and start the publisher threads.
    pub fn start(cfg: EngineConfig) -> Result<MockEngine, EngineError> {
        MockEngine::start_in(cfg, zmq::Context::new())
    }

    /// As [`MockEngine::start`], on the given zmq context: `inproc://` endpoints are only
    /// reachable by sockets of the same context (pass the relay's, or use
    /// [`MockEngine::context`]).
    pub fn start_in(cfg: EngineConfig, ctx: zmq::Context) -> Result<MockEngine, EngineError> {
        let layout = cfg.replay_layout.unwrap_or_else(|| cfg.wire.replay_layout());
        let mut ranks = Vec::new();
        for rank in 0..cfg.dp_size {
            let rc = RankConfig {
                rank,
                endpoint: offset_endpoint(&cfg.endpoint, rank)?,
                replay_endpoint: cfg.replay_endpoint.as_deref().map(|e| offset_endpoint(e, rank)).transpose()?,
                topic: cfg.topic.as_bytes().to_vec(),
                buffer_steps: cfg.buffer_steps,
                replay_layout: layout,
                hwm: cfg.hwm,
            };
            ranks.push(Rank {
                handle: RankHandle::start(&ctx, rc, cfg.record)?,
                state: Mutex::new(RankState {
                    running: true,
                    needs_clear: cfg.wire.clears_on_start(),
                    epoch: 0,
                    cache: CacheSim::new(cfg.wire.engine, cfg.block_size, cfg.cache_blocks)
                        .with_bytes_hashes(cfg.bytes_hashes)
                        .with_host_tier(cfg.host_tier_blocks)
                        .with_eagle(cfg.eagle),
                }),
            });
        }
        let loads = Arc::new(Mutex::new(vec![Load::default(); cfg.dp_size as usize]));
        let metrics = match cfg.metrics_listen {
            Some(addr) => Some(Face::start(addr, cfg.wire.engine, cfg.model_name.clone(), loads.clone())?),
            None => None,
        };
        Ok(MockEngine {
            cfg,
            ranks,
            truth: Mutex::new(Truth::new()),
            loads,
            metrics,
            paused: Mutex::new(false),
            unpaused: Condvar::new(),
            garbage_counter: AtomicU64::new(0),
            ctx,
        })
    }

    /// The zmq context the ranks' sockets live in.
    pub fn context(&self) -> &zmq::Context {
        &self.ctx
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    pub fn wire(&self) -> WireVersion {
        self.cfg.wire
    }

    pub fn dp_size(&self) -> u32 {
        self.cfg.dp_size
    }

    fn rank(&self, rank: u32) -> Result<&Rank, EngineError> {
        self.ranks.get(rank as usize).ok_or(EngineError::NoRank(rank, self.cfg.dp_size))
    }

    fn lock_state(&self, rank: u32) -> Result<(&Rank, MutexGuard<'_, RankState>), EngineError> {
        let r = self.rank(rank)?;
        Ok((r, r.state.lock().expect("rank state lock")))
    }

    /// The bound endpoints of every rank (ephemeral ports resolved).
    pub fn endpoints(&self) -> Vec<RankEndpoints> {
        self.ranks
            .iter()
            .map(|r| {
                let s = r.handle.stats();
                RankEndpoints { rank: r.handle.rank, publisher: s.pub_endpoint, replay: s.replay_endpoint }
            })
            .collect()
    }

    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics.as_ref().map(Face::addr)
    }

    /// The HTTP face, when it listens.
    pub fn face(&self) -> Option<&Face> {
        self.metrics.as_ref()
    }

    /// The engine's base URL (`http://host:port`), when the face listens.
    pub fn url(&self) -> Option<String> {
        self.metrics_addr().map(|a| format!("http://{a}"))
    }

    /// Completions on the face are served by this engine: each prompt's full blocks go through
    /// the rank's prefix cache ([`MockEngine::complete`]).
    pub fn serve_completions(self: &Arc<Self>) {
        let Some(face) = self.face() else { return };
        let me = Arc::downgrade(self);
        face.set_completer(Arc::new(move |rank, tokens| {
            let e = me.upgrade().ok_or("the engine is gone")?;
            e.complete(rank, tokens).map_err(|e| e.to_string())
        }));
    }

    /// How many of the prompt's leading full blocks `rank`'s prefix cache holds now.
    pub fn cached_blocks(&self, rank: u32, tokens: &[u64]) -> Result<usize, EngineError> {
        let blocks = self.full_blocks(tokens);
        let (_, st) = self.lock_state(rank)?;
        Ok(st.cache.cached_prefix(&blocks))
    }

    /// A prompt's full blocks of tokens.
    fn full_blocks(&self, tokens: &[u64]) -> Vec<Vec<u64>> {
        tokens.chunks_exact(self.cfg.block_size as usize).map(<[u64]>::to_vec).collect()
    }

    /// One completion on `rank`: the prompt's full blocks are served by its prefix cache and
    /// the step published; `cached_tokens` is the prefix that was already cached.
    pub fn complete(&self, rank: u32, tokens: &[u64]) -> Result<Served, EngineError> {
        let bs = self.cfg.block_size as usize;
        let blocks = self.full_blocks(tokens);
        let cached = {
            let (_, st) = self.lock_state(rank)?;
            if !st.running {
                return Err(EngineError::Stopped(rank));
            }
            st.cache.cached_prefix(&blocks)
        };
        if !blocks.is_empty() {
            self.serve_request(rank, &blocks, false)?;
        }
        Ok(Served { prompt_tokens: tokens.len() as u64, cached_tokens: (cached * bs) as u64 })
    }

    /// A copy of the truth at this moment.
    pub fn truth(&self) -> Truth {
        self.truth.lock().expect("truth lock").clone()
    }

    /// The rank's counters as its thread last published them; call [`MockEngine::flush`]
    /// first for values that include everything asked so far.
    pub fn stats(&self, rank: u32) -> Result<RankStats, EngineError> {
        Ok(self.rank(rank)?.handle.stats())
    }

    /// Every batch the rank was asked to publish (needs `record`).
    pub fn records(&self, rank: u32) -> Result<Vec<PublishRecord>, EngineError> {
        Ok(self.rank(rank)?.handle.records())
    }

    /// Engine restarts (and starts) of `rank` so far.
    pub fn epoch(&self, rank: u32) -> Result<u64, EngineError> {
        Ok(self.lock_state(rank)?.1.epoch)
    }

    pub fn is_running(&self, rank: u32) -> Result<bool, EngineError> {
        Ok(self.lock_state(rank)?.1.running)
    }

    fn apply_truth(&self, rank: u32, payload: &[u8]) {
        if let Ok(batch) = decode_batch(payload) {
            let mut t = self.truth.lock().expect("truth lock");
            for ev in batch.events.iter().flatten() {
                t.apply(rank, ev);
            }
        }
    }

    fn send_payload(&self, r: &Rank, rank: u32, topic: Option<Vec<u8>>, payload: Vec<u8>) -> Result<(), EngineError> {
        self.apply_truth(rank, &payload);
        r.handle.send(Cmd::Publish { topic, payload })?;
        Ok(())
    }

    fn publish_locked(
        &self,
        r: &Rank,
        st: &mut RankState,
        rank: u32,
        mut events: Vec<EngineEvent>,
    ) -> Result<(), EngineError> {
        if !st.running {
            return Err(EngineError::Stopped(rank));
        }
        if st.needs_clear {
            st.needs_clear = false;
            if !matches!(events.first(), Some(EngineEvent::Cleared)) {
                events.insert(0, EngineEvent::Cleared);
            }
        }
        if events.is_empty() {
            return Ok(()); // engines publish only non-empty batches
        }
        let payload = encode_batch(&self.cfg.wire, &Batch { ts: now_ts(), events, dp_rank: Some(rank) });
        self.send_payload(r, rank, None, payload)
    }

    /// Publish one batch of events from `rank` in the configured wire layout (SGLang: the
    /// first batch of a publisher gets `AllBlocksCleared` in front). An empty batch is not
    /// published, as the engines do.
    pub fn publish(&self, rank: u32, events: Vec<EngineEvent>) -> Result<(), EngineError> {
        let (r, mut st) = self.lock_state(rank)?;
        self.publish_locked(r, &mut st, rank, events)
    }

    /// Publish an already-encoded payload (capture playback); `topic: None` uses the
    /// configured topic.
    pub fn publish_payload(&self, rank: u32, topic: Option<Vec<u8>>, payload: Vec<u8>) -> Result<(), EngineError> {
        let (r, st) = self.lock_state(rank)?;
        if !st.running {
            return Err(EngineError::Stopped(rank));
        }
        self.send_payload(r, rank, topic, payload)
    }

    /// Publish an already-encoded payload without applying it to the truth: for load
    /// generators that keep their own state and publish faster than the truth's decode could
    /// follow (the relay bench's pre-encoded cycles). The seq, the wire and the replay buffer
    /// are as for [`MockEngine::publish_payload`]; [`MockEngine::truth`] no longer describes
    /// the rank once this is used.
    pub fn publish_untracked(&self, rank: u32, payload: Vec<u8>) -> Result<(), EngineError> {
        let (r, st) = self.lock_state(rank)?;
        if !st.running {
            return Err(EngineError::Stopped(rank));
        }
        r.handle.send(Cmd::Publish { topic: None, payload })?;
        Ok(())
    }

    /// Serve one request on `rank`'s prefix cache and publish the resulting step. With
    /// `clear_first`, the cache is reset first and `AllBlocksCleared` rides in front of the
    /// step's events (as vLLM's `reset_prefix_cache` does).
    pub fn serve_request(&self, rank: u32, blocks: &[Vec<u64>], clear_first: bool) -> Result<(), EngineError> {
        let (r, mut st) = self.lock_state(rank)?;
        if !st.running {
            return Err(EngineError::Stopped(rank));
        }
        let mut events = Vec::new();
        if clear_first {
            st.cache.clear();
            events.push(EngineEvent::Cleared);
        }
        events.extend(st.cache.serve(blocks));
        let usage = st.cache.usage();
        {
            let mut loads = self.loads.lock().expect("loads lock");
            if let Some(l) = loads.get_mut(rank as usize) {
                l.kv_usage = usage;
            }
        }
        self.publish_locked(r, &mut st, rank, events)
    }

    /// The hashes the generator's cache of `rank` holds.
    pub fn cache_hashes(&self, rank: u32) -> Result<std::collections::BTreeSet<u64>, EngineError> {
        Ok(self.lock_state(rank)?.1.cache.hashes())
    }

    /// The hashes the generator's host tier of `rank` holds.
    pub fn host_hashes(&self, rank: u32) -> Result<std::collections::BTreeSet<u64>, EngineError> {
        Ok(self.lock_state(rank)?.1.cache.host_hashes())
    }

    /// `reset_prefix_cache`: the rank's cache is emptied and `AllBlocksCleared` published.
    pub fn clear(&self, rank: u32) -> Result<(), EngineError> {
        let (r, mut st) = self.lock_state(rank)?;
        st.cache.clear();
        self.publish_locked(r, &mut st, rank, vec![EngineEvent::Cleared])
    }

    /// `reset_prefix_cache` as the engines publish it: the cache is emptied now, and
    /// `AllBlocksCleared` rides in front of the rank's next batch (nothing is published until
    /// then; the truth changes with that batch).
    pub fn clear_with_next_batch(&self, rank: u32) -> Result<(), EngineError> {
        let (_, mut st) = self.lock_state(rank)?;
        st.cache.clear();
        st.needs_clear = true;
        Ok(())
    }

    pub fn set_load(&self, rank: u32, load: Load) -> Result<(), EngineError> {
        self.rank(rank)?;
        self.loads.lock().expect("loads lock")[rank as usize] = load;
        Ok(())
    }

    pub fn load(&self, rank: u32) -> Result<Load, EngineError> {
        self.rank(rank)?;
        Ok(self.loads.lock().expect("loads lock")[rank as usize])
    }

    /// Wait until every rank's thread has carried out everything asked of it so far (a held
    /// delay included).
    pub fn flush(&self) -> Result<(), EngineError> {
        for r in &self.ranks {
            r.handle.call(Cmd::Sync)?;
        }
        Ok(())
    }

    // ---- faults -------------------------------------------------------------------------

    /// The next `n` batches of `rank` get a seq and go to the replay buffer, but not on the
    /// wire.
    pub fn drop_on_wire(&self, rank: u32, n: u64) -> Result<(), EngineError> {
        Ok(self.rank(rank)?.handle.send(Cmd::DropWire(n))?)
    }

    /// `rank`'s next replay answer sends at most `n` batches and then nothing, not even the end
    /// marker, as an engine that stops answering: the asker's timeout ends it.
    pub fn stall_replay(&self, rank: u32, n: u64) -> Result<(), EngineError> {
        self.stall_replay_after(rank, 0, n)
    }

    /// [`MockEngine::stall_replay`] for the answer after the next `whole` ones, which are sent
    /// whole (e.g. an answer cut short by the asker, then the one it asks for past the cut).
    pub fn stall_replay_after(&self, rank: u32, whole: u64, n: u64) -> Result<(), EngineError> {
        Ok(self.rank(rank)?.handle.send(Cmd::StallReplay(whole, n))?)
    }

    /// The next `n` batches of `rank` get a seq but go neither on the wire nor to the buffer
    /// (a gap nobody can refill).
    pub fn lose(&self, rank: u32, n: u64) -> Result<(), EngineError> {
        Ok(self.rank(rank)?.handle.send(Cmd::Lose(n))?)
    }

    /// The next `n` batches of `rank` go to the replay buffer at once but on the wire only after
    /// the replay socket has answered a request: whoever asks the replay meanwhile (a relay's
    /// tail probe) gets them there before the live copy arrives.
    pub fn wire_after_replay(&self, rank: u32, n: u64) -> Result<(), EngineError> {
        Ok(self.rank(rank)?.handle.send(Cmd::WireAfterReplay(n))?)
    }

    /// Forget buffered batches of `rank`, keeping the newest `keep`.
    pub fn trim_buffer(&self, rank: u32, keep: usize) -> Result<(), EngineError> {
        Ok(self.rank(rank)?.handle.send(Cmd::TrimBuffer(keep))?)
    }

    /// Hold `rank`'s publishing for `d`: batches wait and then go out in order (replay keeps
    /// answering meanwhile).
    pub fn delay(&self, rank: u32, d: Duration) -> Result<(), EngineError> {
        Ok(self.rank(rank)?.handle.send(Cmd::Delay(d))?)
    }

    pub fn set_replay_layout(&self, rank: u32, layout: ReplayLayout) -> Result<(), EngineError> {
        Ok(self.rank(rank)?.handle.send(Cmd::SetReplayLayout(layout))?)
    }

    /// Restart `rank`'s engine: its cache and truth are emptied, new sockets are bound at the
    /// same endpoints, seq starts again at 0 with an empty buffer (SGLang: the first batch
    /// starts with `AllBlocksCleared`). Returns once the new sockets are bound.
    pub fn restart(&self, rank: u32) -> Result<(), EngineError> {
        let (r, mut st) = self.lock_state(rank)?;
        st.cache.clear();
        st.needs_clear = self.cfg.wire.clears_on_start();
        st.epoch += 1;
        st.running = true;
        self.truth.lock().expect("truth lock").clear_rank(rank);
        r.handle.call(Cmd::Restart)?;
        Ok(())
    }

    /// Stop `rank` (the engine process is gone): sockets closed, its blocks gone.
    pub fn stop(&self, rank: u32) -> Result<(), EngineError> {
        let (r, mut st) = self.lock_state(rank)?;
        st.cache.clear();
        st.running = false;
        self.truth.lock().expect("truth lock").clear_rank(rank);
        r.handle.call(Cmd::Stop)?;
        Ok(())
    }

    /// Start a stopped `rank` as a fresh publisher (as after a restart).
    pub fn start_rank(&self, rank: u32) -> Result<(), EngineError> {
        let (r, mut st) = self.lock_state(rank)?;
        if st.running {
            return Ok(());
        }
        st.needs_clear = self.cfg.wire.clears_on_start();
        st.epoch += 1;
        st.running = true;
        r.handle.call(Cmd::Start)?;
        Ok(())
    }

    /// Put garbage on `rank`'s wire.
    pub fn garbage(&self, rank: u32, kind: Garbage) -> Result<(), EngineError> {
        let (r, mut st) = self.lock_state(rank)?;
        if !st.running {
            return Err(EngineError::Stopped(rank));
        }
        let topic = self.cfg.topic.as_bytes().to_vec();
        let wire = self.cfg.wire;
        let n = self.garbage_counter.fetch_add(1, Ordering::Relaxed);
        let good = |i: u64| {
            let h = 0x6a72_6261_6765_0000 ^ (n << 8) ^ i; // "jrbage": distinct from traffic
            EngineEvent::Stored(Stored {
                hashes: vec![match wire.engine {
                    crate::wire::Engine::Vllm => BlockHash::U64(h),
                    crate::wire::Engine::Sglang => BlockHash::I64(h as i64),
                }],
                token_ids: TokenIds::Single(vec![1; self.cfg.block_size as usize]),
                block_size: self.cfg.block_size,
                medium: Some("GPU".into()),
                group_idx: Some(0),
                ..Default::default()
            })
        };
        match kind {
            Garbage::WrongFrameCount => {
                r.handle.send(Cmd::Raw(vec![topic, 0u64.to_be_bytes().to_vec()]))?;
            }
            Garbage::ShortSeq => {
                let empty = encode_batch(&wire, &Batch { ts: now_ts(), events: vec![], dp_rank: Some(rank) });
                r.handle.send(Cmd::Raw(vec![topic, vec![0, 0, 0, 1], empty]))?;
            }
            Garbage::NotMsgpack => {
                self.send_payload(r, rank, None, b"\xc1 this is not msgpack".to_vec())?;
            }
            Garbage::TruncatedMsgpack => {
                let full =
                    encode_batch(&wire, &Batch { ts: now_ts(), events: vec![good(0), good(1)], dp_rank: Some(rank) });
                let cut = full[..full.len() / 2].to_vec();
                self.send_payload(r, rank, None, cut)?;
            }
            Garbage::MalformedEvent => {
                let bad = if wire.events_are_maps() {
                    Value::Map(vec![
                        (Value::from("type"), Value::from("BlockStored")),
                        (Value::from("block_hashes"), Value::from("not-a-list")),
                        (Value::from("parent_block_hash"), Value::Nil),
                        (Value::from("token_ids"), Value::Array(vec![])),
                        (Value::from("block_size"), Value::from(self.cfg.block_size)),
                    ])
                } else {
                    Value::Array(vec![
                        Value::from("BlockStored"),
                        Value::from("not-a-list"),
                        Value::Nil,
                        Value::Array(vec![]),
                        Value::from(self.cfg.block_size),
                        Value::Nil,
                    ])
                };
                let mut bad_bytes = Vec::new();
                rmpv::encode::write_value(&mut bad_bytes, &bad).expect("vec write");
                let mut events = Vec::new();
                if st.needs_clear {
                    st.needs_clear = false;
                    events.push(encode_event_bytes(&wire, &EngineEvent::Cleared));
                }
                events.push(encode_event_bytes(&wire, &good(0)));
                events.push(bad_bytes);
                events.push(encode_event_bytes(&wire, &good(1)));
                let payload = encode_batch_raw(&wire, now_ts(), &events, Some(rank));
                self.send_payload(r, rank, None, payload)?;
            }
        }
        Ok(())
    }

    /// Send a one-frame probe message `["\0mock-engine-probe"]` on `rank`'s PUB socket (no
    /// seq, not buffered). Tests use it to know a SUB's subscription has reached the
    /// publisher before real traffic starts (zmq's slow joiner); a relay would count it as
    /// a malformed message.
    pub fn probe(&self, rank: u32) -> Result<(), EngineError> {
        Ok(self.rank(rank)?.handle.send(Cmd::Raw(vec![PROBE.to_vec()]))?)
    }

    /// Traffic sources wait while paused (the sockets keep answering replay).
    pub fn pause(&self) {
        *self.paused.lock().expect("pause lock") = true;
    }

    pub fn resume(&self) {
        *self.paused.lock().expect("pause lock") = false;
        self.unpaused.notify_all();
    }

    pub fn is_paused(&self) -> bool {
        *self.paused.lock().expect("pause lock")
    }

    /// Block while paused, at most `timeout`; true when not paused.
    pub fn wait_unpaused(&self, timeout: Duration) -> bool {
        let g = self.paused.lock().expect("pause lock");
        let (g, _) = self.unpaused.wait_timeout_while(g, timeout, |p| *p).expect("pause lock");
        !*g
    }
}
