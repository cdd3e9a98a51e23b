//! A follower over a fleet of 100 relays (`kv_relay_testkit::fleet`: the relay's own server
//! code on 100 ports of 127.0.0.1): every relay caught up with the exact blocks, resyncs bounded,
//! a relay restarting with a new epoch resynced by one snapshot without disturbing any other, a
//! relay that disappears reported unreachable alone.

use std::time::Duration;

use kv_relay_testkit::fleet::Fleet;
use kv_router_client::backoff::BackoffConfig;
use kv_router_client::{FollowConfig, Follower, ResyncSlots, WorkerState};

use crate::relay::until;

const RELAYS: usize = 100;
const BLOCKS: usize = 8;

fn caught_up(f: &Follower, fleet: &Fleet) -> bool {
    let relays = f.relays();
    relays.len() == fleet.relays.len()
        && relays.iter().zip(&fleet.relays).all(|(r, fr)| {
            r.epoch == fr.store.epoch() && r.cursor == fr.store.newest_cursor() && !r.syncing && !r.staging
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_follows_a_hundred_relays_and_a_restart_disturbs_no_other() {
    let mut fleet = Fleet::start(RELAYS, 5, BLOCKS).await;
    let f = Follower::new(FollowConfig {
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
    });
    // Follower::relays() lists by URL: keep the fleet's order the same.
    fleet.relays.sort_by_key(|r| r.url());
    for u in fleet.urls() {
        f.add_relay(&u).unwrap();
    }
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
