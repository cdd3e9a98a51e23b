//! The engine's Prometheus load gauges, as `/metrics` on its HTTP face ([`crate::face`]) shows
//! them.
//!
//! vLLM (V1 engine) exposes per-engine gauges labelled `engine` (the DP index) and
//! `model_name`; SGLang labels its scheduler gauges with `model_name` and the scheduler's
//! ranks. The load values are set by the traffic sources or by tests.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
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

/// A minimal HTTP POST of a JSON body for tests, with extra headers: returns (status code, body).
pub fn http_post(addr: SocketAddr, path: &str, headers: &[(&str, &str)], body: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    let extra: String = headers.iter().map(|(k, v)| format!("{k}: {v}\r\n")).collect();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{extra}Connection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut resp = String::new();
    s.read_to_string(&mut resp)?;
    let status = resp.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let (head, body) = resp.split_once("\r\n\r\n").unwrap_or((&resp, ""));
    let chunked = head.lines().any(|l| l.to_ascii_lowercase().replace(' ', "") == "transfer-encoding:chunked");
    Ok((status, if chunked { dechunk(body) } else { body.to_string() }))
}

/// A chunked body's data.
pub fn dechunk(mut rest: &str) -> String {
    let mut out = String::new();
    while let Some((size, tail)) = rest.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else { break };
        if n == 0 || tail.len() < n {
            break;
        }
        out.push_str(&tail[..n]);
        rest = tail[n..].strip_prefix("\r\n").unwrap_or(&tail[n..]);
    }
    out
}
