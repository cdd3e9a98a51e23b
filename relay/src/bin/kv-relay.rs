//! `kv-relay`: the daemon. Loads its settings (flags > environment > file > defaults), sets up
//! logging, and runs [`kv_relay::daemon::run`] until SIGTERM or Ctrl-C; `check-config` prints
//! the effective configuration and exits.

use kv_relay::config::Command;
use kv_relay::config_file::{self, LoadError};
use kv_relay::notify;
use std::process::ExitCode;

/// mimalloc, returning freed memory at once (`kv_relay_alloc`): the relay allocates and frees
/// per block (decode, commit, encode), where glibc's malloc cost a third of its CPU.
#[global_allocator]
static ALLOC: kv_relay_alloc::Allocator = kv_relay_alloc::Allocator;

fn main() -> ExitCode {
    let inv = match config_file::parse(std::env::args_os()) {
        Ok(inv) => inv,
        Err(e @ LoadError::Usage(_)) => {
            let code = e.exit_code();
            if let LoadError::Usage(clap) = &e {
                let _ = clap.print();
            }
            return ExitCode::from(code as u8);
        }
        Err(e @ LoadError::Config(_)) => {
            eprintln!("kv-relay: {e}");
            return ExitCode::from(e.exit_code() as u8);
        }
    };
    let cfg = inv.config;
    if let Some(Command::CheckConfig) = inv.command {
        print!("{}", config_file::effective_toml(&cfg));
        return ExitCode::SUCCESS;
    }
    let filter = tracing_subscriber::EnvFilter::try_from_env("KV_RELAY_LOG").unwrap_or_else(|_| "info".into());
    if cfg.json_logs {
        tracing_subscriber::fmt().json().with_env_filter(filter).init();
    } else {
        tracing_subscriber::fmt().with_env_filter(filter).init();
    }
    if !kv_relay_alloc::tuned() {
        tracing::warn!(
            "mimalloc's options were set after its first arena: idle memory may stay higher; set \
             MIMALLOC_PURGE_DELAY=0 and MIMALLOC_ARENA_EAGER_COMMIT=0 in the environment"
        );
    }
    // The server's threads (`--server-threads`): the rank threads commit on their own, so one
    // worker serves a quiet relay with one wakeup a batch; more workers wake each other.
    let rt = match tokio::runtime::Builder::new_multi_thread().worker_threads(cfg.server.threads).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kv-relay: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    // The SIGTERM handler is installed now, before anything starts: a SIGTERM that arrives during
    // start-up then drains like any other instead of killing the process.
    let term = {
        let _rt = rt.enter();
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
    };
    let shutdown = async move {
        match term {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => tracing::info!("SIGTERM: draining"),
                    _ = tokio::signal::ctrl_c() => tracing::info!("interrupted: draining"),
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGTERM; stop with Ctrl-C");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
        notify::stopping();
    };
    let result = rt.block_on(async {
        if let Some(every) = notify::watchdog_interval() {
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(every);
                loop {
                    tick.tick().await;
                    notify::watchdog();
                }
            });
        }
        kv_relay::daemon::run(cfg, shutdown, |r| {
            tracing::info!(
                listen = %r.listen,
                epoch = format!("{:016x}", r.store.epoch()),
                incarnation = r.store.incarnation(),
                "kv-relay ready"
            );
            notify::status(&format!("serving on {}", r.listen));
            notify::ready();
        })
        .await
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "kv-relay stopped");
            eprintln!("kv-relay: {e}");
            ExitCode::FAILURE
        }
    }
}
