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
