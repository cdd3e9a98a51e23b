//! The example router `kv-router`'s command line, here rather than in the binary so that the
//! packaging's generator (`xtask`) renders its man page and shell completions from the same
//! definition.

use clap::Parser;
use std::net::SocketAddr;

use kv_router_client::DnsName;
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
    /// A worker silent for longer than this (milliseconds) is reported stale.
    #[arg(long, default_value_t = 2000)]
    pub stale_after_ms: u64,
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
