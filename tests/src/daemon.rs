//! The relay daemon in-process (`kv_relay::daemon::run`) beside a mock engine, for tests: its
//! PUB and replay endpoints, its `/metrics` (and so its URL and health endpoint), fast load
//! polls, heartbeats and tail probes.

use crate::engine::MockEngine;
use std::time::Duration;

/// A relay running in this process; [`Daemon::stop`] stops it.
pub struct Daemon {
    pub url: String,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), kv_relay::daemon::DaemonError>>,
    _dir: tempfile::TempDir,
}

/// Starts a relay for `e` (which must have a replay socket and an HTTP face) in a new state
/// directory, with `extra` flags.
pub async fn start_relay(e: &MockEngine, extra: &[&str]) -> Daemon {
    start_relay_in(e, tempfile::tempdir().expect("a state directory"), extra).await
}

/// [`start_relay`] over the state directory in `dir` (a restart when a relay used it before).
pub async fn start_relay_in(e: &MockEngine, dir: tempfile::TempDir, extra: &[&str]) -> Daemon {
    let c = e.config();
    let metrics = format!("http://{}/metrics", e.metrics_addr().expect("the engine has an HTTP face"));
    let state = dir.path().join("state").display().to_string();
    let dp = c.dp_size.to_string();
    let mut argv = vec![
        "kv-relay",
        "--endpoint",
        &c.endpoint,
        "--dp-size",
        &dp,
        "--topic",
        &c.topic,
        "--engine-metrics-url",
        &metrics,
        "--state-dir",
        &state,
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "off",
        "--load-poll-ms",
        "50",
        "--heartbeat-ms",
        "200",
        "--tail-probe-ms",
        "300",
    ];
    let replay = c.replay_endpoint.clone().expect("the engine has a replay socket");
    argv.extend(["--replay-endpoint", &replay]);
    argv.extend_from_slice(extra);
    let cfg = <kv_relay::config::Args as clap::Parser>::try_parse_from(argv)
        .expect("relay flags")
        .validate()
        .expect("relay settings");
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(kv_relay::daemon::run(
        cfg,
        async move {
            let _ = rx.await;
        },
        move |r| {
            let _ = ready_tx.send(r.listen);
        },
    ));
    let listen = ready_rx.await.expect("the relay started");
    Daemon { url: format!("http://{listen}"), shutdown: Some(tx), task, _dir: dir }
}

impl Daemon {
    pub async fn stop(self) {
        self.stop_keeping_state().await;
    }

    /// Stops the relay and gives back its state directory.
    pub async fn stop_keeping_state(mut self) -> tempfile::TempDir {
        let _ = self.shutdown.take().expect("running").send(());
        tokio::time::timeout(Duration::from_secs(15), self.task)
            .await
            .expect("stopped in time")
            .expect("the relay task")
            .expect("the relay ran");
        self._dir
    }
}
