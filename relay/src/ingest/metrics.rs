//! The ingest's metrics (catalogue in `docs/metrics.md`).

use super::rank::Health;
use crate::drops::Tally;
use crate::hashcheck::CheckCounts;
use crate::model::Batch;
use metrics::{counter, gauge};

pub fn batch(rank: u32, b: &Batch, drops: &Tally, rewrites: &Tally, refilled: bool) {
    let r = rank.to_string();
    counter!("kv_relay_batches_total", "rank" => r.clone(), "source" => if refilled { "replay" } else { "live" })
        .increment(1);
    for e in &b.events {
        counter!("kv_relay_events_total", "rank" => r.clone(), "kind" => e.kind()).increment(1);
        counter!("kv_relay_block_ops_total", "rank" => r.clone(), "kind" => e.kind()).increment(e.block_ops() as u64);
    }
    for (reason, n) in &drops.0 {
        counter!("kv_relay_dropped_events_total", "rank" => r.clone(), "reason" => *reason).increment(*n);
    }
    for (kind, n) in &rewrites.0 {
        counter!("kv_relay_rewritten_events_total", "rank" => r.clone(), "kind" => *kind).increment(*n);
    }
}

pub fn message_error(rank: u32, reason: &'static str) {
    counter!("kv_relay_message_errors_total", "rank" => rank.to_string(), "reason" => reason).increment(1);
}

pub fn gap(rank: u32) {
    counter!("kv_relay_gaps_total", "rank" => rank.to_string()).increment(1);
}

pub fn lost(rank: u32, n: u64) {
    counter!("kv_relay_lost_batches_total", "rank" => rank.to_string()).increment(n);
}

pub fn replay_cut(rank: u32) {
    counter!("kv_relay_replay_cuts_total", "rank" => rank.to_string()).increment(1);
}

pub fn disconnect(rank: u32) {
    counter!("kv_relay_disconnects_total", "rank" => rank.to_string()).increment(1);
}

pub fn restart(rank: u32) {
    counter!("kv_relay_publisher_restarts_total", "rank" => rank.to_string()).increment(1);
}

pub fn rank_health(rank: u32, h: Health) {
    let r = rank.to_string();
    gauge!("kv_relay_rank_degraded", "rank" => r.clone()).set(if h == Health::Degraded { 1.0 } else { 0.0 });
    gauge!("kv_relay_rank_incomplete", "rank" => r).set(if h == Health::Incomplete { 1.0 } else { 0.0 });
}

pub fn hash_check(rank: u32, c: &CheckCounts) {
    let r = rank.to_string();
    counter!("kv_relay_hash_checked_blocks_total", "rank" => r.clone()).increment(c.checked);
    counter!("kv_relay_hash_mismatched_blocks_total", "rank" => r.clone()).increment(c.mismatched);
    for (why, n) in &c.skipped {
        counter!("kv_relay_hash_skipped_blocks_total", "rank" => r.clone(), "reason" => why.as_str()).increment(*n);
    }
}

pub fn duplicate(rank: u32) {
    counter!("kv_relay_duplicate_batches_total", "rank" => rank.to_string()).increment(1);
}
