//! The relay's server, with Subscribe responses that can be encoded once and shared.
//!
//! Every caught-up subscriber sends the same record. Encoding it per stream (and copying the
//! message for each) cost the relay's gRPC workers about a third of its CPU with 8 subscribers.
//! [`SubscribeOut::Encoded`] holds a `SubscribeResponse` already encoded: each stream copies its
//! bytes into its frame, nothing more. On the wire the two forms are the same message; a client
//! decodes [`pb::SubscribeResponse`] as before.

use crate::pb;
use bytes::{Buf, BufMut, Bytes};
use prost::encoding::{DecodeContext, WireType};
use prost::{DecodeError, Message};

/// A Subscribe response as the relay's server sends it.
#[derive(Debug, Clone, PartialEq)]
pub enum SubscribeOut {
    Message(pb::SubscribeResponse),
    /// A `SubscribeResponse`'s encoding (its fields, no length prefix), as [`SubscribeOut::encode`]
    /// makes it.
    Encoded(Bytes),
}

impl SubscribeOut {
    /// Encodes `m` once, to be shared.
    pub fn encode(m: &pb::SubscribeResponse) -> Bytes {
        Bytes::from(m.encode_to_vec())
    }

    /// The message, decoded from the shared bytes where need be.
    pub fn to_message(&self) -> Result<pb::SubscribeResponse, DecodeError> {
        match self {
            SubscribeOut::Message(m) => Ok(m.clone()),
            SubscribeOut::Encoded(b) => pb::SubscribeResponse::decode(b.clone()),
        }
    }
}

impl Default for SubscribeOut {
    fn default() -> Self {
        SubscribeOut::Message(pb::SubscribeResponse::default())
    }
}

impl From<pb::SubscribeResponse> for SubscribeOut {
    fn from(m: pb::SubscribeResponse) -> Self {
        SubscribeOut::Message(m)
    }
}

impl Message for SubscribeOut {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        match self {
            SubscribeOut::Message(m) => m.encode_raw(buf),
            SubscribeOut::Encoded(b) => buf.put_slice(b),
        }
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), DecodeError> {
        if let SubscribeOut::Encoded(_) = self {
            *self = SubscribeOut::Message(self.to_message()?);
        }
        match self {
            SubscribeOut::Message(m) => m.merge_field(tag, wire_type, buf, ctx),
            SubscribeOut::Encoded(_) => unreachable!("made a message above"),
        }
    }

    fn encoded_len(&self) -> usize {
        match self {
            SubscribeOut::Message(m) => m.encoded_len(),
            SubscribeOut::Encoded(b) => b.len(),
        }
    }

    fn clear(&mut self) {
        *self = SubscribeOut::default();
    }
}

/// The `Relay` server the relay runs: [`pb::relay_server`] with [`SubscribeOut`] responses.
pub mod server {
    #![allow(clippy::all, missing_docs)]
    include!(concat!(env!("OUT_DIR"), "/shared/kv_relay.v1.rs"));
}

#[cfg(test)]
mod tests {
    use super::*;
    use pb::subscribe_response::Message as M;

    fn sample() -> pb::SubscribeResponse {
        pb::SubscribeResponse {
            message: Some(M::Heartbeat(pb::Heartbeat {
                dp_rank: 3,
                load: None,
                newest_cursor: 1_234_567,
                sent_at_ms: 42,
                liveness: None,
            })),
        }
    }

    #[test]
    fn both_forms_encode_to_the_same_bytes() {
        let m = sample();
        let shared = SubscribeOut::Encoded(SubscribeOut::encode(&m));
        let plain = SubscribeOut::Message(m.clone());
        assert_eq!(shared.encoded_len(), m.encoded_len());
        assert_eq!(shared.encode_to_vec(), m.encode_to_vec());
        assert_eq!(plain.encode_length_delimited_to_vec(), m.encode_length_delimited_to_vec());
        assert_eq!(pb::SubscribeResponse::decode(shared.encode_to_vec().as_slice()).unwrap(), m);
    }

    #[test]
    fn decoding_yields_the_message() {
        let m = sample();
        let got = SubscribeOut::decode(m.encode_to_vec().as_slice()).unwrap();
        assert_eq!(got, SubscribeOut::Message(m.clone()));
        assert_eq!(SubscribeOut::Encoded(SubscribeOut::encode(&m)).to_message().unwrap(), m);
        // Merging into shared bytes decodes them first, then merges as prost does.
        let mut later = m.clone();
        if let Some(M::Heartbeat(h)) = later.message.as_mut() {
            h.sent_at_ms = 99;
        }
        let mut merged = SubscribeOut::Encoded(SubscribeOut::encode(&m));
        merged.merge(later.encode_to_vec().as_slice()).unwrap();
        assert_eq!(merged, SubscribeOut::Message(later));
    }
}
