//! `relayctl`'s command line, here rather than in the binary so that the packaging's generator
//! (`xtask`) renders its man pages and shell completions from the same definition.

use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;

/// `relayctl`'s flags and subcommand.
#[derive(Parser)]
#[command(name = "relayctl", version, about = "Inspect a kv-relay, or decode an engine's KV-event wire")]
pub struct Cli {
    #[command(flatten)]
    pub target: TargetArgs,
    #[command(subcommand)]
    pub cmd: Cmd,
}

/// Which relay to ask, and how to authenticate (global: they go before or after the subcommand).
#[derive(Args)]
pub struct TargetArgs {
    /// The relay's gRPC address; `HOST:PORT` means `http://HOST:PORT` (`https://` with `--tls-*`).
    #[arg(long, global = true, env = "KV_RELAY_ADDR", default_value = "http://127.0.0.1:50051")]
    pub relay: String,
    /// Bearer token, when the relay requires one.
    #[arg(long, global = true, env = "KV_RELAY_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// CA certificate (PEM) to verify the relay's TLS certificate (enables TLS).
    #[arg(long, global = true, env = "KV_RELAY_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// Client certificate (PEM) for mutual TLS (with --tls-key).
    #[arg(long, global = true, env = "KV_RELAY_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// Client key (PEM) for mutual TLS (with --tls-cert).
    #[arg(long, global = true, env = "KV_RELAY_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// The name to verify in the relay's certificate.
    #[arg(long, global = true, env = "KV_RELAY_TLS_DOMAIN")]
    pub tls_domain: Option<String>,
}

/// What to do.
#[derive(Subcommand)]
pub enum Cmd {
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
        /// Keep following new records live (until interrupted).
        #[arg(long, conflicts_with = "to")]
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
