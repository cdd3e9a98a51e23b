//! The configuration file (`--config FILE`, `KV_RELAY_CONFIG`) and the precedence of the layers:
//! **flags > environment > file > defaults**.
//!
//! The file is TOML; its keys are the flags' names in snake_case (`dp_size`, `history_bytes`),
//! and the server's settings sit in a `[server]` table without their `server-` prefix
//! (`[server] tls_cert` is `--server-tls-cert`). A key the relay does not know is an error that
//! names it: a misspelt key silently ignored is a setting silently at its default.
//!
//! How the layers meet: clap parses the flags and the environment (with the defaults) into
//! [`Args`]; for each key in the file, the file's value replaces the parsed one unless
//! [`ArgMatches::value_source`] says the flag or its environment variable was given. The merged
//! [`Args`] are then validated whole by [`Args::validate`], as if everything had been flags.

use crate::config::{Args, Command, Config, ConfigError};
use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory, FromArgMatches};
use std::ffi::OsString;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use toml::{Table, Value};

/// The exit code of bad configuration (`EX_USAGE` of sysexits.h).
pub const EX_USAGE: i32 = 64;

/// What the command line asks for, its configuration loaded and validated.
#[derive(Debug, Clone)]
pub struct Invocation {
    pub config: Config,
    /// `None`: run the relay.
    pub command: Option<Command>,
}

/// Why the command line could not be turned into a configuration.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// Clap's own outcome: a malformed flag or environment value, or `--help` / `--version`
    /// (print it with [`clap::Error::print`]; `--help` and `--version` are not failures, see
    /// [`LoadError::exit_code`]).
    #[error("{0}")]
    Usage(#[from] clap::Error),
    /// A setting that cannot work.
    #[error(transparent)]
    Config(#[from] ConfigError),
}

impl LoadError {
    /// 0 for `--help` and `--version`, [`EX_USAGE`] for everything else.
    pub fn exit_code(&self) -> i32 {
        use clap::error::ErrorKind::{DisplayHelp, DisplayVersion};
        match self {
            LoadError::Usage(e) if matches!(e.kind(), DisplayHelp | DisplayVersion) => 0,
            _ => EX_USAGE,
        }
    }
}

/// Parses flags and environment, reads the file if one is named, and validates the result.
/// Clap's errors (including `--help`) become a [`ConfigError`] of setting `arguments`; a binary
/// that wants `--help` printed calls [`parse`].
pub fn load<I, T>(argv: I) -> Result<Config, ConfigError>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    match parse(argv) {
        Ok(inv) => Ok(inv.config),
        Err(LoadError::Config(e)) => Err(e),
        Err(LoadError::Usage(e)) => {
            Err(ConfigError { setting: "arguments", why: e.render().to_string().trim_end().to_string() })
        }
    }
}

/// [`load`], keeping the subcommand and clap's own errors.
pub fn parse<I, T>(argv: I) -> Result<Invocation, LoadError>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let matches = Args::command().try_get_matches_from(argv)?;
    let mut args = Args::from_arg_matches(&matches)?;
    if let Some(path) = args.config.clone() {
        let text = std::fs::read_to_string(&path)
            .map_err(|e| ConfigError { setting: "config", why: format!("reading {}: {e}", path.display()) })?;
        apply(&mut args, &matches, &path, &text)?;
    }
    let config = args.validate()?;
    Ok(Invocation { config, command: args.command })
}

/// Merges the file's `text` into `args`: each key the file sets replaces the parsed value unless
/// the flag or its environment variable was given.
pub fn apply(args: &mut Args, matches: &ArgMatches, path: &Path, text: &str) -> Result<(), ConfigError> {
    let table: Table = text
        .parse()
        .map_err(|e: toml::de::Error| ConfigError { setting: "config", why: format!("{}: {e}", path.display()) })?;
    let explicit =
        |id: &str| matches!(matches.value_source(id), Some(ValueSource::CommandLine | ValueSource::EnvVariable));
    if table.contains_key("dp_size") && table.contains_key("dp_ranks") {
        return Err(ConfigError {
            setting: "dp-ranks",
            why: format!("{}: set dp_size or dp_ranks, not both", path.display()),
        });
    }
    for (key, value) in &table {
        if key == "server" {
            let Value::Table(server) = value else {
                return Err(ConfigError {
                    setting: "config",
                    why: format!("{}: `server` must be a table", path.display()),
                });
            };
            for (key, value) in server {
                let Some(&(_, id, setting)) = SERVER_KEYS.iter().find(|(k, _, _)| k == key) else {
                    return Err(unknown(path, &format!("server.{key}"), SERVER_KEYS));
                };
                if !explicit(id) {
                    set(args, id, setting, &At { path, key: &format!("server.{key}") }, value)?;
                }
            }
            continue;
        }
        let Some(&(_, id, setting)) = KEYS.iter().find(|(k, _, _)| k == key) else {
            return Err(unknown(path, key, KEYS));
        };
        // A rank list from the file must not override a rank count given as a flag.
        let skip = id == "dp_ranks" && explicit("dp_size");
        if !explicit(id) && !skip {
            set(args, id, setting, &At { path, key }, value)?;
        }
    }
    Ok(())
}

/// The file's top-level keys: (file key, clap argument id, setting name in errors).
const KEYS: &[(&str, &str, &str)] = &[
    ("endpoint", "endpoint", "endpoint"),
    ("replay_endpoint", "replay_endpoint", "replay-endpoint"),
    ("dp_size", "dp_size", "dp-size"),
    ("dp_ranks", "dp_ranks", "dp-ranks"),
    ("topic", "topic", "topic"),
    ("engine_metrics_url", "engine_metrics_url", "engine-metrics-url"),
    ("engine_url", "engine_url", "engine-url"),
    ("engine_health_url", "engine_health_url", "engine-health-url"),
    ("engine_wedge_secs", "engine_wedge_secs", "engine-wedge-secs"),
    ("engine_health_timeout_ms", "engine_health_timeout_ms", "engine-health-timeout-ms"),
    ("load_poll_ms", "load_poll_ms", "load-poll-ms"),
    ("heartbeat_ms", "heartbeat_ms", "heartbeat-ms"),
    ("state_dir", "state_dir", "state-dir"),
    ("history_batches", "history_batches", "history-batches"),
    ("history_bytes", "history_bytes", "history-bytes"),
    ("store_cache_bytes", "store_cache_bytes", "store-cache-bytes"),
    ("listen", "listen", "listen"),
    ("metrics_listen", "metrics_listen", "metrics-listen"),
    ("queue", "queue", "queue"),
    ("replay_timeout_ms", "replay_timeout_ms", "replay-timeout-ms"),
    ("tail_probe_ms", "tail_probe_ms", "tail-probe-ms"),
    ("max_message_bytes", "max_message_bytes", "max-message-bytes"),
    ("log_format", "log_format", "log-format"),
    ("hash_check", "hash_check", "hash-check"),
    ("hash_engine", "hash_engine", "hash-engine"),
    ("hash_engine_version", "hash_engine_version", "hash-engine-version"),
    ("hash_algo", "hash_algo", "hash-algo"),
    ("hash_seed", "hash_seed", "hash-seed"),
    ("hash_sample", "hash_sample", "hash-sample"),
];

/// The `[server]` table's keys.
const SERVER_KEYS: &[(&str, &str, &str)] = &[
    ("tls_cert", "server_tls_cert", "server-tls-cert"),
    ("tls_key", "server_tls_key", "server-tls-key"),
    ("tls_client_ca", "server_tls_client_ca", "server-tls-client-ca"),
    ("token_file", "server_token_file", "server-token-file"),
    ("rate_per_second", "server_rate_per_second", "server-rate-per-second"),
    ("rate_burst", "server_rate_burst", "server-rate-burst"),
    ("max_subscribers", "server_max_subscribers", "server-max-subscribers"),
    ("max_snapshots", "server_max_snapshots", "server-max-snapshots"),
    ("threads", "server_threads", "server-threads"),
];

fn unknown(path: &Path, key: &str, known: &[(&str, &str, &str)]) -> ConfigError {
    let known: Vec<&str> = known.iter().map(|(k, _, _)| *k).collect();
    let mut why = format!("{}: unknown key `{key}` (known keys: {}", path.display(), known.join(", "));
    if !key.starts_with("server.") {
        why.push_str(", and the [server] table");
    }
    why.push(')');
    ConfigError { setting: "config", why }
}

/// Where a value came from, for error messages.
struct At<'a> {
    path: &'a Path,
    key: &'a str,
}

impl At<'_> {
    fn err(&self, setting: &'static str, want: &str, got: &Value) -> ConfigError {
        ConfigError {
            setting,
            why: format!("{} key `{}`: expected {want}, got {} {got}", self.path.display(), self.key, got.type_str()),
        }
    }
}

fn set(args: &mut Args, id: &str, setting: &'static str, at: &At<'_>, v: &Value) -> Result<(), ConfigError> {
    let string = || v.as_str().map(str::to_string).ok_or_else(|| at.err(setting, "a string", v));
    let path = || string().map(PathBuf::from);
    let uint = |max: u64| -> Result<u64, ConfigError> {
        match v.as_integer() {
            Some(i) if i >= 0 && i as u64 <= max => Ok(i as u64),
            _ => Err(at.err(setting, &format!("an integer from 0 to {max}"), v)),
        }
    };
    match id {
        "endpoint" => args.endpoint = string()?,
        "replay_endpoint" => args.replay_endpoint = Some(string()?),
        "dp_size" => args.dp_size = uint(u32::MAX as u64)? as u32,
        "dp_ranks" => {
            let Value::Array(items) = v else { return Err(at.err(setting, "an array of rank numbers", v)) };
            let mut ranks = Vec::with_capacity(items.len());
            for item in items {
                match item.as_integer() {
                    Some(i) if (0..=u32::MAX as i64).contains(&i) => ranks.push(i as u32),
                    _ => return Err(at.err(setting, "an array of rank numbers", v)),
                }
            }
            args.dp_ranks = Some(ranks);
        }
        "topic" => args.topic = string()?,
        "engine_metrics_url" => args.engine_metrics_url = Some(string()?),
        "engine_url" => args.engine_url = Some(string()?),
        "engine_health_url" => args.engine_health_url = Some(string()?),
        "engine_wedge_secs" => {
            args.engine_wedge_secs = v
                .as_float()
                .or_else(|| v.as_integer().map(|i| i as f64))
                .ok_or_else(|| at.err(setting, "a number of seconds", v))?
        }
        "engine_health_timeout_ms" => args.engine_health_timeout_ms = uint(u64::MAX)?,
        "load_poll_ms" => args.load_poll_ms = uint(u64::MAX)?,
        "heartbeat_ms" => args.heartbeat_ms = uint(u64::MAX)?,
        "state_dir" => args.state_dir = Some(path()?),
        "history_batches" => args.history_batches = uint(u64::MAX)?,
        "history_bytes" => args.history_bytes = uint(u64::MAX)?,
        "store_cache_bytes" => args.store_cache_bytes = uint(u64::MAX)?,
        "listen" => {
            let s = string()?;
            args.listen = s.parse::<SocketAddr>().map_err(|_| ConfigError {
                setting,
                why: format!("{} key `{}`: {s:?} is not host:port", at.path.display(), at.key),
            })?;
        }
        "metrics_listen" => args.metrics_listen = string()?,
        "queue" => args.queue = uint(usize::MAX as u64)? as usize,
        "replay_timeout_ms" => args.replay_timeout_ms = uint(u64::MAX)?,
        "tail_probe_ms" => args.tail_probe_ms = uint(u64::MAX)?,
        "max_message_bytes" => args.max_message_bytes = uint(u64::MAX)?,
        "log_format" => args.log_format = string()?,
        "hash_check" => args.hash_check = v.as_bool().ok_or_else(|| at.err(setting, "true or false", v))?,
        "hash_engine" => args.hash_engine = Some(string()?),
        "hash_engine_version" => args.hash_engine_version = Some(string()?),
        "hash_algo" => args.hash_algo = Some(string()?),
        // PYTHONHASHSEED is a string in the environment; an integer in the file means the same.
        "hash_seed" => {
            args.hash_seed = Some(match v {
                Value::Integer(i) if *i >= 0 => i.to_string(),
                _ => v.as_str().map(str::to_string).ok_or_else(|| at.err(setting, "a string or an integer", v))?,
            })
        }
        "hash_sample" => {
            args.hash_sample = match v {
                Value::Float(f) => *f,
                Value::Integer(i) => *i as f64,
                _ => return Err(at.err(setting, "a number in (0, 1]", v)),
            }
        }
        "server_tls_cert" => args.server_tls_cert = Some(path()?),
        "server_tls_key" => args.server_tls_key = Some(path()?),
        "server_tls_client_ca" => args.server_tls_client_ca = Some(path()?),
        "server_token_file" => args.server_token_file = Some(path()?),
        "server_rate_per_second" => args.server_rate_per_second = uint(u32::MAX as u64)? as u32,
        "server_rate_burst" => args.server_rate_burst = uint(u32::MAX as u64)? as u32,
        "server_max_subscribers" => args.server_max_subscribers = uint(usize::MAX as u64)? as usize,
        "server_max_snapshots" => args.server_max_snapshots = uint(usize::MAX as u64)? as usize,
        "server_threads" => args.server_threads = uint(usize::MAX as u64)? as usize,
        other => unreachable!("key table names argument {other} that `set` does not know"),
    }
    Ok(())
}

/// The effective configuration as a TOML file the relay would load to the same settings
/// (`check-config` prints it). Unset settings are comments; secrets are never printed: the
/// bearer token shows as the file it was read from, and credentials in URLs as `***`.
pub fn effective_toml(c: &Config) -> String {
    fn q(s: &str) -> String {
        Value::String(s.to_string()).to_string()
    }
    fn p(p: &Path) -> String {
        q(&p.to_string_lossy())
    }
    let mut o = String::new();
    let ms = |d: std::time::Duration| d.as_millis();
    let ing = &c.ingest;
    let _ = writeln!(o, "# kv-relay: effective configuration (flags > environment > file > defaults)");
    let _ = writeln!(o, "endpoint = {}", q(&ing.endpoint));
    match &ing.replay_endpoint {
        Some(r) => _ = writeln!(o, "replay_endpoint = {}", q(r)),
        None => _ = writeln!(o, "# replay_endpoint: not set (gaps cannot be refilled)"),
    }
    let ranks: Vec<String> = ing.dp_ranks.iter().map(u32::to_string).collect();
    let _ = writeln!(o, "dp_ranks = [{}]", ranks.join(", "));
    let _ = writeln!(o, "topic = {}", q(&ing.topic));
    match &c.engine_metrics_url {
        Some(u) => _ = writeln!(o, "engine_metrics_url = {}", q(&redact_url(u))),
        None => _ = writeln!(o, "# engine_metrics_url: not set (no engine load)"),
    }
    match &c.engine_url {
        Some(u) => _ = writeln!(o, "engine_url = {}", q(&redact_url(u))),
        None => _ = writeln!(o, "# engine_url: not set (routers learn no engine URL)"),
    }
    match &c.liveness {
        Some(l) => {
            let _ = writeln!(o, "engine_health_url = {}", q(&redact_url(&l.health_url)));
            let _ = writeln!(o, "engine_wedge_secs = {:?}", l.wedge_after.as_secs_f64());
            let _ = writeln!(o, "engine_health_timeout_ms = {}", ms(l.probe_timeout));
        }
        None => _ = writeln!(o, "engine_health_url = \"off\" # the engine's liveness is not watched"),
    }
    let _ = writeln!(o, "load_poll_ms = {}", ms(c.load_poll));
    let _ = writeln!(o, "heartbeat_ms = {}", ms(c.heartbeat));
    let _ = writeln!(o, "state_dir = {}", p(&c.state_dir));
    let _ = writeln!(o, "history_batches = {}", c.history_batches);
    let _ = writeln!(o, "history_bytes = {}", c.history_bytes);
    let _ = writeln!(o, "store_cache_bytes = {}", c.store_cache_bytes);
    let _ = writeln!(o, "listen = {}", q(&c.listen.to_string()));
    let metrics = c.metrics_listen.map_or_else(|| "off".to_string(), |a| a.to_string());
    let _ = writeln!(o, "metrics_listen = {}", q(&metrics));
    let _ = writeln!(o, "queue = {}", ing.group_batches);
    let _ = writeln!(o, "replay_timeout_ms = {}", ms(ing.replay_timeout));
    let _ = writeln!(o, "tail_probe_ms = {}", ms(ing.tail_probe));
    let _ = writeln!(o, "max_message_bytes = {}", ing.max_message_bytes);
    let _ = writeln!(o, "log_format = {}", q(if c.json_logs { "json" } else { "text" }));
    match &ing.hash_check {
        Some(h) => {
            let _ = writeln!(o, "hash_check = true");
            let _ = writeln!(o, "hash_engine = {}", q(h.engine));
            let _ = writeln!(o, "hash_engine_version = {}", q(&h.version.to_string()));
            if let Some(a) = h.algo_name() {
                let _ = writeln!(o, "hash_algo = {}", q(a));
            }
            match &h.seed {
                Some(s) => _ = writeln!(o, "hash_seed = {}", q(s)),
                None if h.engine == "vllm" => {
                    _ = writeln!(o, "# hash_seed: not set (the engine has no PYTHONHASHSEED)")
                }
                None => {}
            }
            let _ = writeln!(o, "hash_sample = {:?}", h.sample);
        }
        None => _ = writeln!(o, "hash_check = false"),
    }
    let _ = writeln!(o, "\n[server]");
    let f = &c.server_files;
    for (key, file, unset) in [
        ("tls_cert", &f.tls_cert, "plaintext"),
        ("tls_key", &f.tls_key, "plaintext"),
        ("tls_client_ca", &f.tls_client_ca, "no client certificates required"),
        ("token_file", &f.token_file, "no bearer token required"),
    ] {
        match file {
            Some(path) => _ = writeln!(o, "{key} = {}", p(path)),
            None => _ = writeln!(o, "# {key}: not set ({unset})"),
        }
    }
    if c.server.bearer_token.is_some() {
        let _ = writeln!(o, "# bearer token: read from token_file, value redacted");
    }
    let s = &c.server;
    let _ = writeln!(o, "rate_per_second = {}", s.rate_per_second);
    let _ = writeln!(o, "rate_burst = {}", s.rate_burst);
    let _ = writeln!(o, "max_subscribers = {}", s.max_subscribers);
    let _ = writeln!(o, "max_snapshots = {}", s.max_snapshots);
    let _ = writeln!(o, "threads = {}", s.threads);
    o
}

/// `scheme://user:secret@host/...` → `scheme://***@host/...`.
fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else { return url.to_string() };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => format!("{scheme}://***{}", &rest[at..]),
        None => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_names_a_real_argument() {
        let cmd = Args::command();
        for (key, id, setting) in KEYS.iter().chain(SERVER_KEYS) {
            assert!(cmd.get_arguments().any(|a| a.get_id() == id), "{key} → {id}");
            assert_eq!(setting.replace('-', "_"), *id, "{key}");
        }
    }

    #[test]
    fn credentials_in_urls_are_redacted() {
        assert_eq!(redact_url("http://u:pw@10.0.0.1:8000/metrics"), "http://***@10.0.0.1:8000/metrics");
        assert_eq!(redact_url("http://10.0.0.1:8000/a@b"), "http://10.0.0.1:8000/a@b");
        assert_eq!(redact_url("tcp://127.0.0.1:5557"), "tcp://127.0.0.1:5557");
    }
}
