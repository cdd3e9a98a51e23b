//! Admission over scripted streams: no network, no relay.

use std::time::Duration;

use kv_relay_proto::pb;
use kv_relay_proto::pb::ControlKind as K;
use kv_relay_proto::pb::Tier::{Device, Host};
use kv_router_client::index::TierId;
use kv_router_client::{ClientEvent, Position, Verdict, WorkerState};
use tokio::time::Instant;

use crate::util::*;

const H: [u64; 4] = [11, 12, 13, 14];

#[test]
fn duplicates_are_ignored_and_counted() {
    let mut s = Script::new();
    s.feed([batch(1, 0, vec![stored(Device, &H[..2])]), batch(2, 0, vec![stored(Device, &H[2..])])]);
    // The same records again (a resume that overlapped, a retransmission).
    s.feed([batch(1, 0, vec![stored(Device, &H[..2])]), batch(2, 0, vec![stored(Device, &H[2..])])]);
    assert_eq!(s.adm.counters().duplicates, 2);
    assert_eq!(s.adm.counters().records_applied, 2);
    assert_eq!(s.lookup(&H), expected(&s, &[(0, TierId::DEVICE, &H)]).lookup(&H));
    // One copy each: one removal empties the worker.
    s.feed([batch(3, 0, vec![removed(Device, &H)])]);
    assert!(s.lookup(&H).is_empty());
    assert_eq!(s.index.stats().blocks, 0);
}

#[test]
fn gap_applies_nothing_and_resumes_from_the_last_cursor() {
    let mut s = Script::new();
    s.feed([batch(1, 0, vec![stored(Device, &H[..1])])]);
    let v = s.apply(batch(3, 0, vec![stored(Device, &H[1..2])]));
    assert!(matches!(v, Verdict::Resume(ref why) if why.contains("gap")), "{v:?}");
    assert_eq!(s.adm.position().cursor, 1);
    assert_eq!(s.adm.counters().gaps, 1);
    assert_eq!(s.events, vec![ClientEvent::Gap { relay: arc(URL), after: 1, got: 3 }]);
    assert_eq!(s.adm.subscribe_request(true, false).after_cursor, 1);
    assert_eq!(s.lookup(&H).blocks(s.worker(0)), 1, "record 3 was not applied");
    // The resumed stream sends 2 and 3.
    s.feed([batch(2, 0, vec![stored(Device, &H[1..2])]), batch(3, 0, vec![stored(Device, &H[2..3])])]);
    assert_eq!(s.lookup(&H).blocks(s.worker(0)), 3);
    assert_eq!(s.adm.position().cursor, 3);
}

#[test]
fn rank_reset_clears_only_that_worker_then_it_rebuilds() {
    let mut s = Script::new();
    s.feed([
        batch(1, 0, vec![stored(Device, &H)]),
        batch(2, 1, vec![stored(Device, &H), stored(Host, &H)]),
        control(3, 1, K::RankReset, "publisher restarted"),
    ]);
    assert_eq!(s.lookup(&H), expected(&s, &[(0, TierId::DEVICE, &H)]).lookup(&H));
    assert_eq!(
        s.events,
        vec![ClientEvent::RankReset { relay: arc(URL), dp_rank: 1, reason: "publisher restarted".into() }]
    );
    s.feed([batch(4, 1, vec![stored(Host, &H[..2])])]);
    assert_eq!(s.lookup(&H), expected(&s, &[(0, TierId::DEVICE, &H), (1, TierId::HOST, &H[..2])]).lookup(&H));
    let w1 = s.adm.workers(Instant::now(), Duration::from_secs(2)).into_iter().find(|w| w.dp_rank == 1).unwrap();
    assert_eq!(w1.resets, 1);
}

#[test]
fn snapshot_is_staged_then_swapped_and_later_records_apply_on_top() {
    let mut s = Script::new();
    s.feed([batch(1, 0, vec![stored(Device, &H)]), batch(2, 1, vec![stored(Device, &H[..1])])]);
    let old = s.lookup(&H);
    let epoch = s.adm.position().epoch;
    // The relay sends a snapshot at cursor 5 (same epoch: e.g. a trimmed cursor).
    s.feed([
        snap_begin(epoch, 5, &[]),
        snap_chunk(&[(0, Device, H[0], 1), (0, Device, H[1], 2)]),
        snap_chunk(&[(2, Host, H[0], 1)]),
    ]);
    assert!(s.adm.is_staging());
    // A lookup during staging sees the whole old state.
    assert_eq!(s.lookup(&H), old);
    s.feed([snap_end(5)]);
    assert!(!s.adm.is_staging());
    // Rank 1 (known, absent from an all-ranks snapshot) is emptied; rank 2 appears.
    let want = expected(&s, &[(0, TierId::DEVICE, &H[..2]), (0, TierId::DEVICE, &H[1..2]), (2, TierId::HOST, &H[..1])]);
    assert_eq!(s.lookup(&H), want.lookup(&H));
    assert_eq!(s.adm.position(), Position { epoch, cursor: 5, incarnation: 2 });
    assert_eq!(s.adm.counters().snapshots, 1);
    // Records up to the snapshot's cursor are duplicates; the next applies on top.
    s.feed([batch(5, 0, vec![stored(Device, &H[2..])]), batch(6, 0, vec![removed(Device, &H[1..2])])]);
    assert_eq!(s.adm.counters().duplicates, 1);
    let want = expected(&s, &[(0, TierId::DEVICE, &H[..2]), (2, TierId::HOST, &H[..1])]);
    assert_eq!(s.lookup(&H), want.lookup(&H));
    assert!(matches!(s.events.last(), Some(ClientEvent::SnapshotApplied { cursor: 5, blocks: 3, .. })));
}

#[test]
fn snapshot_of_named_ranks_leaves_the_others() {
    let mut s = Script::new();
    s.feed([batch(1, 0, vec![stored(Device, &H)]), batch(2, 1, vec![stored(Device, &H)])]);
    s.feed([snap_begin(0, 2, &[1]), snap_chunk(&[(1, Device, H[0], 1)]), snap_end(2)]);
    let want = expected(&s, &[(0, TierId::DEVICE, &H), (1, TierId::DEVICE, &H[..1])]);
    assert_eq!(s.lookup(&H), want.lookup(&H));
}

#[test]
fn epoch_change_swaps_in_the_new_epochs_state() {
    let mut s = Script::new();
    s.adm.apply_status(&pb::StatusResponse { epoch: 77, ..Default::default() }, &s.index);
    assert_eq!(s.adm.subscribe_request(true, false).epoch, 77, "the first stream's epoch comes from Status");
    s.feed((1..=10).map(|c| batch(c, 0, vec![stored(Device, &[100 + c])])));
    assert_eq!(s.adm.position(), Position { epoch: 77, cursor: 10, incarnation: 1 });
    // The relay's store was wiped: a new epoch, cursors start over.
    s.feed([snap_begin(99, 3, &[]), snap_chunk(&[(0, Device, H[0], 1)]), snap_end(3)]);
    assert_eq!(s.adm.position(), Position { epoch: 99, cursor: 3, incarnation: 2 });
    assert_eq!(s.adm.counters().epoch_changes, 1);
    assert_eq!(s.index.stats().blocks, 1);
    s.feed([batch(4, 0, vec![stored(Device, &H[1..2])])]);
    assert_eq!(s.lookup(&H), expected(&s, &[(0, TierId::DEVICE, &H[..2])]).lookup(&H));
    let r = s.adm.subscribe_request(true, false);
    assert_eq!((r.epoch, r.after_cursor), (99, 4));
}

#[test]
fn stream_lost_mid_snapshot_discards_the_staging() {
    let mut s = Script::new();
    s.feed([batch(1, 0, vec![stored(Device, &H)])]);
    let old = s.lookup(&H);
    s.feed([snap_begin(5, 9, &[]), snap_chunk(&[(0, Device, 1, 1)])]);
    s.adm.on_disconnected("connection reset".into(), &mut s.events);
    assert!(!s.adm.is_staging());
    assert_eq!(s.lookup(&H), old);
    assert_eq!(s.adm.position().cursor, 1, "the position is the one before the snapshot");
    // An end without its begin (on the next stream) is out of protocol.
    s.adm.on_connected(&mut s.events);
    assert!(matches!(s.apply(snap_end(9)), Verdict::Resume(_)));
    // So is a record inside a snapshot.
    s.feed([snap_begin(5, 9, &[])]);
    assert!(matches!(s.apply(batch(2, 0, vec![])), Verdict::Resume(_)));
    assert_eq!(s.adm.counters().protocol_errors, 2);
}

#[test]
fn resync_request_leaves_the_stream() {
    let mut s = Script::new();
    s.feed([batch(1, 0, vec![])]);
    let v = s.apply(msg(pb::subscribe_response::Message::Resync(pb::Resync {
        reason: "fell behind".into(),
        after_cursor: 1,
        oldest_cursor: 50,
    })));
    assert!(matches!(v, Verdict::Resume(_)));
    assert_eq!(s.adm.counters().resyncs, 1);
    assert_eq!(s.adm.position().cursor, 1);
}

#[test]
fn degraded_incomplete_and_recovered_are_reported() {
    let mut s = Script::new();
    let state = |s: &Script, r: u32| {
        s.adm.workers(Instant::now(), Duration::from_secs(2)).into_iter().find(|w| w.dp_rank == r).unwrap()
    };
    s.feed([batch(1, 0, vec![stored(Device, &H)]), control(2, 0, K::RankDegraded, "gap 5..9 not in replay")]);
    let w = state(&s, 0);
    assert_eq!((w.state, w.degraded.as_deref()), (WorkerState::Degraded, Some("gap 5..9 not in replay")));
    s.feed([control(3, 0, K::RankIncomplete, "replay starts at 40")]);
    assert_eq!(state(&s, 0).state, WorkerState::Degraded, "degraded outranks incomplete");
    s.feed([control(4, 0, K::RankRecovered, "")]);
    let w = state(&s, 0);
    assert_eq!((w.state, w.degraded, w.incomplete), (WorkerState::Fresh, None, None));
    s.feed([control(5, 1, K::RankIncomplete, "replay starts at 40")]);
    assert_eq!(state(&s, 1).state, WorkerState::Incomplete);
    assert_eq!(
        s.events,
        vec![
            ClientEvent::RankDegraded { relay: arc(URL), dp_rank: 0, reason: "gap 5..9 not in replay".into() },
            ClientEvent::RankIncomplete { relay: arc(URL), dp_rank: 0, reason: "replay starts at 40".into() },
            ClientEvent::RankRecovered { relay: arc(URL), dp_rank: 0 },
            ClientEvent::RankIncomplete { relay: arc(URL), dp_rank: 1, reason: "replay starts at 40".into() },
        ]
    );
    // The blocks stay: degraded is a warning, not a clear.
    assert_eq!(s.lookup(&H).blocks(s.worker(0)), 4);
}

#[tokio::test(start_paused = true)]
async fn stale_after_the_silence_bound_and_fresh_again_on_heartbeat() {
    let bound = Duration::from_secs(2);
    let mut s = Script::new();
    s.feed([batch(1, 0, vec![stored(Device, &H)]), heartbeat(1, 3.0)]);
    let states = |s: &Script| -> Vec<WorkerState> {
        s.adm.workers(Instant::now(), bound).into_iter().map(|w| w.state).collect()
    };
    assert_eq!(states(&s), [WorkerState::Fresh, WorkerState::Fresh]);
    tokio::time::advance(Duration::from_millis(1500)).await;
    s.feed([heartbeat(1, 4.0)]);
    tokio::time::advance(Duration::from_millis(600)).await;
    // Rank 0 has been silent 2.1 s; rank 1 heard from 0.6 s ago.
    assert_eq!(states(&s), [WorkerState::Stale, WorkerState::Fresh]);
    s.feed([heartbeat(0, 5.0)]);
    assert_eq!(states(&s), [WorkerState::Fresh, WorkerState::Fresh]);
    let w0 = &s.adm.workers(Instant::now(), bound)[0];
    assert_eq!(w0.load.map(|l| l.running), Some(5.0));
    // A lost stream makes every worker of the relay unreachable, blocks kept.
    s.adm.on_disconnected("connection refused".into(), &mut s.events);
    assert_eq!(states(&s), [WorkerState::RelayUnreachable, WorkerState::RelayUnreachable]);
    assert_eq!(s.lookup(&H).blocks(s.worker(0)), 4);
}

#[test]
fn status_discovers_ranks_and_engine_stops() {
    let mut s = Script::new();
    let st = pb::StatusResponse {
        epoch: 5,
        ranks: vec![
            pb::RankStatus { dp_rank: 0, state: pb::RankState::Ok as i32, ..Default::default() },
            pb::RankStatus {
                dp_rank: 3,
                state: pb::RankState::Stopped as i32,
                load: Some(load(2.0)),
                ..Default::default()
            },
        ],
        ..Default::default()
    };
    s.adm.apply_status(&st, &s.index);
    let ws = s.adm.workers(Instant::now(), Duration::from_secs(2));
    assert_eq!(ws.iter().map(|w| (w.dp_rank, w.engine_stopped)).collect::<Vec<_>>(), [(0, false), (3, true)]);
    assert_eq!(ws[1].load.map(|l| l.running), Some(2.0));
}

#[test]
fn removed_relay_drops_its_workers_and_applies_nothing() {
    let mut s = Script::new();
    s.feed([batch(1, 0, vec![stored(Device, &H)])]);
    s.adm.remove(&s.index);
    assert!(s.lookup(&H).is_empty());
    assert_eq!(s.apply(batch(2, 0, vec![stored(Device, &H)])), Verdict::Stop);
    assert!(s.lookup(&H).is_empty());
}
