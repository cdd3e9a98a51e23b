//! `relayctl`: inspect a kv-relay, or decode a capture of an engine's wire.

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "relayctl", version, about = "Inspect a kv-relay, or decode an engine's KV-event wire")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Decode a capture file (JSON Lines of recorded ZeroMQ messages) and print every batch.
    Decode {
        /// The capture file.
        file: PathBuf,
        /// One JSON object per message instead of a table.
        #[arg(long)]
        json: bool,
    },
}

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.cmd {
        Cmd::Decode { file, json } => {
            let messages = kv_relay::capture::read(&file)?;
            let walk = kv_relay::capture::walk(&messages);
            let out = if json {
                kv_relay::decode_cmd::render_json(&messages, &walk)
            } else {
                kv_relay::decode_cmd::render_table(&messages, &walk)
            };
            std::io::stdout().write_all(out.as_bytes()).context("writing to stdout")?;
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
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
