//! Snapshots.

use super::*;

#[tokio::test]
async fn cursor_predating_history_gets_snapshot_then_batches_and_rebuilds_the_state() {
    let relay = Relay::start(cfg(), HistoryLimits { max_batches: 20, max_bytes: 1 << 30 }).await;
    let mut traffic = Traffic::new(3, 2);
    let mut truth = LiveBlocks::new();
    for r in traffic.commit(&relay.store, 150) {
        apply(&mut truth, &r);
    }
    assert!(relay.store.oldest_cursor().unwrap() > 2, "the history was trimmed");
    let epoch = relay.store.epoch();
    let mut client = relay.client().await;

    // Refused without snapshots.
    let err = client.subscribe(req(epoch, 1, relay.store.incarnation(), false)).await.unwrap_err();
    assert_eq!(err.code(), Code::OutOfRange, "{err:?}");

    let mut s = client.subscribe(req(epoch, 1, relay.store.incarnation(), true)).await.unwrap().into_inner();
    let (begin, end, mut live) = read_snapshot(&mut s).await;
    assert_eq!(begin.reason, pb::SnapshotReason::CursorTrimmed as i32);
    assert_eq!(begin.epoch, epoch);
    assert_eq!(begin.cursor, end.cursor);
    assert_eq!(begin.block_count, Some(end.block_count));
    assert_eq!(end.cursor, 150);
    assert_eq!(live.blocks, truth.blocks, "snapshot equals the state at its cursor");

    // Then live batches (fewer than the history holds, so this reader cannot fall behind); the
    // rebuilt state follows the truth.
    for r in traffic.commit(&relay.store, 15) {
        apply(&mut truth, &r);
    }
    let mut cursor = end.cursor;
    while cursor < relay.store.newest_cursor() {
        let r = next_record(&mut s).await;
        assert_eq!(r.cursor, cursor + 1, "no gap after the snapshot");
        cursor = r.cursor;
        apply(&mut live, &r);
    }
    assert_eq!(live.blocks, truth.blocks, "snapshot + batches rebuild the store's state");

    // A resume from the snapshot's end cursor continues without another snapshot.
    let mut s = client.subscribe(req(epoch, end.cursor, end.incarnation, false)).await.unwrap().into_inner();
    assert_eq!(next_record(&mut s).await.cursor, end.cursor + 1);
    relay.stop().await;
}

#[tokio::test]
async fn cursor_zero_after_a_trimmed_history_is_a_new_client_with_or_without_the_epoch() {
    let relay = Relay::start(cfg(), HistoryLimits { max_batches: 20, max_bytes: 1 << 30 }).await;
    Traffic::new(5, 2).commit(&relay.store, 60);
    let (epoch, incarnation) = (relay.store.epoch(), relay.store.incarnation());
    let mut client = relay.client().await;
    // A router learns the epoch from Status before its first Subscribe; it has still applied
    // nothing, so it is as new as one that sends no epoch.
    for e in [0, epoch] {
        let err = client.subscribe(req(e, 0, incarnation, false)).await.unwrap_err();
        assert_eq!(err.code(), Code::OutOfRange, "{err:?}");
        let mut s = client.subscribe(req(e, 0, incarnation, true)).await.unwrap().into_inner();
        let (begin, end, _) = read_snapshot(&mut s).await;
        assert_eq!((begin.reason, begin.epoch, end.cursor), (pb::SnapshotReason::NewClient as i32, epoch, 60));
    }
    relay.stop().await;
}

#[tokio::test]
async fn new_client_streams_the_whole_history_when_it_starts_at_one() {
    let relay = Relay::start(cfg(), big_history()).await;
    Traffic::new(1, 1).commit(&relay.store, 10);
    let mut s = relay.client().await.subscribe(req(0, 0, 0, false)).await.unwrap().into_inner();
    for c in 1..=10 {
        assert_eq!(next_record(&mut s).await.cursor, c);
    }
    relay.stop().await;
}

#[tokio::test]
async fn rank_filter_passes_only_the_ranks_asked_for() {
    let relay = Relay::start(cfg(), big_history()).await;
    let committed = Traffic::new(17, 3).commit(&relay.store, 60);
    let want: Vec<&Record> = committed
        .iter()
        .filter(|r| match &r.body {
            RecordBody::Batch { batch, .. } => batch.dp_rank == 2,
            RecordBody::Control(c) => c.dp_rank == 2,
        })
        .collect();
    let r = pb::SubscribeRequest { ranks: vec![2], ..req(0, 0, 0, false) };
    let mut s = relay.client().await.subscribe(r).await.unwrap().into_inner();
    for w in want {
        assert_eq!(&next_record(&mut s).await, w);
    }
    relay.stop().await;
}

#[tokio::test]
async fn epoch_change_forces_a_snapshot() {
    let relay = Relay::start(cfg(), big_history()).await;
    let mut traffic = Traffic::new(5, 2);
    let mut truth = LiveBlocks::new();
    for r in traffic.commit(&relay.store, 40) {
        apply(&mut truth, &r);
    }
    let other = relay.store.epoch().wrapping_add(1);
    let mut client = relay.client().await;
    let err = client.subscribe(req(other, 10, 1, false)).await.unwrap_err();
    assert_eq!(err.code(), Code::OutOfRange, "{err:?}");

    let mut s = client.subscribe(req(other, 10, 1, true)).await.unwrap().into_inner();
    let (begin, end, live) = read_snapshot(&mut s).await;
    assert_eq!(begin.reason, pb::SnapshotReason::EpochChanged as i32);
    assert_eq!(begin.epoch, relay.store.epoch());
    assert_eq!(end.cursor, 40);
    assert_eq!(live.blocks, truth.blocks);
    relay.stop().await;
}

#[tokio::test]
async fn lost_or_ahead_cursor_gets_a_snapshot_or_failed_precondition() {
    let relay = Relay::start(cfg(), big_history()).await;
    Traffic::new(9, 2).commit(&relay.store, 30);
    let (epoch, inc) = (relay.store.epoch(), relay.store.incarnation());
    let mut client = relay.client().await;

    // Ahead of the newest: the relay lost its tail.
    let err = client.subscribe(req(epoch, 35, inc, false)).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    let mut s = client.subscribe(req(epoch, 35, inc, true)).await.unwrap().into_inner();
    let (begin, end, _) = read_snapshot(&mut s).await;
    assert_eq!(begin.reason, pb::SnapshotReason::CursorLost as i32);
    assert_eq!(end.cursor, 30);

    // The record at the cursor was committed by another incarnation.
    let err = client.subscribe(req(epoch, 20, inc + 1, false)).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    let mut s = client.subscribe(req(epoch, 20, inc + 1, true)).await.unwrap().into_inner();
    let (begin, _, _) = read_snapshot(&mut s).await;
    assert_eq!(begin.reason, pb::SnapshotReason::CursorLost as i32);

    // The right incarnation resumes in place.
    let mut s = client.subscribe(req(epoch, 20, inc, false)).await.unwrap().into_inner();
    assert_eq!(next_record(&mut s).await.cursor, 21);
    relay.stop().await;
}

#[tokio::test]
async fn snapshot_incarnation_resumes_across_a_reopened_store() {
    // A snapshot taken before the reopened store commits anything ends at a cursor the previous
    // incarnation committed; resuming with the incarnation it gave must not snapshot again.
    let dir = tempfile::tempdir().unwrap();
    {
        let store = Store::open(StoreConfig::new(dir.path())).unwrap();
        Traffic::new(2, 1).commit(&store, 5);
        store.flush().unwrap();
    }
    let store = Store::open(StoreConfig::new(dir.path())).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let task =
        tokio::spawn(serve(cfg(), store.clone(), RelayStatusHandle::new("e"), notice_channel(), listener, async {
            let _ = stopped.await;
        }));
    let mut client = RelayClient::connect(format!("http://{addr}")).await.unwrap();
    let mut s = client.subscribe(req(store.epoch(), 99, 1, true)).await.unwrap().into_inner();
    let (_, end, _) = read_snapshot(&mut s).await;
    assert_eq!(end.cursor, 5);
    let mut s = client.subscribe(req(store.epoch(), end.cursor, end.incarnation, false)).await.unwrap().into_inner();
    Traffic::new(4, 1).commit(&store, 1);
    assert_eq!(next_record(&mut s).await.cursor, 6);
    let _ = stop.send(());
    tokio::time::timeout(T, task).await.unwrap().unwrap().unwrap();
}
