//! The daemon's settings: command-line flags, each with a `KV_RELAY_*` environment variable,
//! validated whole before any socket is bound or the store is opened.

use crate::hashcheck::HashCheckConfig;
use crate::ingest::{endpoint, IngestConfig};
use crate::server::{ServerConfig, TlsConfig};
use clap::{Parser, Subcommand};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// Raw flags, as given.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "kv-relay",
    version,
    about = "Relays an inference engine's KV-cache events to KV-aware routers, losslessly"
)]
pub struct Args {
    /// A TOML file of settings (keys as the flags, in snake_case; see `docs/configuration.md`).
    /// Flags and environment variables override it.
    #[arg(long, env = "KV_RELAY_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// The engine's PUB endpoint of DP rank 0 (rank r: port + r, or `_dp{r}` for inproc).
    #[arg(long, env = "KV_RELAY_ENDPOINT", default_value = "tcp://127.0.0.1:5557")]
    pub endpoint: String,
    /// The engine's replay (ROUTER) endpoint of DP rank 0. Without it, gaps cannot be refilled.
    #[arg(long, env = "KV_RELAY_REPLAY_ENDPOINT")]
    pub replay_endpoint: Option<String>,
    /// Number of DP ranks (ranks 0..N).
    #[arg(long, env = "KV_RELAY_DP_SIZE", default_value_t = 1)]
    pub dp_size: u32,
    /// A subset of ranks instead of 0..dp-size, e.g. `0,2`.
    #[arg(long, env = "KV_RELAY_DP_RANKS", value_delimiter = ',')]
    pub dp_ranks: Option<Vec<u32>>,
    /// The engine's topic (the SUB subscribes to it as a prefix; empty takes everything).
    #[arg(long, env = "KV_RELAY_TOPIC", default_value = "")]
    pub topic: String,
    /// The engine's Prometheus endpoint, for its load (running and waiting requests, KV usage).
    #[arg(long, env = "KV_RELAY_ENGINE_METRICS_URL")]
    pub engine_metrics_url: Option<String>,
    /// The engine's base URL (`http://host:port`), which routers send requests to: the relay
    /// reports it in `Status`. Default: the scheme and host of `--engine-metrics-url` (vLLM and
    /// SGLang serve their metrics and their API on one port).
    #[arg(long, env = "KV_RELAY_ENGINE_URL")]
    pub engine_url: Option<String>,
    /// The engine's health endpoint, probed every second for its liveness (with its progress
    /// counters and its KV events). Default: `<engine-url>/health`; `off` watches nothing.
    #[arg(long, env = "KV_RELAY_ENGINE_HEALTH_URL")]
    pub engine_health_url: Option<String>,
    /// A rank with requests running whose progress counters and KV events stand still this long
    /// (seconds) is `wedged`.
    #[arg(long, env = "KV_RELAY_ENGINE_WEDGE_SECS", default_value_t = 3.0)]
    pub engine_wedge_secs: f64,
    /// A health probe unanswered after this long (milliseconds) finds the engine `unreachable`.
    #[arg(long, env = "KV_RELAY_ENGINE_HEALTH_TIMEOUT_MS", default_value_t = 1000)]
    pub engine_health_timeout_ms: u64,
    /// How often the engine's load is scraped, in milliseconds.
    #[arg(long, env = "KV_RELAY_LOAD_POLL_MS", default_value_t = 250)]
    pub load_poll_ms: u64,
    /// Heartbeat interval while a rank is quiet, in milliseconds.
    #[arg(long, env = "KV_RELAY_HEARTBEAT_MS", default_value_t = 1000)]
    pub heartbeat_ms: u64,
    /// The store's directory (default: `$STATE_DIRECTORY` under systemd, else `./kv-relay-state`).
    #[arg(long, env = "KV_RELAY_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
    /// History bound in batches.
    #[arg(long, env = "KV_RELAY_HISTORY_BATCHES", default_value_t = 10_000)]
    pub history_batches: u64,
    /// History bound in bytes.
    #[arg(long, env = "KV_RELAY_HISTORY_BYTES", default_value_t = 256 << 20)]
    pub history_bytes: u64,
    /// sled's page cache, in bytes. sled holds only the store's identity (format, epoch,
    /// incarnations); the log and the checkpoints are files, read through the kernel's cache.
    #[arg(long, env = "KV_RELAY_STORE_CACHE_BYTES", default_value_t = 64 << 20)]
    pub store_cache_bytes: u64,
    /// The gRPC listen address.
    #[arg(long, env = "KV_RELAY_LISTEN", default_value = "127.0.0.1:50051")]
    pub listen: SocketAddr,
    /// The Prometheus metrics listen address; `off` disables it.
    #[arg(long, env = "KV_RELAY_METRICS_LISTEN", default_value = "127.0.0.1:9464")]
    pub metrics_listen: String,
    /// The most batches a rank's thread decodes before it commits them as one group; it commits
    /// sooner, as soon as its socket has nothing more ready.
    #[arg(long, env = "KV_RELAY_QUEUE", default_value_t = 256)]
    pub queue: usize,
    /// How long a replay request may go unanswered, in milliseconds.
    #[arg(long, env = "KV_RELAY_REPLAY_TIMEOUT_MS", default_value_t = 2000)]
    pub replay_timeout_ms: u64,
    /// How long a rank must be quiet before its replay socket is probed for a lost tail, in
    /// milliseconds.
    #[arg(long, env = "KV_RELAY_TAIL_PROBE_MS", default_value_t = 3000)]
    pub tail_probe_ms: u64,
    /// The largest engine message the relay takes, in bytes (PUB and replay sockets): a larger
    /// one drops the connection before it is read into memory, and its batch is counted lost.
    #[arg(long, env = "KV_RELAY_MAX_MESSAGE_BYTES", default_value_t = crate::ingest::DEFAULT_MAX_MESSAGE_BYTES)]
    pub max_message_bytes: u64,
    /// Log format: `text` or `json`.
    #[arg(long, env = "KV_RELAY_LOG_FORMAT", default_value = "text")]
    pub log_format: String,
    /// The gRPC server's TLS certificate chain (PEM); with `--server-tls-key`, the server speaks TLS.
    #[arg(long, env = "KV_RELAY_SERVER_TLS_CERT", value_name = "FILE")]
    pub server_tls_cert: Option<PathBuf>,
    /// The gRPC server's TLS private key (PEM).
    #[arg(long, env = "KV_RELAY_SERVER_TLS_KEY", value_name = "FILE")]
    pub server_tls_key: Option<PathBuf>,
    /// A CA (PEM): clients must present a certificate it signed (mutual TLS).
    #[arg(long, env = "KV_RELAY_SERVER_TLS_CLIENT_CA", value_name = "FILE")]
    pub server_tls_client_ca: Option<PathBuf>,
    /// A file holding the bearer token every `Relay` call must carry (health stays open).
    #[arg(long, env = "KV_RELAY_SERVER_TOKEN_FILE", value_name = "FILE")]
    pub server_token_file: Option<PathBuf>,
    /// Subscribe and Snapshot requests per second per client IP.
    #[arg(long, env = "KV_RELAY_SERVER_RATE_PER_SECOND", default_value_t = 10)]
    pub server_rate_per_second: u32,
    /// Burst of Subscribe and Snapshot requests per client IP.
    #[arg(long, env = "KV_RELAY_SERVER_RATE_BURST", default_value_t = 20)]
    pub server_rate_burst: u32,
    /// Subscribe streams open at once, whole relay.
    #[arg(long, env = "KV_RELAY_SERVER_MAX_SUBSCRIBERS", default_value_t = 256)]
    pub server_max_subscribers: usize,
    /// Snapshots being sent at once, whole relay.
    #[arg(long, env = "KV_RELAY_SERVER_MAX_SNAPSHOTS", default_value_t = 8)]
    pub server_max_snapshots: usize,
    /// Threads that run the gRPC server (every stream's sends) and the daemon's timers. One
    /// keeps a quiet relay's wakeups to one a batch; raise it for many subscribers at high rates.
    #[arg(long, env = "KV_RELAY_SERVER_THREADS", default_value_t = 1)]
    pub server_threads: usize,
    /// Checks the engine's block hashes: each store's blocks are re-hashed from their token ids
    /// with the engine's hash settings below, and mismatches counted per rank (a diagnostic:
    /// events are never dropped or changed by it). `--hash-check` or `--hash-check=true|false`.
    #[arg(long, env = "KV_RELAY_HASH_CHECK", default_value_t = false, num_args = 0..=1,
          default_missing_value = "true", action = clap::ArgAction::Set)]
    pub hash_check: bool,
    /// The engine whose hashes are checked: `vllm` or `sglang`.
    #[arg(long, env = "KV_RELAY_HASH_ENGINE")]
    pub hash_engine: Option<String>,
    /// The engine's release, e.g. `0.32.0` (the hash rules change between releases).
    #[arg(long, env = "KV_RELAY_HASH_ENGINE_VERSION")]
    pub hash_engine_version: Option<String>,
    /// vLLM's `--prefix-caching-hash-algo`: `sha256` (vLLM's default), `sha256_cbor`, `xxhash`,
    /// `xxhash_cbor`. Not for SGLang.
    #[arg(long, env = "KV_RELAY_HASH_ALGO")]
    pub hash_algo: Option<String>,
    /// The engine's `PYTHONHASHSEED` (vLLM); leave unset when the engine has none.
    #[arg(long, env = "KV_RELAY_HASH_SEED")]
    pub hash_seed: Option<String>,
    /// Share of sequences whose blocks are checked, in (0, 1]: a sequence's first block is drawn
    /// (from its hash) and its descendants follow. Bounds the check's cost.
    #[arg(long, env = "KV_RELAY_HASH_SAMPLE", default_value_t = 1.0)]
    pub hash_sample: f64,
    #[command(subcommand)]
    pub command: Option<Command>,
}

/// What the binary does besides running.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Subcommand)]
pub enum Command {
    /// Validates the configuration, prints the effective settings as TOML (secrets redacted) and
    /// exits: 0 when valid, 64 when not.
    CheckConfig,
}

/// Where the server's TLS material and token were read from (what `check-config` shows).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServerFiles {
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    pub tls_client_ca: Option<PathBuf>,
    pub token_file: Option<PathBuf>,
}

/// A setting that cannot work, with why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid setting {setting}: {why}")]
pub struct ConfigError {
    pub setting: &'static str,
    pub why: String,
}

fn bad(setting: &'static str, why: impl Into<String>) -> ConfigError {
    ConfigError { setting, why: why.into() }
}

/// How the engine's liveness is watched.
#[derive(Debug, Clone, PartialEq)]
pub struct LivenessConfig {
    pub health_url: String,
    pub wedge_after: Duration,
    pub probe_timeout: Duration,
}

/// `http://host:port` of a URL (its path dropped).
fn base_url(url: &str) -> Option<String> {
    let rest = url.strip_prefix("http://")?;
    let host = rest.split('/').next().filter(|h| !h.is_empty())?;
    Some(format!("http://{host}"))
}

/// Validated settings.
#[derive(Debug, Clone)]
pub struct Config {
    pub ingest: IngestConfig,
    pub engine_metrics_url: Option<String>,
    /// The engine's base URL, reported in `Status`.
    pub engine_url: Option<String>,
    /// The engine's liveness watch; `None` when there is no health endpoint.
    pub liveness: Option<LivenessConfig>,
    pub load_poll: Duration,
    pub heartbeat: Duration,
    pub state_dir: PathBuf,
    pub history_batches: u64,
    pub history_bytes: u64,
    pub store_cache_bytes: u64,
    pub listen: SocketAddr,
    pub metrics_listen: Option<SocketAddr>,
    pub json_logs: bool,
    /// The gRPC server's settings, TLS files and token read (its `listen` is [`Config::listen`]).
    pub server: ServerConfig,
    /// The files [`Config::server`] was read from.
    pub server_files: ServerFiles,
}

impl Args {
    /// Checks every setting and builds the daemon's configuration.
    pub fn validate(&self) -> Result<Config, ConfigError> {
        let dp_ranks = match &self.dp_ranks {
            Some(r) if r.is_empty() => return Err(bad("dp-ranks", "empty list")),
            Some(r) => {
                let mut r = r.clone();
                r.sort_unstable();
                r.dedup();
                r
            }
            None if self.dp_size == 0 => return Err(bad("dp-size", "must be at least 1")),
            None => (0..self.dp_size).collect(),
        };
        for ep in [Some(&self.endpoint), self.replay_endpoint.as_ref()].into_iter().flatten() {
            let setting = if ep == &self.endpoint { "endpoint" } else { "replay-endpoint" };
            if !["tcp://", "ipc://", "inproc://"].iter().any(|p| ep.starts_with(p)) {
                return Err(bad(setting, format!("{ep:?} is not a tcp://, ipc:// or inproc:// endpoint")));
            }
            for &r in &dp_ranks {
                endpoint::for_rank(ep, r).map_err(|e| bad(setting, e.to_string()))?;
            }
        }
        if let (Some(rep), true) = (&self.replay_endpoint, dp_ranks.len() > 1) {
            // Rank r's PUB port must not be another rank's replay port.
            let pubs: Vec<String> =
                dp_ranks.iter().filter_map(|&r| endpoint::for_rank(&self.endpoint, r).ok()).collect();
            for &r in &dp_ranks {
                let re = endpoint::for_rank(rep, r).map_err(|e| bad("replay-endpoint", e.to_string()))?;
                if pubs.contains(&re) {
                    return Err(bad(
                        "replay-endpoint",
                        format!("rank {r}'s replay endpoint {re} is also a PUB endpoint (move the replay base, e.g. to port 5567)"),
                    ));
                }
            }
        }
        if let Some(url) = &self.engine_metrics_url {
            crate::ingest::load::split_url(url).map_err(|e| bad("engine-metrics-url", e.to_string()))?;
        }
        let engine_url = match &self.engine_url {
            Some(u) => {
                let u = u.trim().trim_end_matches('/').to_string();
                crate::ingest::load::split_url(&u).map_err(|e| bad("engine-url", e.to_string()))?;
                Some(u)
            }
            None => self.engine_metrics_url.as_deref().and_then(base_url),
        };
        if !self.engine_wedge_secs.is_finite() || self.engine_wedge_secs <= 0.0 {
            return Err(bad("engine-wedge-secs", "must be a number above 0"));
        }
        if self.engine_health_timeout_ms == 0 {
            return Err(bad("engine-health-timeout-ms", "must be above 0"));
        }
        let health_url = match self.engine_health_url.as_deref().map(str::trim) {
            Some("off") => None,
            Some(u) => {
                crate::ingest::load::split_url(u).map_err(|e| bad("engine-health-url", e.to_string()))?;
                Some(u.to_string())
            }
            None => engine_url.as_ref().map(|u| format!("{u}/health")),
        };
        let liveness = health_url.map(|health_url| LivenessConfig {
            health_url,
            wedge_after: Duration::from_secs_f64(self.engine_wedge_secs),
            probe_timeout: Duration::from_millis(self.engine_health_timeout_ms),
        });
        if self.load_poll_ms == 0 {
            return Err(bad("load-poll-ms", "must be above 0"));
        }
        if self.heartbeat_ms == 0 {
            return Err(bad("heartbeat-ms", "must be above 0"));
        }
        if self.history_batches == 0 {
            return Err(bad("history-batches", "must be at least 1"));
        }
        if self.history_bytes < 1 << 20 {
            return Err(bad("history-bytes", "must be at least 1 MiB"));
        }
        if self.store_cache_bytes < 1 << 20 {
            return Err(bad("store-cache-bytes", "must be at least 1 MiB"));
        }
        if self.queue == 0 {
            return Err(bad("queue", "must be at least 1"));
        }
        if self.max_message_bytes < 64 << 10 {
            return Err(bad(
                "max-message-bytes",
                "must be at least 64 KiB (an engine's batches reach hundreds of KiB)",
            ));
        }
        let metrics_listen = match self.metrics_listen.as_str() {
            "off" | "" => None,
            s => Some(s.parse().map_err(|_| bad("metrics-listen", format!("{s:?} is not host:port or `off`")))?),
        };
        let json_logs = match self.log_format.as_str() {
            "text" => false,
            "json" => true,
            other => return Err(bad("log-format", format!("{other:?}: use text or json"))),
        };
        let state_dir = self
            .state_dir
            .clone()
            .or_else(|| {
                std::env::var_os("STATE_DIRECTORY").map(|s| {
                    // systemd may list several directories separated by ':'; the first is ours.
                    PathBuf::from(s.to_string_lossy().split(':').next().unwrap_or_default().to_string())
                })
            })
            .unwrap_or_else(|| PathBuf::from("./kv-relay-state"));
        let (server, server_files) = self.server()?;
        let hash_check = self.hash_check()?;
        Ok(Config {
            ingest: IngestConfig {
                endpoint: self.endpoint.clone(),
                replay_endpoint: self.replay_endpoint.clone(),
                dp_ranks,
                topic: self.topic.clone(),
                replay_timeout: Duration::from_millis(self.replay_timeout_ms.max(1)),
                tail_probe: Duration::from_millis(self.tail_probe_ms.max(1)),
                rcvhwm: 100_000,
                max_message_bytes: self.max_message_bytes,
                group_batches: self.queue,
                hash_check,
            },
            engine_metrics_url: self.engine_metrics_url.clone(),
            engine_url,
            liveness,
            load_poll: Duration::from_millis(self.load_poll_ms),
            heartbeat: Duration::from_millis(self.heartbeat_ms),
            state_dir,
            history_batches: self.history_batches,
            history_bytes: self.history_bytes,
            store_cache_bytes: self.store_cache_bytes,
            listen: self.listen,
            metrics_listen,
            json_logs,
            server,
            server_files,
        })
    }

    /// The hash check's settings: `None` when it is off (the other `hash-*` settings are then
    /// not used, but the sample must still be a share).
    fn hash_check(&self) -> Result<Option<Arc<HashCheckConfig>>, ConfigError> {
        if !(self.hash_sample > 0.0 && self.hash_sample <= 1.0) {
            return Err(bad("hash-sample", format!("{} is not in (0, 1]", self.hash_sample)));
        }
        if !self.hash_check {
            return Ok(None);
        }
        HashCheckConfig::new(
            self.hash_engine.as_deref(),
            self.hash_engine_version.as_deref(),
            self.hash_algo.as_deref(),
            self.hash_seed.as_deref(),
            self.hash_sample,
        )
        .map(|c| Some(Arc::new(c)))
        .map_err(|e| bad(e.setting, e.why))
    }

    /// The server's settings; reads the TLS files and the token so a bad path fails here.
    fn server(&self) -> Result<(ServerConfig, ServerFiles), ConfigError> {
        let read = |setting: &'static str, p: &PathBuf| {
            std::fs::read(p).map_err(|e| bad(setting, format!("reading {}: {e}", p.display())))
        };
        let pem = |setting: &'static str, p: &PathBuf| {
            let b = read(setting, p)?;
            if !b.windows(11).any(|w| w == b"-----BEGIN ") {
                return Err(bad(setting, format!("{} is not PEM (no -----BEGIN line)", p.display())));
            }
            Ok(b)
        };
        let tls = match (&self.server_tls_cert, &self.server_tls_key) {
            (Some(c), Some(k)) => Some(TlsConfig {
                cert_pem: pem("server-tls-cert", c)?,
                key_pem: pem("server-tls-key", k)?,
                client_ca_pem: self
                    .server_tls_client_ca
                    .as_ref()
                    .map(|p| pem("server-tls-client-ca", p))
                    .transpose()?,
            }),
            (Some(_), None) => return Err(bad("server-tls-key", "server-tls-cert is set without a key")),
            (None, Some(_)) => return Err(bad("server-tls-cert", "server-tls-key is set without a certificate")),
            (None, None) if self.server_tls_client_ca.is_some() => {
                return Err(bad("server-tls-client-ca", "client certificates need TLS: set server-tls-cert and -key"))
            }
            (None, None) => None,
        };
        let bearer_token = match &self.server_token_file {
            Some(p) => {
                let raw = read("server-token-file", p)?;
                let t = String::from_utf8(raw)
                    .map_err(|_| bad("server-token-file", format!("{} is not UTF-8", p.display())))?
                    .trim()
                    .to_string();
                if t.is_empty() {
                    return Err(bad("server-token-file", format!("{} is empty", p.display())));
                }
                if !t.bytes().all(|b| b.is_ascii_graphic()) {
                    return Err(bad("server-token-file", "the token must be printable ASCII without spaces"));
                }
                Some(t)
            }
            None => None,
        };
        for (setting, v) in [
            ("server-rate-per-second", self.server_rate_per_second as usize),
            ("server-rate-burst", self.server_rate_burst as usize),
            ("server-max-subscribers", self.server_max_subscribers),
            ("server-max-snapshots", self.server_max_snapshots),
            ("server-threads", self.server_threads),
        ] {
            if v == 0 {
                return Err(bad(setting, "must be at least 1"));
            }
        }
        let server = ServerConfig {
            listen: self.listen,
            tls,
            bearer_token,
            rate_per_second: self.server_rate_per_second,
            rate_burst: self.server_rate_burst,
            max_subscribers: self.server_max_subscribers,
            max_snapshots: self.server_max_snapshots,
            threads: self.server_threads,
            ..ServerConfig::default()
        };
        let files = ServerFiles {
            tls_cert: self.server_tls_cert.clone(),
            tls_key: self.server_tls_key.clone(),
            tls_client_ca: self.server_tls_client_ca.clone(),
            token_file: self.server_token_file.clone(),
        };
        Ok((server, files))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(extra: &[&str]) -> Args {
        let mut v = vec!["kv-relay"];
        v.extend_from_slice(extra);
        Args::try_parse_from(v).unwrap()
    }

    #[test]
    fn defaults_are_the_documented_ones() {
        let c = args(&["--state-dir", "/tmp/x"]).validate().unwrap();
        assert_eq!(c.ingest.endpoint, "tcp://127.0.0.1:5557");
        assert_eq!(c.ingest.dp_ranks, vec![0]);
        assert_eq!(c.listen, "127.0.0.1:50051".parse().unwrap());
        assert_eq!(c.metrics_listen, Some("127.0.0.1:9464".parse().unwrap()));
        assert_eq!((c.history_batches, c.history_bytes, c.store_cache_bytes), (10_000, 256 << 20, 64 << 20));
        assert_eq!(c.load_poll, Duration::from_millis(250));
        assert_eq!(c.heartbeat, Duration::from_secs(1));
        assert_eq!((c.engine_url, c.liveness), (None, None));
    }

    #[test]
    fn the_engine_url_and_its_health_endpoint_follow_the_metrics_url() {
        let c = args(&["--engine-metrics-url", "http://10.0.0.7:8000/metrics"]).validate().unwrap();
        assert_eq!(c.engine_url.as_deref(), Some("http://10.0.0.7:8000"));
        assert_eq!(
            c.liveness,
            Some(LivenessConfig {
                health_url: "http://10.0.0.7:8000/health".into(),
                wedge_after: Duration::from_secs(3),
                probe_timeout: Duration::from_secs(1),
            })
        );
        let c = args(&[
            "--engine-metrics-url",
            "http://10.0.0.7:8000/metrics",
            "--engine-url",
            "http://engine:9000/",
            "--engine-wedge-secs",
            "1.5",
            "--engine-health-timeout-ms",
            "300",
        ])
        .validate()
        .unwrap();
        assert_eq!(c.engine_url.as_deref(), Some("http://engine:9000"));
        let l = c.liveness.unwrap();
        assert_eq!(l.health_url, "http://engine:9000/health");
        assert_eq!((l.wedge_after, l.probe_timeout), (Duration::from_millis(1500), Duration::from_millis(300)));
        let c = args(&["--engine-url", "http://e:1", "--engine-health-url", "http://e:2/healthz"]).validate().unwrap();
        assert_eq!(c.liveness.unwrap().health_url, "http://e:2/healthz");
        let c = args(&["--engine-url", "http://e:1", "--engine-health-url", "off"]).validate().unwrap();
        assert_eq!((c.engine_url.as_deref(), c.liveness), (Some("http://e:1"), None));
    }

    #[test]
    fn ranks_come_from_dp_size_or_an_explicit_subset() {
        assert_eq!(args(&["--dp-size", "3"]).validate().unwrap().ingest.dp_ranks, vec![0, 1, 2]);
        assert_eq!(args(&["--dp-ranks", "2,0,2"]).validate().unwrap().ingest.dp_ranks, vec![0, 2]);
    }

    #[test]
    fn bad_settings_name_the_setting_and_why() {
        let cases: &[(&[&str], &str)] = &[
            (&["--dp-size", "0"], "dp-size"),
            (&["--endpoint", "udp://x:1"], "endpoint"),
            (&["--endpoint", "ipc:///tmp/kv", "--dp-size", "2"], "endpoint"),
            (&["--replay-endpoint", "tcp://127.0.0.1:5558", "--dp-size", "2"], "replay-endpoint"),
            (&["--engine-metrics-url", "https://x/metrics"], "engine-metrics-url"),
            (&["--engine-url", "https://x"], "engine-url"),
            (&["--engine-health-url", "ftp://x/health"], "engine-health-url"),
            (&["--engine-wedge-secs", "0"], "engine-wedge-secs"),
            (&["--engine-health-timeout-ms", "0"], "engine-health-timeout-ms"),
            (&["--history-bytes", "1000"], "history-bytes"),
            (&["--metrics-listen", "nowhere"], "metrics-listen"),
            (&["--log-format", "xml"], "log-format"),
            (&["--hash-sample", "0"], "hash-sample"),
            (&["--hash-check"], "hash-engine"),
            (&["--hash-check", "--hash-engine", "trtllm"], "hash-engine"),
            (&["--hash-check", "--hash-engine", "vllm"], "hash-engine-version"),
            (&["--hash-check", "--hash-engine", "vllm", "--hash-engine-version", "x"], "hash-engine-version"),
            (&["--hash-check", "--hash-engine", "vllm", "--hash-engine-version", "0.9.1"], "hash-engine-version"),
            (
                &["--hash-check", "--hash-engine", "vllm", "--hash-engine-version", "0.32", "--hash-algo", "md5"],
                "hash-algo",
            ),
            (
                &["--hash-check", "--hash-engine", "vllm", "--hash-engine-version", "0.12", "--hash-algo", "xxhash"],
                "hash-algo",
            ),
            (&["--hash-check", "--hash-engine", "vllm", "--hash-engine-version", "0.28"], "hash-seed"),
            (
                &["--hash-check", "--hash-engine", "sglang", "--hash-engine-version", "0.5.23", "--hash-seed", "0"],
                "hash-seed",
            ),
            (&["--hash-check", "--hash-engine", "sglang", "--hash-engine-version", "0.4.7"], "hash-engine-version"),
        ];
        for (a, setting) in cases {
            let e = args(a).validate().unwrap_err();
            assert_eq!(e.setting, *setting, "{a:?}: {e}");
        }
        assert_eq!(args(&["--metrics-listen", "off"]).validate().unwrap().metrics_listen, None);
    }

    #[test]
    fn the_hash_check_is_off_by_default_and_resolves_the_engines_settings() {
        let off = args(&["--hash-engine", "nonsense"]).validate().unwrap();
        assert_eq!(off.ingest.hash_check, None);
        let c = args(&["--hash-check", "--hash-engine", "vllm", "--hash-engine-version", "0.32.0"]).validate().unwrap();
        let h = c.ingest.hash_check.unwrap();
        assert_eq!((h.engine, h.algo_name(), h.seed.as_deref(), h.sample), ("vllm", Some("sha256"), None, 1.0));
        let c = args(&["--hash-check=false", "--hash-engine", "vllm"]).validate().unwrap();
        assert_eq!(c.ingest.hash_check, None);
        let c = args(&[
            "--hash-check",
            "--hash-engine",
            "sglang",
            "--hash-engine-version",
            "0.5.23",
            "--hash-sample",
            "0.25",
        ])
        .validate()
        .unwrap();
        assert_eq!(c.ingest.hash_check.unwrap().sample, 0.25);
    }
}
