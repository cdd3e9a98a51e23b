//! The ingest's metrics (catalogue in `docs/metrics.md`).

use crate::drops::Tally;
use crate::hashcheck::CheckCounts;
use crate::model::Batch;
use crate::model::RankHealth;
use metrics::{counter, gauge};

pub fn batch(rank: u32, b: &Batch, drops: &Tally, rewrites: &Tally, refilled: bool) {
    let r = rank.to_string();
    counter!("kv_relay_batches_total", "rank" => r.clone(), "source" => if refilled { "replay" } else { "live" })
        .increment(1);
    // Summed per kind first: a batch of SGLang's one-block events is hundreds of events, and each
    // counter call looks its labels up in the registry.
    let mut kinds: [(&'static str, u64, u64); 3] = [("stored", 0, 0), ("removed", 0, 0), ("cleared", 0, 0)];
    for e in &b.events {
        if let Some((_, events, ops)) = kinds.iter_mut().find(|k| k.0 == e.kind()) {
            *events += 1;
            *ops += e.block_ops() as u64;
        }
    }
    for (kind, events, ops) in kinds {
        if events > 0 {
            counter!("kv_relay_events_total", "rank" => r.clone(), "kind" => kind).increment(events);
            counter!("kv_relay_block_ops_total", "rank" => r.clone(), "kind" => kind).increment(ops);
        }
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

pub fn rank_health(rank: u32, h: &RankHealth) {
    let r = rank.to_string();
    gauge!("kv_relay_rank_degraded", "rank" => r.clone()).set(if matches!(h, RankHealth::Degraded { .. }) {
        1.0
    } else {
        0.0
    });
    gauge!("kv_relay_rank_incomplete", "rank" => r).set(if matches!(h, RankHealth::Incomplete { .. }) {
        1.0
    } else {
        0.0
    });
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Cleared, Event, Removed, Tier};
    use metrics_exporter_prometheus::PrometheusBuilder;

    fn removed(hashes: &[u64]) -> Event {
        Event::Removed(Removed { tier: Tier::Device, group: 0, block_hashes: hashes.to_vec(), ownership: None })
    }

    #[test]
    fn a_batch_counts_its_events_and_block_operations_per_kind() {
        let recorder = PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        let b = Batch {
            dp_rank: 3,
            seq: 7,
            ts: 0.0,
            events: vec![removed(&[1, 2]), Event::Cleared(Cleared { tier: None }), removed(&[3]), removed(&[4, 5, 6])],
        };
        metrics::with_local_recorder(&recorder, || batch(3, &b, &Tally::default(), &Tally::default(), false));
        let text = handle.render();
        let mut lines: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("kv_relay_events_total") || l.starts_with("kv_relay_block_ops_total"))
            .collect();
        lines.sort();
        assert_eq!(
            lines,
            [
                "kv_relay_block_ops_total{rank=\"3\",kind=\"cleared\"} 1",
                "kv_relay_block_ops_total{rank=\"3\",kind=\"removed\"} 6",
                "kv_relay_events_total{rank=\"3\",kind=\"cleared\"} 1",
                "kv_relay_events_total{rank=\"3\",kind=\"removed\"} 3",
            ]
        );
    }
}
