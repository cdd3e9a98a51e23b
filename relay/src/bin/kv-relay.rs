//! `kv-relay`: the daemon. Parses its settings, sets up logging, and runs
//! [`kv_relay::daemon::run`] until SIGTERM or Ctrl-C.

use clap::Parser;
use kv_relay::config::Args;
use std::process::ExitCode;

/// `EX_USAGE`: bad configuration.
const EX_USAGE: u8 = 64;

fn main() -> ExitCode {
    let args = Args::parse();
    let cfg = match args.validate() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kv-relay: {e}");
            return ExitCode::from(EX_USAGE);
        }
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("KV_RELAY_LOG").unwrap_or_else(|_| "info".into());
    if cfg.json_logs {
        tracing_subscriber::fmt().json().with_env_filter(filter).init();
    } else {
        tracing_subscriber::fmt().with_env_filter(filter).init();
    }
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kv-relay: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let shutdown = async {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGTERM; stop with Ctrl-C");
                let _ = tokio::signal::ctrl_c().await;
                return;
            }
        };
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: draining"),
            _ = tokio::signal::ctrl_c() => tracing::info!("interrupted: draining"),
        }
    };
    let result = rt.block_on(kv_relay::daemon::run(cfg, shutdown, |r| {
        tracing::info!(
            listen = %r.listen,
            epoch = format!("{:016x}", r.store.epoch()),
            incarnation = r.store.incarnation(),
            "kv-relay ready"
        );
    }));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "kv-relay stopped");
            eprintln!("kv-relay: {e}");
            ExitCode::FAILURE
        }
    }
}
