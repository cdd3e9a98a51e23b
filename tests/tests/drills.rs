//! The fault drills in their short form (seconds each): every pass rule is an
//! assertion. Needs the `kv-relay` binary: `cargo build -p kv-relay --bins` (or `KV_RELAY_BIN`).
//! The long form, in release: `KV_RELAY_BIN=target/release/kv-relay cargo run --release -p
//! kv-relay-testkit --bin drills -- --long` (docs/drills.md).

use kv_relay_testkit::drills::{self, Report, Scale};

/// One drill at a time: they measure timings and RSS, and share two cores with everything else.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn run(f: fn(Scale) -> Report) {
    let _one = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let r = f(Scale { long: false });
    println!("{}", r.text());
    if let Some(why) = &r.skipped {
        println!("SKIPPED: {} ({why})", r.name);
        return;
    }
    assert!(r.passed(), "{}", r.text());
}

#[test]
fn router_restarted_under_load_is_equal_within_2500ms() {
    run(drills::router_restart);
}

#[test]
fn router_cursor_older_than_history_resyncs_from_a_snapshot() {
    run(drills::stale_cursor);
}

#[test]
fn twenty_batches_dropped_on_the_wire_are_refilled_without_a_gap() {
    run(drills::wire_drops);
}

#[test]
fn publisher_delay_shows_as_lag_and_loses_nothing() {
    run(drills::publisher_delay);
}

#[test]
fn publisher_restart_resets_only_that_rank() {
    run(drills::publisher_restart);
}

#[test]
fn gap_beyond_replay_buffer_degrades_the_rank_until_a_clear() {
    run(drills::replay_gap);
}

#[test]
fn relay_killed_under_load_is_equal_within_2500ms_of_its_restart() {
    run(drills::relay_kill);
}

#[test]
fn a_batch_over_max_message_bytes_is_lost_alone_and_the_relay_does_not_take_it() {
    run(drills::oversized);
}

#[test]
fn engine_gone_then_back_keeps_serving_and_converges() {
    run(drills::engine_gone);
}

#[test]
fn slow_subscriber_resyncs_and_leaves_fast_ones_alone() {
    run(drills::slow_subscriber);
}

#[test]
fn garbage_frames_are_counted_by_reason_and_good_events_applied() {
    run(drills::garbage);
}

// The short form: 8 routers at 100 requests/s (a debug relay keeps up on two shared cores); the
// long form (64 routers, 10 minutes) runs in release: docs/drills.md.
#[test]
fn many_subscribers_keep_up_and_relay_rss_stays_flat() {
    run(drills::soak);
}

#[test]
fn disk_full_counts_errors_keeps_the_store_and_recovers() {
    run(drills::disk_full);
}

#[test]
fn a_killed_engine_leaves_routing_within_2500ms_and_returns_when_it_serves() {
    run(drills::routing::engine_killed);
}

#[test]
fn a_partitioned_host_leaves_routing_within_2500ms_and_returns_after_the_heal() {
    run(drills::routing::host_partitioned);
}

#[test]
fn a_wedged_engine_leaves_routing_within_the_wedge_bound_and_returns_within_1s() {
    run(drills::routing::engine_wedged);
}

#[test]
fn a_frozen_engine_leaves_routing_within_2500ms_and_returns_within_1s_of_sigcont() {
    run(drills::routing::engine_frozen);
}

#[test]
fn an_engine_restarted_empty_is_readmitted_takes_misses_and_its_index_regrows() {
    run(drills::routing::engine_restarted_empty);
}

#[test]
fn a_router_restarted_under_load_serves_within_2s_with_every_index_equal() {
    run(drills::routing::router_restarted);
}

#[test]
fn five_hundred_twelve_concurrent_route_calls_all_answer_with_bounded_rss() {
    run(drills::routing::route_storm);
}
