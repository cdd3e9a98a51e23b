//! `mock-engine`: a vLLM or SGLang KV-event publisher without GPUs, for end-to-end drills.
//!
//! It binds one PUB (and optionally one replay ROUTER) per DP rank, prints the bound
//! endpoints, plays a capture or generates traffic, and reads fault commands on stdin, one
//! per line, answering each with one line (`ok`, `error: ...`, or JSON). Type `help`.

use std::io::BufRead;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Parser;
use kv_relay_testkit::capture::{play, ranks_needed, read_capture};
use kv_relay_testkit::engine::{EngineConfig, Garbage, MockEngine};
use kv_relay_testkit::face::Fault;
use kv_relay_testkit::generate::{generate, GenerateOptions};
use kv_relay_testkit::metrics::Load;
use kv_relay_testkit::traffic::{MooncakeSource, RandomSource, RequestSource};
use kv_relay_testkit::wire::{Engine, ReplayLayout, WireVersion};

#[derive(Parser, Debug)]
#[command(
    name = "mock-engine",
    about = "A mock vLLM/SGLang KV-event publisher (PUB + replay ROUTER per DP rank) with faults on demand"
)]
struct Args {
    /// Which engine's wire to speak: vllm or sglang.
    #[arg(long, default_value = "vllm")]
    engine: String,
    /// Release whose layout to publish (e.g. 0.32, 0.9.1, 0.5.18); default: the newest known.
    #[arg(long)]
    wire_version: Option<String>,
    /// PUB endpoint of rank 0 (rank r: port + r; port 0: ephemeral per rank).
    #[arg(long, default_value = "tcp://127.0.0.1:5557")]
    endpoint: String,
    /// Replay ROUTER endpoint of rank 0 (rank r: port + r). None: no replay socket.
    #[arg(long)]
    replay_endpoint: Option<String>,
    /// Replay reply layout: old or new (default: the release's).
    #[arg(long)]
    replay_layout: Option<String>,
    #[arg(long, default_value_t = 1)]
    dp_size: u32,
    /// Topic frame (the engines' default is empty).
    #[arg(long, default_value = "")]
    topic: String,
    /// Replay buffer bound in batches.
    #[arg(long, default_value_t = 10_000)]
    buffer_steps: usize,
    /// Serve the HTTP face here (port 0: ephemeral): /metrics, /health, /v1/models and
    /// /v1/completions, /v1/chat/completions served by the ranks' prefix caches.
    #[arg(long, alias = "http-listen")]
    metrics_listen: Option<SocketAddr>,
    #[arg(long, default_value = "mock-model")]
    model_name: String,
    /// Play the pub lines of a capture file (testdata/fixtures/*.jsonl).
    #[arg(long, conflicts_with = "generate")]
    play: Option<PathBuf>,
    /// With --play: keep the recorded pace (default: as fast as possible).
    #[arg(long)]
    paced: bool,
    /// Generate traffic: `random` or `mooncake:FILE`.
    #[arg(long)]
    generate: Option<String>,
    /// Requests per second over all ranks (`50` or `50/s`); default: as fast as possible.
    #[arg(long)]
    rate: Option<String>,
    /// Stop generating after this many requests.
    #[arg(long)]
    requests: Option<u64>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Tokens per block of generated traffic.
    #[arg(long, default_value_t = 16)]
    block_size: u32,
    /// Prefix-cache capacity per rank, in blocks.
    #[arg(long, default_value_t = 1024)]
    cache_blocks: usize,
    /// Offload GPU evictions to a host tier of this many blocks per rank (CPU / CPU_PINNED).
    #[arg(long, default_value_t = 0)]
    host_tier_blocks: usize,
    /// vLLM: publish hashes as raw digests (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0).
    #[arg(long)]
    bytes_hashes: bool,
    /// SGLang: EAGLE bigram pages (token_ids as [a, b] pairs).
    #[arg(long)]
    eagle: bool,
    /// Per request, the chance that the rank's cache is reset first (AllBlocksCleared).
    #[arg(long, default_value_t = 0.0)]
    clear_probability: f64,
    /// Exit once the capture or generation is done (default: keep serving replay and
    /// commands until `quit` or a signal).
    #[arg(long)]
    exit_when_done: bool,
}

const HELP: &str = "commands (RANK omitted = every rank): drop N [RANK] | lose N [RANK] | \
trim-buffer KEEP [RANK] | delay DURATION [RANK] | restart RANK | stop RANK | start RANK | \
clear RANK | clear-next RANK | garbage RANK [frames|short-seq|not-msgpack|truncated|malformed-event] | \
layout old|new [RANK] | load RANK RUNNING WAITING USAGE | pause | resume | flush | truth | \
stats | endpoints | fault none|wedged|unhealthy|frozen|listener-gone | quit";

fn parse_rate(s: &str) -> anyhow::Result<f64> {
    let n = s.trim().trim_end_matches("/s");
    let r: f64 = n.parse().with_context(|| format!("bad --rate {s:?}"))?;
    if r <= 0.0 {
        bail!("--rate must be positive");
    }
    Ok(r)
}

/// `1500ms`, `2s`, `1.5s`, `250` (milliseconds).
fn parse_duration(s: &str) -> anyhow::Result<Duration> {
    let s = s.trim();
    if let Some(ms) = s.strip_suffix("ms") {
        return Ok(Duration::from_millis(ms.parse()?));
    }
    if let Some(secs) = s.strip_suffix('s') {
        return Ok(Duration::from_secs_f64(secs.parse()?));
    }
    Ok(Duration::from_millis(s.parse()?))
}

enum Traffic {
    None,
    Play(PathBuf, bool),
    Generate(Box<dyn RequestSource>, GenerateOptions),
}

fn build(args: &Args) -> anyhow::Result<(EngineConfig, Traffic)> {
    let engine = Engine::parse(&args.engine)?;
    let wire = match &args.wire_version {
        Some(v) => WireVersion::parse(engine, v)?,
        None => WireVersion::latest(engine),
    };
    let mut cfg = EngineConfig::new(wire);
    cfg.dp_size = args.dp_size.max(1);
    cfg.endpoint = args.endpoint.clone();
    cfg.replay_endpoint = args.replay_endpoint.clone();
    cfg.replay_layout = args.replay_layout.as_deref().map(ReplayLayout::parse).transpose()?;
    cfg.topic = args.topic.clone();
    cfg.buffer_steps = args.buffer_steps;
    cfg.metrics_listen = args.metrics_listen;
    cfg.model_name = args.model_name.clone();
    cfg.block_size = args.block_size.max(1);
    cfg.cache_blocks = args.cache_blocks.max(1);
    cfg.host_tier_blocks = args.host_tier_blocks;
    cfg.bytes_hashes = args.bytes_hashes;
    cfg.eagle = args.eagle;
    let traffic = if let Some(path) = &args.play {
        let lines = read_capture(path)?;
        cfg.dp_size = cfg.dp_size.max(ranks_needed(&lines));
        Traffic::Play(path.clone(), args.paced)
    } else if let Some(g) = &args.generate {
        let source: Box<dyn RequestSource> = if g == "random" {
            Box::new(RandomSource::new(args.seed, cfg.block_size, 8))
        } else if let Some(file) = g.strip_prefix("mooncake:") {
            Box::new(MooncakeSource::open(file.as_ref(), cfg.block_size).with_context(|| format!("reading {file}"))?)
        } else {
            bail!("--generate takes random or mooncake:FILE, not {g:?}");
        };
        let opts = GenerateOptions {
            rate: args.rate.as_deref().map(parse_rate).transpose()?,
            max_requests: args.requests,
            clear_probability: args.clear_probability,
            seed: args.seed,
        };
        Traffic::Generate(source, opts)
    } else {
        Traffic::None
    };
    Ok((cfg, traffic))
}

fn ranks_arg(engine: &MockEngine, arg: Option<&&str>) -> anyhow::Result<Vec<u32>> {
    match arg {
        None => Ok((0..engine.dp_size()).collect()),
        Some(r) => Ok(vec![r.parse().with_context(|| format!("bad rank {r:?}"))?]),
    }
}

fn one_rank(arg: Option<&&str>) -> anyhow::Result<u32> {
    arg.context("needs a RANK")?.parse().context("RANK must be a number")
}

/// Carry out one command line; the answer is one line.
fn command(engine: &MockEngine, line: &str) -> anyhow::Result<Option<String>> {
    let words: Vec<&str> = line.split_whitespace().collect();
    let Some((&cmd, rest)) = words.split_first() else {
        return Ok(None);
    };
    let num =
        |i: usize| -> anyhow::Result<u64> { rest.get(i).context("needs a number")?.parse().context("not a number") };
    match cmd {
        "help" => return Ok(Some(HELP.to_string())),
        "drop" => {
            let n = num(0)?;
            for r in ranks_arg(engine, rest.get(1))? {
                engine.drop_on_wire(r, n)?;
            }
        }
        "lose" => {
            let n = num(0)?;
            for r in ranks_arg(engine, rest.get(1))? {
                engine.lose(r, n)?;
            }
        }
        "trim-buffer" => {
            let keep = num(0)? as usize;
            for r in ranks_arg(engine, rest.get(1))? {
                engine.trim_buffer(r, keep)?;
            }
        }
        "delay" => {
            let d = parse_duration(rest.first().context("needs a DURATION")?)?;
            for r in ranks_arg(engine, rest.get(1))? {
                engine.delay(r, d)?;
            }
        }
        "layout" => {
            let l = ReplayLayout::parse(rest.first().context("needs old or new")?)?;
            for r in ranks_arg(engine, rest.get(1))? {
                engine.set_replay_layout(r, l)?;
            }
        }
        "restart" => engine.restart(one_rank(rest.first())?)?,
        "stop" => engine.stop(one_rank(rest.first())?)?,
        "start" => engine.start_rank(one_rank(rest.first())?)?,
        "clear" => engine.clear(one_rank(rest.first())?)?,
        "clear-next" => engine.clear_with_next_batch(one_rank(rest.first())?)?,
        "garbage" => {
            let rank = one_rank(rest.first())?;
            let kind = match rest.get(1) {
                None => Garbage::NotMsgpack,
                Some(k) => Garbage::parse(k).with_context(|| format!("unknown garbage {k:?}"))?,
            };
            engine.garbage(rank, kind)?;
        }
        "load" => {
            let rank = one_rank(rest.first())?;
            let usage: f64 = rest.get(3).context("needs USAGE")?.parse()?;
            engine.set_load(rank, Load { running: num(1)? as u32, waiting: num(2)? as u32, kv_usage: usage })?;
        }
        "pause" => engine.pause(),
        "resume" => engine.resume(),
        "fault" => {
            let f = match *rest.first().context("needs a fault")? {
                "none" => Fault::None,
                "wedged" => Fault::Wedged,
                "unhealthy" => Fault::Unhealthy,
                "frozen" => Fault::Frozen,
                "listener-gone" => Fault::ListenerGone,
                other => bail!("unknown fault {other:?}"),
            };
            engine.face().context("no HTTP face: start with --http-listen")?.set_fault(f)?;
        }
        "flush" => engine.flush()?,
        "truth" => {
            engine.flush()?;
            return Ok(Some(serde_json::json!({ "truth": engine.truth().to_json() }).to_string()));
        }
        "stats" => {
            engine.flush()?;
            let stats = (0..engine.dp_size()).map(|r| engine.stats(r)).collect::<Result<Vec<_>, _>>()?;
            return Ok(Some(serde_json::json!({ "stats": stats }).to_string()));
        }
        "endpoints" => return Ok(Some(endpoints_json(engine).to_string())),
        other => bail!("unknown command {other:?} (try help)"),
    }
    Ok(Some("ok".to_string()))
}

fn endpoints_json(engine: &MockEngine) -> serde_json::Value {
    serde_json::json!({
        "wire": engine.wire().to_string(),
        "ranks": engine.endpoints(),
        "metrics": engine.metrics_addr().map(|a| format!("http://{a}/metrics")),
        "url": engine.url(),
    })
}

fn run(args: Args) -> anyhow::Result<()> {
    let (cfg, traffic) = build(&args)?;
    let engine = Arc::new(MockEngine::start(cfg).context("starting the mock engine")?);
    engine.serve_completions();
    for ep in engine.endpoints() {
        println!("rank {} pub {} replay {}", ep.rank, ep.publisher, ep.replay.as_deref().unwrap_or("none"));
    }
    if let Some(a) = engine.metrics_addr() {
        println!("metrics http://{a}/metrics");
    }
    println!("ready {}", endpoints_json(&engine));

    let stop = Arc::new(AtomicBool::new(false));
    let (done_tx, done_rx) = mpsc::channel::<String>();
    let worker = {
        let engine = engine.clone();
        let stop = stop.clone();
        std::thread::spawn(move || {
            let msg = match traffic {
                Traffic::None => return,
                Traffic::Play(path, paced) => read_capture(&path)
                    .map_err(anyhow::Error::from)
                    .and_then(|lines| Ok(play(&engine, &lines, paced, &stop)?))
                    .map(|r| format!("done {}", serde_json::json!({ "play": r })))
                    .unwrap_or_else(|e| format!("error: {e:#}")),
                Traffic::Generate(mut source, opts) => match generate(&engine, source.as_mut(), &opts, &stop) {
                    Ok(n) => format!("done {}", serde_json::json!({ "requests": n })),
                    Err(e) => format!("error: {e}"),
                },
            };
            let _ = engine.flush();
            let _ = done_tx.send(msg);
        })
    };

    let (line_tx, line_rx) = mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            if line_tx.send(line).is_err() {
                break;
            }
        }
    });

    let mut stdin_open = true;
    loop {
        if let Ok(msg) = done_rx.try_recv() {
            println!("{msg}");
            if args.exit_when_done {
                break;
            }
        }
        if !stdin_open {
            std::thread::sleep(Duration::from_millis(100));
            continue;
        }
        match line_rx.recv_timeout(Duration::from_millis(50)) {
            Ok(line) => {
                let line = line.trim();
                if line == "quit" || line == "exit" {
                    break;
                }
                match command(&engine, line) {
                    Ok(Some(answer)) => println!("{answer}"),
                    Ok(None) => {}
                    Err(e) => println!("error: {e:#}"),
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            // stdin closed: keep serving until killed (or until done with --exit-when-done).
            Err(mpsc::RecvTimeoutError::Disconnected) => stdin_open = false,
        }
    }
    stop.store(true, Ordering::SeqCst);
    engine.resume();
    let _ = worker.join();
    Ok(())
}

fn main() {
    let args = Args::parse();
    if let Err(e) = run(args) {
        eprintln!("mock-engine: {e:#}");
        std::process::exit(64);
    }
}
