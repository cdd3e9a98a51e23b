//! One batch payload: decode, then normalize. Must not panic, and every event the decoder
//! reports must come out of the normalizer as exactly one outcome.

#![no_main]

use kv_relay::normalize::Normalizer;
use kv_relay::wire;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The event decoder alone, on bytes that may not even be an array or a map.
    let _ = wire::decode_event(data);
    if let Ok(raw) = wire::decode_batch(data) {
        let n = raw.events.len();
        let rank = raw.dp_rank.unwrap_or(0);
        let out = Normalizer::new().normalize(rank, 0, raw);
        assert_eq!(out.outcomes.len(), n);
        let kept = out.outcomes.iter().filter(|o| **o == kv_relay::normalize::Outcome::Kept).count();
        assert_eq!(kept, out.batch.events.len());
        assert_eq!(out.drops.total() as usize, n - kept);
    }
});
