//! The engine's load, scraped from its Prometheus `/metrics`: running and waiting requests and
//! KV-cache usage, per DP rank where the engine labels them (`engine="r"` in vLLM, `dp_rank="r"`
//! in SGLang), else one value for every rank.

use crate::model::Load;
use std::collections::BTreeMap;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Which gauge a metric feeds.
#[derive(Clone, Copy)]
enum Gauge {
    Running,
    Waiting,
    KvUsage,
}

const NAMES: &[(&str, Gauge)] = &[
    ("vllm:num_requests_running", Gauge::Running),
    ("vllm:num_requests_waiting", Gauge::Waiting),
    ("vllm:kv_cache_usage_perc", Gauge::KvUsage),
    ("vllm:gpu_cache_usage_perc", Gauge::KvUsage),
    ("sglang:num_running_reqs", Gauge::Running),
    ("sglang:num_queue_reqs", Gauge::Waiting),
    ("sglang:token_usage", Gauge::KvUsage),
];

/// Loads parsed from one exposition: per rank where labelled (`Some(rank)`), else `None`.
pub type Loads = BTreeMap<Option<u32>, Load>;

/// Parses Prometheus text. Values of the same gauge and rank from several series (e.g. one per
/// model) are summed for request counts and maxed for usage.
pub fn parse(text: &str, scraped_at_ms: u64) -> Loads {
    let mut out = Loads::new();
    for (series, rank, value) in samples(text) {
        let Some(&(_, gauge)) = NAMES.iter().find(|(n, _)| *n == series) else { continue };
        let l = out.entry(rank).or_insert(Load { scraped_at_ms, ..Load::default() });
        match gauge {
            Gauge::Running => l.running += value,
            Gauge::Waiting => l.waiting += value,
            Gauge::KvUsage => l.kv_usage = l.kv_usage.max(value),
        }
    }
    out
}

/// The counters that move while an engine makes progress: tokens prefilled and generated.
const PROGRESS: &[&str] = &[
    "vllm:generation_tokens_total",
    "vllm:prompt_tokens_total",
    "sglang:generation_tokens_total",
    "sglang:prompt_tokens_total",
];

/// The engine's progress counters summed per rank where labelled (`Some(rank)`), else `None`;
/// empty when the engine exposes none of them.
pub fn progress(text: &str) -> BTreeMap<Option<u32>, f64> {
    let mut out = BTreeMap::new();
    for (series, rank, value) in samples(text) {
        if PROGRESS.contains(&series) {
            *out.entry(rank).or_insert(0.0) += value;
        }
    }
    out
}

/// Each sample of an exposition: its metric name, its rank label (`engine` in vLLM, `dp_rank` in
/// SGLang) and its value. Comments, blank and malformed lines are skipped.
fn samples(text: &str) -> impl Iterator<Item = (&str, Option<u32>, f64)> {
    text.lines().filter_map(|line| {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            return None;
        }
        let (series, rest) = line.split_at(line.find(['{', ' '])?);
        let (labels, value) = match rest.strip_prefix('{') {
            Some(r) => r.split_once('}')?,
            None => ("", rest),
        };
        let value = value.split_whitespace().next()?.parse::<f64>().ok()?;
        let rank = label(labels, "engine").or_else(|| label(labels, "dp_rank")).and_then(|v| v.parse().ok());
        Some((series, rank, value))
    })
}

fn label<'a>(labels: &'a str, name: &str) -> Option<&'a str> {
    labels.split(',').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k.trim() == name).then(|| v.trim().trim_matches('"'))
    })
}

/// The load for one rank: its own labelled series, else the unlabelled one.
pub fn for_rank(loads: &Loads, rank: u32) -> Option<Load> {
    loads.get(&Some(rank)).or_else(|| loads.get(&None)).copied()
}

/// Why a scrape failed.
#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    #[error("only http:// metrics urls are supported: {0}")]
    Url(String),
    #[error("connecting to {0}: {1}")]
    Connect(String, std::io::Error),
    #[error("reading {0}: {1}")]
    Io(String, std::io::Error),
    #[error("{0} answered {1}")]
    Status(String, String),
    #[error("{0} did not answer within {1:?}")]
    Timeout(String, Duration),
}

/// `host:port` and path of an `http://` url.
pub fn split_url(url: &str) -> Result<(String, String), ScrapeError> {
    let rest = url.strip_prefix("http://").ok_or_else(|| ScrapeError::Url(url.into()))?;
    let (host, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/metrics"),
    };
    if host.is_empty() {
        return Err(ScrapeError::Url(url.into()));
    }
    let host = if host.contains(':') && !host.ends_with(']') { host.to_string() } else { format!("{host}:80") };
    Ok((host, path.to_string()))
}

/// Maximum exposition size read (an engine's is a few hundred KiB at most).
const MAX_BODY: usize = 8 << 20;

/// One HTTP/1.1 GET of the metrics page (a plain client: the engines serve plain text).
pub async fn scrape(url: &str, timeout: Duration) -> Result<String, ScrapeError> {
    let (host, path) = split_url(url)?;
    let fut = async {
        let mut s = tokio::net::TcpStream::connect(&host).await.map_err(|e| ScrapeError::Connect(url.into(), e))?;
        let req = format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nAccept: text/plain\r\nConnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await.map_err(|e| ScrapeError::Io(url.into(), e))?;
        let mut buf = Vec::new();
        (&mut s).take(MAX_BODY as u64).read_to_end(&mut buf).await.map_err(|e| ScrapeError::Io(url.into(), e))?;
        let text = String::from_utf8_lossy(&buf).into_owned();
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
        let status = head.lines().next().unwrap_or("");
        if status.split_whitespace().nth(1).is_none_or(|c| c != "200") {
            return Err(ScrapeError::Status(url.into(), status.to_string()));
        }
        let chunked = head.lines().any(|l| {
            l.to_ascii_lowercase().starts_with("transfer-encoding:") && l.to_ascii_lowercase().contains("chunked")
        });
        Ok(if chunked { dechunk(body) } else { body.to_string() })
    };
    tokio::time::timeout(timeout, fut).await.map_err(|_| ScrapeError::Timeout(url.into(), timeout))?
}

fn dechunk(body: &str) -> String {
    let mut out = String::new();
    let mut rest = body;
    while let Some((size, tail)) = rest.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else { break };
        if n == 0 || tail.len() < n {
            break;
        }
        out.push_str(&tail[..n]);
        rest = tail[n..].trim_start_matches("\r\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_and_sglang_gauges_parse_per_rank() {
        let text = "# HELP vllm:num_requests_running x\n\
            vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0\n\
            vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 5.0\n\
            vllm:num_requests_waiting{engine=\"1\",model_name=\"m\"} 2.0\n\
            vllm:kv_cache_usage_perc{engine=\"1\",model_name=\"m\"} 0.25\n\
            sglang:num_running_reqs{dp_rank=\"2\"} 7\n\
            sglang:token_usage 0.5\n\
            other_metric 9\n";
        let l = parse(text, 42);
        assert_eq!(l[&Some(0)], Load { running: 3.0, waiting: 0.0, kv_usage: 0.0, scraped_at_ms: 42 });
        assert_eq!(l[&Some(1)], Load { running: 5.0, waiting: 2.0, kv_usage: 0.25, scraped_at_ms: 42 });
        assert_eq!(l[&Some(2)].running, 7.0);
        assert_eq!(l[&None].kv_usage, 0.5);
        assert_eq!(for_rank(&l, 9).unwrap().kv_usage, 0.5);
        assert_eq!(for_rank(&l, 1).unwrap().running, 5.0);
    }

    #[test]
    fn progress_counters_sum_per_rank() {
        let text = "vllm:generation_tokens_total{engine=\"0\",model_name=\"m\"} 10.0\n\
            vllm:prompt_tokens_total{engine=\"0\",model_name=\"m\"} 32.0\n\
            vllm:generation_tokens_total{engine=\"1\",model_name=\"m\"} 4.0\n\
            vllm:generation_tokens_created{engine=\"1\",model_name=\"m\"} 1.7e9\n\
            sglang:generation_tokens_total 5\n\
            vllm:num_requests_running{engine=\"0\"} 3\n";
        let p = progress(text);
        assert_eq!(p, BTreeMap::from([(Some(0), 42.0), (Some(1), 4.0), (None, 5.0)]));
        assert_eq!(progress("vllm:num_requests_running 1\n"), BTreeMap::new());
    }

    #[test]
    fn urls_split_and_chunked_bodies_join() {
        assert_eq!(split_url("http://127.0.0.1:8000/metrics").unwrap(), ("127.0.0.1:8000".into(), "/metrics".into()));
        assert_eq!(split_url("http://engine").unwrap(), ("engine:80".into(), "/metrics".into()));
        assert!(matches!(split_url("https://x/metrics"), Err(ScrapeError::Url(_))));
        assert_eq!(dechunk("5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"), "hello world");
    }
}
