//! `kv-router`: the example router. Follows a set of kv-relays, holds the prefix index, and
//! answers match queries over HTTP (`POST /match`, `GET /workers`, `GET /metrics`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Parser as _;
use kv_router_client::cli::Args;
use kv_router_client::discovery::{parse_relays_file, Discovery, DnsName, SystemResolver};
use kv_router_client::{http, validate_url, FollowConfig, Follower};

/// The validated configuration: everything read before any port is bound.
struct Config {
    relays: Vec<String>,
    relays_file: Option<PathBuf>,
    names: Vec<DnsName>,
    interval: Duration,
    grace: Duration,
    listen: SocketAddr,
    follow: FollowConfig,
}

fn config(args: Args) -> anyhow::Result<Config> {
    for r in &args.relays {
        validate_url(r.trim()).with_context(|| "--relay".to_string())?;
    }
    if let Some(path) = &args.relays_file {
        // Read once here so that a missing or malformed file is a usage error at start; later
        // reads that fail keep the relays followed.
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        parse_relays_file(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    } else if args.relays.is_empty() && args.relays_dns.is_empty() {
        bail!(
            "no relay given: use --relay URL (repeatable), --relays-file FILE or --relays-dns NAME:PORT (repeatable)"
        );
    }
    let tls_ca_pem = match &args.relay_ca {
        Some(p) => Some(std::fs::read(p).with_context(|| format!("reading {}", p.display()))?),
        None => None,
    };
    let follow = FollowConfig {
        stale_after: Duration::from_millis(args.stale_after_ms),
        receive_timeout: Duration::from_millis(args.receive_timeout_ms.max(1)),
        bearer_token: args.relay_token,
        tls_ca_pem,
        max_concurrent_resyncs: args.max_concurrent_resyncs as usize,
        start_jitter: Duration::from_millis(args.start_jitter_ms),
        ..FollowConfig::default()
    };
    Ok(Config {
        relays: args.relays,
        relays_file: args.relays_file,
        names: args.relays_dns,
        interval: Duration::from_millis(args.dns_interval_ms),
        grace: Duration::from_millis(args.dns_grace_ms),
        listen: args.listen,
        follow,
    })
}

async fn run(cfg: Config) -> anyhow::Result<()> {
    let follower = Follower::new(cfg.follow);
    let mut discovery = Discovery::new(follower.clone(), Arc::new(SystemResolver)).with_grace(cfg.grace);
    for r in &cfg.relays {
        discovery.add_url(r).with_context(|| format!("relay {r}"))?;
    }
    let changing = cfg.relays_file.is_some() || !cfg.names.is_empty();
    if let Some(path) = cfg.relays_file {
        discovery.add_file(path);
    }
    for name in cfg.names {
        discovery.add_name(name);
    }
    // The first poll before listening: fixed relays, the file and the names' first answers.
    discovery.poll(tokio::time::Instant::now()).await;
    let following = discovery.followed().count();
    let listener =
        tokio::net::TcpListener::bind(cfg.listen).await.with_context(|| format!("binding {}", cfg.listen))?;
    let addr = listener.local_addr()?;
    println!("kv-router listening on http://{addr} following {following} relay(s)");
    tracing::info!(%addr, relays = following, "listening");
    let rediscover = changing.then(|| {
        let interval = cfg.interval;
        tokio::spawn(async move {
            tokio::time::sleep(interval).await;
            discovery.run(interval, std::future::pending()).await;
        })
    });
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    http::serve(listener, follower.clone(), shutdown).await.context("http server")?;
    if let Some(task) = rediscover {
        task.abort();
    }
    follower.shutdown().await;
    Ok(())
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "kv_router_client=info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let cfg = match config(args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kv-router: {e:#}");
            return ExitCode::from(64); // EX_USAGE
        }
    };
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kv-router: starting the runtime: {e}");
            return ExitCode::from(2);
        }
    };
    match rt.block_on(run(cfg)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprint!("kv-router: error");
            for cause in e.chain() {
                eprint!(": {cause}");
            }
            eprintln!();
            ExitCode::from(2)
        }
    }
}
