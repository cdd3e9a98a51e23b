//! Resume.

use super::*;

#[tokio::test]
async fn resuming_at_random_points_receives_the_uninterrupted_sequence() {
    let relay = Relay::start(cfg(), big_history()).await;
    let mut traffic = Traffic::new(7, 3);
    traffic.commit(&relay.store, 200);
    let epoch = relay.store.epoch();

    // The uninterrupted subscriber: from scratch, through history into live.
    let mut steady = relay.client().await.subscribe(req(0, 0, 0, false)).await.unwrap().into_inner();

    let mut rng = StdRng::seed_from_u64(11);
    let mut got: Vec<Record> = Vec::new();
    let (mut cursor, mut inc) = (0u64, 0u32);
    let mut client = relay.client().await;
    for _ in 0..100 {
        // New records keep arriving between and during the resumes.
        traffic.commit(&relay.store, rng.random_range(0..4));
        let mut s = client.subscribe(req(epoch, cursor, inc, false)).await.unwrap().into_inner();
        for _ in 0..rng.random_range(1..8) {
            if cursor == relay.store.newest_cursor() {
                break;
            }
            let r = next_record(&mut s).await;
            (cursor, inc) = (r.cursor, r.incarnation);
            got.push(r);
        }
        drop(s); // disconnect at a random point
    }
    traffic.commit(&relay.store, 5);
    let newest = relay.store.newest_cursor();
    let mut s = client.subscribe(req(epoch, cursor, inc, false)).await.unwrap().into_inner();
    while cursor < newest {
        let r = next_record(&mut s).await;
        cursor = r.cursor;
        got.push(r);
    }

    let mut want = Vec::new();
    while want.len() < newest as usize {
        want.push(next_record(&mut steady).await);
    }
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(g, w, "resumed subscriber differs at cursor {}", w.cursor);
    }
    // And both equal the history as committed.
    let history = relay.store.history(0, usize::MAX).unwrap();
    assert_eq!(want, history);
    relay.stop().await;
}

/// What a lean record is: the full one without token ids, key parts, lookahead or multimodal
/// infos.
fn without_token_ids(mut r: Record) -> Record {
    if let RecordBody::Batch { batch, .. } = &mut r.body {
        for e in &mut batch.events {
            if let Event::Stored(s) = e {
                for b in &mut s.blocks {
                    b.token_ids.clear();
                    b.extra_keys = None;
                }
                s.lookahead_token_ids = None;
                s.block_mm_infos = None;
            }
        }
    }
    r
}

#[tokio::test]
async fn a_lean_stream_is_the_full_one_without_token_ids_and_a_request_without_the_field_is_full() {
    let relay = Relay::start(cfg(), big_history()).await;
    let mut traffic = Traffic::new(3, 2);
    traffic.commit(&relay.store, 60);
    let newest = relay.store.newest_cursor();
    let mut client = relay.client().await;
    let mut full = client.subscribe(req(0, 0, 0, false)).await.unwrap().into_inner();
    let lean_req = pb::SubscribeRequest { omit_token_ids: true, ..req(0, 0, 0, false) };
    let mut lean = client.subscribe(lean_req).await.unwrap().into_inner();
    let history = relay.store.history(0, usize::MAX).unwrap();
    let mut blocks_with_tokens = 0;
    for want in &history {
        let (f, l) = (next_record(&mut full).await, next_record(&mut lean).await);
        assert_eq!(&f, want, "a request without omit_token_ids gets the record as committed");
        assert_eq!(l, without_token_ids(want.clone()), "cursor {}", want.cursor);
        if let RecordBody::Batch { batch, .. } = &f.body {
            for e in &batch.events {
                if let Event::Stored(s) = e {
                    blocks_with_tokens += s.blocks.iter().filter(|b| !b.token_ids.is_empty()).count();
                }
            }
        }
    }
    assert_eq!(history.len() as u64, newest);
    assert!(blocks_with_tokens > 0, "the traffic stores blocks with token ids");
    // Live records too, past the history the streams began in.
    traffic.commit(&relay.store, 5);
    for cursor in newest + 1..=relay.store.newest_cursor() {
        let want = relay.store.history(cursor - 1, 1).unwrap().remove(0);
        assert_eq!(next_record(&mut full).await, want);
        assert_eq!(next_record(&mut lean).await, without_token_ids(want));
    }
    relay.stop().await;
}
