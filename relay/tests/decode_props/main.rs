//! Property tests of the decoder and the normalizer:
//!
//! * arbitrary bytes and frames never panic `decode_batch`, `decode_event`, `split_pub`,
//!   `split_replay` or the normalizer;
//! * real payloads from every fixture, mutated (bit flips, truncations, insertions, overwrites),
//!   never panic, and a cut payload keeps exactly the events before the cut;
//! * whatever the normalizer keeps, the store can hold: every normalized batch is committed (a
//!   record the store refused would be dropped, with its rank marked degraded);
//! * a bad event beside good ones never loses the good ones: batches of generated well-formed
//!   events (array and map forms, unsigned/signed/bytes hashes, bigram tokens, optional fields)
//!   with malformed events injected at random positions decode to exactly the good events, each
//!   bad one dropped with its expected reason, and normalize as if the bad ones were not there.
//!
//! Case counts are proptest's defaults (256 per property) so the file runs in seconds in debug.
//! For a longer run: `PROPTEST_CASES=20000 cargo test -p kv-relay --release --test decode_props`.

use kv_relay::capture::{self, SocketKind};
use kv_relay::drops::{DropReason, Field};
use kv_relay::model::{KeyPart, RecordBody, TokenLayout};
use kv_relay::normalize::{Normalizer, Outcome};
use kv_relay::store::{Store, StoreConfig};
use kv_relay::wire::{self, RawCleared, RawEvent, RawRemoved, RawStored, RawTokens};
use proptest::prelude::*;
use rmpv::Value as V;
use std::sync::OnceLock;

fn enc(v: &V) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).unwrap();
    out
}

/// One store for every case of the file (its state only grows; any sequence of batches is one
/// it must take).
fn store() -> &'static Store {
    static STORE: OnceLock<(tempfile::TempDir, Store)> = OnceLock::new();
    &STORE
        .get_or_init(|| {
            let dir = tempfile::tempdir().unwrap();
            let store = Store::open(StoreConfig::new(dir.path())).unwrap();
            (dir, store)
        })
        .1
}

/// Decodes and normalizes whatever decodes; checks the bookkeeping that must hold for any input,
/// and that the store takes the normalized batch.
fn decode_and_normalize(payload: &[u8]) {
    let _ = wire::decode_event(payload);
    if let Ok(raw) = wire::decode_batch(payload) {
        let n = raw.events.len();
        let out = Normalizer::new().normalize(raw.dp_rank.unwrap_or(0), 1, raw);
        assert_eq!(out.outcomes.len(), n);
        let kept = out.outcomes.iter().filter(|o| **o == Outcome::Kept).count();
        assert_eq!(kept, out.batch.events.len());
        assert_eq!(out.drops.total() as usize, n - kept);
        if let Err(e) = store().commit(RecordBody::Batch { batch: out.batch, load: None, liveness: None }) {
            panic!("the store refused a normalized batch: {e}");
        }
    }
}

mod arbitrary;
mod bad_beside_good;
mod mutated;
