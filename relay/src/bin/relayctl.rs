//! `relayctl`: inspect a kv-relay (`status`, `history`, `snapshot`), or decode a capture of an
//! engine's wire (`decode`).

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand};
use kv_relay::ctl::{self, CtlError, SnapshotSummary, Target};
use kv_relay_proto::pb;
use std::io::{IsTerminal as _, Write as _};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "relayctl", version, about = "Inspect a kv-relay, or decode an engine's KV-event wire")]
struct Cli {
    #[command(flatten)]
    target: TargetArgs,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Args)]
struct TargetArgs {
    /// The relay's gRPC address.
    #[arg(long, global = true, env = "KV_RELAY_ADDR", default_value = "http://127.0.0.1:50051")]
    relay: String,
    /// Bearer token, when the relay requires one.
    #[arg(long, global = true, env = "KV_RELAY_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// CA certificate (PEM) to verify the relay's TLS certificate (enables TLS).
    #[arg(long, global = true, env = "KV_RELAY_TLS_CA")]
    tls_ca: Option<PathBuf>,
    /// Client certificate (PEM) for mutual TLS.
    #[arg(long, global = true, env = "KV_RELAY_TLS_CERT")]
    tls_cert: Option<PathBuf>,
    /// Client key (PEM) for mutual TLS.
    #[arg(long, global = true, env = "KV_RELAY_TLS_KEY")]
    tls_key: Option<PathBuf>,
    /// The name to verify in the relay's certificate.
    #[arg(long, global = true, env = "KV_RELAY_TLS_DOMAIN")]
    tls_domain: Option<String>,
}

#[derive(Subcommand)]
enum Cmd {
    /// The relay at a glance: epoch, engine, ranks and their state, cursors, history, counters.
    Status {
        #[arg(long)]
        json: bool,
    },
    /// Committed batches and rank events (default: the newest 20).
    History {
        /// Only these DP ranks (repeatable).
        #[arg(long)]
        rank: Vec<u32>,
        /// First cursor (inclusive).
        #[arg(long)]
        from: Option<u64>,
        /// Last cursor (inclusive).
        #[arg(long)]
        to: Option<u64>,
        /// At most this many records.
        #[arg(long)]
        limit: Option<u32>,
        /// Keep following new records live.
        #[arg(long)]
        follow: bool,
        /// One JSON object per record.
        #[arg(long)]
        json: bool,
    },
    /// The live blocks, summarized per rank, tier and group.
    Snapshot {
        /// List every block.
        #[arg(long)]
        blocks: bool,
        /// Include each block's token ids.
        #[arg(long)]
        include_token_ids: bool,
        /// Only these DP ranks (repeatable).
        #[arg(long)]
        rank: Vec<u32>,
        /// Only these tiers: device, host, disk, external, or another medium's name (repeatable).
        #[arg(long)]
        tier: Vec<String>,
        #[arg(long)]
        json: bool,
    },
    /// Decode a capture file (JSON Lines of recorded ZeroMQ messages) and print every batch.
    Decode {
        /// The capture file.
        file: PathBuf,
        /// One JSON object per message instead of a table.
        #[arg(long)]
        json: bool,
    },
}

fn out(s: &str) -> anyhow::Result<()> {
    std::io::stdout().write_all(s.as_bytes()).context("writing to stdout")
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let t = Target {
        url: cli.target.relay.clone(),
        token: cli.target.token.clone(),
        tls_ca: cli.target.tls_ca.clone(),
        tls_cert: cli.target.tls_cert.clone(),
        tls_key: cli.target.tls_key.clone(),
        tls_domain: cli.target.tls_domain.clone(),
    };
    let url = t.url.clone();
    let rpc = |s: tonic::Status| CtlError::rpc(&url, s);
    match cli.cmd {
        Cmd::Decode { file, json } => {
            let messages = kv_relay::capture::read(&file)?;
            let walk = kv_relay::capture::walk(&messages);
            out(&if json {
                kv_relay::decode_cmd::render_json(&messages, &walk)
            } else {
                kv_relay::decode_cmd::render_table(&messages, &walk)
            })?;
        }
        Cmd::Status { json } => {
            let mut c = ctl::connect(&t).await?;
            let s = c.status(pb::StatusRequest {}).await.map_err(rpc)?.into_inner();
            if json {
                out(&format!("{}\n", serde_json::to_string_pretty(&ctl::status_json(&url, &s))?))?;
            } else {
                out(&ctl::status_table(&url, &s))?;
            }
        }
        Cmd::History { rank, from, to, limit, follow, json } => {
            let mut c = ctl::connect(&t).await?;
            let s = c.status(pb::StatusRequest {}).await.map_err(rpc)?.into_inner();
            let (from, limit) = match (from, to, limit) {
                (Some(f), _, l) => (f, l.unwrap_or(0)),
                (None, Some(to), l) => {
                    let l = l.unwrap_or(20);
                    (to.saturating_sub(u64::from(l)).saturating_add(1).max(s.oldest_cursor), l)
                }
                (None, None, l) => {
                    let l = l.unwrap_or(20);
                    (s.newest_cursor.saturating_sub(u64::from(l)).saturating_add(1).max(s.oldest_cursor), l)
                }
            };
            if !json {
                out(&format!("{}\n", ctl::HISTORY_HEADER))?;
            }
            let mut last = from.saturating_sub(1);
            if s.newest_cursor >= from {
                let req = pb::HistoryRequest {
                    from_cursor: from,
                    to_cursor: to.unwrap_or(0),
                    limit,
                    ranks: rank.clone(),
                    epoch: s.epoch,
                };
                let mut stream = c.history(req).await.map_err(rpc)?.into_inner();
                while let Some(r) = stream.message().await.map_err(rpc)? {
                    last = match &r.record {
                        Some(pb::history_response::Record::Batch(b)) => b.cursor,
                        Some(pb::history_response::Record::Control(c)) => c.cursor,
                        None => last,
                    };
                    out(&format!("{}\n", if json { ctl::record_json(&r).to_string() } else { ctl::record_line(&r) }))?;
                }
            }
            if follow {
                let req = pb::SubscribeRequest {
                    epoch: s.epoch,
                    after_cursor: last.max(s.newest_cursor.min(last)),
                    incarnation: s.incarnation,
                    allow_snapshot: false,
                    ranks: rank,
                    snapshot_token_ids: false,
                };
                let mut stream = c.subscribe(req).await.map_err(rpc)?.into_inner();
                while let Some(m) = stream.message().await.map_err(rpc)? {
                    let line = match m.message {
                        Some(pb::subscribe_response::Message::Batch(b)) if json => ctl::batch_json(&b).to_string(),
                        Some(pb::subscribe_response::Message::Batch(b)) => ctl::batch_line(&b),
                        Some(pb::subscribe_response::Message::Control(c)) if json => ctl::control_json(&c).to_string(),
                        Some(pb::subscribe_response::Message::Control(c)) => ctl::control_line(&c),
                        Some(pb::subscribe_response::Message::Resync(r)) => {
                            anyhow::bail!("the relay asked to resync: {} (oldest cursor {})", r.reason, r.oldest_cursor)
                        }
                        _ => continue,
                    };
                    out(&format!("{line}\n"))?;
                }
            }
        }
        Cmd::Snapshot { blocks, include_token_ids, rank, tier, json } => {
            let mut c = ctl::connect(&t).await?;
            let req = pb::SnapshotRequest { ranks: rank, tiers: tier, include_token_ids };
            let mut stream = c.snapshot(req).await.map_err(rpc)?.into_inner();
            let mut sum = SnapshotSummary::default();
            let progress = std::io::stderr().is_terminal();
            let mut n = 0u64;
            while let Some(m) = stream.message().await.map_err(rpc)? {
                match m.message {
                    Some(pb::snapshot_response::Message::Begin(b)) => {
                        sum.cursor = b.cursor;
                        sum.epoch = b.epoch;
                        sum.incarnation = b.incarnation;
                    }
                    Some(pb::snapshot_response::Message::Chunk(ch)) => {
                        for b in ch.blocks {
                            sum.add(b, blocks);
                            n += 1;
                        }
                        if progress {
                            eprint!("\rreceived {n} blocks");
                        }
                    }
                    Some(pb::snapshot_response::Message::End(e)) => sum.cursor = e.cursor,
                    None => {}
                }
            }
            if progress && n > 0 {
                eprintln!();
            }
            if json {
                out(&format!("{}\n", serde_json::to_string_pretty(&sum.json(blocks, include_token_ids))?))?;
            } else {
                out(&sum.table(blocks))?;
            }
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("relayctl: cannot start: {e}");
            return ExitCode::from(2);
        }
    };
    match rt.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            if e.chain().any(|c| {
                c.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
            }) {
                return ExitCode::SUCCESS;
            }
            eprintln!("relayctl: {e}");
            for cause in e.chain().skip(1) {
                eprintln!("  caused by: {cause}");
            }
            ExitCode::from(2)
        }
    }
}
