//! The main job, with nothing to install but Rust: a kv-relay beside a built-in simulated engine
//! (two DP ranks of a vLLM-wire mock engine with a replay socket and a `/metrics` page, fed by a
//! seeded request stream, with a few batches dropped on the wire now and then), showing what the
//! relay does, then serving until Ctrl-C.

use clap::Parser;
use kv_relay::ctl::{self, Target};
use kv_relay_proto::pb;
use kv_relay_testkit::engine::{EngineConfig, MockEngine};
use kv_relay_testkit::traffic::{RandomSource, RequestSource};
use kv_relay_testkit::wire::{Engine, WireVersion};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

#[derive(Parser)]
#[command(name = "kv-relay-demo", about = "A kv-relay beside a simulated engine")]
struct Args {
    /// The relay's gRPC listen address.
    #[arg(long, default_value = "127.0.0.1:50051")]
    listen: String,
    /// The relay's Prometheus listen address (`off` to disable).
    #[arg(long, default_value = "127.0.0.1:9464")]
    metrics_listen: String,
    /// The simulated engine's first PUB port (rank r: +r; replay: +10 +r; /metrics: +20).
    #[arg(long, default_value_t = 15557)]
    engine_port: u16,
    /// Requests per second per rank.
    #[arg(long, default_value_t = 20)]
    rate: u32,
    /// The relay's state directory (default: a fresh temporary directory).
    #[arg(long)]
    state_dir: Option<std::path::PathBuf>,
    /// Stop after this many seconds (default: serve until Ctrl-C).
    #[arg(long)]
    seconds: Option<u64>,
}

fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let p = a.engine_port;
    let mut ec = EngineConfig::new(WireVersion::parse(Engine::Vllm, "0.32")?);
    ec.dp_size = 2;
    ec.endpoint = format!("tcp://127.0.0.1:{p}");
    ec.replay_endpoint = Some(format!("tcp://127.0.0.1:{}", p + 10));
    ec.topic = "kv".into();
    ec.metrics_listen = Some(format!("127.0.0.1:{}", p + 20).parse()?);
    ec.block_size = 16;
    ec.cache_blocks = 512;
    let engine = Arc::new(MockEngine::start(ec)?);
    println!(
        "simulated engine: vLLM 0.32 wire, 2 DP ranks on tcp://127.0.0.1:{p}+r, replay on :{}+r, metrics on :{}",
        p + 10,
        p + 20
    );

    let stop = Arc::new(AtomicBool::new(false));
    let traffic = {
        let (engine, stop, rate) = (engine.clone(), stop.clone(), a.rate.max(1));
        std::thread::spawn(move || {
            let mut src = RandomSource::new(42, 16, 24);
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                for r in 0..2 {
                    if let Some(req) = src.next_request() {
                        let _ = engine.serve_request(r, &req, false);
                    }
                }
                n += 1;
                if n.is_multiple_of(200) {
                    // Now and then the wire loses a few batches: the relay refills them.
                    let _ = engine.drop_on_wire((n / 200 % 2) as u32, 5);
                }
                std::thread::sleep(Duration::from_secs(1) / rate);
            }
        })
    };

    let tmp = tempfile::tempdir()?;
    let state_dir = a.state_dir.clone().unwrap_or_else(|| tmp.path().join("state"));
    let args = kv_relay::config::Args::try_parse_from([
        "kv-relay",
        "--endpoint",
        &format!("tcp://127.0.0.1:{p}"),
        "--replay-endpoint",
        &format!("tcp://127.0.0.1:{}", p + 10),
        "--dp-size",
        "2",
        "--topic",
        "kv",
        "--engine-metrics-url",
        &format!("http://127.0.0.1:{}/metrics", p + 20),
        "--state-dir",
        &state_dir.display().to_string(),
        "--listen",
        &a.listen,
        "--metrics-listen",
        &a.metrics_listen,
    ])?;
    let cfg = args.validate()?;
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .init();

    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async move {
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let seconds = a.seconds;
        let shutdown = async move {
            match seconds {
                Some(s) => tokio::time::sleep(Duration::from_secs(s)).await,
                None => {
                    let _ = tokio::signal::ctrl_c().await;
                }
            }
        };
        let relay = tokio::spawn(kv_relay::daemon::run(cfg, shutdown, move |r| {
            let _ = ready_tx.send(r.listen);
        }));
        let listen = ready_rx.await?;
        let url = format!("http://{listen}");
        println!("kv-relay: serving gRPC on {url}; state in {}", state_dir.display());
        tokio::time::sleep(Duration::from_secs(3)).await;
        let t = Target { url: url.clone(), ..Target::default() };
        let mut c = ctl::connect(&t).await?;
        let s = c.status(pb::StatusRequest {}).await?.into_inner();
        println!("\n$ relayctl status\n{}", ctl::status_table(&url, &s));
        let from = s.newest_cursor.saturating_sub(9).max(s.oldest_cursor);
        let req = pb::HistoryRequest { from_cursor: from, to_cursor: 0, limit: 10, ranks: vec![], epoch: s.epoch };
        let mut h = c.history(req).await?.into_inner();
        println!("$ relayctl history --limit 10\n{}", ctl::HISTORY_HEADER);
        while let Some(r) = h.message().await? {
            println!("{}", ctl::record_line(&r));
        }
        println!("\nserving until Ctrl-C; try: cargo run --release --bin relayctl -- --relay {url} status");
        let mut tick = tokio::time::interval(Duration::from_secs(10));
        tick.tick().await;
        let mut relay = relay;
        loop {
            tokio::select! {
                r = &mut relay => {
                    r??;
                    break;
                }
                _ = tick.tick() => {
                    if let Ok(s) = c.status(pb::StatusRequest {}).await {
                        let s = s.into_inner();
                        let states: Vec<String> = s.ranks.iter().map(|r| format!("rank {}: seq {}", r.dp_rank, r.last_engine_seq)).collect();
                        println!("newest cursor {}  history {} records  {}", s.newest_cursor, s.history_records, states.join("  "));
                    }
                }
            }
        }
        anyhow::Ok(())
    })?;
    stop.store(true, Ordering::Relaxed);
    let _ = traffic.join();
    Ok(())
}
