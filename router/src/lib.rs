//! `kv-router`: a KV-aware router over kv-relays. It follows the relays with
//! [`kv_router_client::Follower`], and decides where each request goes: to the live worker that
//! holds most of its prefix, at an acceptable load.
//!
//! # Layout
//!
//! - [`policy`]: the [`Policy`] trait and the policies (`cache_aware`, the default;
//!   `round_robin`, `least_load`, `random`), pure functions of the workers' views.
//! - [`liveness`]: each worker's circuit breaker ([`Tracker`]), driven by what the relay reports
//!   of the engine, the relay's stream and the router's own requests; pure.
//! - [`engine`]: an engine's block-hash settings as JSON ([`HashSettings`]), resolved to its
//!   hash function.
//! - [`router`]: [`Router`]: the follower, the tracker and the policy: `route` and `report`.
//! - [`http`]: the HTTP API (`POST /match`, `POST /route`, `POST /route/report`,
//!   `GET /workers`, `GET /metrics`); feature `server`.
//! - [`front`]: the OpenAI-compatible front (`/v1/completions`, `/v1/chat/completions`,
//!   `/v1/models`) passed through to the chosen engine; feature `server`.
//! - [`tokenize`]: a model directory's tokenizer and chat template, so text prompts and chat
//!   messages are routed by the tokens the engine will see; feature `server`.
//! - [`cli`]: the `kv-router` binary's command line; feature `server`.

#[cfg(feature = "server")]
pub mod cli;
pub mod engine;
#[cfg(feature = "server")]
pub mod front;
#[cfg(feature = "server")]
pub mod http;
pub mod liveness;
pub mod policy;
pub mod router;
#[cfg(feature = "server")]
pub mod tokenize;

pub use engine::{HashSettings, LoraSettings};
pub use liveness::{Cause, Gate, Outcome, ReportError, RoutingState, Signals, Tracker, TrackerConfig};
pub use policy::{CacheAware, CacheAwareConfig, Candidate, Choice, Overload, Policy, PolicyKind, Reason, RouteInput};
pub use router::{Reported, RouteError, Routed, RoutedWorker, Router, RouterConfig, RouterCounters, Tokens};
