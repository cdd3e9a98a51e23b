//! The example router `kv-router`'s command line, here rather than in the binary so that the
//! packaging's generator (`xtask`) renders its man page and shell completions from the same
//! definition.

use clap::Parser;
use std::net::SocketAddr;

use kv_router_client::DnsName;

use crate::policy::PolicyKind;
use std::path::PathBuf;

/// Follows kv-relays and answers "which worker holds this request's prefix" over HTTP.
#[derive(Parser, Debug)]
#[command(name = "kv-router", version)]
pub struct Args {
    /// A relay to follow (`http://host:port`); repeatable.
    #[arg(long = "relay", value_name = "URL")]
    pub relays: Vec<String>,
    /// A file with one relay URL per line (blank lines and `#` comments ignored); re-read every
    /// `--dns-interval-ms`, relays added and removed as it changes.
    #[arg(long, value_name = "FILE")]
    pub relays_file: Option<PathBuf>,
    /// A DNS name whose A and AAAA records are relays listening on PORT (a Kubernetes headless
    /// Service), resolved every `--dns-interval-ms`; repeatable.
    #[arg(long = "relays-dns", value_name = "NAME:PORT")]
    pub relays_dns: Vec<DnsName>,
    /// How often (milliseconds) the names are resolved and the relays file re-read.
    #[arg(long, default_value_t = 5000, value_parser = clap::value_parser!(u64).range(1..))]
    pub dns_interval_ms: u64,
    /// An address missing from its name's records for this long (milliseconds) is dropped; a
    /// record that comes back sooner keeps its relay and index. Failed resolutions never drop.
    #[arg(long, default_value_t = 30000)]
    pub dns_grace_ms: u64,
    /// At most this many relays are resynced (snapshots pulled) at once; the others wait, their
    /// workers `syncing` and left out of /match.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    pub max_concurrent_resyncs: u64,
    /// Each relay's first connection waits a random delay up to this long (milliseconds).
    #[arg(long, default_value_t = 500)]
    pub start_jitter_ms: u64,
    /// Where the HTTP API listens.
    #[arg(long, default_value = "127.0.0.1:8090")]
    pub listen: SocketAddr,
    /// Threads serving the HTTP API, apart from the relays' streams (so that a `/match` never
    /// waits behind them). One answers thousands of `/match` a second; more serve concurrent
    /// callers with large answers.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=256))]
    pub http_threads: u64,
    /// The relays' streams run this much nicer than the HTTP API (Linux thread niceness), so
    /// that a `/match` on a busy host takes a core before the streams' work; 0 runs them alike.
    /// Lag stays bounded by the relays' history: a stream that falls behind resumes.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u8).range(0..=19))]
    pub stream_niceness: u8,
    /// A worker whose relay's stream says nothing of it for this long (seconds) is `stale` and
    /// leaves routing: its host is cut off or its relay is gone (the relay heartbeats every
    /// second while a rank is quiet).
    #[arg(long, default_value_t = 2.0, value_parser = positive_secs)]
    pub worker_stall_secs: f64,
    /// The routing policy: `cache_aware`, `round_robin`, `least_load` or `random`.
    #[arg(long, default_value_t = PolicyKind::CacheAware)]
    pub policy: PolicyKind,
    /// `cache_aware`: a block held only in a host (or lower) tier counts as this share of a
    /// device block (0..=1).
    #[arg(long, default_value_t = 0.5, value_parser = unit)]
    pub host_discount: f64,
    /// `cache_aware`: the prefill of one block the worker does not hold, in microseconds.
    #[arg(long, default_value_t = 400.0, value_parser = non_negative)]
    pub prefill_us_per_block: f64,
    /// `cache_aware`: what each request queued ahead on a worker adds to its wait, in
    /// microseconds.
    #[arg(long, default_value_t = 20_000.0, value_parser = non_negative)]
    pub queue_us_per_request: f64,
    /// `cache_aware`: the share of cache misses sent to warming workers (back with an almost
    /// empty cache), 0..=1.
    #[arg(long, default_value_t = 0.25, value_parser = unit)]
    pub warm_share: f64,
    /// Overload protection: a worker at this KV-cache usage or above is steered away from.
    #[arg(long, default_value_t = 0.8, value_parser = unit)]
    pub overload_kv_usage: f64,
    /// Overload protection: a worker with this many waiting requests or more is steered away
    /// from.
    #[arg(long, default_value_t = 8.0, value_parser = non_negative)]
    pub overload_waiting: f64,
    /// Turns overload protection off (`cache_aware` then weighs load only through the wait).
    #[arg(long)]
    pub no_overload_protection: bool,
    /// When every worker is overloaded, refuse requests (`/route` answers 503) instead of
    /// sending them to the least loaded one.
    #[arg(long)]
    pub shed: bool,
    /// After a refused connection, a worker whose relay reports it alive is probed again after
    /// this many milliseconds.
    #[arg(long, default_value_t = 1000)]
    pub retry_after_ms: u64,
    /// The front (`/v1/completions`, `/v1/chat/completions`): how the engines hash blocks, as
    /// `/match`'s `hash` object, e.g. `{"engine": "vllm", "version": "0.32", "block_size": 16}`.
    /// Token-id prompts are then routed by their cached prefix; without it, by load alone.
    #[arg(long, value_name = "JSON")]
    pub engine_hash: Option<String>,
    /// The front: the model's directory (its `tokenizer.json`, and `tokenizer_config.json` with
    /// the chat template, or `chat_template.jinja`). Text prompts and chat messages are then
    /// tokenized as the engine tokenizes them and routed by their cached prefix (with
    /// `--engine-hash`). Nothing is downloaded.
    #[arg(long, value_name = "DIR", conflicts_with = "tokenize_via_engine")]
    pub model_dir: Option<PathBuf>,
    /// The front, with no `--model-dir`: ask an engine's `POST /tokenize` for a text prompt's or
    /// chat request's tokens before routing it (one more round trip to an engine per request).
    #[arg(long)]
    pub tokenize_via_engine: bool,
    /// The front: connecting to an engine gives up after this long (milliseconds), and counts
    /// as a refused connection (the request goes to the next choice).
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(1..))]
    pub engine_connect_timeout_ms: u64,
    /// No stream message for this long (milliseconds): reconnect and resume.
    #[arg(long, default_value_t = 5000)]
    pub receive_timeout_ms: u64,
    /// Bearer token for the relays (also read from `KV_ROUTER_RELAY_TOKEN`).
    #[arg(long, env = "KV_ROUTER_RELAY_TOKEN", hide_env_values = true)]
    pub relay_token: Option<String>,
    /// CA certificate (PEM) for `https://` relays.
    #[arg(long, value_name = "FILE")]
    pub relay_ca: Option<PathBuf>,
}

fn number(s: &str) -> Result<f64, String> {
    let v: f64 = s.trim().parse().map_err(|e| format!("{e}"))?;
    if !v.is_finite() {
        return Err("must be a finite number".into());
    }
    Ok(v)
}

fn positive_secs(s: &str) -> Result<f64, String> {
    let v = number(s)?;
    if v <= 0.0 {
        return Err("must be above 0".into());
    }
    Ok(v)
}

fn non_negative(s: &str) -> Result<f64, String> {
    let v = number(s)?;
    if v < 0.0 {
        return Err("must be at least 0".into());
    }
    Ok(v)
}

fn unit(s: &str) -> Result<f64, String> {
    let v = number(s)?;
    if !(0.0..=1.0).contains(&v) {
        return Err("must be within 0..=1".into());
    }
    Ok(v)
}
