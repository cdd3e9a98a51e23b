//! A follower over a fleet of 100 relays (`kv_relay_testkit::fleet`: the relay's own server
//! code on 100 ports of 127.0.0.1): every relay caught up with the exact blocks, resyncs bounded,
//! a relay restarting with a new epoch resynced by one snapshot without disturbing any other, a
//! relay that disappears reported unreachable alone; under a steady stream of records every live
//! set followed exactly, and a slow relay (stalled, then throttled) left behind and caught up
//! alone.

use std::time::Duration;

use kv_relay_testkit::fleet::{Fleet, StreamConfig};
use kv_router_client::backoff::BackoffConfig;
use kv_router_client::{FollowConfig, Follower, ResyncSlots, WorkerState};

use crate::relay::until;

const RELAYS: usize = 100;
const BLOCKS: usize = 8;

fn caught_up(f: &Follower, fleet: &Fleet) -> bool {
    let relays = f.relays();
    relays.len() == fleet.relays.len()
        && relays.iter().zip(&fleet.relays).all(|(r, fr)| {
            r.epoch == fr.store().epoch() && r.cursor == fr.store().newest_cursor() && !r.syncing && !r.staging
        })
}

fn follower() -> Follower {
    Follower::new(FollowConfig {
        max_concurrent_resyncs: 16,
        start_jitter: Duration::from_millis(200),
        backoff: BackoffConfig {
            initial: Duration::from_millis(20),
            max: Duration::from_millis(200),
            multiplier: 2.0,
            jitter: 0.5,
        },
        stale_after: Duration::from_secs(600),
        ..FollowConfig::default()
    })
}

/// A follower of every relay of `fleet` (sorted by URL, as `Follower::relays()` lists them).
fn follow(fleet: &mut Fleet) -> Follower {
    let f = follower();
    fleet.relays.sort_by_key(|r| r.url());
    for u in fleet.urls() {
        f.add_relay(&u).unwrap();
    }
    f
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_follows_a_hundred_relays_and_a_restart_disturbs_no_other() {
    let mut fleet = Fleet::start(RELAYS, 5, BLOCKS).await;
    let f = follow(&mut fleet);
    until("every relay caught up", || caught_up(&f, &fleet)).await;
    assert_eq!(f.index().stats().blocks, RELAYS * 5 * BLOCKS);
    fleet.tick();
    until("every relay caught up after a tick", || caught_up(&f, &fleet)).await;
    assert_eq!(f.index().stats().blocks, RELAYS * 6 * BLOCKS);
    assert_eq!(f.resync_slots(), ResyncSlots { limit: 16, in_flight: 0, waiting: 0 });
    assert_eq!(f.counters().snapshots, 0, "a first start streams the history");

    // Relay 7 restarts with a new epoch and 3 batches: one snapshot for it, nothing for the others.
    let others = |f: &Follower| -> Vec<_> {
        f.relays()
            .into_iter()
            .enumerate()
            .filter(|&(i, _)| i != 7)
            .map(|(_, r)| {
                (r.url, r.epoch, r.cursor, r.counters.snapshots, r.counters.records_applied, r.counters.reconnects)
            })
            .collect()
    };
    let before = others(&f);
    fleet.restart_new_epoch(7, 3).await;
    until("relay 7 resynced", || caught_up(&f, &fleet)).await;
    let seven = &f.relays()[7];
    assert_eq!((seven.counters.snapshots, seven.counters.epoch_changes), (1, 1));
    assert_eq!(others(&f), before);
    assert_eq!(f.index().stats().blocks, (RELAYS - 1) * 6 * BLOCKS + 3 * BLOCKS);

    // Relay 3 disappears: its worker alone is unreachable.
    fleet.disappear(3).await;
    until("relay 3 unreachable", || f.workers()[3].state == WorkerState::RelayUnreachable).await;
    let states: Vec<_> = f.workers().iter().map(|w| w.state).collect();
    let mut want = vec![WorkerState::Fresh; RELAYS];
    want[3] = WorkerState::RelayUnreachable;
    assert_eq!(states, want);
    f.shutdown().await;
    fleet.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_steady_stream_is_followed_exactly_and_a_slow_relay_falls_behind_and_catches_up_alone() {
    const N: usize = 20;
    const SLOW: usize = 5;
    // 10 batches of 8 blocks: 80 live blocks a relay.
    let mut fleet = Fleet::start(N, 10, BLOCKS).await;
    let f = follow(&mut fleet);
    until("every relay caught up", || caught_up(&f, &fleet)).await;
    let reconnects = |f: &Follower| -> Vec<u64> { f.relays().iter().map(|r| r.counters.reconnects).collect() };
    let before = reconnects(&f);

    // Relay 5 stalls; 10 records of 4 stores and 4 removals go to every relay.
    fleet.slow(SLOW, 0).await;
    let report =
        fleet.stream(StreamConfig { records_per_second: 2000.0, stores: 4, removes: 4, limit: Some(200) }).wait();
    assert_eq!(report.records, 200);
    let others_caught_up = |f: &Follower| {
        f.relays()
            .iter()
            .zip(&fleet.relays)
            .enumerate()
            .all(|(i, (r, fr))| i == SLOW || r.cursor == fr.store().newest_cursor())
    };
    until("every relay but the slow one caught up", || others_caught_up(&f)).await;
    let relays = f.relays();
    assert_eq!((relays[SLOW].cursor, fleet.relays[SLOW].store().newest_cursor()), (10, 20));
    assert_eq!(fleet.relays[SLOW].live(), 40..120);

    // Throttled to 16 KiB/s, it catches up; then it is recovered.
    fleet.slow(SLOW, 16 << 10).await;
    until("the slow relay caught up", || caught_up(&f, &fleet)).await;
    fleet.recover(SLOW);
    fleet.tick();
    until("every relay caught up after a tick", || caught_up(&f, &fleet)).await;

    // Exact live sets: 80 a relay after the stream, 8 more after the tick; no snapshot, and no
    // relay but the slow one reconnected.
    assert_eq!(f.index().stats().blocks, N * (80 + BLOCKS));
    let mut want = vec![0u64; N];
    want[SLOW] = 1;
    let got = reconnects(&f);
    let moved: Vec<u64> = got.iter().zip(&before).map(|(a, b)| u64::from(a != b)).collect();
    assert_eq!(moved, want);
    assert_eq!(f.counters().snapshots, 0);
    f.shutdown().await;
    fleet.stop().await;
}
