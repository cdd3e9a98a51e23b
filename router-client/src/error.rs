//! The client's errors.

use kv_relay_proto::hash::HashError;

use crate::index::IndexError;

/// Why a relay could not be added, or a lookup could not be answered.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The relay URL does not parse as an `http://` or `https://` URI.
    #[error("invalid relay url {url:?}: {reason}")]
    InvalidUrl {
        /// The URL given.
        url: String,
        /// Why it was refused.
        reason: String,
    },
    /// The relay is already followed.
    #[error("relay {0} is already followed")]
    AlreadyFollowing(String),
    /// The relay is not followed.
    #[error("relay {0} is not followed")]
    NotFollowing(String),
    /// The index ran out of worker or tier ids.
    #[error("index: {0}")]
    Index(#[from] IndexError),
    /// The request's block hashes could not be computed.
    #[error("block hashes: {0}")]
    Hash(#[from] HashError),
}

/// Why one Subscribe attempt ended (reported in [`crate::RelayInfo::last_error`] and in the logs;
/// the follower always reconnects, except after [`StreamError::Unauthenticated`], which it retries
/// at the longest backoff).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StreamError {
    /// The connection could not be made.
    #[error("connect: {0}")]
    Connect(String),
    /// The relay answered with a gRPC status.
    #[error("relay status {code}: {message}")]
    Status {
        /// The gRPC code's name.
        code: String,
        /// The status message.
        message: String,
    },
    /// The relay refused the bearer token.
    #[error("unauthenticated: {0}")]
    Unauthenticated(String),
    /// Nothing (not even a heartbeat) arrived within the receive timeout.
    #[error("no message for {0:?}")]
    ReceiveTimeout(std::time::Duration),
    /// The relay ended the stream (it never does while it runs).
    #[error("stream ended by the relay")]
    Ended,
    /// The client left the stream to resume elsewhere (a gap, a protocol error, a resync).
    #[error("resume: {0}")]
    Resume(String),
}
