//! Capture playback: the `pub` lines of a fixtures capture (`testdata/fixtures/*.jsonl`), per
//! rank, as fast as possible or at the recorded pace.
//!
//! Payloads and topics are sent exactly as recorded; the seq is the mock's own (0 per
//! publisher instance), which equals the recorded seq because the captures have no gaps.
//! Where the recorded seq on an endpoint does not increase (a publisher restart in the
//! capture), the rank is restarted first, so seq, buffer and truth follow the capture.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use base64::Engine as _;

use crate::engine::{EngineError, MockEngine};

/// One line of a capture file.
#[derive(Debug, Clone, PartialEq)]
pub struct CaptureLine {
    /// Seconds since the recorder started.
    pub t: f64,
    /// `"pub"` or `"replay"`.
    pub socket: String,
    pub endpoint: String,
    pub dp_rank: Option<u32>,
    pub frames: Vec<Vec<u8>>,
}

#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    #[error("{0}: {1}")]
    Io(String, std::io::Error),
    #[error("{file}:{line}: {msg}")]
    Line { file: String, line: usize, msg: String },
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("capture needs rank {0} but the engine has {1} rank(s)")]
    TooFewRanks(u32, u32),
}

/// Read every line of a capture.
pub fn read_capture(path: &Path) -> Result<Vec<CaptureLine>, CaptureError> {
    let name = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| CaptureError::Io(name.clone(), e))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let err = |msg: String| CaptureError::Line { file: name.clone(), line: i + 1, msg };
        let v: serde_json::Value = serde_json::from_str(line).map_err(|e| err(e.to_string()))?;
        let frames = v["frames"]
            .as_array()
            .ok_or_else(|| err("no frames".into()))?
            .iter()
            .map(|f| {
                let s = f.as_str().ok_or_else(|| err("frame is not a string".into()))?;
                base64::engine::general_purpose::STANDARD.decode(s).map_err(|e| err(format!("base64: {e}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        out.push(CaptureLine {
            t: v["t"].as_f64().unwrap_or(0.0),
            socket: v["socket"].as_str().unwrap_or("").to_string(),
            endpoint: v["endpoint"].as_str().unwrap_or("").to_string(),
            dp_rank: v["dp_rank"].as_u64().map(|r| r as u32),
            frames,
        });
    }
    Ok(out)
}

/// The number of ranks a capture's `pub` lines need.
pub fn ranks_needed(lines: &[CaptureLine]) -> u32 {
    let mut endpoints: Vec<&str> = Vec::new();
    let mut max_rank = 0;
    for l in lines.iter().filter(|l| l.socket == "pub") {
        match l.dp_rank {
            Some(r) => max_rank = max_rank.max(r + 1),
            None => {
                if !endpoints.contains(&l.endpoint.as_str()) {
                    endpoints.push(&l.endpoint);
                }
            }
        }
    }
    max_rank.max(endpoints.len() as u32).max(1)
}

/// What a playback did.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct PlayReport {
    pub batches: u64,
    pub restarts: u64,
    pub skipped_malformed: u64,
}

/// Play the `pub` lines of `lines` through `engine`. `paced`: keep the recorded gaps between
/// lines. Stops early when `stop` is set; waits while the engine is paused.
pub fn play(
    engine: &MockEngine,
    lines: &[CaptureLine],
    paced: bool,
    stop: &AtomicBool,
) -> Result<PlayReport, CaptureError> {
    let mut report = PlayReport::default();
    let mut last_seq: HashMap<&str, u64> = HashMap::new();
    let mut endpoint_rank: HashMap<&str, u32> = HashMap::new();
    let pubs: Vec<&CaptureLine> = lines.iter().filter(|l| l.socket == "pub").collect();
    let t0 = pubs.first().map(|l| l.t).unwrap_or(0.0);
    let start = Instant::now();
    for line in pubs {
        while !engine.wait_unpaused(Duration::from_millis(100)) {
            if stop.load(Ordering::SeqCst) {
                return Ok(report);
            }
        }
        if stop.load(Ordering::SeqCst) {
            return Ok(report);
        }
        if paced {
            let due = start + Duration::from_secs_f64((line.t - t0).max(0.0));
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
        }
        let next = endpoint_rank.len() as u32;
        let rank = match line.dp_rank {
            Some(r) => r,
            None => *endpoint_rank.entry(&line.endpoint).or_insert(next),
        };
        if rank >= engine.dp_size() {
            return Err(CaptureError::TooFewRanks(rank, engine.dp_size()));
        }
        let [topic, seq, payload] = line.frames.as_slice() else {
            report.skipped_malformed += 1;
            continue;
        };
        let Ok(seq8) = <[u8; 8]>::try_from(seq.as_slice()) else {
            report.skipped_malformed += 1;
            continue;
        };
        let seq = u64::from_be_bytes(seq8);
        if let Some(&prev) = last_seq.get(line.endpoint.as_str()) {
            if seq <= prev {
                engine.restart(rank)?;
                report.restarts += 1;
            }
        }
        last_seq.insert(&line.endpoint, seq);
        engine.publish_payload(rank, Some(topic.clone()), payload.clone())?;
        report.batches += 1;
    }
    Ok(report)
}
