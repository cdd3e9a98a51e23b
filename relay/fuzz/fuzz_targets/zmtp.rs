//! The engine's byte stream after the ZMTP handshake, as the relay's own SUB reads it
//! (`kv_relay::ingest::zmtp::Frames`): any bytes, cut into reads anywhere. Must not panic, and
//! must split into the same messages, commands and error whatever the cuts.
//!
//! Input layout: a byte `k`, then the stream; the stream is pushed in reads of `k % 61 + 1`
//! bytes (so 1 to 61), and again in one piece, and the two outcomes are compared. The frame
//! bound is 4,096 bytes, so the bound's error is reachable.

#![no_main]

use kv_relay::ingest::zmtp::units;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| {
    let Some((&k, stream)) = input.split_first() else { return };
    assert_eq!(units(stream, usize::from(k % 61) + 1, 4096), units(stream, stream.len(), 4096));
});
