//! The mock engine's HTTP face: what vLLM's OpenAI server answers on its one port, in the small.
//!
//! - `GET /metrics`: the load gauges and the progress counters (`vllm:prompt_tokens_total`,
//!   `vllm:generation_tokens_total`, or SGLang's), per rank (see [`crate::metrics::render`]).
//! - `GET /health`: 200 with an empty body, as vLLM answers.
//! - `GET /v1/models`: the model.
//! - `POST /v1/completions`, `POST /v1/chat/completions`: served on the rank the
//!   `X-data-parallel-rank` header names (0 without it) by the engine's [`Completer`]: the
//!   prompt's full blocks go through the rank's prefix cache (publishing its KV events), and the
//!   answer carries `usage` with the exact `cached_tokens`; `"stream": true` answers SSE chunks
//!   and a last chunk with the usage, then `data: [DONE]`.
//!
//! Faults on demand ([`Fault`]): wedged (health answers, completions hang, nothing progresses),
//! unhealthy (health answers 503), frozen (nothing answers: what a stopped process looks like
//! from outside, the kernel still accepting connections), listener gone (connections refused;
//! the port is bound again when the fault is cleared).
//!
//! One thread accepts, one thread per connection answers (`Connection: close`).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::metrics::{render, Load};
use crate::wire::Engine;

/// A fault of the face.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fault {
    #[default]
    None,
    /// `/health` answers; completions hang until the fault is cleared; the counters stand.
    Wedged,
    /// `/health` answers 503.
    Unhealthy,
    /// Nothing is answered until the fault is cleared (connections are accepted and wait).
    Frozen,
    /// The listener is closed: connections are refused.
    ListenerGone,
}

/// What a completion did on the rank: the prompt's tokens and how many of them were cached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Served {
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
}

/// Serves one completion on a rank: `(rank, prompt token ids) -> what was served`.
pub type Completer = Arc<dyn Fn(u32, &[u64]) -> Result<Served, String> + Send + Sync>;

/// The tokens each completion generates.
pub const COMPLETION_TOKENS: u64 = 4;

/// Each rank's progress counters.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Counters {
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    /// Completions being served now.
    pub in_flight: u32,
    /// Completions waiting for a place in the batch ([`CostModel::max_batch`]).
    pub waiting: u32,
    /// The prompt tokens of the completions being served now.
    pub running_tokens: u64,
}

/// How long a completion takes on a rank, for a simulated fleet: at most `max_batch` requests
/// run at once and the others queue for a place; one request at a time is prefilled (the rank's
/// compute), `prefill_per_token` for each prompt token not already cached; then each output
/// token (`max_tokens`) takes `decode_per_token`, alongside the other running requests. A
/// stream's first chunk is sent when the prefill ends.
///
/// With `kv_tokens` (the rank's KV capacity in tokens) above 0, `/metrics` reports the KV usage
/// as vLLM counts it: the running completions' prompt tokens over the capacity. A cached block
/// that no running request holds is free (evictable) in vLLM's block pool, so a full prefix
/// cache alone is not usage. With 0, the usage is the cache's fill (the generator's).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostModel {
    pub max_batch: u32,
    pub prefill_per_token: Duration,
    pub decode_per_token: Duration,
    pub kv_tokens: u64,
}

/// Each rank's places in the batch and its prefill lane.
struct Ranks {
    running: Mutex<Vec<u32>>,
    freed: Condvar,
    prefill: Vec<Mutex<()>>,
}

/// A place in a rank's batch, given back when dropped.
struct Place<'a> {
    ranks: &'a Ranks,
    rank: usize,
}

impl Ranks {
    fn new(n: usize) -> Ranks {
        Ranks {
            running: Mutex::new(vec![0; n]),
            freed: Condvar::new(),
            prefill: (0..n).map(|_| Mutex::new(())).collect(),
        }
    }

    fn place(&self, rank: usize, max: u32) -> Place<'_> {
        let mut r = self.running.lock().expect("places");
        while r[rank] >= max.max(1) {
            r = self.freed.wait(r).expect("places");
        }
        r[rank] += 1;
        Place { ranks: self, rank }
    }
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        self.ranks.running.lock().expect("places")[self.rank] -= 1;
        self.ranks.freed.notify_all();
    }
}

struct Shared {
    engine: Engine,
    model_name: String,
    loads: Arc<Mutex<Vec<Load>>>,
    counters: Mutex<Vec<Counters>>,
    completer: RwLock<Option<Completer>>,
    cost: RwLock<Option<CostModel>>,
    ranks: Ranks,
    fault: Mutex<Fault>,
    /// Woken when the fault changes.
    changed: Condvar,
    stop: AtomicBool,
}

impl Shared {
    /// Waits while `hold(fault)` holds (or until the face stops).
    fn wait_while(&self, hold: impl Fn(Fault) -> bool) {
        let mut f = self.fault.lock().expect("fault");
        while hold(*f) && !self.stop.load(Ordering::SeqCst) {
            f = self.changed.wait_timeout(f, Duration::from_millis(100)).expect("fault").0;
        }
    }

    fn fault(&self) -> Fault {
        *self.fault.lock().expect("fault")
    }
}

/// A running face; stops when dropped.
pub struct Face {
    addr: SocketAddr,
    shared: Arc<Shared>,
    acceptor: Mutex<Option<JoinHandle<()>>>,
}

impl Face {
    /// Binds `listen` (port 0: ephemeral, see [`Face::addr`]) and serves.
    pub fn start(
        listen: SocketAddr,
        engine: Engine,
        model_name: String,
        loads: Arc<Mutex<Vec<Load>>>,
    ) -> std::io::Result<Face> {
        let listener = TcpListener::bind(listen)?;
        let addr = listener.local_addr()?;
        let ranks = loads.lock().expect("loads").len();
        let shared = Arc::new(Shared {
            engine,
            model_name,
            loads,
            counters: Mutex::new(vec![Counters::default(); ranks]),
            completer: RwLock::new(None),
            cost: RwLock::new(None),
            ranks: Ranks::new(ranks),
            fault: Mutex::new(Fault::None),
            changed: Condvar::new(),
            stop: AtomicBool::new(false),
        });
        let face = Face { addr, shared, acceptor: Mutex::new(None) };
        face.accept_on(listener)?;
        Ok(face)
    }

    fn accept_on(&self, listener: TcpListener) -> std::io::Result<()> {
        let shared = self.shared.clone();
        let t = std::thread::Builder::new().name("mock-engine-http".into()).spawn(move || {
            for conn in listener.incoming() {
                if shared.stop.load(Ordering::SeqCst) || shared.fault() == Fault::ListenerGone {
                    return;
                }
                if let Ok(stream) = conn {
                    let shared = shared.clone();
                    let _ = std::thread::Builder::new().name("mock-engine-conn".into()).spawn(move || {
                        let _ = answer(&shared, stream);
                    });
                }
            }
        })?;
        *self.acceptor.lock().expect("acceptor") = Some(t);
        Ok(())
    }

    /// The engine's base URL's address (`http://{addr}`).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Sets how completions are served.
    pub fn set_completer(&self, c: Completer) {
        *self.shared.completer.write().expect("completer") = Some(c);
    }

    /// Sets how long completions take (`None`: at once, [`COMPLETION_TOKENS`] each).
    pub fn set_cost(&self, c: Option<CostModel>) {
        *self.shared.cost.write().expect("cost") = c;
    }

    /// Each rank's counters.
    pub fn counters(&self) -> Vec<Counters> {
        self.shared.counters.lock().expect("counters").clone()
    }

    pub fn fault(&self) -> Fault {
        self.shared.fault()
    }

    /// Sets a fault ([`Fault::None`] clears it). Leaving [`Fault::ListenerGone`] binds the port
    /// again (retrying while the kernel holds it).
    pub fn set_fault(&self, f: Fault) -> std::io::Result<()> {
        let was = std::mem::replace(&mut *self.shared.fault.lock().expect("fault"), f);
        self.shared.changed.notify_all();
        if f == Fault::ListenerGone && was != Fault::ListenerGone {
            self.wake_and_join();
        }
        if was == Fault::ListenerGone && f != Fault::ListenerGone {
            let mut tries = 0;
            let listener = loop {
                match TcpListener::bind(self.addr) {
                    Ok(l) => break l,
                    Err(e) if tries < 50 => {
                        tries += 1;
                        let _ = e;
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    Err(e) => return Err(e),
                }
            };
            self.accept_on(listener)?;
        }
        Ok(())
    }

    fn wake_and_join(&self) {
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
        if let Some(t) = self.acceptor.lock().expect("acceptor").take() {
            let _ = t.join();
        }
    }
}

impl Drop for Face {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.changed.notify_all();
        self.wake_and_join();
    }
}

/// A request read off a connection: method, path, headers (lower-cased names) and body.
struct Req {
    method: String,
    path: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

fn read_request(stream: &mut TcpStream) -> std::io::Result<Option<Req>> {
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
        if buf.len() > 64 * 1024 {
            return Ok(None);
        }
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            return Ok(None);
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let mut first = lines.next().unwrap_or("").split_whitespace();
    let method = first.next().unwrap_or("").to_string();
    let path = first.next().unwrap_or("").split('?').next().unwrap_or("").to_string();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let len = headers.iter().find(|(k, _)| k == "content-length").and_then(|(_, v)| v.parse().ok()).unwrap_or(0usize);
    let mut body = buf[head_end + 4..].to_vec();
    while body.len() < len {
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            break;
        }
        body.extend_from_slice(&chunk[..n]);
    }
    body.truncate(len);
    Ok(Some(Req { method, path, headers, body }))
}

fn respond(stream: &mut TcpStream, status: &str, content_type: &str, body: &[u8]) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes())?;
    stream.write_all(body)?;
    stream.flush()
}

fn error_json(message: &str, code: u16) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({"error": {"message": message, "type": "BadRequestError", "code": code}}))
        .unwrap_or_default()
}

fn answer(shared: &Shared, mut stream: TcpStream) -> std::io::Result<()> {
    let Some(req) = read_request(&mut stream)? else { return Ok(()) };
    shared.wait_while(|f| f == Fault::Frozen);
    match (req.method.as_str(), req.path.as_str()) {
        ("GET", "/metrics") => {
            let body = {
                let loads = shared.loads.lock().expect("loads").clone();
                let counters = shared.counters.lock().expect("counters").clone();
                let kv_tokens = shared.cost.read().expect("cost").map_or(0, |c| c.kv_tokens);
                let loads: Vec<Load> = loads
                    .iter()
                    .zip(&counters)
                    .map(|(l, c)| Load {
                        running: l.running + c.in_flight,
                        waiting: l.waiting + c.waiting,
                        kv_usage: if kv_tokens > 0 {
                            (c.running_tokens as f64 / kv_tokens as f64).min(1.0)
                        } else {
                            l.kv_usage
                        },
                    })
                    .collect();
                let mut text = render(shared.engine, &shared.model_name, &loads);
                text.push_str(&render_counters(shared.engine, &shared.model_name, &counters));
                text
            };
            respond(&mut stream, "200 OK", "text/plain; version=0.0.4; charset=utf-8", body.as_bytes())
        }
        ("GET", "/health") => match shared.fault() {
            Fault::Unhealthy => respond(&mut stream, "503 Service Unavailable", "text/plain", b"unhealthy\n"),
            _ => respond(&mut stream, "200 OK", "text/plain", b""),
        },
        ("GET", "/v1/models") => {
            let body = serde_json::json!({"object": "list", "data": [{"id": shared.model_name, "object": "model", "owned_by": "mock-engine"}]});
            respond(&mut stream, "200 OK", "application/json", body.to_string().as_bytes())
        }
        ("POST", "/v1/completions") | ("POST", "/v1/chat/completions") => complete(shared, &mut stream, &req),
        ("POST", "/tokenize") => {
            // vLLM's: a prompt's or chat request's tokens, as the mock reads them.
            let tokens = serde_json::from_slice::<serde_json::Value>(&req.body).ok().and_then(|v| prompt_tokens(&v));
            match tokens {
                Some(t) => {
                    let body = serde_json::json!({"count": t.len(), "max_model_len": 1 << 20, "tokens": t});
                    respond(&mut stream, "200 OK", "application/json", body.to_string().as_bytes())
                }
                None => respond(
                    &mut stream,
                    "400 Bad Request",
                    "application/json",
                    &error_json("no prompt or messages", 400),
                ),
            }
        }
        ("GET", _) => respond(&mut stream, "404 Not Found", "text/plain", b"not found\n"),
        _ => respond(&mut stream, "405 Method Not Allowed", "text/plain", b"method not allowed\n"),
    }
}

/// The prompt's token ids: `prompt` as ids, else the bytes of the prompt text or of the chat
/// messages' contents (the mock's tokenizer: one token per byte).
pub fn prompt_tokens(v: &serde_json::Value) -> Option<Vec<u64>> {
    if let Some(p) = v.get("prompt") {
        return match p {
            serde_json::Value::String(s) => Some(s.bytes().map(u64::from).collect()),
            serde_json::Value::Array(a) => a.iter().map(|x| x.as_u64()).collect(),
            _ => None,
        };
    }
    let msgs = v.get("messages")?.as_array()?;
    let mut out = Vec::new();
    for m in msgs {
        out.extend(m.get("content")?.as_str()?.bytes().map(u64::from));
    }
    Some(out)
}

fn complete(shared: &Shared, stream: &mut TcpStream, req: &Req) -> std::io::Result<()> {
    let rank: u32 =
        req.headers.iter().find(|(k, _)| k == "x-data-parallel-rank").and_then(|(_, v)| v.parse().ok()).unwrap_or(0);
    let ranks = shared.counters.lock().expect("counters").len() as u32;
    if rank >= ranks {
        return respond(stream, "400 Bad Request", "application/json", &error_json(&format!("no DP rank {rank}"), 400));
    }
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(&req.body) else {
        return respond(stream, "400 Bad Request", "application/json", &error_json("the body is not JSON", 400));
    };
    let Some(tokens) = prompt_tokens(&v) else {
        return respond(stream, "400 Bad Request", "application/json", &error_json("no prompt or messages", 400));
    };
    let completer = shared.completer.read().expect("completer").clone();
    let Some(completer) = completer else {
        return respond(stream, "503 Service Unavailable", "application/json", &error_json("no completions here", 503));
    };
    let cost = *shared.cost.read().expect("cost");
    let r = rank as usize;
    let place = cost.map(|c| {
        shared.counters.lock().expect("counters")[r].waiting += 1;
        let p = shared.ranks.place(r, c.max_batch);
        shared.counters.lock().expect("counters")[r].waiting -= 1;
        p
    });
    let held = tokens.len() as u64;
    {
        let mut c = shared.counters.lock().expect("counters");
        c[r].in_flight += 1;
        c[r].running_tokens += held;
    }
    shared.wait_while(|f| f == Fault::Wedged);
    let lane = place.as_ref().map(|_| shared.ranks.prefill[r].lock().expect("prefill lane"));
    let served = completer(rank, &tokens);
    let output_tokens = match (cost, &served) {
        (Some(c), Ok(s)) => {
            let uncached = u32::try_from(s.prompt_tokens.saturating_sub(s.cached_tokens)).unwrap_or(u32::MAX);
            std::thread::sleep(c.prefill_per_token * uncached);
            v.get("max_tokens").and_then(serde_json::Value::as_u64).unwrap_or(COMPLETION_TOKENS).clamp(1, 4096)
        }
        _ => COMPLETION_TOKENS,
    };
    drop(lane);
    let decode = cost.map_or(Duration::ZERO, |c| c.decode_per_token);
    let result = answer_completion(shared, stream, (req, r), &v, served, output_tokens, decode);
    {
        let mut c = shared.counters.lock().expect("counters");
        c[r].in_flight -= 1;
        c[r].running_tokens -= held;
    }
    drop(place);
    result
}

/// Writes a completion's answer: `output_tokens` tokens, each after `decode` (streamed: a chunk
/// each, after a first chunk sent at once).
fn answer_completion(
    shared: &Shared,
    stream: &mut TcpStream,
    (req, rank): (&Req, usize),
    v: &serde_json::Value,
    served: Result<Served, String>,
    output_tokens: u64,
    decode: Duration,
) -> std::io::Result<()> {
    if let Ok(s) = &served {
        shared.counters.lock().expect("counters")[rank].prompt_tokens += s.prompt_tokens;
    }
    let s = match served {
        Ok(s) => s,
        Err(e) => return respond(stream, "500 Internal Server Error", "application/json", &error_json(&e, 500)),
    };
    let generated = |n: u64| shared.counters.lock().expect("counters")[rank].generation_tokens += n;
    let chat = req.path.ends_with("/chat/completions");
    let usage = serde_json::json!({
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": output_tokens,
        "total_tokens": s.prompt_tokens + output_tokens,
        "prompt_tokens_details": {"cached_tokens": s.cached_tokens},
    });
    let (object, choice) = if chat {
        (
            "chat.completion",
            serde_json::json!({"index": 0, "message": {"role": "assistant", "content": "ok ok"}, "finish_reason": "length"}),
        )
    } else {
        ("text_completion", serde_json::json!({"index": 0, "text": "ok ok", "finish_reason": "length"}))
    };
    let model = &shared.model_name;
    if v.get("stream").and_then(|s| s.as_bool()) == Some(true) {
        let head = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\nConnection: close\r\n\r\n";
        stream.write_all(head.as_bytes())?;
        for i in 0..output_tokens {
            if i > 0 {
                std::thread::sleep(decode);
            }
            generated(1);
            let delta = if chat {
                serde_json::json!({"index": 0, "delta": {"content": format!("t{i}")}, "finish_reason": null})
            } else {
                serde_json::json!({"index": 0, "text": format!("t{i}"), "finish_reason": null})
            };
            let chunk = serde_json::json!({"id": "cmpl-mock", "object": object, "model": model, "choices": [delta]});
            write!(stream, "data: {chunk}\n\n")?;
            stream.flush()?;
        }
        let last =
            serde_json::json!({"id": "cmpl-mock", "object": object, "model": model, "choices": [], "usage": usage});
        write!(stream, "data: {last}\n\ndata: [DONE]\n\n")?;
        return stream.flush();
    }
    std::thread::sleep(decode * u32::try_from(output_tokens).unwrap_or(u32::MAX));
    generated(output_tokens);
    let body =
        serde_json::json!({"id": "cmpl-mock", "object": object, "model": model, "choices": [choice], "usage": usage});
    respond(stream, "200 OK", "application/json", body.to_string().as_bytes())
}

/// The progress counters in the engine's names.
pub fn render_counters(engine: Engine, model_name: &str, counters: &[Counters]) -> String {
    let (prompt, generation) = match engine {
        Engine::Vllm => ("vllm:prompt_tokens_total", "vllm:generation_tokens_total"),
        Engine::Sglang => ("sglang:prompt_tokens_total", "sglang:generation_tokens_total"),
    };
    let mut out = String::new();
    for (name, get) in
        [(prompt, (|c: &Counters| c.prompt_tokens) as fn(&Counters) -> u64), (generation, |c| c.generation_tokens)]
    {
        out.push_str(&format!("# TYPE {name} counter\n"));
        for (rank, c) in counters.iter().enumerate() {
            let labels = match engine {
                Engine::Vllm => format!("engine=\"{rank}\",model_name=\"{model_name}\""),
                Engine::Sglang => format!("model_name=\"{model_name}\",dp_rank=\"{rank}\""),
            };
            out.push_str(&format!("{name}{{{labels}}} {:?}\n", get(c) as f64));
        }
    }
    out
}
