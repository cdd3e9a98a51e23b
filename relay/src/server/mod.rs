//! The relay's gRPC server: the `kv_relay.v1.Relay` service over the [`Store`], with gRPC health
//! and reflection, TLS (and client certificates), a bearer token, per-client rate limits, and a
//! graceful shutdown. The contract and its resume rules are in `docs/protocol.md`.
//!
//! - [`convert`]: the model ↔ pb conversions.
//! - the status it serves is [`crate::status`] ([`RelayStatusHandle`]), which the ingest and the
//!   commits keep current, with its live notices ([`Notice`]).
//! - `guard`: token check, rate limits, and the stream wrapper that ends streams on shutdown.
//! - `stream`: the per-stream producers (Subscribe, History, Snapshot).

pub mod convert;
pub mod encode;
mod guard;

mod stream;

pub use crate::status::{notice_channel, Notice, RankStatus, RelayStatus, RelayStatusHandle};
pub use guard::RETRY_AFTER_MS;

use crate::model::Tier;
use crate::shutdown::{Shutdown, ShutdownTrigger};
use crate::store::{CursorCheck, SnapshotFilter, Store};
use guard::{resource_exhausted, ClientLimiter, TokenCheck, UntilShutdown};
use kv_relay_proto::encoded::server::relay_server::{Relay, RelayServer};
use kv_relay_proto::encoded::SubscribeOut;
use kv_relay_proto::pb;
use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use stream::{Driven, Outgoing, Start, Subscriber};
use tokio::sync::{broadcast, mpsc, Semaphore};
use tokio_stream::wrappers::ReceiverStream;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Certificate, Identity, Server, ServerTlsConfig};
use tonic::{Request, Response, Status};

/// TLS material, PEM encoded.
#[derive(Clone)]
pub struct TlsConfig {
    /// The server's certificate chain.
    pub cert_pem: Vec<u8>,
    /// The server's private key.
    pub key_pem: Vec<u8>,
    /// When set, clients must present a certificate signed by this CA (mTLS).
    pub client_ca_pem: Option<Vec<u8>>,
}

impl std::fmt::Debug for TlsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the key.
        f.debug_struct("TlsConfig").field("mtls", &self.client_ca_pem.is_some()).finish_non_exhaustive()
    }
}

impl TlsConfig {
    /// Reads the PEM files.
    pub fn from_files(cert: &Path, key: &Path, client_ca: Option<&Path>) -> std::io::Result<TlsConfig> {
        Ok(TlsConfig {
            cert_pem: std::fs::read(cert)?,
            key_pem: std::fs::read(key)?,
            client_ca_pem: client_ca.map(std::fs::read).transpose()?,
        })
    }
}

/// The server's configuration. [`ServerConfig::default`] is what the relay runs with unless
/// configured otherwise.
#[derive(Clone)]
pub struct ServerConfig {
    /// Where the binary binds (`127.0.0.1:50051`); [`serve`] takes an already bound listener.
    pub listen: SocketAddr,
    /// TLS, and client certificates; `None`: plaintext.
    pub tls: Option<TlsConfig>,
    /// When set, every `Relay` call must carry `authorization: Bearer <token>`. Health and
    /// reflection stay open.
    pub bearer_token: Option<String>,
    /// Subscribe and Snapshot requests per second per client (peer IP).
    pub rate_per_second: u32,
    /// Burst of Subscribe and Snapshot requests per client.
    pub rate_burst: u32,
    /// Subscribe streams open at once, whole relay; more get `RESOURCE_EXHAUSTED`.
    pub max_subscribers: usize,
    /// Snapshots being sent at once (Snapshot RPCs, and Subscribe streams starting with one): a
    /// Snapshot RPC beyond it gets `RESOURCE_EXHAUSTED`, a Subscribe waits its turn.
    pub max_snapshots: usize,
    /// Threads of the runtime the binary runs the server on (its tokio workers); [`serve`] runs
    /// on whatever runtime calls it.
    pub threads: usize,
    /// HTTP/2 concurrent streams per connection.
    pub max_streams_per_connection: u32,
    /// The largest request message decoded, bytes.
    pub max_request_bytes: usize,
    /// The largest response message encoded, bytes.
    pub max_response_bytes: usize,
    /// Messages buffered per stream between its producer and the connection. Bounded: when full
    /// the producer waits (and a Subscribe producer reads nothing more from the store).
    pub stream_buffer: usize,
    /// History records read from the store per page.
    pub history_page: usize,
    /// Blocks per snapshot chunk.
    pub snapshot_chunk_blocks: usize,
    /// Heartbeat period while a stream is quiet.
    pub heartbeat_interval: Duration,
    /// How long shutdown waits for connections to close before it returns anyway.
    pub shutdown_grace: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 50051)),
            tls: None,
            bearer_token: None,
            rate_per_second: 10,
            rate_burst: 20,
            max_subscribers: 256,
            max_snapshots: 8,
            threads: 1,
            max_streams_per_connection: 64,
            max_request_bytes: 64 << 10,
            max_response_bytes: 16 << 20,
            stream_buffer: 64,
            history_page: 256,
            snapshot_chunk_blocks: 1024,
            heartbeat_interval: Duration::from_secs(1),
            shutdown_grace: Duration::from_secs(5),
        }
    }
}

impl std::fmt::Debug for ServerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerConfig")
            .field("listen", &self.listen)
            .field("tls", &self.tls)
            .field("bearer_token", &self.bearer_token.as_ref().map(|_| "<set>"))
            .field("rate_per_second", &self.rate_per_second)
            .field("rate_burst", &self.rate_burst)
            .field("max_subscribers", &self.max_subscribers)
            .field("max_snapshots", &self.max_snapshots)
            .finish_non_exhaustive()
    }
}

/// Why the server could not run.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("tls configuration: {0}")]
    Tls(#[source] tonic::transport::Error),
    #[error("reflection descriptors: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
    #[error("grpc server: {0}")]
    Transport(#[source] tonic::transport::Error),
}

/// The `kv_relay.v1.Relay` service.
pub struct RelayService {
    store: Store,
    status: RelayStatusHandle,
    notices: broadcast::Sender<Notice>,
    cfg: Arc<ServerConfig>,
    limiter: Arc<ClientLimiter>,
    subscriber_slots: Arc<Semaphore>,
    snapshot_slots: Arc<Semaphore>,
    shutdown: Shutdown,
}

type BoxStream<T> = Pin<Box<dyn tokio_stream::Stream<Item = Result<T, Status>> + Send + 'static>>;

fn ranks_filter(ranks: &[u32]) -> Option<Vec<u32>> {
    (!ranks.is_empty()).then(|| ranks.to_vec())
}

impl RelayService {
    fn check_rate<T>(&self, req: &Request<T>, what: &str) -> Result<(), Status> {
        self.limiter.check(req.remote_addr().map(|a| a.ip()), what)
    }

    fn stream_of<T: Send + 'static>(&self, rx: mpsc::Receiver<Result<T, Status>>) -> BoxStream<T> {
        self.until_shutdown(ReceiverStream::new(rx))
    }

    /// A response stream that ends when the server shuts down.
    fn until_shutdown<T>(
        &self,
        s: impl tokio_stream::Stream<Item = Result<T, Status>> + Send + Unpin + 'static,
    ) -> BoxStream<T> {
        Box::pin(UntilShutdown::new(s, self.shutdown.clone()))
    }

    /// Picks where a Subscribe starts (the resume rules of `docs/protocol.md`).
    fn plan(&self, r: &pb::SubscribeRequest) -> Result<Start, Status> {
        use pb::SnapshotReason as Why;
        let store = &self.store;
        let epoch = store.epoch();
        let newest = store.newest_cursor();
        let oldest = store.oldest_cursor();
        // The first record not held: everything after `c` is held when `c + 1 >= first_held`.
        let first_held = oldest.unwrap_or(newest + 1);
        let snapshot_or = |why: Why, refusal: Status| {
            if r.allow_snapshot {
                Ok(Start::Snapshot(why))
            } else {
                Err(refusal)
            }
        };
        if r.epoch != 0 && r.epoch != epoch {
            return snapshot_or(
                Why::EpochChanged,
                Status::out_of_range(format!("epoch {} is not the relay's ({epoch}): resync from a snapshot", r.epoch)),
            );
        }
        let c = r.after_cursor;
        if c == 0 {
            if first_held <= 1 {
                return Ok(Start::After(0));
            }
            // Cursor 0 applied nothing: a new client, even one that learned the epoch from Status.
            return snapshot_or(
                Why::NewClient,
                Status::out_of_range(format!("the history starts at cursor {first_held}: resync from a snapshot")),
            );
        }
        if r.epoch == 0 {
            return snapshot_or(
                Why::EpochChanged,
                Status::out_of_range("a cursor without its epoch cannot be resumed: resync from a snapshot"),
            );
        }
        if c > newest {
            return snapshot_or(
                Why::CursorLost,
                Status::failed_precondition(format!(
                    "cursor {c} is ahead of the relay's newest ({newest}): the relay lost records in a crash; \
                     resync from a snapshot"
                )),
            );
        }
        match store.cursor_matches(c, r.incarnation) {
            CursorCheck::Same => Ok(Start::After(c)),
            CursorCheck::Lost => snapshot_or(
                Why::CursorLost,
                Status::failed_precondition(format!(
                    "the record at cursor {c} of incarnation {} was lost in a relay crash: resync from a snapshot",
                    r.incarnation
                )),
            ),
            CursorCheck::Trimmed if c + 1 >= first_held => Ok(Start::After(c)),
            CursorCheck::Trimmed => snapshot_or(
                Why::CursorTrimmed,
                Status::out_of_range(format!(
                    "cursor {c} predates the history (oldest held: {first_held}): resync from a snapshot"
                )),
            ),
        }
    }
}

#[tonic::async_trait]
impl Relay for RelayService {
    type SubscribeStream = BoxStream<SubscribeOut>;
    type HistoryStream = BoxStream<pb::HistoryResponse>;
    type SnapshotStream = BoxStream<pb::SnapshotResponse>;

    async fn subscribe(
        &self,
        request: Request<pb::SubscribeRequest>,
    ) -> Result<Response<Self::SubscribeStream>, Status> {
        self.check_rate(&request, "subscribe")?;
        let permit = self
            .subscriber_slots
            .clone()
            .try_acquire_owned()
            .map_err(|_| resource_exhausted("too many subscribers", Duration::from_secs(1)))?;
        let r = request.into_inner();
        let start = self.plan(&r)?;
        let (tx, rx) = mpsc::channel(self.cfg.stream_buffer.max(1));
        let sub = Subscriber {
            store: self.store.clone(),
            status: self.status.clone(),
            cfg: self.cfg.clone(),
            notices: self.notices.subscribe(),
            newest: self.store.watch_newest(),
            shutdown: self.shutdown.clone(),
            ranks: ranks_filter(&r.ranks),
            snapshot_token_ids: r.snapshot_token_ids,
            shape: if r.omit_token_ids { encode::Shape::Lean } else { encode::Shape::Full },
            start,
            snapshot_slots: self.snapshot_slots.clone(),
            _permit: permit,
        };
        // The connection's task runs the producer (`Driven`). Queued records are shared with the
        // store's tail: each becomes a message of its own only when the connection takes it, so
        // a full queue holds no copies.
        let messages = tokio_stream::StreamExt::map(Driven::new(sub.run(tx), rx), |r| r.map(Outgoing::into_message));
        Ok(Response::new(self.until_shutdown(messages)))
    }

    async fn status(&self, _request: Request<pb::StatusRequest>) -> Result<Response<pb::StatusResponse>, Status> {
        let st = self.status.get();
        let hs = self.store.history_stats();
        let mut ranks: std::collections::BTreeMap<u32, pb::RankStatus> = st
            .ranks
            .iter()
            .map(|(&r, s)| {
                let rs = pb::RankStatus {
                    dp_rank: r,
                    state: convert::rank_state_to_pb(&s.health, s.stopped) as i32,
                    reason: s.health.reason().to_string(),
                    last_engine_seq: s.last_engine_seq,
                    lag_ms: s.lag_ms,
                    load: s.load.as_ref().map(convert::load_to_pb),
                    hash_check: s.hash_check.as_ref().map(|h| pb::HashCheckStatus {
                        checked_blocks: h.checked,
                        mismatched_blocks: h.mismatched,
                        skipped_blocks: h.skipped_total(),
                        mismatch_rate: h.mismatch_rate(),
                    }),
                    liveness: s.liveness.as_ref().map(convert::liveness_to_pb),
                };
                (r, rs)
            })
            .collect();
        // Ranks the store has committed that the ingest has not reported (yet): their state from
        // the history's control records.
        for (r, rc) in self.store.rank_states() {
            ranks.entry(r).or_insert_with(|| pb::RankStatus {
                dp_rank: r,
                state: convert::rank_state_to_pb(&rc.health, false) as i32,
                reason: rc.health.reason().to_string(),
                last_engine_seq: rc.last_seq.unwrap_or(0),
                lag_ms: 0,
                load: None,
                hash_check: None,
                liveness: None,
            });
        }
        let mut counters: std::collections::HashMap<String, u64> = st.counters.into_iter().collect();
        let live = self.store.live_stats();
        counters.insert("live_blocks".into(), live.blocks);
        counters.insert("live_copies".into(), live.copies);
        counters.insert("removed_not_live".into(), live.removed_not_live);
        counters.insert("stored_already_live".into(), live.stored_already_live);
        Ok(Response::new(pb::StatusResponse {
            epoch: self.store.epoch(),
            incarnation: self.store.incarnation(),
            engine: st.engine,
            ranks: ranks.into_values().collect(),
            oldest_cursor: hs.oldest.unwrap_or(0),
            newest_cursor: hs.newest,
            history_records: hs.batches,
            history_bytes: hs.bytes,
            subscribers: st.subscribers,
            counters,
            relay_version: env!("CARGO_PKG_VERSION").to_string(),
            engine_url: st.engine_url.clone().unwrap_or_default(),
        }))
    }

    async fn history(&self, request: Request<pb::HistoryRequest>) -> Result<Response<Self::HistoryStream>, Status> {
        let r = request.into_inner();
        if r.epoch != 0 && r.epoch != self.store.epoch() {
            return Err(Status::failed_precondition(format!(
                "epoch {} is not the relay's ({})",
                r.epoch,
                self.store.epoch()
            )));
        }
        let to = if r.to_cursor == 0 { self.store.newest_cursor() } else { r.to_cursor };
        if r.to_cursor != 0 && r.from_cursor > r.to_cursor {
            return Err(Status::invalid_argument("from_cursor is after to_cursor"));
        }
        let limit = match r.limit {
            0 => 1000,
            n => u64::from(n).min(100_000),
        };
        let (tx, rx) = mpsc::channel(self.cfg.stream_buffer.max(1));
        tokio::spawn(stream::send_history(
            self.store.clone(),
            r.from_cursor.max(1),
            to,
            limit,
            ranks_filter(&r.ranks),
            self.cfg.history_page.max(1),
            tx,
        ));
        Ok(Response::new(self.stream_of(rx)))
    }

    async fn snapshot(&self, request: Request<pb::SnapshotRequest>) -> Result<Response<Self::SnapshotStream>, Status> {
        self.check_rate(&request, "snapshot")?;
        let slot = self
            .snapshot_slots
            .clone()
            .try_acquire_owned()
            .map_err(|_| resource_exhausted("too many snapshots in progress", Duration::from_secs(1)))?;
        let r = request.into_inner();
        let filter = SnapshotFilter {
            ranks: ranks_filter(&r.ranks),
            tiers: (!r.tiers.is_empty()).then(|| r.tiers.iter().map(|t| Tier::parse(t)).collect()),
            include_token_ids: r.include_token_ids,
        };
        let (tx, rx) = mpsc::channel(self.cfg.stream_buffer.max(1));
        let (store, chunk) = (self.store.clone(), self.cfg.snapshot_chunk_blocks);
        tokio::spawn(async move {
            let _slot = slot;
            let wrap = |p| {
                use pb::snapshot_response::Message as M;
                pb::SnapshotResponse {
                    message: Some(match p {
                        stream::SnapPart::Begin(b) => M::Begin(b),
                        stream::SnapPart::Chunk(c) => M::Chunk(c),
                        stream::SnapPart::End(e) => M::End(e),
                    }),
                }
            };
            let _ = stream::send_snapshot(&store, filter, chunk, pb::SnapshotReason::Unspecified, &tx, wrap).await;
        });
        Ok(Response::new(self.stream_of(rx)))
    }
}

/// Serves the relay's gRPC API on `listener` until `shutdown` completes, then ends every open
/// stream with `UNAVAILABLE "relay shutting down"`, marks the health `NOT_SERVING`, and waits up
/// to [`ServerConfig::shutdown_grace`] for connections to close.
///
/// `notices` is the live channel the ingest sends heartbeats into ([`notice_channel`]); `status`
/// is the handle the ingest keeps current.
pub async fn serve(
    cfg: ServerConfig,
    store: Store,
    status: RelayStatusHandle,
    notices: broadcast::Sender<Notice>,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let cfg = Arc::new(cfg);
    let stop = ShutdownTrigger::new();
    let service = RelayService {
        store,
        status,
        notices,
        cfg: cfg.clone(),
        limiter: Arc::new(ClientLimiter::new(cfg.rate_per_second, cfg.rate_burst)),
        subscriber_slots: Arc::new(Semaphore::new(cfg.max_subscribers)),
        snapshot_slots: Arc::new(Semaphore::new(cfg.max_snapshots.max(1))),
        shutdown: stop.subscribe(),
    };
    let relay = RelayServer::new(service)
        .max_decoding_message_size(cfg.max_request_bytes)
        .max_encoding_message_size(cfg.max_response_bytes);
    let token = TokenCheck::new(cfg.bearer_token.as_deref());
    let relay = InterceptedService::new(relay, move |req| token.check(req));

    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<RelayServer<RelayService>>().await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()?;
    let reflection_alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()?;

    let mut builder = Server::builder()
        .max_concurrent_streams(Some(cfg.max_streams_per_connection))
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(20)));
    if let Some(tls) = &cfg.tls {
        let mut t = ServerTlsConfig::new().identity(Identity::from_pem(&tls.cert_pem, &tls.key_pem));
        if let Some(ca) = &tls.client_ca_pem {
            t = t.client_ca_root(Certificate::from_pem(ca));
        }
        builder = builder.tls_config(t).map_err(ServeError::Tls)?;
    }
    let local = listener.local_addr().ok();
    tracing::info!(listen = ?local, tls = cfg.tls.is_some(), token = cfg.bearer_token.is_some(), "grpc serving");

    let service_stop = stop.subscribe();
    let signal = {
        let health = health.clone();
        async move {
            shutdown.await;
            tracing::info!("grpc shutting down: ending streams");
            health.set_not_serving::<RelayServer<RelayService>>().await;
            stop.trigger();
        }
    };
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    let server = builder
        .add_service(health_service)
        .add_service(reflection)
        .add_service(reflection_alpha)
        .add_service(relay)
        .serve_with_incoming_shutdown(incoming, signal);
    tokio::pin!(server);
    let mut stopping = service_stop;
    let grace = cfg.shutdown_grace;
    tokio::select! {
        r = &mut server => r.map_err(ServeError::Transport),
        _ = async move {
            stopping.recv().await;
            tokio::time::sleep(grace).await;
        } => {
            tracing::warn!(?grace, "grpc connections still open after the grace period: closing them");
            Ok(())
        }
    }
}
