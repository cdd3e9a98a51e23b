//! Capture files: one ZeroMQ multipart message per JSON line, as recorded from engines (the
//! format of `testdata/fixtures/`, documented in `docs/decode.md`), and decoding them whole.

use crate::drops::Tally;
use crate::live::LiveBlocks;
use crate::normalize::{Normalized, Normalizer};
use crate::wire::{self, MessageError, ReplayReply};
use base64::Engine as _;
use serde::Deserialize;
use std::path::Path;

/// Which socket a captured message came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SocketKind {
    /// Received by a SUB from the engine's PUB socket.
    Pub,
    /// Received by a DEALER from the engine's replay ROUTER.
    Replay,
}

/// One captured message.
#[derive(Debug, Clone, PartialEq)]
pub struct CapturedMessage {
    /// 0-based line number in the file.
    pub line: usize,
    /// Seconds since the recorder started.
    pub t: f64,
    pub socket: SocketKind,
    pub endpoint: String,
    pub dp_rank: Option<u32>,
    pub frames: Vec<Vec<u8>>,
}

#[derive(Deserialize)]
struct Line {
    t: f64,
    socket: SocketKind,
    #[serde(default)]
    endpoint: String,
    dp_rank: Option<u32>,
    frames: Vec<String>,
}

/// Why a capture file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    #[error("cannot read {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("line {line}: {msg}")]
    Line { line: usize, msg: String },
}

/// Parses a capture from its text.
pub fn parse(text: &str) -> Result<Vec<CapturedMessage>, CaptureError> {
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut out = Vec::new();
    for (i, l) in text.lines().enumerate() {
        if l.trim().is_empty() {
            continue;
        }
        let line: Line = serde_json::from_str(l).map_err(|e| CaptureError::Line { line: i + 1, msg: e.to_string() })?;
        let frames = line
            .frames
            .iter()
            .enumerate()
            .map(|(j, f)| {
                b64.decode(f)
                    .map_err(|e| CaptureError::Line { line: i + 1, msg: format!("frame {j}: bad base64: {e}") })
            })
            .collect::<Result<Vec<_>, _>>()?;
        out.push(CapturedMessage {
            line: i,
            t: line.t,
            socket: line.socket,
            endpoint: line.endpoint,
            dp_rank: line.dp_rank,
            frames,
        });
    }
    Ok(out)
}

/// Reads a capture file.
pub fn read(path: &Path) -> Result<Vec<CapturedMessage>, CaptureError> {
    let text = std::fs::read_to_string(path)
        .map_err(|source| CaptureError::Io { path: path.display().to_string(), source })?;
    parse(&text)
}

/// What one captured message decoded to.
#[derive(Debug, Clone, PartialEq)]
pub enum Decoded {
    /// A batch.
    Batch {
        topic: Vec<u8>,
        /// The DP rank used: the batch's own, else the line's, else 0.
        dp_rank: u32,
        normalized: Normalized,
        /// The payload ended early; see [`crate::wire::RawBatch::truncated`].
        truncated: bool,
    },
    /// The end marker of a replay.
    ReplayEnd,
    /// The message was unusable.
    Error(MessageError),
}

/// Decodes one message's frames (pub or replay) and normalizes the batch.
pub fn decode_message(normalizer: &mut Normalizer, msg: &CapturedMessage) -> Decoded {
    let frames: Vec<&[u8]> = msg.frames.iter().map(Vec::as_slice).collect();
    let split = match msg.socket {
        SocketKind::Pub => wire::split_pub(&frames),
        SocketKind::Replay => match wire::split_replay(&frames) {
            Ok(ReplayReply::Batch(f)) => Ok(f),
            Ok(ReplayReply::End) => return Decoded::ReplayEnd,
            Err(e) => Err(e),
        },
    };
    let f = match split {
        Ok(f) => f,
        Err(e) => return Decoded::Error(e),
    };
    match wire::decode_batch(f.payload) {
        Ok(raw) => {
            let dp_rank = raw.dp_rank.or(msg.dp_rank).unwrap_or(0);
            let truncated = raw.truncated;
            Decoded::Batch {
                topic: f.topic.to_vec(),
                dp_rank,
                normalized: normalizer.normalize(dp_rank, f.seq, raw),
                truncated,
            }
        }
        Err(e) => Decoded::Error(e),
    }
}

/// Totals over a decoded capture.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Summary {
    pub messages: u64,
    pub batches: u64,
    pub replay_ends: u64,
    /// Events by normalized kind (`stored`, `removed`, `cleared`).
    pub events: Tally,
    pub drops: Tally,
    pub rewrites: Tally,
    pub message_errors: Tally,
}

impl Summary {
    pub fn add(&mut self, d: &Decoded) {
        self.messages += 1;
        match d {
            Decoded::Batch { normalized, truncated, .. } => {
                self.batches += 1;
                for e in &normalized.batch.events {
                    self.events.add(e.kind(), 1);
                }
                self.drops.merge(&normalized.drops);
                self.rewrites.merge(&normalized.rewrites);
                if *truncated {
                    self.message_errors.add("truncated_batch", 1);
                }
            }
            Decoded::ReplayEnd => self.replay_ends += 1,
            Decoded::Error(e) => self.message_errors.add(e.as_str(), 1),
        }
    }
}

/// A whole capture decoded in file order, with the live blocks its `pub` lines leave.
#[derive(Debug, Clone, Default)]
pub struct Walk {
    pub decoded: Vec<Decoded>,
    pub summary: Summary,
    /// Live blocks after applying every `pub` batch in order (replay lines are decoded but not
    /// applied: they repeat what was published). A seq on an endpoint that is not greater than
    /// the previous one is a publisher restart and resets that rank first.
    pub live: LiveBlocks,
    /// Publisher restarts seen (by the seq rule).
    pub restarts: u64,
}

/// Decodes every message of a capture and walks its live blocks.
pub fn walk(messages: &[CapturedMessage]) -> Walk {
    let mut normalizer = Normalizer::new();
    let mut w = Walk::default();
    let mut last_seq: std::collections::HashMap<&str, u64> = std::collections::HashMap::new();
    for m in messages {
        // Restart detection happens before normalizing, so the rank's group knowledge resets too.
        if m.socket == SocketKind::Pub {
            let frames: Vec<&[u8]> = m.frames.iter().map(Vec::as_slice).collect();
            if let Ok(f) = wire::split_pub(&frames) {
                if let Some(prev) = last_seq.insert(&m.endpoint, f.seq) {
                    if f.seq <= prev {
                        w.restarts += 1;
                        let rank =
                            wire::decode_batch(f.payload).ok().and_then(|b| b.dp_rank).or(m.dp_rank).unwrap_or(0);
                        normalizer.reset_rank(rank);
                        w.live.reset_rank(rank);
                    }
                }
            }
        }
        let d = decode_message(&mut normalizer, m);
        if let (SocketKind::Pub, Decoded::Batch { normalized, .. }) = (m.socket, &d) {
            w.live.apply(&normalized.batch);
        }
        w.summary.add(&d);
        w.decoded.push(d);
    }
    w
}
