//! The engine's Prometheus `/metrics` endpoint with its load gauges, on a tiny hand-written
//! HTTP/1.1 server (one thread, one request per connection, `Connection: close`).
//!
//! vLLM (V1 engine) exposes per-engine gauges labelled `engine` (the DP index) and
//! `model_name`; SGLang labels its scheduler gauges with `model_name` and the scheduler's
//! ranks. The load values are set by the traffic sources or by tests.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::wire::Engine;

/// The load one DP rank reports.
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize)]
pub struct Load {
    pub running: u32,
    pub waiting: u32,
    /// Fraction of KV-cache in use, 0..=1.
    pub kv_usage: f64,
}

/// A gauge: name, help text, and how to read it from a rank's load.
type Gauge = (&'static str, &'static str, fn(&Load) -> f64);

/// Render the exposition text for every rank.
pub fn render(engine: Engine, model_name: &str, loads: &[Load]) -> String {
    let mut out = String::new();
    let gauges: [Gauge; 3] = match engine {
        Engine::Vllm => [
            ("vllm:num_requests_running", "Number of requests in model execution batches.", |l| f64::from(l.running)),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", |l| f64::from(l.waiting)),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", |l| l.kv_usage),
        ],
        Engine::Sglang => [
            ("sglang:num_running_reqs", "The number of running requests.", |l| f64::from(l.running)),
            ("sglang:num_queue_reqs", "The number of requests in the waiting queue.", |l| f64::from(l.waiting)),
            ("sglang:token_usage", "The token usage.", |l| l.kv_usage),
        ],
    };
    for (name, help, get) in gauges {
        out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} gauge\n"));
        for (rank, load) in loads.iter().enumerate() {
            let labels = match engine {
                Engine::Vllm => format!("engine=\"{rank}\",model_name=\"{model_name}\""),
                Engine::Sglang => format!(
                    "model_name=\"{model_name}\",engine_type=\"unified\",tp_rank=\"0\",pp_rank=\"0\",dp_rank=\"{rank}\""
                ),
            };
            out.push_str(&format!("{name}{{{labels}}} {:?}\n", get(load)));
        }
    }
    out
}

/// A running `/metrics` server; stops when dropped.
pub struct MetricsServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl MetricsServer {
    /// Bind `listen` (port 0: ephemeral, see [`MetricsServer::addr`]) and serve `/metrics`.
    pub fn start(
        listen: SocketAddr,
        engine: Engine,
        model_name: String,
        loads: Arc<Mutex<Vec<Load>>>,
    ) -> std::io::Result<MetricsServer> {
        let listener = TcpListener::bind(listen)?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let thread = std::thread::Builder::new().name("mock-engine-metrics".into()).spawn(move || {
            for conn in listener.incoming() {
                if stop2.load(Ordering::SeqCst) {
                    return;
                }
                if let Ok(stream) = conn {
                    let body = {
                        let loads = loads.lock().expect("loads lock");
                        render(engine, &model_name, &loads)
                    };
                    let _ = answer(stream, &body);
                }
            }
        })?;
        Ok(MetricsServer { addr, stop, thread: Some(thread) })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn answer(mut stream: TcpStream, body: &str) -> std::io::Result<()> {
    stream.set_read_timeout(Some(Duration::from_secs(2)))?;
    let mut req = Vec::new();
    let mut buf = [0u8; 1024];
    while !req.windows(4).any(|w| w == b"\r\n\r\n") && req.len() < 16 * 1024 {
        let n = stream.read(&mut buf)?;
        if n == 0 {
            break;
        }
        req.extend_from_slice(&buf[..n]);
    }
    let line = String::from_utf8_lossy(&req);
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = path.split('?').next().unwrap_or("");
    let (status, content_type, body) = if method == "GET" && path == "/metrics" {
        ("200 OK", "text/plain; version=0.0.4; charset=utf-8", body)
    } else if method == "GET" {
        ("404 Not Found", "text/plain", "not found\n")
    } else {
        ("405 Method Not Allowed", "text/plain", "method not allowed\n")
    };
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes())?;
    if method != "HEAD" {
        stream.write_all(body.as_bytes())?;
    }
    stream.flush()
}

/// A minimal HTTP GET for tests: returns (status code, body).
pub fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n")?;
    let mut resp = String::new();
    s.read_to_string(&mut resp)?;
    let status = resp.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = resp.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    Ok((status, body))
}
