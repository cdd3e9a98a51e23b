//! `kv-router`: the router. Follows a set of kv-relays, holds the prefix index, routes
//! (`POST /route`, `POST /route/report`), serves OpenAI requests in front of the engines
//! (`/v1/completions`, `/v1/chat/completions`, `/v1/models`), and answers match queries
//! (`POST /match`, `GET /workers`, `GET /metrics`).
//!
//! Two runtimes. The relays' streams (one task each, a thousand in a fleet) and discovery run
//! on the main multi-threaded runtime; the HTTP API runs on a runtime of its own, on its own
//! threads (`--http-threads`). A `/match` then never waits in a run queue behind the streams'
//! tasks: it reads the index and the workers' views without locks, so it only needs a core. The
//! streams' threads run nicer (`--stream-niceness`, 5 by default), so that it gets one first on
//! a host whose cores the streams keep busy.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Parser as _;
use kv_router::cli::Args;
use kv_router::front::FrontConfig;
use kv_router::http::HashSettings;
use kv_router::{http, CacheAwareConfig, Overload, Router, RouterConfig, TrackerConfig};
use kv_router_client::discovery::{parse_relays_file, Discovery, DnsName, SystemResolver};
use kv_router_client::{validate_url, FollowConfig, Follower};

/// The validated configuration: everything read before any port is bound.
struct Config {
    relays: Vec<String>,
    relays_file: Option<PathBuf>,
    names: Vec<DnsName>,
    interval: Duration,
    grace: Duration,
    listen: SocketAddr,
    http_threads: usize,
    stream_niceness: u8,
    follow: FollowConfig,
    routing: RouterConfig,
    front: FrontConfig,
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
    let hash = match &args.engine_hash {
        Some(j) => {
            let h: HashSettings = serde_json::from_str(j).with_context(|| format!("--engine-hash {j}"))?;
            Some(h.resolve().map_err(|e| anyhow::anyhow!("--engine-hash: {e}"))?)
        }
        None => None,
    };
    let tokenizer = match &args.model_dir {
        Some(dir) => {
            let t = kv_router::tokenize::Tokenizer::from_dir(dir).with_context(|| "--model-dir".to_string())?;
            tracing::info!(dir = %dir.display(), chat_template = t.has_chat_template(), "tokenizer loaded");
            Some(Arc::new(t))
        }
        None => None,
    };
    if hash.is_none() && (tokenizer.is_some() || args.tokenize_via_engine) {
        tracing::warn!("--model-dir / --tokenize-via-engine without --engine-hash: prompts are tokenized, but routed by load alone");
    }
    let front = FrontConfig {
        hash,
        connect_timeout: Duration::from_millis(args.engine_connect_timeout_ms),
        tokenizer,
        tokenize_via_engine: args.tokenize_via_engine,
    };
    let follow = FollowConfig {
        stale_after: Duration::from_secs_f64(args.worker_stall_secs),
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
        http_threads: args.http_threads as usize,
        stream_niceness: args.stream_niceness,
        follow,
        routing: RouterConfig {
            policy: args.policy,
            cache_aware: CacheAwareConfig {
                host_discount: args.host_discount,
                prefill_us_per_block: args.prefill_us_per_block,
                queue_us_per_request: args.queue_us_per_request,
                warm_share: args.warm_share,
                overload: Overload {
                    enabled: !args.no_overload_protection,
                    kv_usage: args.overload_kv_usage,
                    waiting: args.overload_waiting,
                    shed: args.shed,
                },
                ..CacheAwareConfig::default()
            },
            tracker: TrackerConfig {
                retry_after: Duration::from_millis(args.retry_after_ms),
                ..TrackerConfig::default()
            },
            ..RouterConfig::default()
        },
        front,
    })
}

async fn run(cfg: Config) -> anyhow::Result<()> {
    let follower = Follower::new(cfg.follow);
    let router = Arc::new(Router::new(follower.clone(), cfg.routing));
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
    let listener = listen(cfg.listen).with_context(|| format!("binding {}", cfg.listen))?;
    let addr = listener.local_addr()?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let mut http = serve_http(listener, router.clone(), cfg.front, cfg.http_threads, stopped)?;
    println!("kv-router listening on http://{addr} following {following} relay(s), policy {}", router.policy());
    tracing::info!(%addr, relays = following, http_threads = cfg.http_threads, "listening");
    let rediscover = changing.then(|| {
        let interval = cfg.interval;
        tokio::spawn(async move {
            tokio::time::sleep(interval).await;
            discovery.run(interval, std::future::pending()).await;
        })
    });
    let served = tokio::select! {
        _ = tokio::signal::ctrl_c() => {
            let _ = stop.send(());
            (&mut http).await
        }
        r = &mut http => r,
    };
    if let Some(task) = rediscover {
        task.abort();
    }
    follower.shutdown().await;
    match served {
        Ok(r) => r.context("http server"),
        Err(_) => bail!("http server: its thread ended without a result"),
    }
}

/// The connections the kernel queues for the HTTP listener before it accepts them (capped by
/// `net.core.somaxconn`): a burst of clients connecting at once waits in the queue instead of
/// having its handshakes dropped and retried (std's `bind` queues 128).
const LISTEN_BACKLOG: u32 = 4096;

/// A listening socket on `addr` with [`LISTEN_BACKLOG`], non-blocking, for the HTTP runtime.
fn listen(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    let socket = if addr.is_ipv4() { tokio::net::TcpSocket::new_v4()? } else { tokio::net::TcpSocket::new_v6()? };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)?.into_std()
}

/// Serves the HTTP API on `threads` threads of a runtime of its own (see the module docs) until
/// `stop` fires; the receiver gets the server's result when it ends.
fn serve_http(
    listener: std::net::TcpListener,
    router: Arc<Router>,
    front: FrontConfig,
    threads: usize,
    stop: tokio::sync::oneshot::Receiver<()>,
) -> anyhow::Result<tokio::sync::oneshot::Receiver<std::io::Result<()>>> {
    let rt = match threads {
        1 => tokio::runtime::Builder::new_current_thread().enable_all().build(),
        n => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(n)
            .thread_name("kv-router-http")
            .enable_all()
            .build(),
    }
    .context("starting the HTTP runtime")?;
    let (done, result) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("kv-router-http".into())
        .spawn(move || {
            let r = rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener)?;
                http::serve_with(listener, router, front, async move {
                    let _ = stop.await;
                })
                .await
            });
            let _ = done.send(r);
        })
        .context("starting the HTTP thread")?;
    Ok(result)
}

/// Adds `by` to this thread's niceness (Linux keeps one per thread). A failure is logged once:
/// the streams then run at the HTTP thread's priority, as with `--stream-niceness 0`.
fn renice_this_thread(by: u8) {
    if by == 0 {
        return;
    }
    let tid = rustix::thread::gettid();
    let r = rustix::process::getpriority_process(Some(tid))
        .and_then(|now| rustix::process::setpriority_process(Some(tid), (now + i32::from(by)).min(19)));
    if let Err(e) = r {
        static WARNED: std::sync::Once = std::sync::Once::new();
        WARNED.call_once(|| tracing::warn!(error = %e, "could not lower the streams' threads' priority"));
    }
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "kv_router_client=info,kv_router=info".into()),
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
    let niceness = cfg.stream_niceness;
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .on_thread_start(move || renice_this_thread(niceness))
        .build()
    {
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
