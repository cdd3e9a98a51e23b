//! The follower: one background task per relay keeps a Subscribe stream current and feeds the
//! shared prefix index through [`RelayAdmission`]; lookups read the index and the workers' state.
//!
//! Each task has the shape of a resilient watch consumer: connect, ask the relay's Status (its
//! epoch and ranks), subscribe from the position held, apply every message, and on any end
//! (error, receive timeout, gap, resync) reconnect after a jittered exponential backoff and
//! resume. It returns as soon as its stop signal fires: when the relay is removed, or when the
//! last clone of the [`Follower`] is dropped (`tokio::select! { biased; _ = stop => return, .. }`).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};
use std::time::Duration;

use arc_swap::ArcSwap;
use kv_relay_proto::hash::{block_event_hashes, EngineHashConfig, RequestKeys};
use kv_relay_proto::pb;
use kv_relay_proto::pb::relay_client::RelayClient;
use rand::Rng as _;
use serde::Serialize;
use std::sync::atomic::{AtomicUsize, Ordering};
use tokio::sync::{broadcast, oneshot, Semaphore};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};
use tonic::Code;

use crate::admission::{ClientEvent, Position, RelayAdmission, RelayCounters, Verdict};
use crate::backoff::{Backoff, BackoffConfig};
use crate::discovery::{DiscoveryCounters, DiscoveryStats};
use crate::error::{ClientError, StreamError};
use crate::index::{IndexConfig, PrefixIndex};
use crate::matches::{Match, MatchOptions, Matches, RelayView};
use crate::worker::WorkerInfo;

/// The follower's settings.
#[derive(Clone, Debug)]
pub struct FollowConfig {
    /// A worker with no batch, heartbeat or control for longer than this is `stale` (the relay
    /// sends a heartbeat about every second while quiet).
    pub stale_after: Duration,
    /// No message at all (not even a heartbeat) for this long: the stream is dropped and
    /// resumed.
    pub receive_timeout: Duration,
    /// Connecting, and each unary call (Status), give up after this long.
    pub connect_timeout: Duration,
    /// Delays between reconnects.
    pub backoff: BackoffConfig,
    /// How often the relay's Status is asked while a stream is open (the engine's rank states,
    /// such as `STOPPED`, only travel there).
    pub status_interval: Duration,
    /// Let the relay answer with a snapshot when it cannot continue the cursor. Without it, such
    /// a relay is retried forever (and its state reported stale).
    pub allow_snapshot: bool,
    /// Sent as `authorization: Bearer <token>` when set.
    pub bearer_token: Option<String>,
    /// For `https://` relays: the CA (PEM) their certificates are signed by.
    pub tls_ca_pem: Option<Vec<u8>>,
    /// The largest stream message decoded (the relay sends up to 16 MiB).
    pub max_message_bytes: usize,
    /// The HTTP/2 receive windows (per stream and per connection) offered to relays: how many
    /// bytes a relay may send ahead of what this router has read. `None`: the transport's
    /// defaults (megabytes). A relay tells a router that fell behind its history to resync
    /// only once its buffers for that router are full, so small windows (say 64 KiB) let a
    /// stalled router be noticed within seconds rather than after megabytes of records.
    pub http2_window_bytes: Option<u32>,
    /// Events buffered per [`Follower::events`] receiver; a receiver that falls further behind
    /// loses the oldest (it gets `Lagged`), the follower never waits for it.
    pub events_capacity: usize,
    /// At most this many relays are resynced at once (from their Subscribe until their first
    /// message outside a snapshot); the others wait, their workers [`WorkerState::Syncing`](crate::worker::WorkerState::Syncing).
    /// Bounds the snapshots a starting router (or one back from a partition) pulls at once.
    /// 0 is taken as 1.
    pub max_concurrent_resyncs: usize,
    /// Ask relays for full records, with every block's token ids. Off (the default), they send
    /// lean ones: what the index reads (hashes, parents, tiers, groups, namespaces, the load),
    /// a fraction of the bytes to receive and decode.
    pub full_records: bool,
    /// A relay's first connection waits a random delay up to this long, so that a router
    /// started with many relays does not open every connection in the same instant.
    pub start_jitter: Duration,
    /// The prefix index's construction parameters.
    pub index: IndexConfig,
}

impl Default for FollowConfig {
    fn default() -> Self {
        FollowConfig {
            stale_after: Duration::from_secs(2),
            receive_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(5),
            backoff: BackoffConfig::default(),
            status_interval: Duration::from_secs(5),
            allow_snapshot: true,
            bearer_token: None,
            tls_ca_pem: None,
            max_message_bytes: 64 << 20,
            http2_window_bytes: None,
            events_capacity: 1024,
            max_concurrent_resyncs: 16,
            start_jitter: Duration::from_millis(500),
            full_records: false,
            index: IndexConfig::default(),
        }
    }
}

/// One relay as the follower knows it now.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RelayInfo {
    /// The URL, as added.
    #[serde(serialize_with = "crate::worker::ser_arc_str")]
    pub url: Arc<str>,
    /// A Subscribe stream is open.
    pub connected: bool,
    /// The relay epoch held.
    pub epoch: u64,
    /// The last cursor applied.
    pub cursor: u64,
    /// Its incarnation.
    pub incarnation: u32,
    /// The relay's newest cursor as last heard.
    pub relay_newest: u64,
    /// A snapshot is being received.
    pub staging: bool,
    /// Being resynced: waiting for a resync slot, or subscribed and not yet past a snapshot.
    pub syncing: bool,
    /// Why the last stream ended.
    pub last_error: Option<String>,
    /// The stream's counters.
    #[serde(skip)]
    pub counters: RelayCounters,
}

impl RelayInfo {
    /// The position to resume from.
    pub fn position(&self) -> Position {
        Position { epoch: self.epoch, cursor: self.cursor, incarnation: self.incarnation }
    }
}

/// A relay followed: its endpoint and admission state.
struct Relay {
    url: Arc<str>,
    endpoint: Endpoint,
    /// Taken briefly by the relay's task for each message, and by readers (`workers()`,
    /// `relays()`); never held across an `.await`.
    admission: Mutex<RelayAdmission>,
    /// What matches read of the workers: published after each change ([`Relay::update`]), read
    /// without the lock.
    view: ArcSwap<RelayView>,
}

impl Relay {
    fn new(url: Arc<str>, endpoint: Endpoint) -> Self {
        Relay {
            admission: Mutex::new(RelayAdmission::new(url.clone())),
            view: ArcSwap::from_pointee(RelayView::empty(url.clone())),
            url,
            endpoint,
        }
    }

    /// Changes the admission, then publishes its view (under the lock, so views follow the
    /// changes' order).
    fn update<R>(&self, change: impl FnOnce(&mut RelayAdmission) -> R) -> R {
        let mut a = lock(&self.admission);
        let r = change(&mut a);
        self.view.store(Arc::new(a.view()));
        r
    }
}

struct Shared {
    cfg: FollowConfig,
    index: PrefixIndex,
    relays: RwLock<BTreeMap<Arc<str>, Arc<Relay>>>,
    /// Counters of relays removed, so totals never go down.
    removed: Mutex<RelayCounters>,
    events: broadcast::Sender<ClientEvent>,
    /// Counted by [`crate::discovery::Discovery`] when it drives this follower.
    discovery: DiscoveryStats,
    /// The resync slots ([`FollowConfig::max_concurrent_resyncs`]).
    resyncs: Semaphore,
    /// Relays waiting for a resync slot.
    resyncs_waiting: AtomicUsize,
}

/// The resync slots now ([`Follower::resync_slots`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ResyncSlots {
    /// The bound ([`FollowConfig::max_concurrent_resyncs`]).
    pub limit: usize,
    /// Relays being resynced now.
    pub in_flight: usize,
    /// Relays waiting for a slot.
    pub waiting: usize,
}

struct Task {
    /// Dropping or firing it ends the relay's task.
    stop: oneshot::Sender<()>,
    join: JoinHandle<()>,
}

/// Owned by the follower's clones only (never by the tasks), so that dropping the last clone
/// drops every stop sender and the tasks return.
struct Tasks(Mutex<BTreeMap<Arc<str>, Task>>);

/// Follows any number of relays and answers prefix lookups over all their workers.
///
/// Cheap to clone (all clones share the index and the tasks); the tasks end when the last clone
/// is dropped, or at [`Follower::shutdown`]. Needs a tokio runtime for [`Follower::add_relay`].
#[derive(Clone)]
pub struct Follower {
    shared: Arc<Shared>,
    tasks: Arc<Tasks>,
}

impl std::fmt::Debug for Follower {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Follower").field("relays", &self.relays().len()).finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Follower {
    /// A follower of no relay yet.
    pub fn new(cfg: FollowConfig) -> Self {
        let (events, _) = broadcast::channel(cfg.events_capacity.max(1));
        let index = PrefixIndex::new(cfg.index);
        let slots = resync_limit(&cfg);
        Follower {
            shared: Arc::new(Shared {
                cfg,
                index,
                relays: RwLock::new(BTreeMap::new()),
                removed: Mutex::new(RelayCounters::default()),
                events,
                discovery: DiscoveryStats::default(),
                resyncs: Semaphore::new(slots),
                resyncs_waiting: AtomicUsize::new(0),
            }),
            tasks: Arc::new(Tasks(Mutex::new(BTreeMap::new()))),
        }
    }

    /// The settings.
    pub fn config(&self) -> &FollowConfig {
        &self.shared.cfg
    }

    /// The prefix index the follower keeps.
    pub fn index(&self) -> &PrefixIndex {
        &self.shared.index
    }

    /// How many relays are being resynced, and how many wait for a slot.
    pub fn resync_slots(&self) -> ResyncSlots {
        let limit = resync_limit(&self.shared.cfg);
        ResyncSlots {
            limit,
            in_flight: limit - self.shared.resyncs.available_permits(),
            waiting: self.shared.resyncs_waiting.load(Ordering::Relaxed),
        }
    }

    /// The counters of the [`crate::discovery::Discovery`] driving this follower (all 0 without
    /// one).
    pub fn discovery_counters(&self) -> DiscoveryCounters {
        self.shared.discovery.get()
    }

    /// Where a [`crate::discovery::Discovery`] driving this follower counts.
    pub fn discovery_stats(&self) -> &DiscoveryStats {
        &self.shared.discovery
    }

    /// Rank events, snapshots, gaps, connects and disconnects, as they happen. An event is sent
    /// before the change that made it shows in [`Follower::relays`] or [`Follower::counters`]:
    /// whoever reads those and then drains the receiver has every event of what it read.
    pub fn events(&self) -> broadcast::Receiver<ClientEvent> {
        self.shared.events.subscribe()
    }

    /// Starts following a relay (`http://host:port` or `https://...`).
    pub fn add_relay(&self, url: &str) -> Result<(), ClientError> {
        let url = url.trim();
        let endpoint = endpoint(url, &self.shared.cfg)?;
        let url: Arc<str> = Arc::from(url);
        let mut tasks = lock(&self.tasks.0);
        let relay = {
            let mut relays = self.shared.relays.write().unwrap_or_else(PoisonError::into_inner);
            if relays.contains_key(&url) {
                return Err(ClientError::AlreadyFollowing(url.to_string()));
            }
            let relay = Arc::new(Relay::new(url.clone(), endpoint));
            relays.insert(url.clone(), relay.clone());
            relay
        };
        let (stop, stopped) = oneshot::channel();
        let join = tokio::spawn(follow(relay, self.shared.clone(), stopped));
        tasks.insert(url, Task { stop, join });
        Ok(())
    }

    /// Stops following a relay and drops its workers from the index (atomically per worker).
    pub fn remove_relay(&self, url: &str) -> Result<(), ClientError> {
        let task = lock(&self.tasks.0).remove(url.trim());
        let relay = self.shared.relays.write().unwrap_or_else(PoisonError::into_inner).remove(url.trim());
        let Some(relay) = relay else {
            return Err(ClientError::NotFollowing(url.to_string()));
        };
        relay.update(|a| {
            a.remove(&self.shared.index);
            *lock(&self.shared.removed) += a.counters();
        });
        if let Some(t) = task {
            let _ = t.stop.send(());
        }
        Ok(())
    }

    /// Stops every task and waits for them to end.
    pub async fn shutdown(self) {
        let tasks: Vec<Task> = std::mem::take(&mut *lock(&self.tasks.0)).into_values().collect();
        for t in tasks {
            let _ = t.stop.send(());
            let _ = t.join.await;
        }
    }

    fn relay_list(&self) -> Vec<Arc<Relay>> {
        self.shared.relays.read().unwrap_or_else(PoisonError::into_inner).values().cloned().collect()
    }

    /// Every relay followed, by URL.
    pub fn relays(&self) -> Vec<RelayInfo> {
        self.relay_list()
            .iter()
            .map(|r| {
                let a = lock(&r.admission);
                let p = a.position();
                RelayInfo {
                    url: r.url.clone(),
                    connected: a.is_connected(),
                    epoch: p.epoch,
                    cursor: p.cursor,
                    incarnation: p.incarnation,
                    relay_newest: a.relay_newest(),
                    staging: a.is_staging(),
                    syncing: a.is_syncing(),
                    last_error: a.last_error().map(str::to_string),
                    counters: a.counters(),
                }
            })
            .collect()
    }

    /// Every worker known (from the streams and the relays' Status), by relay then rank, with its
    /// state now.
    pub fn workers(&self) -> Vec<WorkerInfo> {
        let now = Instant::now();
        let stale = self.shared.cfg.stale_after;
        self.relay_list().iter().flat_map(|r| lock(&r.admission).workers(now, stale)).collect()
    }

    /// The counters summed over every relay ever followed.
    pub fn counters(&self) -> RelayCounters {
        let mut total = *lock(&self.shared.removed);
        for r in self.relay_list() {
            total += lock(&r.admission).counters();
        }
        total
    }

    /// For a request's block hashes, every known worker that is ready (all but
    /// [`WorkerState::Syncing`](crate::worker::WorkerState::Syncing) ones), by relay then rank, with the leading blocks it holds (any
    /// tier, and per tier), its state and load. Workers holding none have `matched_blocks: 0`.
    /// [`Follower::matches`] is the same answer without a map of tier names per worker, and can
    /// list fewer workers.
    pub fn match_blocks(&self, hashes: &[u64]) -> Vec<Match> {
        self.matches(hashes, MatchOptions::default()).to_vec()
    }

    /// For a request's block hashes, the ready workers `opts` asks for (by default every one,
    /// by relay then rank; see [`MatchOptions`]) with the leading blocks each holds, as
    /// [`Follower::match_blocks`] gives them. Takes no relay's lock: each relay's task
    /// publishes its workers' state after each change, and this reads those; tier names are
    /// read once per call.
    pub fn matches(&self, hashes: &[u64], opts: MatchOptions) -> Matches {
        let result = self.shared.index.lookup(hashes);
        let relays = if opts.matched_only && result.is_empty() {
            Vec::new()
        } else {
            let relays = self.shared.relays.read().unwrap_or_else(PoisonError::into_inner);
            relays.values().map(|r| r.view.load_full()).collect()
        };
        let tiers = self.shared.index.tiers().names();
        Matches::new(relays, result, tiers, Instant::now(), self.shared.cfg.stale_after, opts)
    }

    /// [`Follower::match_blocks`] for a request given by its token ids (and salt, LoRA, ...):
    /// the hashes are computed as the engine computes them.
    pub fn match_tokens(
        &self,
        engine: &EngineHashConfig,
        request: &RequestKeys<'_>,
    ) -> Result<Vec<Match>, ClientError> {
        let hashes = block_event_hashes(engine, request)?;
        Ok(self.match_blocks(&hashes))
    }
}

/// The resync bound in effect: at least 1, at most what a semaphore holds.
fn resync_limit(cfg: &FollowConfig) -> usize {
    cfg.max_concurrent_resyncs.clamp(1, Semaphore::MAX_PERMITS)
}

/// Checks that `url` is one [`Follower::add_relay`] takes (`http://` or `https://`, a valid URI).
pub fn validate_url(url: &str) -> Result<(), ClientError> {
    endpoint(url, &FollowConfig::default()).map(drop)
}

fn endpoint(url: &str, cfg: &FollowConfig) -> Result<Endpoint, ClientError> {
    let bad = |reason: String| ClientError::InvalidUrl { url: url.to_string(), reason };
    if !(url.starts_with("http://") || url.starts_with("https://")) {
        return Err(bad("must start with http:// or https://".into()));
    }
    let mut ep = Endpoint::from_shared(url.to_string())
        .map_err(|e| bad(e.to_string()))?
        .connect_timeout(cfg.connect_timeout)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(cfg.receive_timeout)
        .initial_stream_window_size(cfg.http2_window_bytes)
        .initial_connection_window_size(cfg.http2_window_bytes);
    if url.starts_with("https://") {
        let mut tls = ClientTlsConfig::new();
        if let Some(ca) = &cfg.tls_ca_pem {
            tls = tls.ca_certificate(Certificate::from_pem(ca));
        }
        ep = ep.tls_config(tls).map_err(|e| bad(e.to_string()))?;
    }
    Ok(ep)
}

impl Shared {
    /// Sends the events a change of a relay's admission made. Called with that admission's lock
    /// held, so that whoever reads the relay's state ([`Follower::relays`], its counters) after
    /// the change finds the change's events already sent.
    fn emit(&self, events: &mut Vec<ClientEvent>) {
        for e in events.drain(..) {
            // No receiver is fine: events are for whoever listens.
            let _ = self.events.send(e);
        }
    }

    fn request<T>(&self, msg: T) -> tonic::Request<T> {
        let mut req = tonic::Request::new(msg);
        if let Some(token) = &self.cfg.bearer_token {
            if let Ok(v) = format!("Bearer {token}").parse() {
                req.metadata_mut().insert("authorization", v);
            }
        }
        req
    }
}

fn stream_error(status: tonic::Status) -> StreamError {
    if status.code() == Code::Unauthenticated {
        return StreamError::Unauthenticated(status.message().to_string());
    }
    StreamError::Status { code: format!("{:?}", status.code()), message: status.message().to_string() }
}

/// The relay's `retry-after-ms` hint on a `RESOURCE_EXHAUSTED`.
fn retry_after(status: &tonic::Status) -> Option<Duration> {
    let v = status.metadata().get("retry-after-ms")?.to_str().ok()?.parse().ok()?;
    Some(Duration::from_millis(v))
}

/// The relay's task: sessions, then backoff, until stopped.
async fn follow(relay: Arc<Relay>, shared: Arc<Shared>, mut stop: oneshot::Receiver<()>) {
    let mut backoff = Backoff::new(shared.cfg.backoff);
    let mut first = true;
    let jitter = shared.cfg.start_jitter;
    if !jitter.is_zero() {
        let delay = rand::rng().random_range(Duration::ZERO..=jitter);
        tokio::select! {
            biased;
            _ = &mut stop => return,
            _ = tokio::time::sleep(delay) => {}
        }
    }
    loop {
        if !first {
            lock(&relay.admission).count_reconnect();
        }
        first = false;
        let mut hint = None;
        let err = tokio::select! {
            biased;
            _ = &mut stop => return,
            e = session(&relay, &shared, &mut backoff, &mut hint) => e,
        };
        let mut events = Vec::new();
        let removed = relay.update(|a| {
            if a.is_removed() {
                return true;
            }
            if matches!(err, StreamError::ReceiveTimeout(_)) {
                a.count_receive_timeout();
            }
            a.set_syncing(false);
            a.on_disconnected(err.to_string(), &mut events);
            shared.emit(&mut events);
            false
        });
        if removed {
            return;
        }
        let delay = match &err {
            StreamError::Unauthenticated(_) => backoff.max_delay(),
            _ => backoff.next_delay().max(hint.unwrap_or_default()),
        };
        tracing::debug!(relay = %relay.url, error = %err, ?delay, "relay stream ended; resuming after backoff");
        tokio::select! {
            biased;
            _ = &mut stop => return,
            _ = tokio::time::sleep(delay) => {}
        }
    }
}

/// One connection: Status, Subscribe, then every message until the stream ends.
async fn session(relay: &Relay, shared: &Shared, backoff: &mut Backoff, hint: &mut Option<Duration>) -> StreamError {
    let cfg = &shared.cfg;
    let channel: Channel = match relay.endpoint.connect().await {
        Ok(c) => c,
        Err(e) => return StreamError::Connect(error_chain(&e)),
    };
    let mut client = RelayClient::new(channel).max_decoding_message_size(cfg.max_message_bytes);
    if let Err(e) = poll_status(&mut client, relay, shared).await {
        if let StreamError::Unauthenticated(_) = e {
            return e;
        }
        tracing::debug!(relay = %relay.url, error = %e, "relay status unavailable");
    }
    // A resync slot from the Subscribe until the stream's first message outside a snapshot.
    // Taken after connecting, so that relays that are down hold no slot.
    relay.update(|a| a.set_syncing(true));
    let mut slot = Some({
        let _waiting = Waiting::new(&shared.resyncs_waiting);
        match shared.resyncs.acquire().await {
            Ok(p) => p,
            Err(_) => return StreamError::Resume("follower closed".into()),
        }
    });
    let req = lock(&relay.admission).subscribe_request(cfg.allow_snapshot, !cfg.full_records);
    let mut stream = match tokio::time::timeout(cfg.connect_timeout, client.subscribe(shared.request(req))).await {
        Err(_) => return StreamError::Connect("subscribe timed out".into()),
        Ok(Err(status)) => {
            *hint = retry_after(&status);
            return stream_error(status);
        }
        Ok(Ok(r)) => r.into_inner(),
    };
    let mut events = Vec::new();
    relay.update(|a| {
        a.on_connected(&mut events);
        shared.emit(&mut events);
    });
    let mut deadline = Instant::now() + cfg.receive_timeout;
    let mut status_tick = tokio::time::interval_at(Instant::now() + cfg.status_interval, cfg.status_interval);
    status_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            m = stream.message() => {
                let msg = match m {
                    Ok(Some(msg)) => msg,
                    Ok(None) => return StreamError::Ended,
                    Err(status) => {
                        *hint = retry_after(&status);
                        return stream_error(status);
                    }
                };
                let now = Instant::now();
                deadline = now + cfg.receive_timeout;
                let verdict = relay.update(|a| {
                    let v = a.apply(msg, &shared.index, now, &mut events);
                    if slot.is_some() && !a.is_staging() {
                        a.set_syncing(false);
                        slot = None;
                    }
                    shared.emit(&mut events);
                    v
                });
                match verdict {
                    Verdict::Continue => backoff.reset(),
                    Verdict::Resume(why) => return StreamError::Resume(why),
                    Verdict::Stop => return StreamError::Resume("relay removed".into()),
                }
            }
            _ = tokio::time::sleep_until(deadline) => return StreamError::ReceiveTimeout(cfg.receive_timeout),
            _ = status_tick.tick() => {
                if let Err(e) = poll_status(&mut client, relay, shared).await {
                    tracing::debug!(relay = %relay.url, error = %e, "relay status unavailable");
                }
            }
        }
    }
}

/// Counts a relay waiting for a resync slot while it lives (the wait may be cancelled).
struct Waiting<'a>(&'a AtomicUsize);

impl<'a> Waiting<'a> {
    fn new(n: &'a AtomicUsize) -> Self {
        n.fetch_add(1, Ordering::Relaxed);
        Waiting(n)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

async fn poll_status(client: &mut RelayClient<Channel>, relay: &Relay, shared: &Shared) -> Result<(), StreamError> {
    let call = client.status(shared.request(pb::StatusRequest {}));
    match tokio::time::timeout(shared.cfg.connect_timeout, call).await {
        Err(_) => Err(StreamError::Connect("status timed out".into())),
        Ok(Err(status)) => Err(stream_error(status)),
        Ok(Ok(st)) => {
            relay.update(|a| a.apply_status(st.get_ref(), &shared.index));
            Ok(())
        }
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}
