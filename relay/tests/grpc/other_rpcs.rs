//! Other RPCs.

use super::*;

#[tokio::test]
async fn history_status_and_snapshot_rpcs() {
    let relay = Relay::start(cfg(), big_history()).await;
    let mut traffic = Traffic::new(21, 3);
    let mut truth = LiveBlocks::new();
    let committed = traffic.commit(&relay.store, 60);
    for r in &committed {
        apply(&mut truth, r);
    }
    relay.status.set_rank_health(1, kv_relay::model::RankHealth::Degraded { reason: "gap 5..9".into() }, false);
    let mut client = relay.client().await;

    let mut h = client
        .history(pb::HistoryRequest { from_cursor: 10, to_cursor: 30, limit: 0, ranks: vec![1], epoch: 0 })
        .await
        .unwrap()
        .into_inner();
    let mut got = Vec::new();
    while let Some(m) = tokio::time::timeout(T, h.message()).await.unwrap().unwrap() {
        let m = match m.record.unwrap() {
            pb::history_response::Record::Batch(b) => M::Batch(b),
            pb::history_response::Record::Control(c) => M::Control(c),
        };
        got.push(record_from_subscribe(&pb::SubscribeResponse { message: Some(m) }).unwrap().unwrap());
    }
    let want: Vec<Record> = committed[9..30]
        .iter()
        .filter(|r| match &r.body {
            RecordBody::Batch { batch, .. } => batch.dp_rank == 1,
            RecordBody::Control(c) => c.dp_rank == 1,
        })
        .cloned()
        .collect();
    assert_eq!(got, want);
    let err = client.history(pb::HistoryRequest { epoch: 1, ..Default::default() }).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);

    let st = client.status(pb::StatusRequest {}).await.unwrap().into_inner();
    assert_eq!(st.epoch, relay.store.epoch());
    assert_eq!(st.engine, "test-engine");
    assert_eq!((st.oldest_cursor, st.newest_cursor, st.history_records), (1, 60, 60));
    assert_eq!(st.counters["live_blocks"], truth.len() as u64);
    let r1 = st.ranks.iter().find(|r| r.dp_rank == 1).unwrap();
    assert_eq!((r1.state, r1.reason.as_str()), (pb::RankState::Degraded as i32, "gap 5..9"));

    let mut s = client
        .snapshot(pb::SnapshotRequest { ranks: vec![0, 2], tiers: vec!["device".into()], include_token_ids: true })
        .await
        .unwrap()
        .into_inner();
    let mut live = LiveBlocks::new();
    let mut end = None;
    while let Some(m) = tokio::time::timeout(T, s.message()).await.unwrap().unwrap() {
        match m.message.unwrap() {
            pb::snapshot_response::Message::Begin(b) => assert_eq!(b.cursor, 60),
            pb::snapshot_response::Message::Chunk(c) => {
                for b in &c.blocks {
                    assert_eq!(b.token_ids, vec![1, 2, 3, 4]);
                    let b = snapshot_block_from_pb(b).unwrap();
                    live.blocks
                        .entry(LiveKey { dp_rank: b.dp_rank, tier: b.tier, group: b.group })
                        .or_default()
                        .insert(b.hash, b.copies);
                }
            }
            pb::snapshot_response::Message::End(e) => end = Some(e),
        }
    }
    assert_eq!(end.unwrap().cursor, 60);
    let mut want = truth.clone();
    want.blocks.retain(|k, _| k.dp_rank != 1 && k.tier == Tier::Device);
    assert_eq!(live.blocks, want.blocks);
    relay.stop().await;
}

#[tokio::test]
async fn quiet_streams_get_heartbeats_with_the_load() {
    let cfg = ServerConfig { heartbeat_interval: Duration::from_millis(200), ..cfg() };
    let relay = Relay::start(cfg, big_history()).await;
    let load = Load { running: 3.0, waiting: 1.0, kv_usage: 0.5, scraped_at_ms: 7 };
    relay.status.set_load(2, load);
    let mut s = relay.client().await.subscribe(req(0, 0, 0, false)).await.unwrap().into_inner();
    // The server's own heartbeat, from the status.
    match next(&mut s).await {
        M::Heartbeat(h) => {
            assert_eq!(h.dp_rank, 2);
            assert_eq!(h.load.unwrap().running, 3.0);
        }
        other => panic!("expected a heartbeat, got {other:?}"),
    }
    // One the ingest sends.
    let sent = Load { running: 9.0, ..load };
    let mut tries = 0;
    let hb = loop {
        tries += 1;
        assert!(tries < 100, "the ingest's heartbeat never came through");
        let _ = relay.notices.send(Notice::Heartbeat { dp_rank: 5, load: Some(sent) });
        match next(&mut s).await {
            M::Heartbeat(h) if h.dp_rank == 5 => break h,
            M::Heartbeat(_) => {}
            other => panic!("expected a heartbeat, got {other:?}"),
        }
    };
    assert_eq!(hb.load.unwrap().running, 9.0);
    relay.stop().await;
}
