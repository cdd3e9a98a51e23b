//! `relayctl decode FILE`: every captured message decoded, as a table for people or as one JSON
//! object per message (`--json`, documented in `docs/decode.md`).

use crate::capture::{CapturedMessage, Decoded, SocketKind, Walk};
use crate::model::Event;
use crate::normalize::Outcome;
use serde_json::{json, Value};
use std::fmt::Write as _;

fn socket_name(s: SocketKind) -> &'static str {
    match s {
        SocketKind::Pub => "pub",
        SocketKind::Replay => "replay",
    }
}

/// One JSON object for one message.
pub fn message_json(m: &CapturedMessage, d: &Decoded) -> Value {
    let mut o = json!({
        "line": m.line,
        "socket": socket_name(m.socket),
        "endpoint": m.endpoint,
    });
    let obj = o.as_object_mut().expect("object");
    match d {
        Decoded::Batch { topic, dp_rank, normalized, truncated } => {
            obj.insert("topic".into(), json!(String::from_utf8_lossy(topic)));
            obj.insert("dp_rank".into(), json!(dp_rank));
            obj.insert("seq".into(), json!(normalized.batch.seq));
            obj.insert("ts".into(), json!(normalized.batch.ts));
            obj.insert("events".into(), serde_json::to_value(&normalized.batch.events).unwrap_or(Value::Null));
            let dropped: Vec<Value> = normalized
                .outcomes
                .iter()
                .enumerate()
                .filter_map(|(i, o)| match o {
                    Outcome::Dropped(r) => Some(json!({"index": i, "reason": r.as_str()})),
                    Outcome::Kept => None,
                })
                .collect();
            obj.insert("dropped".into(), Value::Array(dropped));
            obj.insert("rewrites".into(), json!(normalized.rewrites.0));
            obj.insert("truncated".into(), json!(truncated));
        }
        Decoded::ReplayEnd => {
            obj.insert("replay_end".into(), json!(true));
        }
        Decoded::Error(e) => {
            obj.insert("error".into(), json!(e.as_str()));
            obj.insert("detail".into(), json!(e.to_string()));
        }
    }
    o
}

/// The whole walk as JSON Lines (one object per message, then none: totals are in the table).
pub fn render_json(messages: &[CapturedMessage], walk: &Walk) -> String {
    let mut s = String::new();
    for (m, d) in messages.iter().zip(&walk.decoded) {
        let _ = writeln!(s, "{}", message_json(m, d));
    }
    s
}

fn event_row(e: &Event) -> (String, String, String, String, String) {
    match e {
        Event::Stored(s) => (
            "stored".into(),
            s.tier.to_string(),
            s.group.idx.to_string(),
            s.blocks.len().to_string(),
            s.blocks.first().map(|b| b.hash.to_string()).unwrap_or_default(),
        ),
        Event::Removed(r) => (
            "removed".into(),
            r.tier.to_string(),
            r.group.to_string(),
            r.block_hashes.len().to_string(),
            r.block_hashes.first().map(|h| h.to_string()).unwrap_or_default(),
        ),
        Event::Cleared(c) => (
            "cleared".into(),
            c.tier.as_ref().map(|t| t.to_string()).unwrap_or_else(|| "all".into()),
            "-".into(),
            "-".into(),
            String::new(),
        ),
    }
}

/// The whole walk as a table, with totals and the final live blocks.
pub fn render_table(messages: &[CapturedMessage], walk: &Walk) -> String {
    let mut s = String::new();
    let _ = writeln!(s, " LINE SOCKET RANK    SEQ  EVENT    TIER     GRP BLOCKS  FIRST HASH            NOTE");
    for (m, d) in messages.iter().zip(&walk.decoded) {
        let head = |rank: &str, seq: &str| format!("{:>5} {:<6} {:>4} {:>6}", m.line, socket_name(m.socket), rank, seq);
        match d {
            Decoded::Batch { dp_rank, normalized, truncated, .. } => {
                let (rank, seq) = (dp_rank.to_string(), normalized.batch.seq.to_string());
                let mut kept = normalized.batch.events.iter();
                if normalized.outcomes.is_empty() {
                    let _ = writeln!(s, "{}  (empty batch)", head(&rank, &seq));
                }
                for o in &normalized.outcomes {
                    match o {
                        Outcome::Kept => {
                            let Some(e) = kept.next() else { continue };
                            let (k, tier, grp, n, first) = event_row(e);
                            let _ = writeln!(
                                s,
                                "{}  {:<8} {:<8} {:>3} {:>6}  {:<20}",
                                head(&rank, &seq),
                                k,
                                tier,
                                grp,
                                n,
                                first
                            );
                        }
                        Outcome::Dropped(r) => {
                            let _ = writeln!(
                                s,
                                "{}  {:<8} {:<8} {:>3} {:>6}  {:<20}  dropped: {}",
                                head(&rank, &seq),
                                "-",
                                "-",
                                "-",
                                "-",
                                "",
                                r
                            );
                        }
                    }
                }
                if *truncated {
                    let _ = writeln!(s, "{}  (payload truncated: later events lost)", head(&rank, &seq));
                }
            }
            Decoded::ReplayEnd => {
                let _ = writeln!(s, "{}  (end of replay)", head("-", "-"));
            }
            Decoded::Error(e) => {
                let _ = writeln!(s, "{}  error: {}", head("-", "-"), e);
            }
        }
    }
    let sum = &walk.summary;
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "messages {}  batches {}  replay ends {}  restarts {}",
        sum.messages, sum.batches, sum.replay_ends, walk.restarts
    );
    let tally = |t: &crate::drops::Tally| {
        if t.0.is_empty() {
            "none".to_string()
        } else {
            t.0.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(" ")
        }
    };
    let _ = writeln!(s, "events: {}", tally(&sum.events));
    let _ = writeln!(s, "dropped: {}", tally(&sum.drops));
    let _ = writeln!(s, "rewritten: {}", tally(&sum.rewrites));
    let _ = writeln!(s, "message errors: {}", tally(&sum.message_errors));
    let _ = writeln!(s, "live blocks after the pub stream:");
    if walk.live.is_empty() {
        let _ = writeln!(s, "  none");
    }
    for (k, set) in &walk.live.blocks {
        let copies: u64 = set.values().map(|c| u64::from(*c)).sum();
        let _ =
            writeln!(s, "  rank {} {} group {}: {} blocks, {} copies", k.dp_rank, k.tier, k.group, set.len(), copies);
    }
    s
}
