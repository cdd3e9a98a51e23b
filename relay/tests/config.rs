//! The daemon's configuration: the file, the precedence of flags > environment > file >
//! defaults, unknown keys, the setting each validation error names, exit codes, and the
//! effective configuration `check-config` prints.
//!
//! The environment is the process's: every test holds [`LOCK`] and starts from an environment
//! without `KV_RELAY_*` variables.

use kv_relay::config::{Command, Config, ConfigError};
use kv_relay::config_file::{effective_toml, load, parse, LoadError, EX_USAGE};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

static LOCK: Mutex<()> = Mutex::new(());

/// A clean environment and a temporary directory, for one test.
struct Env {
    _guard: MutexGuard<'static, ()>,
    dir: tempfile::TempDir,
}

impl Env {
    fn new() -> Env {
        let guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
        for (k, _) in std::env::vars_os() {
            if k.to_string_lossy().starts_with("KV_RELAY_") || k == "STATE_DIRECTORY" {
                std::env::remove_var(&k);
            }
        }
        Env { _guard: guard, dir: tempfile::tempdir().unwrap() }
    }

    fn file(&self, name: &str, text: &str) -> PathBuf {
        let p = self.dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    fn config(&self, text: &str) -> String {
        self.file("relay.toml", text).to_string_lossy().into_owned()
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }
}

fn argv(extra: &[&str]) -> Vec<String> {
    std::iter::once("kv-relay").chain(extra.iter().copied()).map(String::from).collect()
}

fn load_ok(extra: &[&str]) -> Config {
    load(argv(extra)).unwrap_or_else(|e| panic!("{extra:?}: {e}"))
}

fn load_err(extra: &[&str]) -> ConfigError {
    match load(argv(extra)) {
        Ok(c) => panic!("{extra:?} loaded: {c:?}"),
        Err(e) => e,
    }
}

/// One setting seen through every layer: its file line, environment variable and flag, three
/// distinct values, and how to read it back from the validated configuration.
struct Layered {
    file_line: &'static str,
    env: &'static str,
    flag: &'static str,
    default: &'static str,
    file: &'static str,
    env_value: &'static str,
    flag_value: &'static str,
    read: fn(&Config) -> String,
}

fn layered() -> Vec<Layered> {
    macro_rules! l {
        ($key:literal = $file_toml:literal => $file:literal, $env:literal = $ev:literal, $flag:literal = $fv:literal, default $d:literal, |$c:ident| $read:expr) => {
            Layered {
                file_line: concat!($key, " = ", $file_toml),
                env: $env,
                flag: $flag,
                default: $d,
                file: $file,
                env_value: $ev,
                flag_value: $fv,
                read: |$c: &Config| $read,
            }
        };
    }
    vec![
        l!("endpoint" = "\"tcp://10.0.0.1:6000\"" => "tcp://10.0.0.1:6000",
           "KV_RELAY_ENDPOINT" = "tcp://10.0.0.2:6000", "--endpoint" = "tcp://10.0.0.3:6000",
           default "tcp://127.0.0.1:5557", |c| c.ingest.endpoint.clone()),
        l!("replay_endpoint" = "\"tcp://10.0.0.1:7000\"" => "Some(\"tcp://10.0.0.1:7000\")",
           "KV_RELAY_REPLAY_ENDPOINT" = "tcp://10.0.0.2:7000", "--replay-endpoint" = "tcp://10.0.0.3:7000",
           default "None", |c| format!("{:?}", c.ingest.replay_endpoint)),
        l!("dp_size" = "2" => "[0, 1]", "KV_RELAY_DP_SIZE" = "3", "--dp-size" = "4",
           default "[0]", |c| format!("{:?}", c.ingest.dp_ranks)),
        l!("dp_ranks" = "[1, 3]" => "[1, 3]", "KV_RELAY_DP_RANKS" = "0,2", "--dp-ranks" = "2,5",
           default "[0]", |c| format!("{:?}", c.ingest.dp_ranks)),
        l!("topic" = "\"kv@file\"" => "kv@file", "KV_RELAY_TOPIC" = "kv@env", "--topic" = "kv@flag",
           default "", |c| c.ingest.topic.clone()),
        l!("engine_metrics_url" = "\"http://127.0.0.1:8001/metrics\"" => "Some(\"http://127.0.0.1:8001/metrics\")",
           "KV_RELAY_ENGINE_METRICS_URL" = "http://127.0.0.1:8002/metrics",
           "--engine-metrics-url" = "http://127.0.0.1:8003/metrics",
           default "None", |c| format!("{:?}", c.engine_metrics_url)),
        l!("load_poll_ms" = "100" => "100ms", "KV_RELAY_LOAD_POLL_MS" = "200", "--load-poll-ms" = "300",
           default "250ms", |c| format!("{:?}", c.load_poll)),
        l!("heartbeat_ms" = "500" => "500ms", "KV_RELAY_HEARTBEAT_MS" = "600", "--heartbeat-ms" = "700",
           default "1s", |c| format!("{:?}", c.heartbeat)),
        l!("state_dir" = "\"/var/lib/file\"" => "/var/lib/file", "KV_RELAY_STATE_DIR" = "/var/lib/env",
           "--state-dir" = "/var/lib/flag", default "./kv-relay-state", |c| c.state_dir.display().to_string()),
        l!("history_batches" = "20000" => "20000", "KV_RELAY_HISTORY_BATCHES" = "30000",
           "--history-batches" = "40000", default "10000", |c| c.history_batches.to_string()),
        l!("history_bytes" = "2097152" => "2097152", "KV_RELAY_HISTORY_BYTES" = "3145728",
           "--history-bytes" = "4194304", default "268435456", |c| c.history_bytes.to_string()),
        l!("store_cache_bytes" = "8388608" => "8388608", "KV_RELAY_STORE_CACHE_BYTES" = "16777216",
           "--store-cache-bytes" = "33554432", default "67108864", |c| c.store_cache_bytes.to_string()),
        l!("listen" = "\"0.0.0.0:50061\"" => "0.0.0.0:50061", "KV_RELAY_LISTEN" = "0.0.0.0:50062",
           "--listen" = "0.0.0.0:50063", default "127.0.0.1:50051", |c| c.listen.to_string()),
        l!("metrics_listen" = "\"off\"" => "None", "KV_RELAY_METRICS_LISTEN" = "0.0.0.0:9465",
           "--metrics-listen" = "0.0.0.0:9466", default "Some(127.0.0.1:9464)", |c| format!("{:?}", c.metrics_listen)),
        l!("queue" = "16" => "16", "KV_RELAY_QUEUE" = "32", "--queue" = "64",
           default "256", |c| c.ingest.group_batches.to_string()),
        l!("replay_timeout_ms" = "1000" => "1s", "KV_RELAY_REPLAY_TIMEOUT_MS" = "1500",
           "--replay-timeout-ms" = "2500", default "2s", |c| format!("{:?}", c.ingest.replay_timeout)),
        l!("tail_probe_ms" = "1000" => "1s", "KV_RELAY_TAIL_PROBE_MS" = "4000",
           "--tail-probe-ms" = "5000", default "3s", |c| format!("{:?}", c.ingest.tail_probe)),
        l!("max_message_bytes" = "1048576" => "1048576", "KV_RELAY_MAX_MESSAGE_BYTES" = "2097152",
           "--max-message-bytes" = "4194304", default "16777216", |c| c.ingest.max_message_bytes.to_string()),
        l!("log_format" = "\"json\"" => "true", "KV_RELAY_LOG_FORMAT" = "text", "--log-format" = "json",
           default "false", |c| c.json_logs.to_string()),
        l!("[server]\nrate_per_second" = "1" => "1", "KV_RELAY_SERVER_RATE_PER_SECOND" = "2",
           "--server-rate-per-second" = "3", default "10", |c| c.server.rate_per_second.to_string()),
        l!("[server]\nrate_burst" = "4" => "4", "KV_RELAY_SERVER_RATE_BURST" = "5",
           "--server-rate-burst" = "6", default "20", |c| c.server.rate_burst.to_string()),
        l!("[server]\nmax_subscribers" = "7" => "7", "KV_RELAY_SERVER_MAX_SUBSCRIBERS" = "8",
           "--server-max-subscribers" = "9", default "256", |c| c.server.max_subscribers.to_string()),
        l!("[server]\nmax_snapshots" = "1" => "1", "KV_RELAY_SERVER_MAX_SNAPSHOTS" = "2",
           "--server-max-snapshots" = "3", default "8", |c| c.server.max_snapshots.to_string()),
        l!("[server]\nthreads" = "2" => "2", "KV_RELAY_SERVER_THREADS" = "3",
           "--server-threads" = "4", default "1", |c| c.server.threads.to_string()),
    ]
}

#[test]
fn every_setting_takes_flag_over_environment_over_file_over_default() {
    let env = Env::new();
    for s in layered() {
        let flag = format!("{}={}", s.flag, s.flag_value);
        for k in [s.env, "KV_RELAY_CONFIG"] {
            std::env::remove_var(k);
        }
        assert_eq!((s.read)(&load_ok(&[])), s.default, "{}: default", s.flag);
        let file = env.config(s.file_line);
        assert_eq!((s.read)(&load_ok(&["--config", &file])), s.file, "{}: file over default", s.flag);
        std::env::set_var("KV_RELAY_CONFIG", &file);
        assert_eq!((s.read)(&load_ok(&[])), s.file, "{}: file named by KV_RELAY_CONFIG", s.flag);
        std::env::set_var(s.env, s.env_value);
        let from_env = (s.read)(&load_ok(&[]));
        assert_ne!(from_env, s.file, "{}: environment over file", s.flag);
        std::env::remove_var("KV_RELAY_CONFIG");
        assert_eq!((s.read)(&load_ok(&[])), from_env, "{}: environment over default", s.flag);
        std::env::set_var("KV_RELAY_CONFIG", &file);
        let from_flag = (s.read)(&load_ok(&[&flag]));
        assert_ne!(from_flag, from_env, "{}: flag over environment", s.flag);
        std::env::remove_var(s.env);
        assert_eq!((s.read)(&load_ok(&[&flag])), from_flag, "{}: flag over file", s.flag);
        std::env::remove_var("KV_RELAY_CONFIG");
        assert_eq!((s.read)(&load_ok(&[&flag])), from_flag, "{}: flag over default", s.flag);
    }
}

#[test]
fn the_hash_check_settings_take_flag_over_environment_over_file() {
    let env = Env::new();
    let file = env.config(
        "hash_check = true\nhash_engine = \"vllm\"\nhash_engine_version = \"0.32.0\"\nhash_seed = 0\nhash_sample = 0.5\n",
    );
    let seed = |c: &Config| c.ingest.hash_check.as_ref().map(|h| (h.seed.clone(), h.sample));
    assert_eq!(seed(&load_ok(&["--config", &file])), Some((Some("0".into()), 0.5)));
    std::env::set_var("KV_RELAY_HASH_SEED", "1");
    assert_eq!(seed(&load_ok(&["--config", &file])), Some((Some("1".into()), 0.5)));
    assert_eq!(seed(&load_ok(&["--config", &file, "--hash-seed", "2"])), Some((Some("2".into()), 0.5)));
    std::env::set_var("KV_RELAY_HASH_CHECK", "false");
    assert_eq!(seed(&load_ok(&["--config", &file])), None);
    assert_eq!(seed(&load_ok(&["--config", &file, "--hash-check"])), Some((Some("1".into()), 0.5)));
    std::env::remove_var("KV_RELAY_HASH_CHECK");
    std::env::remove_var("KV_RELAY_HASH_SEED");
    assert_eq!(seed(&load_ok(&["--hash-sample", "0.25"])), None, "off by default");
}

#[test]
fn environment_and_flag_values_are_the_exact_ones_given() {
    let env = Env::new();
    let file = env.config("dp_size = 2\nhistory_batches = 20000\nlisten = \"0.0.0.0:50061\"\n");
    std::env::set_var("KV_RELAY_HISTORY_BATCHES", "30000");
    let c = load_ok(&["--config", &file, "--listen", "127.0.0.1:1"]);
    assert_eq!(c.ingest.dp_ranks, vec![0, 1]);
    assert_eq!(c.history_batches, 30000);
    assert_eq!(c.listen, "127.0.0.1:1".parse().unwrap());
    assert_eq!(c.server.listen, c.listen);
}

#[test]
fn a_rank_count_flag_beats_a_rank_list_in_the_file() {
    let env = Env::new();
    let file = env.config("dp_ranks = [1, 3]\n");
    assert_eq!(load_ok(&["--config", &file, "--dp-size", "2"]).ingest.dp_ranks, vec![0, 1]);
    std::env::set_var("KV_RELAY_DP_SIZE", "3");
    assert_eq!(load_ok(&["--config", &file]).ingest.dp_ranks, vec![0, 1, 2]);
}

#[test]
fn the_state_directory_defaults_to_systemds() {
    let _env = Env::new();
    std::env::set_var("STATE_DIRECTORY", "/var/lib/kv-relay/a:/var/lib/other");
    assert_eq!(load_ok(&[]).state_dir, PathBuf::from("/var/lib/kv-relay/a"));
    assert_eq!(load_ok(&["--state-dir", "/x"]).state_dir, PathBuf::from("/x"));
}

#[test]
fn an_unknown_key_is_rejected_by_name() {
    let env = Env::new();
    let file = env.config("endpoint = \"tcp://127.0.0.1:5557\"\nhistroy_batches = 5\n");
    let e = load_err(&["--config", &file]);
    assert_eq!(e.setting, "config");
    assert_eq!(
        e.why,
        format!(
            "{file}: unknown key `histroy_batches` (known keys: endpoint, replay_endpoint, dp_size, dp_ranks, topic, \
             engine_metrics_url, engine_url, engine_health_url, engine_wedge_secs, engine_health_timeout_ms, \
             load_poll_ms, heartbeat_ms, state_dir, history_batches, history_bytes, \
             store_cache_bytes, listen, metrics_listen, queue, replay_timeout_ms, tail_probe_ms, max_message_bytes, \
             log_format, \
             hash_check, hash_engine, hash_engine_version, hash_algo, hash_seed, hash_sample, and the [server] table)"
        )
    );
    let file = env.config("[server]\ntoken = \"hunter2\"\n");
    let e = load_err(&["--config", &file]);
    assert_eq!(e.setting, "config");
    assert_eq!(
        e.why,
        format!(
            "{file}: unknown key `server.token` (known keys: tls_cert, tls_key, tls_client_ca, token_file, \
             rate_per_second, rate_burst, max_subscribers, max_snapshots, threads)"
        )
    );
    // Flags are not file keys of their own: the file cannot name another file.
    let e = load_err(&["--config", &env.config("config = \"/etc/other.toml\"\n")]);
    assert!(e.why.contains("unknown key `config`"), "{e}");
}

#[test]
fn each_bad_setting_names_itself() {
    let env = Env::new();
    let pem = env.file("cert.pem", "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n");
    let pem = pem.to_str().unwrap();
    let not_pem = env.file("not.pem", "hello\n");
    let not_pem = not_pem.to_str().unwrap();
    let empty = env.file("empty-token", "\n");
    let empty = empty.to_str().unwrap();
    let missing = env.path().join("missing.pem");
    let missing = missing.to_str().unwrap();
    let cases: Vec<(String, &str)> = vec![
        ("dp_size = 0".into(), "dp-size"),
        ("dp_size = \"two\"".into(), "dp-size"),
        ("dp_size = -1".into(), "dp-size"),
        ("dp_ranks = []".into(), "dp-ranks"),
        ("dp_ranks = [0, \"1\"]".into(), "dp-ranks"),
        ("dp_ranks = [0]\ndp_size = 1".into(), "dp-ranks"),
        ("endpoint = \"udp://x:1\"".into(), "endpoint"),
        ("endpoint = \"ipc:///tmp/kv\"\ndp_size = 2".into(), "endpoint"),
        ("replay_endpoint = \"tcp://127.0.0.1:5558\"\ndp_size = 2".into(), "replay-endpoint"),
        ("engine_metrics_url = \"https://x/metrics\"".into(), "engine-metrics-url"),
        ("load_poll_ms = 0".into(), "load-poll-ms"),
        ("heartbeat_ms = 0".into(), "heartbeat-ms"),
        ("state_dir = 7".into(), "state-dir"),
        ("history_batches = 0".into(), "history-batches"),
        ("history_bytes = 1000".into(), "history-bytes"),
        ("store_cache_bytes = 1000".into(), "store-cache-bytes"),
        ("listen = \"everywhere\"".into(), "listen"),
        ("metrics_listen = \"nowhere\"".into(), "metrics-listen"),
        ("queue = 0".into(), "queue"),
        ("replay_timeout_ms = 1.5".into(), "replay-timeout-ms"),
        ("tail_probe_ms = true".into(), "tail-probe-ms"),
        ("max_message_bytes = 65535".into(), "max-message-bytes"),
        ("max_message_bytes = -1".into(), "max-message-bytes"),
        ("log_format = \"xml\"".into(), "log-format"),
        ("topic = 1".into(), "topic"),
        ("hash_check = \"yes\"".into(), "hash-check"),
        ("hash_sample = 0".into(), "hash-sample"),
        ("hash_sample = \"all\"".into(), "hash-sample"),
        ("hash_check = true".into(), "hash-engine"),
        ("hash_check = true\nhash_engine = \"vllm\"".into(), "hash-engine-version"),
        (
            "hash_check = true\nhash_engine = \"vllm\"\nhash_engine_version = \"0.32\"\nhash_algo = \"md5\"".into(),
            "hash-algo",
        ),
        ("hash_check = true\nhash_engine = \"vllm\"\nhash_engine_version = \"0.28\"".into(), "hash-seed"),
        ("hash_seed = [0]".into(), "hash-seed"),
        (format!("[server]\ntls_cert = {pem:?}"), "server-tls-key"),
        (format!("[server]\ntls_key = {pem:?}"), "server-tls-cert"),
        (format!("[server]\ntls_cert = {missing:?}\ntls_key = {pem:?}"), "server-tls-cert"),
        (format!("[server]\ntls_cert = {pem:?}\ntls_key = {not_pem:?}"), "server-tls-key"),
        (format!("[server]\ntls_client_ca = {pem:?}"), "server-tls-client-ca"),
        (
            format!("[server]\ntls_cert = {pem:?}\ntls_key = {pem:?}\ntls_client_ca = {missing:?}"),
            "server-tls-client-ca",
        ),
        (format!("[server]\ntoken_file = {empty:?}"), "server-token-file"),
        (format!("[server]\ntoken_file = {missing:?}"), "server-token-file"),
        ("[server]\nrate_per_second = 0".into(), "server-rate-per-second"),
        ("[server]\nrate_burst = 0".into(), "server-rate-burst"),
        ("[server]\nmax_subscribers = 0".into(), "server-max-subscribers"),
        ("[server]\nmax_snapshots = 0".into(), "server-max-snapshots"),
        ("[server]\nthreads = 0".into(), "server-threads"),
        ("server = 1".into(), "config"),
        ("this is not toml".into(), "config"),
    ];
    for (text, setting) in &cases {
        let file = env.config(text);
        let e = load_err(&["--config", &file]);
        assert_eq!(e.setting, *setting, "{text:?}: {e}");
    }
    assert_eq!(load_err(&["--config", missing]).setting, "config");
}

#[test]
fn file_errors_say_where_and_what_was_expected() {
    let env = Env::new();
    let file = env.config("dp_size = \"two\"\n");
    assert_eq!(
        load_err(&["--config", &file]).to_string(),
        format!("invalid setting dp-size: {file} key `dp_size`: expected an integer from 0 to 4294967295, got string \"two\"")
    );
    let file = env.config("[server]\nrate_burst = 0\n");
    assert_eq!(load_err(&["--config", &file]).to_string(), "invalid setting server-rate-burst: must be at least 1");
}

#[test]
fn malformed_flags_and_environment_exit_with_ex_usage_and_help_exits_zero() {
    let _env = Env::new();
    let code = |extra: &[&str]| match parse(argv(extra)) {
        Ok(_) => panic!("{extra:?} parsed"),
        Err(e) => e.exit_code(),
    };
    assert_eq!(EX_USAGE, 64);
    assert_eq!(code(&["--dp-size", "two"]), 64);
    assert_eq!(code(&["--no-such-flag"]), 64);
    assert_eq!(code(&["--history-bytes", "1000"]), 64);
    assert_eq!(code(&["--help"]), 0);
    assert_eq!(code(&["--version"]), 0);
    std::env::set_var("KV_RELAY_DP_SIZE", "two");
    assert!(matches!(parse(argv(&[])), Err(LoadError::Usage(_))));
    assert_eq!(code(&[]), 64);
    let e = load_err(&[]);
    assert_eq!(e.setting, "arguments");
    assert!(e.why.contains("--dp-size"), "{e}");
}

#[test]
fn check_config_is_a_subcommand_after_the_flags() {
    let env = Env::new();
    let file = env.config("dp_size = 2\n");
    let inv = parse(argv(&["--config", &file, "check-config"])).unwrap();
    assert_eq!(inv.command, Some(Command::CheckConfig));
    assert_eq!(inv.config.ingest.dp_ranks, vec![0, 1]);
    assert_eq!(parse(argv(&["--config", &file])).unwrap().command, None);
}

fn full_file(env: &Env) -> String {
    let cert = env.file("server.crt", "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n");
    let key = env.file("server.key", "-----BEGIN PRIVATE KEY-----\nsecret\n-----END PRIVATE KEY-----\n");
    let ca = env.file("clients-ca.crt", "-----BEGIN CERTIFICATE-----\nMIIC\n-----END CERTIFICATE-----\n");
    let token = env.file("token", "s3cr3t-t0ken\n");
    env.config(&format!(
        r#"endpoint = "tcp://127.0.0.1:5557"
replay_endpoint = "tcp://127.0.0.1:5567"
dp_size = 2
topic = "kv"
engine_metrics_url = "http://127.0.0.1:8000/metrics"
load_poll_ms = 500
state_dir = "/var/lib/kv-relay/engine-a"
history_bytes = 134217728
listen = "0.0.0.0:50051"
log_format = "json"
hash_check = true
hash_engine = "vllm"
hash_engine_version = "0.32.0"
hash_seed = 0

[server]
tls_cert = {cert:?}
tls_key = {key:?}
tls_client_ca = {ca:?}
token_file = {token:?}
rate_per_second = 5
"#
    ))
}

#[test]
fn effective_configuration_is_the_merged_settings_with_secrets_redacted() {
    let env = Env::new();
    let file = full_file(&env);
    std::env::set_var("KV_RELAY_HEARTBEAT_MS", "2000");
    let c = load_ok(&["--config", &file, "--metrics-listen", "off"]);
    assert_eq!(c.server.bearer_token.as_deref(), Some("s3cr3t-t0ken"));
    assert!(c.server.tls.as_ref().is_some_and(|t| t.client_ca_pem.is_some()));
    let out = effective_toml(&c);
    assert!(!out.contains("s3cr3t"), "{out}");
    assert!(!out.contains("PRIVATE KEY"), "{out}");
    let out = out.replace(&env.path().to_string_lossy().into_owned(), "<dir>");
    insta::assert_snapshot!("effective_full", out);

    std::env::remove_var("KV_RELAY_HEARTBEAT_MS");
    let bare = effective_toml(&load_ok(&["--state-dir", "/var/lib/kv-relay/b"]));
    insta::assert_snapshot!("effective_defaults", bare);
}

#[test]
fn the_effective_configuration_loads_back_to_itself() {
    let env = Env::new();
    let file = full_file(&env);
    let first = effective_toml(&load_ok(&["--config", &file, "--dp-ranks", "0,3"]));
    let again = env.file("effective.toml", &first);
    let second = effective_toml(&load_ok(&["--config", again.to_str().unwrap()]));
    assert_eq!(first, second);
}

#[test]
fn the_annotated_example_in_deploy_is_valid_and_complete() {
    let _env = Env::new();
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/relay.toml");
    let text = std::fs::read_to_string(example).unwrap();
    let c = load_ok(&["--config", example]);
    assert_eq!(c.ingest.endpoint, "tcp://127.0.0.1:5557");
    // Every key is shown, set or commented out.
    let effective = effective_toml(&c);
    for line in effective.lines().filter(|l| !l.starts_with('#') && !l.starts_with('[') && l.contains(" = ")) {
        let key = line.split(" = ").next().unwrap();
        assert!(text.contains(&format!("{key} = ")), "deploy/relay.toml does not show `{key}`");
    }
    assert!(text.contains("dp_size = "));
}

#[test]
fn the_kubernetes_sidecars_configuration_loads() {
    let env = Env::new();
    let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/kubernetes/vllm-with-kv-relay.yaml");
    let yaml = std::fs::read_to_string(manifest).unwrap();
    // The ConfigMap's `relay.toml: |` block, unindented.
    let block: Vec<&str> = yaml
        .lines()
        .skip_while(|l| l.trim() != "relay.toml: |")
        .skip(1)
        .take_while(|l| l.starts_with("    ") || l.trim().is_empty())
        .map(|l| l.strip_prefix("    ").unwrap_or(""))
        .collect();
    assert!(block.len() > 5, "no relay.toml in {manifest}");
    let file = env.config(&block.join("\n"));
    let c = load_ok(&["--config", &file]);
    assert_eq!(c.ingest.replay_endpoint.as_deref(), Some("tcp://127.0.0.1:5567"));
    assert_eq!(c.listen, "0.0.0.0:50051".parse().unwrap());
    assert_eq!(c.state_dir, PathBuf::from("/var/lib/kv-relay"));
    assert!(c.json_logs);
}
