//! The router's HTTP API over a [`Router`]: `POST /match`, `POST /route`, `POST /route/report`,
//! `GET /workers`, `GET /metrics`. Served with axum (already in the dependency tree through tonic), so HTTP/1.1
//! parsing, keep-alive and body limits come from a tested server rather than a hand-written one.
//! See `docs/router-client.md` for the API with examples.

use std::fmt::Write as _;
use std::future::Future;
use std::num::NonZeroUsize;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use kv_relay_proto::hash::RequestKeys;
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;

use kv_router_client::{Follower, MatchOptions, Matches, RelayInfo, WorkerState};

pub use crate::engine::{HashSettings, LoraSettings};
use crate::front::{Front, FrontConfig};
use crate::liveness::Outcome;
use crate::policy::Reason;
use crate::router::{RouteError, RoutedWorker, Router, RouterConfig, Tokens};

/// The largest `/match` request body (token ids of a long prompt fit easily).
pub const MAX_BODY_BYTES: usize = 16 << 20;

/// A `POST /match` request: block hashes, or token ids with the engine's hash settings.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MatchRequest {
    /// The request's engine block hashes, in order.
    #[serde(default)]
    pub block_hashes: Option<Vec<u64>>,
    /// The request's token ids (with `hash`).
    #[serde(default)]
    pub token_ids: Option<Vec<u64>>,
    /// How the engine hashes blocks (with `token_ids`).
    #[serde(default)]
    pub hash: Option<HashSettings>,
    /// The request's cache salt.
    #[serde(default)]
    pub cache_salt: Option<String>,
    /// The request's LoRA adapter (vLLM: name and path; SGLang: `name` is the radix extra key).
    #[serde(default)]
    pub lora: Option<LoraSettings>,
    /// List only the workers holding at least the request's first block (default: every ready
    /// worker). See [`MatchOptions::matched_only`].
    #[serde(default)]
    pub matched_only: bool,
    /// List at most this many workers (at least 1): the most matched blocks first, ties by
    /// relay URL then rank. See [`MatchOptions::limit`].
    #[serde(default)]
    pub limit: Option<u64>,
}

impl MatchRequest {
    /// The request's [`MatchOptions`], or why they are invalid.
    pub fn options(&self) -> Result<MatchOptions, String> {
        let limit = match self.limit.map(|k| NonZeroUsize::new(usize::try_from(k).unwrap_or(usize::MAX))) {
            Some(None) => return Err("\"limit\" must be at least 1 (leave it out to list every worker)".into()),
            limit => limit.flatten(),
        };
        Ok(MatchOptions { matched_only: self.matched_only, limit })
    }
}

/// A `POST /match` answer.
#[derive(Debug, Serialize)]
pub struct MatchResponse {
    /// The request's block hashes (computed when token ids were given).
    pub blocks: usize,
    /// The ready workers the request asked for: by default every one, by relay then rank.
    pub workers: Matches,
}

#[derive(Serialize)]
struct WorkerView {
    #[serde(flatten)]
    worker: RoutedWorker,
    epoch: u64,
    cursor: u64,
    relay_newest: u64,
}

#[derive(Serialize)]
struct WorkersResponse {
    relays: Vec<RelayInfo>,
    workers: Vec<WorkerView>,
}

fn json<T: Serialize>(status: StatusCode, value: &T) -> Response {
    match serde_json::to_vec(value) {
        Ok(body) => (status, [(header::CONTENT_TYPE, "application/json")], body).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

fn bad_request(msg: impl Into<String>) -> Response {
    #[derive(Serialize)]
    struct Error {
        error: String,
    }
    json(StatusCode::BAD_REQUEST, &Error { error: msg.into() })
}

/// Answers a match request (the body of `POST /match`).
pub fn answer_match(follower: &Follower, req: &MatchRequest) -> Result<MatchResponse, String> {
    let opts = req.options()?;
    let hashes = request_hashes(req)?;
    Ok(MatchResponse { blocks: hashes.len(), workers: follower.matches(&hashes, opts) })
}

/// A request's block hashes: given, or computed from its token ids as the engine does.
pub fn request_hashes(req: &MatchRequest) -> Result<Vec<u64>, String> {
    Ok(match (&req.block_hashes, &req.token_ids, &req.hash) {
        (Some(h), None, None) => h.clone(),
        (None, Some(tokens), Some(settings)) => {
            let engine = settings.resolve()?;
            let lora = req.lora.as_ref().map(LoraSettings::to_ref);
            let keys = RequestKeys {
                token_ids: tokens,
                cache_salt: req.cache_salt.as_deref(),
                lora: lora.as_ref(),
                ..RequestKeys::default()
            };
            kv_relay_proto::hash::block_event_hashes(&engine, &keys).map_err(|e| e.to_string())?
        }
        (None, Some(_), None) => return Err("token_ids need the engine's hash settings in \"hash\"".into()),
        _ => return Err("give either \"block_hashes\", or \"token_ids\" with \"hash\"".into()),
    })
}

async fn post_match(State(r): State<Arc<Router>>, body: Bytes) -> Response {
    let req: MatchRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return bad_request(format!("invalid request: {e}")),
    };
    match answer_match(r.follower(), &req) {
        Ok(r) => json(StatusCode::OK, &r),
        Err(e) => bad_request(e),
    }
}

#[derive(Serialize)]
struct RouteFailure<'a> {
    error: String,
    /// `no_worker` or `shed`.
    reason: &'a str,
}

async fn post_route(State(r): State<Arc<Router>>, body: Bytes) -> Response {
    let req: MatchRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return bad_request(format!("invalid request: {e}")),
    };
    if let Err(e) = req.options() {
        return bad_request(e);
    }
    let hashes = match request_hashes(&req) {
        Ok(h) => h,
        Err(e) => return bad_request(e),
    };
    match r.route(&hashes) {
        Ok(routed) => json(StatusCode::OK, &routed),
        Err(e @ RouteError::NoWorker { .. }) => {
            json(StatusCode::SERVICE_UNAVAILABLE, &RouteFailure { error: e.to_string(), reason: "no_worker" })
        }
        Err(e @ RouteError::Shed) => {
            json(StatusCode::SERVICE_UNAVAILABLE, &RouteFailure { error: e.to_string(), reason: "shed" })
        }
        Err(RouteError::Hash(e)) => bad_request(e),
    }
}

/// A `POST /route/report` request: how a routed request ended.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReportRequest {
    /// The `request_id` `/route` answered.
    pub request_id: u64,
    /// `done` (the engine answered, whatever its status), `failed` (after the engine's first
    /// byte), or `connect_failed` (refused, reset or timed out before it: the worker leaves
    /// routing).
    pub outcome: ReportOutcome,
    #[serde(default)]
    pub prompt_tokens: u64,
    #[serde(default)]
    pub completion_tokens: u64,
    /// The engine's `usage.prompt_tokens_details.cached_tokens`, when it sent it.
    #[serde(default)]
    pub cached_tokens: Option<u64>,
}

/// How a routed request ended, as `POST /route/report` spells it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReportOutcome {
    Done,
    Failed,
    ConnectFailed,
}

impl From<ReportOutcome> for Outcome {
    fn from(o: ReportOutcome) -> Self {
        match o {
            ReportOutcome::Done => Outcome::Done,
            ReportOutcome::Failed => Outcome::Failed { connect: false },
            ReportOutcome::ConnectFailed => Outcome::Failed { connect: true },
        }
    }
}

async fn post_report(State(r): State<Arc<Router>>, body: Bytes) -> Response {
    let req: ReportRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return bad_request(format!("invalid request: {e}")),
    };
    let tokens = Tokens {
        prompt_tokens: req.prompt_tokens,
        completion_tokens: req.completion_tokens,
        cached_tokens: req.cached_tokens,
    };
    match r.report(req.request_id, req.outcome.into(), tokens) {
        Ok(at) => json(StatusCode::OK, &at),
        Err(e) => {
            #[derive(Serialize)]
            struct Error {
                error: String,
            }
            json(StatusCode::NOT_FOUND, &Error { error: e.to_string() })
        }
    }
}

async fn get_workers(State(router): State<Arc<Router>>) -> Response {
    let f = router.follower();
    let relays = f.relays();
    let workers = router
        .workers()
        .into_iter()
        .map(|w| {
            let r = relays.iter().find(|r| r.url == w.worker.relay);
            WorkerView {
                epoch: r.map_or(0, |r| r.epoch),
                cursor: r.map_or(0, |r| r.cursor),
                relay_newest: r.map_or(0, |r| r.relay_newest),
                worker: w,
            }
        })
        .collect();
    json(StatusCode::OK, &WorkersResponse { relays, workers })
}

/// `GET /metrics`: the follower's, the routing's and the front's.
fn metrics_response(r: &Router, front: &Front) -> Response {
    let mut text = prometheus_text(r.follower());
    routing_text(r, &mut text);
    front_text(front, &mut text);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

/// The front's metrics in the Prometheus text format, appended to `out`.
pub fn front_text(f: &Front, out: &mut String) {
    use std::sync::atomic::Ordering::Relaxed;
    let c = f.counters();
    let _ = writeln!(out, "# HELP kv_router_front_tokenized_total Text prompts and chat requests tokenized, by where.");
    let _ = writeln!(out, "# TYPE kv_router_front_tokenized_total counter");
    let _ = writeln!(out, "kv_router_front_tokenized_total{{by=\"router\"}} {}", c.tokenized.load(Relaxed));
    let _ = writeln!(out, "kv_router_front_tokenized_total{{by=\"engine\"}} {}", c.tokenized_by_engine.load(Relaxed));
    write_counter(
        out,
        "kv_router_front_tokenize_errors_total",
        "Prompts that could not be tokenized (routed by load; the engine answers them).",
        c.tokenize_errors.load(Relaxed),
    );
}

/// The router's routing metrics in the Prometheus text format, appended to `out`.
pub fn routing_text(r: &Router, out: &mut String) {
    let c = r.counters();
    let _ = writeln!(out, "# HELP kv_router_routed_total Requests routed, by why the worker was chosen.");
    let _ = writeln!(out, "# TYPE kv_router_routed_total counter");
    for reason in Reason::ALL {
        let _ = writeln!(out, "kv_router_routed_total{{reason=\"{}\"}} {}", reason.as_str(), c.routed[reason as usize]);
    }
    let t = c.tracker;
    let counters: [(&str, &str, u64); 12] = [
        ("route_shed", "Requests refused (HTTP 503): every worker overloaded, shedding on.", c.shed),
        ("route_no_worker", "Requests with no routable worker (HTTP 503).", c.no_worker),
        ("worker_outs", "Times a worker left routing.", t.outs),
        ("worker_probes", "Probe requests sent to workers back on good contact.", t.probes),
        ("worker_returns", "Probes that succeeded: the worker is back in full routing.", t.returns),
        ("reports_done", "Routed requests reported done.", t.done),
        ("reports_connect_failed", "Routed requests that failed to connect.", t.connect_failures),
        ("reports_failed", "Routed requests that failed after the engine answered.", t.failures),
        ("requests_forgotten", "Routed requests never reported within the request timeout.", t.forgotten),
        ("prompt_tokens", "Prompt tokens of the reported requests.", c.prompt_tokens),
        ("completion_tokens", "Completion tokens of the reported requests.", c.completion_tokens),
        ("cached_tokens", "Cached prompt tokens the engines reported.", c.cached_tokens),
    ];
    for (name, help, v) in counters {
        write_counter(out, &format!("kv_router_{name}_total"), help, v);
    }
    let workers = r.workers();
    let _ = writeln!(out, "# HELP kv_router_workers_routing Workers by routing state.");
    let _ = writeln!(out, "# TYPE kv_router_workers_routing gauge");
    for state in ["routable", "probing", "out"] {
        let n = workers.iter().filter(|w| w.routing.routing == state).count();
        let _ = writeln!(out, "kv_router_workers_routing{{routing=\"{state}\"}} {n}");
    }
    let _ = writeln!(out, "# HELP kv_router_in_flight Routed requests not yet reported.");
    let _ = writeln!(out, "# TYPE kv_router_in_flight gauge\nkv_router_in_flight {}", r.in_flight());
}

fn label(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// The follower's metrics in the Prometheus text format.
pub fn prometheus_text(f: &Follower) -> String {
    let c = f.counters();
    let mut out = String::new();
    let counters: [(&str, &str, u64); 11] = [
        ("records_applied", "History records (batches and controls) applied.", c.records_applied),
        ("duplicates", "Records ignored because their cursor was already applied.", c.duplicates),
        ("gaps", "Records beyond the next cursor (each resumes the stream).", c.gaps),
        ("snapshots", "Snapshot resyncs swapped in.", c.snapshots),
        ("epoch_changes", "Snapshots that came with a new relay epoch.", c.epoch_changes),
        ("resyncs", "Resync requests from relays (this client fell behind their history).", c.resyncs),
        ("reconnects", "Subscribe attempts after the first, per relay.", c.reconnects),
        ("receive_timeouts", "Streams dropped because nothing arrived in time.", c.receive_timeouts),
        ("heartbeats", "Heartbeats received.", c.heartbeats),
        ("protocol_errors", "Stream messages out of protocol.", c.protocol_errors),
        ("skipped_events", "Events skipped (unspecified tier, unknown kind).", c.skipped_events),
    ];
    for (name, help, v) in counters {
        write_counter(&mut out, &format!("kv_router_{name}_total"), help, v);
    }
    let d = f.discovery_counters();
    let discovery: [(&str, &str, u64); 4] = [
        ("dns_errors", "Resolutions of the relays' DNS names that failed (relays were kept).", d.dns_errors),
        (
            "file_errors",
            "Reads of the relays file that failed or found an invalid line (relays were kept).",
            d.file_errors,
        ),
        ("relays_added", "Relays added by discovery (DNS names, the relays file, fixed URLs).", d.added),
        (
            "relays_removed",
            "Relays removed by discovery (gone from the file, or from DNS past the grace period).",
            d.removed,
        ),
    ];
    for (name, help, v) in discovery {
        write_counter(&mut out, &format!("kv_router_discovery_{name}_total"), help, v);
    }
    let workers = f.workers();
    let _ = writeln!(out, "# HELP kv_router_workers Workers by state.\n# TYPE kv_router_workers gauge");
    for s in WorkerState::ALL {
        let n = workers.iter().filter(|w| w.state == s).count();
        let _ = writeln!(out, "kv_router_workers{{state=\"{}\"}} {n}", s.as_str());
    }
    let slots = f.resync_slots();
    let gauges: [(&str, &str, usize); 3] = [
        ("resyncs_in_flight", "Relays being resynced now (Subscribe sent, not yet past a snapshot).", slots.in_flight),
        ("resyncs_waiting", "Relays waiting for a resync slot.", slots.waiting),
        ("resyncs_limit", "The bound on relays resynced at once (--max-concurrent-resyncs).", slots.limit),
    ];
    for (name, help, v) in gauges {
        let _ = writeln!(out, "# HELP kv_router_{name} {help}\n# TYPE kv_router_{name} gauge\nkv_router_{name} {v}");
    }
    let relays = f.relays();
    let _ = writeln!(out, "# HELP kv_router_relay_connected Whether a stream to the relay is open.");
    let _ = writeln!(out, "# TYPE kv_router_relay_connected gauge");
    for r in &relays {
        let _ = writeln!(out, "kv_router_relay_connected{{relay=\"{}\"}} {}", label(&r.url), u8::from(r.connected));
    }
    let _ = writeln!(out, "# HELP kv_router_relay_cursor The last relay cursor applied.");
    let _ = writeln!(out, "# TYPE kv_router_relay_cursor gauge");
    for r in &relays {
        let _ = writeln!(out, "kv_router_relay_cursor{{relay=\"{}\"}} {}", label(&r.url), r.cursor);
    }
    let _ = writeln!(out, "# HELP kv_router_relay_lag_records The relay's newest cursor minus the last applied.");
    let _ = writeln!(out, "# TYPE kv_router_relay_lag_records gauge");
    for r in &relays {
        let lag = r.relay_newest.saturating_sub(r.cursor);
        let _ = writeln!(out, "kv_router_relay_lag_records{{relay=\"{}\"}} {lag}", label(&r.url));
    }
    let stats = f.index().stats();
    let _ = writeln!(out, "# HELP kv_router_index_blocks Indexed (worker, tier, hash) blocks.");
    let _ = writeln!(out, "# TYPE kv_router_index_blocks gauge\nkv_router_index_blocks {}", stats.blocks);
    let _ = writeln!(out, "# HELP kv_router_index_bytes Memory the prefix index holds.");
    let _ = writeln!(out, "# TYPE kv_router_index_bytes gauge\nkv_router_index_bytes {}", f.index().memory_bytes());
    let _ = writeln!(out, "# HELP kv_router_index_dead_slots Dead table slots, reused after a grace period.");
    let _ = writeln!(out, "# TYPE kv_router_index_dead_slots gauge\nkv_router_index_dead_slots {}", stats.tombstones);
    let index_counters: [(&str, &str, u64); 3] = [
        (
            "missing_removes",
            "Removed blocks the index did not hold (no-ops: the index and the events disagree).",
            stats.missing_removes,
        ),
        ("rebuilds", "Shard tables rebuilt.", stats.rebuilds),
        ("sweeps", "Full shard tables that freed their dead slots in place instead of a rebuild.", stats.sweeps),
    ];
    for (name, help, v) in index_counters {
        write_counter(&mut out, &format!("kv_router_index_{name}_total"), help, v);
    }
    out
}

/// One counter in the Prometheus text format.
fn write_counter(out: &mut String, name: &str, help: &str, v: u64) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
}

/// What the API serves: a [`Router`], or a [`Follower`] routed with the default settings.
pub trait IntoRouter {
    fn into_router(self) -> Arc<Router>;
}

impl IntoRouter for Arc<Router> {
    fn into_router(self) -> Arc<Router> {
        self
    }
}

impl IntoRouter for Follower {
    fn into_router(self) -> Arc<Router> {
        Arc::new(Router::new(self, RouterConfig::default()))
    }
}

/// The HTTP routes over a router, with the OpenAI-compatible front in its default settings.
pub fn routes(router: impl IntoRouter) -> axum::Router {
    app(router.into_router(), FrontConfig::default())
}

/// The HTTP routes over a router, with the front in `front`'s settings.
pub fn app(router: Arc<Router>, front: FrontConfig) -> axum::Router {
    let f = Arc::new(Front::new(router.clone(), front));
    let metrics = {
        let (r, f) = (router.clone(), f.clone());
        get(move || {
            let (r, f) = (r.clone(), f.clone());
            async move { metrics_response(&r, &f) }
        })
    };
    api(router).route("/metrics", metrics).merge(crate::front::routes(f)).layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
}

fn api(router: Arc<Router>) -> axum::Router {
    axum::Router::new()
        .route("/match", post(post_match))
        .route("/route", post(post_route))
        .route("/route/report", post(post_report))
        .route("/workers", get(get_workers))
        .with_state(router)
}

/// Serves the API on `listener` until `shutdown` completes.
pub async fn serve(
    listener: TcpListener,
    router: impl IntoRouter,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, routes(router)).with_graceful_shutdown(shutdown).await
}

/// [`serve`] with the front in `front`'s settings.
pub async fn serve_with(
    listener: TcpListener,
    router: Arc<Router>,
    front: FrontConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, app(router, front)).with_graceful_shutdown(shutdown).await
}
