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
//! - [`live`]: the live-block set with copies counted (the reference semantics of the snapshot).
//! - [`capture`]: capture files (JSON Lines of recorded messages) and decoding them whole.
//! - [`decode_cmd`]: `relayctl decode`: the table and JSON renderings of a decoded capture.

pub mod capture;
pub mod decode_cmd;
pub mod drops;
pub mod live;
pub mod model;
pub mod normalize;
pub mod wire;
