//! `kv-router-client`: what a KV-aware router embeds to follow kv-relays and know which
//! worker holds which KV blocks.
//!
//! # Layout
//!
//! - [`index`]: the prefix index: a lock-free-read, compact, concurrent map from block hashes
//!   to the (worker, tier, copies) holding them, answering "how many leading blocks of this
//!   request does each worker hold, per tier", plus its naive reference
//!   ([`index::reference`]) used by tests.

pub mod index;
