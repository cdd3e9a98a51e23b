//! `kv-router`: a KV-aware router over kv-relays. It follows the relays with
//! [`kv_router_client::Follower`], and decides where each request goes.
//!
//! # Layout
//!
//! - [`http`]: the HTTP API (`POST /match`, `GET /workers`, `GET /metrics`); feature `server`.
//! - [`cli`]: the `kv-router` binary's command line; feature `server`.

#[cfg(feature = "server")]
pub mod cli;
#[cfg(feature = "server")]
pub mod http;
