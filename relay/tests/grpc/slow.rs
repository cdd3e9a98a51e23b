//! Slow subscribers.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_subscriber_does_not_hold_back_a_fast_one_and_resyncs_only_behind_the_history() {
    let cfg = ServerConfig { stream_buffer: 4, history_page: 8, ..cfg() };
    let relay = Relay::start(cfg, HistoryLimits { max_batches: 50, max_bytes: 1 << 30 }).await;
    let mut traffic = Traffic::new(13, 2);
    let mut client = relay.client().await;
    // The slow reader on its own connection with small HTTP/2 windows (16 KiB), so what is in
    // flight to it is small: the rest waits in the store.
    let ep = Endpoint::from_shared(format!("http://{}", relay.addr))
        .unwrap()
        .initial_stream_window_size(Some(16 << 10))
        .initial_connection_window_size(Some(16 << 10));
    let mut slow_client = RelayClient::new(ep.connect().await.unwrap());
    let mut slow = slow_client.subscribe(req(0, 0, 0, false)).await.unwrap().into_inner();
    let mut fast = client.subscribe(req(0, 0, 0, false)).await.unwrap().into_inner();

    // Within the history: the slow one lags (reads 3, pauses) but is never told to resync.
    traffic.commit(&relay.store, 40);
    for c in 1..=3 {
        assert_eq!(next_record(&mut slow).await.cursor, c);
    }
    for c in 1..=40 {
        assert_eq!(next_record(&mut fast).await.cursor, c);
    }
    for c in 4..=40 {
        assert_eq!(next_record(&mut slow).await.cursor, c, "a lagging subscriber within the history catches up");
    }

    // The slow one pauses while 1,000 more records are committed (the history keeps 50; far more
    // than its windows hold): the fast one gets every record meanwhile.
    for _ in 0..100 {
        for r in traffic.commit(&relay.store, 10) {
            assert_eq!(next_record(&mut fast).await.cursor, r.cursor);
        }
    }
    // The slow one gets what was in flight (its channel, one page, the HTTP/2 windows), then the
    // resync.
    let mut last = 40;
    let mut heartbeats = 0;
    let resync = loop {
        match next(&mut slow).await {
            M::Resync(r) => break r,
            M::Heartbeat(_) => {
                heartbeats += 1;
                assert!(heartbeats < 5, "caught up at {last} without a resync");
            }
            m => {
                let r = record_from_subscribe(&pb::SubscribeResponse { message: Some(m) }).unwrap().unwrap();
                assert_eq!(r.cursor, last + 1, "contiguous until the resync");
                last = r.cursor;
            }
        }
    };
    assert_eq!(resync.after_cursor, last);
    assert!(resync.oldest_cursor > last + 1, "told to resync only once behind the history");
    assert_eq!(status_of(&mut slow).await.code(), Code::OutOfRange);
    relay.stop().await;
}
