//! `kv-relay`: the daemon. Loads its settings (flags > environment > file > defaults), sets up
//! logging, and runs [`kv_relay::daemon::run`] until SIGTERM or Ctrl-C; `check-config` prints
//! the effective configuration and exits.

use kv_relay::config::Command;
use kv_relay::config_file::{self, LoadError};
use kv_relay::notify;
use std::process::ExitCode;

/// mimalloc: the relay allocates and frees per block (decode, commit, encode), where glibc's
/// malloc cost about a third of its CPU (docs/benchmarks.md).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's options, as `mi_option_e` numbers them in the version Cargo.lock pins
/// (libmimalloc-sys 0.1.49, mimalloc v3); the test below checks their defaults.
#[allow(unsafe_code)]
mod mi {
    use std::os::raw::{c_int, c_long};
    pub const ARENA_EAGER_COMMIT: c_int = 4;
    pub const PURGE_DELAY: c_int = 15;
    extern "C" {
        pub fn mi_option_set(option: c_int, value: c_long);
        #[cfg(test)]
        pub fn mi_option_get(option: c_int) -> c_long;
    }
}

/// Memory freed goes back to the system at once, and arenas are committed as they are used.
/// With mimalloc's defaults (freed memory purged after 1 s, arenas committed whole) the relay
/// held 344 MiB at a million live blocks and 58 MiB idle; set so, 210 and 14 MiB.
#[allow(unsafe_code)]
fn tune_allocator() {
    // SAFETY: plain setters of mimalloc's global options; any value is valid for both.
    unsafe {
        mi::mi_option_set(mi::PURGE_DELAY, 0);
        mi::mi_option_set(mi::ARENA_EAGER_COMMIT, 0);
    }
}

fn main() -> ExitCode {
    tune_allocator();
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
    let rt = match tokio::runtime::Runtime::new() {
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

#[cfg(test)]
mod tests {
    use super::mi;

    #[test]
    #[allow(unsafe_code)]
    fn the_allocator_options_are_the_ones_meant() {
        // mimalloc v3's defaults (its options.c): a renumbered enum would read other options here.
        // SAFETY: plain getters of mimalloc's global options.
        let (eager, purge) = unsafe { (mi::mi_option_get(mi::ARENA_EAGER_COMMIT), mi::mi_option_get(mi::PURGE_DELAY)) };
        assert_eq!((eager, purge), (2, 1000));
        super::tune_allocator();
        let (eager, purge) = unsafe { (mi::mi_option_get(mi::ARENA_EAGER_COMMIT), mi::mi_option_get(mi::PURGE_DELAY)) };
        assert_eq!((eager, purge), (0, 0));
    }
}
