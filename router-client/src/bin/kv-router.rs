//! `kv-router`: the example router. Follows a set of kv-relays, holds the prefix index, and
//! answers match queries over HTTP (`POST /match`, `GET /workers`, `GET /metrics`).

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Parser as _;
use kv_router_client::cli::Args;
use kv_router_client::{http, FollowConfig, Follower};

/// The validated configuration: everything read before any port is bound.
struct Config {
    relays: Vec<String>,
    listen: SocketAddr,
    follow: FollowConfig,
}

fn config(args: Args) -> anyhow::Result<Config> {
    let mut relays = args.relays;
    if let Some(path) = &args.relays_file {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        relays.extend(text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).map(str::to_string));
    }
    if relays.is_empty() {
        bail!("no relay given: use --relay URL (repeatable) or --relays-file FILE");
    }
    let mut seen = std::collections::BTreeSet::new();
    relays.retain(|r| seen.insert(r.clone()));
    let tls_ca_pem = match &args.relay_ca {
        Some(p) => Some(std::fs::read(p).with_context(|| format!("reading {}", p.display()))?),
        None => None,
    };
    let follow = FollowConfig {
        stale_after: Duration::from_millis(args.stale_after_ms),
        receive_timeout: Duration::from_millis(args.receive_timeout_ms.max(1)),
        bearer_token: args.relay_token,
        tls_ca_pem,
        ..FollowConfig::default()
    };
    Ok(Config { relays, listen: args.listen, follow })
}

async fn run(cfg: Config) -> anyhow::Result<()> {
    let follower = Follower::new(cfg.follow);
    for r in &cfg.relays {
        follower.add_relay(r).with_context(|| format!("relay {r}"))?;
    }
    let listener =
        tokio::net::TcpListener::bind(cfg.listen).await.with_context(|| format!("binding {}", cfg.listen))?;
    let addr = listener.local_addr()?;
    println!("kv-router listening on http://{addr} following {} relay(s)", cfg.relays.len());
    tracing::info!(%addr, relays = cfg.relays.len(), "listening");
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    http::serve(listener, follower.clone(), shutdown).await.context("http server")?;
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
