//! # kv-relay-testkit: the mock engine
//!
//! A stand-in for vLLM and SGLang KV-event publishers, good enough to test the relay without
//! GPUs: every wire layout, the replay socket, load metrics, generated or recorded traffic,
//! the engine's own truth, and faults on demand. The `mock-engine` binary drives the same
//! library from the command line.
//!
//! # Layout
//! - [`wire`]: the engine-side event model and its msgpack encoding for every release.
//! - [`decode`]: a small tolerant decoder (rmpv) for checking what went on the wire.
//! - [`truth`]: the live blocks per (rank, medium, group) with copy counts.
//! - [`publisher`]: one DP rank's PUB + replay ROUTER thread, and its wire-level faults.
//! - [`engine`]: the mock engine: ranks, truth, load, faults, generated requests.
//! - [`generate`]: the traffic loop (rate, clears, load gauges) over a request source.
//! - [`capture`]: playback of recorded captures (`testdata/fixtures/*.jsonl`).
//! - [`fleet`]: N relays in one process (the relay's own server code, each on its own port), for
//!   routers to follow: a steady stream of records, and restarts under a new epoch,
//!   disappearances and slow relays on demand.
//! - [`fixtures`]: the fixtures with their manifests: expected live blocks, hash settings, playback.
//! - [`traffic`]: the per-rank prefix cache simulator and request sources (random, Mooncake).
//! - [`hashing`]: engine-style block hashes (vLLM `sha256_cbor`, SGLang chained SHA-256).
//! - [`metrics`]: the `/metrics` endpoint with the engines' load gauges.
//! - [`pace`]: a paced loop's due times (event k at k / rate seconds).
//! - [`client`]: SUB / DEALER helpers and free-port finding for loopback tests.
//! - [`drills`]: the end-to-end fault drills (mock engine, `kv-relay` processes, subscribers).

pub mod capture;
pub mod client;
pub mod daemon;
pub mod decode;
pub mod drills;
pub mod engine;
pub mod face;
pub mod fixtures;
pub mod fleet;
pub mod generate;
pub mod hashing;
pub mod kit;
pub mod metrics;
pub mod pace;
pub mod publisher;
pub mod traffic;
pub mod truth;
pub mod wire;
