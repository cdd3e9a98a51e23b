//! Limits and shutdown.

use super::*;

#[tokio::test]
async fn rate_limit_returns_resource_exhausted_with_a_retry_hint() {
    let cfg = ServerConfig { rate_per_second: 1, rate_burst: 2, ..ServerConfig::default() };
    let relay = Relay::start(cfg, big_history()).await;
    let mut client = relay.client().await;
    let _a = client.subscribe(req(0, 0, 0, true)).await.unwrap();
    let _b = client.snapshot(pb::SnapshotRequest::default()).await.unwrap();
    let err = client.subscribe(req(0, 0, 0, true)).await.unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    let ms: u64 = err.metadata().get(RETRY_AFTER_MS).unwrap().to_str().unwrap().parse().unwrap();
    assert!(ms > 0 && ms <= 1000, "retry after {ms} ms");
    // Status is not rate limited.
    client.status(pb::StatusRequest {}).await.unwrap();
    relay.stop().await;
}

#[tokio::test]
async fn subscriber_limit_returns_resource_exhausted() {
    let cfg = ServerConfig { max_subscribers: 1, ..cfg() };
    let relay = Relay::start(cfg, big_history()).await;
    let mut client = relay.client().await;
    let a = client.subscribe(req(0, 0, 0, true)).await.unwrap();
    let err = client.subscribe(req(0, 0, 0, true)).await.unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted);
    drop(a);
    // The slot comes back once the first stream's producer sees the client gone.
    let ok = tokio::time::timeout(T, async {
        loop {
            if client.subscribe(req(0, 0, 0, true)).await.is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(ok.is_ok());
    relay.stop().await;
}

/// A live set of 40,000 blocks of 16 token ids on rank 0, in 40 records (the history holds 5);
/// returns the truth.
fn big_live_set(store: &Store) -> LiveBlocks {
    let mut truth = LiveBlocks::new();
    for r in 0..40u64 {
        let blocks = (0..1000).map(|i| Block { hash: r << 32 | i, token_ids: vec![7; 16], extra_keys: None }).collect();
        let batch = Batch {
            dp_rank: 0,
            seq: r + 1,
            ts: 0.0,
            events: vec![Event::Stored(Stored::plain(Tier::Device, 0, 16, blocks))],
        };
        apply(&mut truth, &store.commit(RecordBody::Batch { batch, load: None, liveness: None }).unwrap());
    }
    truth
}

#[tokio::test]
async fn max_snapshots_bounds_the_snapshots_in_flight_and_the_others_wait_their_turn() {
    // 2 snapshots at once; a one-message buffer and readers with 64 KiB windows, so a snapshot
    // (2.6 MB) whose reader reads nothing holds its slot: its chunks wait for the window.
    let cfg = ServerConfig { max_snapshots: 2, snapshot_chunk_blocks: 100, stream_buffer: 1, ..cfg() };
    let relay = Relay::start(cfg, HistoryLimits { max_batches: 5, max_bytes: 1 << 30 }).await;
    let truth = big_live_set(&relay.store);
    let epoch = relay.store.epoch();
    let with_tokens = pb::SubscribeRequest { snapshot_token_ids: true, ..req(0, 0, 0, true) };
    // Five routers starting from nothing, each on its own connection (a shared connection's
    // window would stall them all).
    let mut streams = Vec::new();
    let mut clients = Vec::new();
    for _ in 0..5 {
        let ep = Endpoint::from_shared(format!("http://{}", relay.addr)).unwrap();
        let ep = ep.initial_stream_window_size(64 << 10).initial_connection_window_size(64 << 10);
        let mut c = RelayClient::new(ep.connect().await.unwrap());
        streams.push(c.subscribe(with_tokens.clone()).await.unwrap().into_inner());
        clients.push(c);
    }
    // The first two hold the slots: a Snapshot call finds none free.
    let mut begun = Vec::new();
    for s in &mut streams[..2] {
        match next(s).await {
            M::SnapshotBegin(b) => begun.push(b),
            other => panic!("expected a snapshot begin, got {other:?}"),
        }
    }
    assert!(begun.iter().all(|b| b.epoch == epoch && b.cursor == 40));
    let err = clients[0].snapshot(pb::SnapshotRequest::default()).await.unwrap_err();
    assert_eq!((err.code(), err.message()), (Code::ResourceExhausted, "too many snapshots in progress"));
    // The other three wait: nothing at all reaches them while both slots are held.
    for s in &mut streams[2..] {
        let waited = tokio::time::timeout(Duration::from_millis(300), s.message()).await;
        assert!(waited.is_err(), "a third snapshot began while two were in flight: {waited:?}");
    }
    // Each in turn completes, every one the whole live set at the newest cursor.
    let (first, rest) = streams.split_at_mut(2);
    for s in first {
        let (end, live) = read_snapshot_after_begin(s).await;
        assert_eq!((end.cursor, end.block_count, &live.blocks), (40, 40_000, &truth.blocks));
    }
    for s in rest {
        let (begin, end, live) = read_snapshot(s).await;
        assert_eq!((begin.epoch, begin.cursor, end.cursor, end.block_count), (epoch, 40, 40, 40_000));
        assert_eq!(live.blocks, truth.blocks);
    }
    relay.stop().await;
}

#[tokio::test]
async fn shutdown_ends_streams_with_unavailable() {
    let relay = Relay::start(cfg(), big_history()).await;
    Traffic::new(1, 1).commit(&relay.store, 3);
    let mut s = relay.client().await.subscribe(req(0, 0, 0, false)).await.unwrap().into_inner();
    for _ in 0..3 {
        next_record(&mut s).await;
    }
    let Relay { stop, task, .. } = relay;
    let _ = stop.unwrap().send(());
    let st = status_of(&mut s).await;
    assert_eq!(st.code(), Code::Unavailable, "{st:?}");
    assert_eq!(st.message(), "relay shutting down");
    tokio::time::timeout(T, task).await.unwrap().unwrap();
}
