//! The OpenAI-compatible front: `POST /v1/completions`, `POST /v1/chat/completions` and
//! `GET /v1/models`, passed through to the engine [`Router::route`] chooses; `POST /tokenize`,
//! the router's own tokenization of a prompt (with a model directory).
//!
//! The request body goes to the engine byte for byte (vLLM takes the DP rank in the
//! `X-data-parallel-rank` header), and the engine's status, headers and body (streamed, so SSE
//! passes through as the engine writes it) come back the same way. A worker that refuses the
//! connection, or fails before the engine's first byte, is reported (it leaves routing when the
//! connection failed) and the request is sent once more, to the next choice. Each request's end
//! goes to [`Router::report`]: `done` with the tokens of the engine's `usage` once its body has
//! been passed on whole, `failed` when the client went away first (dropping the body drops the
//! upstream request, which cancels it in the engine).

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, Method, Request, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use http_body::Frame;
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kv_relay_proto::hash::{block_event_hashes, EngineHashConfig, RequestKeys};
use serde::Serialize;

use crate::liveness::Outcome;
use crate::router::{RouteError, Routed, Router, Tokens};
use crate::tokenize::{Prompt, Tokenizer};

/// The header vLLM's OpenAI server takes a request's DP rank from.
pub const DP_RANK_HEADER: &str = "x-data-parallel-rank";
/// The answer's header naming the worker the router chose: its relay's URL and DP rank.
pub const WORKER_HEADER: &str = "x-kv-router-worker";
/// The answer's header with the request's leading blocks the router saw the worker hold: times
/// the block size, the engine's `cached_tokens` when the prediction holds.
pub const MATCHED_HEADER: &str = "x-kv-router-matched-blocks";

/// The most of an engine's answer kept to read its `usage` from: a non-streaming answer's
/// whole JSON up to this size, a stream's last bytes.
const USAGE_WINDOW: usize = 1 << 20;

/// The front's settings.
#[derive(Clone, Debug)]
pub struct FrontConfig {
    /// How the engines hash blocks: prompts are hashed with it and routed by their prefix.
    /// `None`: requests are routed by load alone.
    pub hash: Option<EngineHashConfig>,
    /// Connecting to an engine gives up after this long (and counts as a refused connection).
    pub connect_timeout: Duration,
    /// The model's tokenizer and chat template: text prompts and chat messages are tokenized
    /// with it. `None`: only token-id prompts are routed by their prefix (unless
    /// `tokenize_via_engine`).
    pub tokenizer: Option<Arc<Tokenizer>>,
    /// With no tokenizer, a text prompt's or chat request's tokens come from a routable
    /// engine's `POST /tokenize` (vLLM's), one more round trip before the request is routed.
    pub tokenize_via_engine: bool,
}

impl Default for FrontConfig {
    fn default() -> Self {
        FrontConfig { hash: None, connect_timeout: Duration::from_secs(2), tokenizer: None, tokenize_via_engine: false }
    }
}

/// What the front's tokenization did, for `/metrics`.
#[derive(Debug, Default)]
pub struct FrontCounters {
    /// Prompts tokenized in the router (text prompts and chat messages).
    pub tokenized: AtomicU64,
    /// Prompts tokenized by an engine's `/tokenize`.
    pub tokenized_by_engine: AtomicU64,
    /// Prompts that could not be tokenized (a template error, an engine's `/tokenize` failed):
    /// routed by load; the engine answers the request as it would.
    pub tokenize_errors: AtomicU64,
}

/// The front's state: the router and one pooled HTTP/1.1 client to the engines.
pub struct Front {
    router: Arc<Router>,
    client: Client<HttpConnector, Body>,
    cfg: FrontConfig,
    counters: FrontCounters,
    /// Spreads `/tokenize` calls over the routable engines.
    next_tokenizer: AtomicU64,
}

impl Front {
    pub fn new(router: Arc<Router>, cfg: FrontConfig) -> Front {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(cfg.connect_timeout));
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new()).build(connector);
        Front { router, client, cfg, counters: FrontCounters::default(), next_tokenizer: AtomicU64::new(0) }
    }

    pub fn counters(&self) -> &FrontCounters {
        &self.counters
    }

    /// The request's block hashes, when its tokens can be known (token ids; text or chat with
    /// the tokenizer or `tokenize_via_engine`) and the engine's hash settings are; empty
    /// otherwise (routed by load).
    pub async fn prompt_hashes(&self, path: &str, body: &[u8]) -> Vec<u64> {
        let Some(engine) = &self.cfg.hash else { return Vec::new() };
        let Some(tokens) = self.prompt_tokens(path, body).await else { return Vec::new() };
        block_event_hashes(engine, &RequestKeys { token_ids: &tokens, ..RequestKeys::default() }).unwrap_or_default()
    }

    /// The request's prompt tokens, as the engine will see them, when they can be known.
    pub async fn prompt_tokens(&self, path: &str, body: &[u8]) -> Option<Vec<u64>> {
        let prompt = Prompt::of(path, body).ok()?;
        if let Prompt::Ids(ids) = prompt {
            return Some(ids);
        }
        let c = &self.counters;
        if let Some(t) = &self.cfg.tokenizer {
            return match t.tokens(&prompt) {
                Ok(ids) => {
                    c.tokenized.fetch_add(1, Ordering::Relaxed);
                    Some(ids)
                }
                Err(e) => {
                    c.tokenize_errors.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(error = %e, "prompt not tokenized; routed by load");
                    None
                }
            };
        }
        if !self.cfg.tokenize_via_engine {
            return None;
        }
        match self.tokenize_via_engine(&prompt).await {
            Ok(ids) => {
                c.tokenized_by_engine.fetch_add(1, Ordering::Relaxed);
                Some(ids)
            }
            Err(e) => {
                c.tokenize_errors.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(error = %e, "engine /tokenize failed; routed by load");
                None
            }
        }
    }

    /// The engine URLs of the routable workers, in the router's order.
    fn routable_engine_urls(&self) -> Vec<Arc<str>> {
        self.router
            .workers()
            .into_iter()
            .filter(|w| w.routing.routing == "routable")
            .filter_map(|w| w.worker.engine_url)
            .collect()
    }

    /// `POST /tokenize` on a routable engine (vLLM's: `{"prompt"}` or `{"messages", ...}`,
    /// answered with `{"tokens": [...]}`).
    async fn tokenize_via_engine(&self, prompt: &Prompt) -> Result<Vec<u64>, String> {
        let engines = self.routable_engine_urls();
        if engines.is_empty() {
            return Err("no routable engine with a known URL".into());
        }
        let base = &engines[(self.next_tokenizer.fetch_add(1, Ordering::Relaxed) % engines.len() as u64) as usize];
        let body = match prompt {
            Prompt::Ids(ids) => return Ok(ids.clone()),
            Prompt::Text { text, add_special_tokens } => {
                serde_json::json!({"prompt": text, "add_special_tokens": add_special_tokens}).to_string()
            }
            // The request itself: vLLM's /tokenize takes a chat request's fields (and ignores
            // the others), and its maps keep their order.
            Prompt::Chat(req) => req.clone(),
        };
        let uri: Uri = format!("{}/tokenize", base.trim_end_matches('/'))
            .parse()
            .map_err(|e| format!("engine URL {base}: {e}"))?;
        let req = Request::builder()
            .method(Method::POST)
            .uri(uri)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(body))
            .map_err(|e| e.to_string())?;
        let resp = self.client.request(req).await.map_err(|e| format!("{base}/tokenize: {}", error_chain(&e)))?;
        let status = resp.status();
        let bytes = read_body(resp.into_body()).await.map_err(|e| format!("{base}/tokenize: {e}"))?;
        if !status.is_success() {
            return Err(format!("{base}/tokenize answered {status}: {}", String::from_utf8_lossy(&bytes)));
        }
        #[derive(serde::Deserialize)]
        struct Tokenized {
            tokens: Vec<u64>,
        }
        let t: Tokenized =
            serde_json::from_slice(&bytes).map_err(|e| format!("{base}/tokenize: not a tokenize answer: {e}"))?;
        Ok(t.tokens)
    }
}

/// An engine's whole answer body, up to [`USAGE_WINDOW`].
async fn read_body(mut body: Incoming) -> Result<Vec<u8>, String> {
    use http_body::Body as _;
    let mut out = Vec::new();
    while let Some(frame) = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
        let frame = frame.map_err(|e| e.to_string())?;
        if let Ok(data) = frame.into_data() {
            out.extend_from_slice(&data);
            if out.len() > USAGE_WINDOW {
                return Err(format!("answer over {USAGE_WINDOW} bytes"));
            }
        }
    }
    Ok(out)
}

#[derive(Serialize)]
struct ErrorBody {
    error: ErrorDetail,
}

#[derive(Serialize)]
struct ErrorDetail {
    message: String,
    r#type: &'static str,
    code: u16,
}

/// An error in the OpenAI shape.
fn error(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Response {
    let body = ErrorBody { error: ErrorDetail { message: message.into(), r#type: kind, code: status.as_u16() } };
    let bytes = serde_json::to_vec(&body).unwrap_or_default();
    (status, [(header::CONTENT_TYPE, "application/json")], bytes).into_response()
}

/// What a routed request's end is reported with: dropped before the body ended, it reports
/// `failed`; at the end, `done` with the tokens read from the body's `usage`.
struct Report {
    router: Arc<Router>,
    request_id: u64,
    /// The body's bytes kept for `usage`: all of a JSON answer up to the window, a stream's tail.
    kept: Vec<u8>,
    ended: bool,
}

impl Report {
    fn keep(&mut self, data: &[u8]) {
        self.kept.extend_from_slice(data);
        if self.kept.len() > 2 * USAGE_WINDOW {
            self.kept.drain(..self.kept.len() - USAGE_WINDOW);
        }
    }
}

impl Drop for Report {
    fn drop(&mut self) {
        let (outcome, tokens) = if self.ended {
            (Outcome::Done, usage(&self.kept))
        } else {
            (Outcome::Failed { connect: false }, Tokens::default())
        };
        let _ = self.router.report(self.request_id, outcome, tokens);
    }
}

/// The tokens of the last `usage` object in an engine's answer (a JSON body, or SSE chunks).
pub fn usage(body: &[u8]) -> Tokens {
    fn read(v: &serde_json::Value) -> Option<Tokens> {
        let u = v.get("usage")?;
        if u.is_null() {
            return None;
        }
        Some(Tokens {
            prompt_tokens: u.get("prompt_tokens").and_then(|v| v.as_u64()).unwrap_or(0),
            completion_tokens: u.get("completion_tokens").and_then(|v| v.as_u64()).unwrap_or(0),
            cached_tokens: u.get("prompt_tokens_details").and_then(|d| d.get("cached_tokens")).and_then(|v| v.as_u64()),
        })
    }
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(body) {
        return read(&v).unwrap_or_default();
    }
    let text = String::from_utf8_lossy(body);
    text.lines()
        .rev()
        .filter_map(|l| l.strip_prefix("data:"))
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d.trim()).ok())
        .find_map(|v| read(&v))
        .unwrap_or_default()
}

/// The engine's body on its way to the client, watched for its end.
struct Watched {
    inner: Incoming,
    report: Report,
}

impl http_body::Body for Watched {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.report.keep(data);
                }
                // The server may stop polling once the body says it has ended.
                if this.inner.is_end_stream() {
                    this.report.ended = true;
                }
            }
            Poll::Ready(None) => this.report.ended = true,
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// The upstream request to `routed`'s engine.
fn upstream(routed: &Routed, path: &str, headers: &HeaderMap, body: Bytes) -> Result<Request<Body>, String> {
    let base = routed.engine_url.as_deref().ok_or_else(|| {
        format!(
            "relay {} reports no engine URL for rank {} (set --engine-url on the relay)",
            routed.relay, routed.dp_rank
        )
    })?;
    let uri: Uri =
        format!("{}{path}", base.trim_end_matches('/')).parse().map_err(|e| format!("engine URL {base}: {e}"))?;
    let mut req = Request::builder().method(Method::POST).uri(uri);
    for (name, value) in headers {
        // Hop-by-hop and framing headers are the client's connection's, not the engine's.
        if [header::HOST, header::CONNECTION, header::CONTENT_LENGTH, header::TRANSFER_ENCODING].contains(name) {
            continue;
        }
        if name.as_str() == DP_RANK_HEADER {
            continue;
        }
        req = req.header(name, value);
    }
    req = req.header(DP_RANK_HEADER, HeaderValue::from(routed.dp_rank));
    req.body(Body::from(body)).map_err(|e| e.to_string())
}

async fn forward(front: Arc<Front>, path: &'static str, headers: HeaderMap, body: Bytes) -> Response {
    let hashes = front.prompt_hashes(path, &body).await;
    let mut last_error = String::new();
    for _attempt in 0..2 {
        let routed = match front.router.route(&hashes) {
            Ok(r) => r,
            Err(e @ (RouteError::NoWorker { .. } | RouteError::Shed)) => {
                return error(StatusCode::SERVICE_UNAVAILABLE, "service_unavailable", e.to_string())
            }
            Err(RouteError::Hash(e)) => return error(StatusCode::BAD_REQUEST, "invalid_request_error", e),
        };
        let req = match upstream(&routed, path, &headers, body.clone()) {
            Ok(r) => r,
            Err(e) => {
                let _ = front.router.report(routed.request_id, Outcome::Failed { connect: true }, Tokens::default());
                last_error = e;
                continue;
            }
        };
        match front.client.request(req).await {
            Ok(resp) => {
                let (mut parts, inner) = resp.into_parts();
                // What the router chose and predicted, for the client's own accounting.
                let h = &mut parts.headers;
                if let Ok(v) = HeaderValue::from_str(&format!("{} {}", routed.relay, routed.dp_rank)) {
                    h.insert(WORKER_HEADER, v);
                }
                h.insert(MATCHED_HEADER, HeaderValue::from(routed.matched_blocks));
                let report = Report {
                    router: front.router.clone(),
                    request_id: routed.request_id,
                    kept: Vec::new(),
                    ended: false,
                };
                return Response::from_parts(parts, Body::new(Watched { inner, report }));
            }
            Err(e) => {
                // No byte of the engine's answer arrived: the next choice gets the request.
                let connect = e.is_connect();
                let _ = front.router.report(routed.request_id, Outcome::Failed { connect }, Tokens::default());
                last_error = format!("{} rank {}: {}", routed.relay, routed.dp_rank, error_chain(&e));
            }
        }
    }
    error(StatusCode::BAD_GATEWAY, "bad_gateway", format!("no engine answered: {last_error}"))
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

async fn completions(State(f): State<Arc<Front>>, headers: HeaderMap, body: Bytes) -> Response {
    forward(f, "/v1/completions", headers, body).await
}

async fn chat_completions(State(f): State<Arc<Front>>, headers: HeaderMap, body: Bytes) -> Response {
    forward(f, "/v1/chat/completions", headers, body).await
}

/// `GET /v1/models`: the first routable engine's answer.
async fn models(State(f): State<Arc<Front>>) -> Response {
    let Some(base) = f.routable_engine_urls().into_iter().next() else {
        return error(StatusCode::SERVICE_UNAVAILABLE, "service_unavailable", "no routable engine with a known URL");
    };
    let uri: Uri = match format!("{}/v1/models", base.trim_end_matches('/')).parse() {
        Ok(u) => u,
        Err(e) => return error(StatusCode::BAD_GATEWAY, "bad_gateway", format!("engine URL {base}: {e}")),
    };
    let req = match Request::builder().method(Method::GET).uri(uri).body(Body::empty()) {
        Ok(r) => r,
        Err(e) => return error(StatusCode::BAD_GATEWAY, "bad_gateway", e.to_string()),
    };
    match f.client.request(req).await {
        Ok(resp) => resp.map(Body::new).into_response(),
        Err(e) => error(StatusCode::BAD_GATEWAY, "bad_gateway", error_chain(&e)),
    }
}

/// `POST /tokenize`: a prompt's or chat request's tokens as the router makes them (vLLM's
/// `/tokenize` shape: `{"prompt": ...}` or `{"messages": [...], ...}`, answered with
/// `{"count", "tokens"}`), to hold the router's tokenization to the engine's.
async fn tokenize(State(f): State<Arc<Front>>, body: Bytes) -> Response {
    let Some(t) = &f.cfg.tokenizer else {
        return error(StatusCode::NOT_FOUND, "not_found", "the router has no tokenizer (start it with --model-dir)");
    };
    let is_chat = serde_json::from_slice::<serde_json::Value>(&body).is_ok_and(|v| v.get("messages").is_some());
    let path = if is_chat { "/v1/chat/completions" } else { "/v1/completions" };
    match Prompt::of(path, &body).and_then(|p| t.tokens(&p)) {
        Ok(tokens) => {
            let answer = serde_json::json!({"count": tokens.len(), "tokens": tokens});
            (StatusCode::OK, [(header::CONTENT_TYPE, "application/json")], answer.to_string()).into_response()
        }
        Err(e) => error(StatusCode::BAD_REQUEST, "invalid_request_error", e.to_string()),
    }
}

/// The front's routes, to merge into the API's.
pub fn routes(front: Arc<Front>) -> axum::Router {
    use axum::routing::{get, post};
    axum::Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/tokenize", post(tokenize))
        .with_state(front)
}
