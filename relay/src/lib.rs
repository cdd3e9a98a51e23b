//! # kv-relay
//!
//! A sidecar daemon beside one inference engine (vLLM or SGLang): it subscribes to every DP
//! rank's KV-cache events over ZeroMQ, decodes every released wire layout into one normalized
//! model, and serves them to KV-aware routers.
//!
//! # Layout
//!
//! - [`wire`]: the engines' ZeroMQ frames and msgpack batches, every layout, decoded to raw events
//!   (pure; [`wire::msgpack`] is the panic-free cursor underneath).
//! - [`normalize`]: raw events to the relay's model: tiers, groups and the hybrid policy,
//!   locality, namespaces, per-block tokens (pure).
//! - [`model`]: the normalized model every other part speaks.
//! - [`drops`]: drop reasons and rewrites, with their stable labels.
//! - [`hashcheck`]: the optional check of the engine's block hashes against their token ids.
//! - [`ingest`]: the engine side: a SUB and a replay DEALER per DP rank, gap refill, restarts,
//!   priming, lost tails, the engine's load.
//! - [`live`]: the live-block set with copies counted (the reference semantics of the snapshot).
//! - [`commit`]: each rank's thread commits its own batches to the store (group commit).
//! - [`store`]: the durable store in sled: bounded history, live-block snapshot, epoch and crash protocol.
//! - [`server`]: the gRPC server (`kv_relay.v1.Relay`, health, reflection): resume streams over
//!   the store, TLS, token, rate limits.
//! - [`config`]: the daemon's flags and environment, validated whole before anything starts.
//! - [`config_file`]: the TOML configuration file, the precedence of flags, environment, file and
//!   defaults, and the effective configuration `check-config` prints.
//! - [`daemon`]: `run(config, shutdown)`: ingest → commit → serve, as the binary and tests run it.
//! - [`watch`]: the engine watch: health probes and each rank's liveness.
//! - [`ctl`]: `relayctl`'s gRPC client and the renderings of its answers; [`ctl::cli`], its
//!   command line.
//! - [`notify`]: systemd's notify protocol: `READY=1`, watchdog pings, `STOPPING=1`.
//! - [`capture`]: capture files (JSON Lines of recorded messages) and decoding them whole.
//! - [`decode_cmd`]: `relayctl decode`: the table and JSON renderings of a decoded capture.

pub mod capture;
pub mod commit;
pub mod config;
pub mod config_file;
pub mod ctl;
pub mod daemon;
pub mod decode_cmd;
pub mod drops;
pub mod hashcheck;
pub mod ingest;
pub mod live;
pub mod model;
pub mod normalize;
pub mod notify;
pub mod server;
pub mod shutdown;
pub mod status;
pub mod store;
mod sync;
pub mod watch;
pub mod wire;
