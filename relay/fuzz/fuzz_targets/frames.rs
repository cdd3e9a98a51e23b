//! A sequence of ZeroMQ messages, as the relay reads them from one rank's sockets: each split
//! (PUB or replay layout), decoded, and normalized by one [`Normalizer`] that keeps its group
//! knowledge from message to message. Must not panic.
//!
//! Input layout (so seeds can be written from captures, see `docs/fuzzing.md`): repeated
//! messages, each `mode` (1 byte: bit 0 = replay socket, bits 1..=3 = frame count - 1, so 1 to 8
//! frames, bit 7 = the rank's publisher restarted before this message) followed by its frames,
//! each a little-endian `u16` length and that many bytes. The input may end anywhere: a short
//! frame is taken as it is.

#![no_main]

use kv_relay::normalize::Normalizer;
use kv_relay::wire::{self, ReplayReply};
use libfuzzer_sys::fuzz_target;

fn take_frame<'a>(data: &mut &'a [u8]) -> &'a [u8] {
    let n = match data {
        [a, b, ..] => usize::from(u16::from_le_bytes([*a, *b])),
        _ => 0,
    };
    let rest = data.get(2..).unwrap_or(&[]);
    let (frame, rest) = rest.split_at(n.min(rest.len()));
    *data = rest;
    frame
}

fuzz_target!(|input: &[u8]| {
    let mut data = input;
    let mut normalizer = Normalizer::new();
    while let Some((&mode, rest)) = data.split_first() {
        data = rest;
        let replay = mode & 1 == 1;
        let n_frames = 1 + usize::from((mode >> 1) & 0x07);
        let frames: Vec<&[u8]> = (0..n_frames).map(|_| take_frame(&mut data)).collect();
        let split = if replay {
            match wire::split_replay(&frames) {
                Ok(ReplayReply::Batch(f)) => Ok(f),
                Ok(ReplayReply::End) => continue,
                Err(e) => Err(e),
            }
        } else {
            wire::split_pub(&frames)
        };
        let Ok(f) = split else { continue };
        if let Ok(raw) = wire::decode_batch(f.payload) {
            let rank = raw.dp_rank.unwrap_or(0);
            if mode & 0x80 != 0 {
                // A publisher restart on this rank.
                normalizer.reset_rank(rank);
            }
            let n = raw.events.len();
            let out = normalizer.normalize(rank, f.seq, raw);
            assert_eq!(out.outcomes.len(), n);
        }
    }
});
