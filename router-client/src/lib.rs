//! `kv-router-client`: what a KV-aware router embeds to follow kv-relays and know which
//! worker holds which KV blocks. The router itself (policies, liveness, the HTTP API and the
//! `kv-router` binary) is the `kv-router` crate.
//!
//! # Layout
//!
//! - [`index`]: the prefix index: a lock-free-read, compact, concurrent map from block hashes
//!   to the (worker, tier, copies) holding them, answering "how many leading blocks of this
//!   request does each worker hold, per tier", plus its naive reference
//!   ([`index::reference`]) used by tests.
//! - [`follower`]: [`Follower`]: one background task per relay keeps a resumable Subscribe
//!   stream current (backoff, receive timeout, Status polls); lookups over every worker.
//! - [`discovery`]: [`discovery::Discovery`]: the relays of fixed URLs, relays files re-read when
//!   they change, and DNS names resolved again and again, kept followed (a grace period before
//!   an address missing from DNS is dropped).
//! - [`admission`]: the admission rules, pure: exactly-once cursor order per relay, rank
//!   resets, flags, staged snapshots swapped in atomically.
//! - [`mod@matches`]: a match's answer ([`Matches`]) read from each relay's published view of its
//!   workers, and the options that list fewer workers ([`MatchOptions`]).
//! - [`worker`]: what a router is told about a worker: load, freshness, state.
//! - [`backoff`]: jittered exponential backoff.
//! - [`error`]: the client's error enums.

pub mod admission;
pub mod backoff;
pub mod discovery;
pub mod error;
pub mod follower;
pub mod index;
pub mod matches;
pub mod worker;

pub use admission::{ClientEvent, Position, RelayAdmission, RelayCounters, Verdict};
pub use discovery::{Discovery, DnsName};
pub use error::{ClientError, StreamError};
pub use follower::{validate_url, FollowConfig, Follower, RelayInfo, ResyncSlots};
pub use matches::{Match, MatchOptions, MatchRef, Matches};
pub use worker::{EngineLiveness, Liveness, Load, WorkerInfo, WorkerState};
