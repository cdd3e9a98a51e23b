//! Match answers and their options (`matched_only`, `limit`), exactly, over two scripted relays
//! of the same four ranks: the library's [`Follower::matches`] and `POST /match`.

use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kv_relay_proto::pb;
use kv_relay_proto::pb::relay_server::Relay;
use kv_relay_proto::pb::subscribe_response::Message as M;
use kv_router::http;
use kv_router_client::backoff::BackoffConfig;
use kv_router_client::{FollowConfig, Follower, MatchOptions, WorkerState};
use tokio::sync::{mpsc, oneshot, Notify};
use tonic::{Request, Response, Status};

use crate::relay::{http_call, until};
use crate::util::{msg, serve_relay, snap_begin, snap_end, BoxStream};

const EPOCH: u64 = 5;
const A: u64 = 101;
const B: u64 = 102;
const C: u64 = 103;
const D: u64 = 104;
/// Held by nobody.
const E: u64 = 105;

/// A relay of ranks 0..=3, each with a load from its Status, that answers every Subscribe with
/// one snapshot and then silence (but see [`Fixed::resync`]):
/// - rank 0: A B C on the device, A on the host (3 blocks of A B C);
/// - rank 1: A on the device, A B on a tier of its own, `archive` (2 blocks);
/// - rank 2: D only (0 blocks);
/// - rank 3: B C on the device, not A (0 blocks).
#[derive(Clone, Default)]
struct Fixed {
    /// When set: the first stream ends when this is notified, and every later Subscribe is
    /// answered with a snapshot's beginning only (its workers syncing until the test ends).
    resync: Option<Arc<Notify>>,
    subscribes: Arc<AtomicUsize>,
}

impl Fixed {
    fn resyncing() -> (Fixed, Arc<Notify>) {
        let end = Arc::new(Notify::new());
        (Fixed { resync: Some(end.clone()), ..Fixed::default() }, end)
    }
}

/// `(rank, tier, tier name, hash, parent)`.
const BLOCKS: [(u32, pb::Tier, &str, u64, Option<u64>); 10] = [
    (0, pb::Tier::Device, "", A, None),
    (0, pb::Tier::Device, "", B, Some(A)),
    (0, pb::Tier::Device, "", C, Some(B)),
    (0, pb::Tier::Host, "", A, None),
    (1, pb::Tier::Device, "", A, None),
    (1, pb::Tier::Other, "archive", A, None),
    (1, pb::Tier::Other, "archive", B, Some(A)),
    (2, pb::Tier::Device, "", D, None),
    (3, pb::Tier::Device, "", B, Some(A)),
    (3, pb::Tier::Device, "", C, Some(B)),
];

fn chunk() -> pb::SubscribeResponse {
    let blocks = BLOCKS
        .iter()
        .map(|&(dp_rank, tier, name, hash, parent)| pb::SnapshotBlock {
            dp_rank,
            tier: tier as i32,
            tier_name: name.into(),
            hash,
            parent,
            copies: 1,
            block_size: 4,
            ..Default::default()
        })
        .collect();
    msg(M::SnapshotChunk(pb::SnapshotChunk { blocks }))
}

#[tonic::async_trait]
impl Relay for Fixed {
    type SubscribeStream = BoxStream<pb::SubscribeResponse>;
    type HistoryStream = BoxStream<pb::HistoryResponse>;
    type SnapshotStream = BoxStream<pb::SnapshotResponse>;

    async fn subscribe(&self, _: Request<pb::SubscribeRequest>) -> Result<Response<Self::SubscribeStream>, Status> {
        let (tx, rx) = mpsc::channel(4);
        let first = self.subscribes.fetch_add(1, Ordering::SeqCst) == 0;
        let resync = self.resync.clone();
        tokio::spawn(async move {
            let script = if first || resync.is_none() {
                vec![snap_begin(EPOCH, 1, &[]), chunk(), snap_end(1)]
            } else {
                vec![snap_begin(EPOCH, 1, &[])]
            };
            for m in script {
                let _ = tx.send(Ok(m)).await;
            }
            match resync {
                // The stream ends: the follower resubscribes.
                Some(end) if first => end.notified().await,
                _ => tx.closed().await,
            }
        });
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }

    async fn status(&self, _: Request<pb::StatusRequest>) -> Result<Response<pb::StatusResponse>, Status> {
        let ranks = (0..4)
            .map(|r| pb::RankStatus {
                dp_rank: r,
                state: pb::RankState::Ok as i32,
                load: Some(pb::Load {
                    running: f64::from(r + 1),
                    waiting: 0.0,
                    kv_usage: 0.25,
                    scraped_at_ms: 1000 + u64::from(r),
                }),
                ..Default::default()
            })
            .collect();
        Ok(Response::new(pb::StatusResponse { epoch: EPOCH, ranks, ..Default::default() }))
    }

    async fn history(&self, _: Request<pb::HistoryRequest>) -> Result<Response<Self::HistoryStream>, Status> {
        Err(Status::unimplemented("fixed"))
    }

    async fn snapshot(&self, _: Request<pb::SnapshotRequest>) -> Result<Response<Self::SnapshotStream>, Status> {
        Err(Status::unimplemented("fixed"))
    }
}

/// `relays` served and followed to their snapshots, every worker fresh: the follower, and the
/// relays' URLs with what stops them, in the order given.
async fn follow(relays: Vec<Fixed>) -> (Follower, Vec<String>, Vec<oneshot::Sender<()>>) {
    let n = relays.len();
    let mut served = Vec::new();
    for r in relays {
        served.push(serve_relay(r).await);
    }
    let (urls, stops): (Vec<String>, Vec<_>) = served.into_iter().unzip();
    let f = Follower::new(FollowConfig {
        start_jitter: Duration::ZERO,
        // Silence after the snapshot: neither stale nor dropped during the test.
        stale_after: Duration::from_secs(600),
        receive_timeout: Duration::from_secs(600),
        backoff: BackoffConfig {
            initial: Duration::from_millis(10),
            max: Duration::from_millis(50),
            multiplier: 2.0,
            jitter: 0.5,
        },
        ..FollowConfig::default()
    });
    for u in &urls {
        f.add_relay(u).unwrap();
    }
    until("every worker fresh with its load", || {
        let w = f.workers();
        w.len() == 4 * n
            && w.iter().all(|w| w.state == WorkerState::Fresh && w.load.is_some())
            && f.relays().iter().all(|r| r.cursor == 1)
    })
    .await;
    (f, urls, stops)
}

/// Two relays of [`Fixed`], their URLs in order.
async fn two_relays() -> (Follower, Vec<String>, Vec<oneshot::Sender<()>>) {
    let (f, mut urls, stops) = follow(vec![Fixed::default(), Fixed::default()]).await;
    let mut stops: Vec<_> = urls.iter().cloned().zip(stops).collect();
    stops.sort_by(|a, b| a.0.cmp(&b.0));
    urls.sort();
    (f, urls, stops.into_iter().map(|s| s.1).collect())
}

/// One worker's JSON in a `/match` answer to A B C.
fn worker_json(url: &str, rank: u32) -> String {
    let (blocks, by_tier) = match rank {
        0 => (3, r#"{"device":3,"host":1}"#),
        1 => (2, r#"{"archive":2,"device":1}"#),
        _ => (0, "{}"),
    };
    format!(
        r#"{{"relay":"{url}","dp_rank":{rank},"matched_blocks":{blocks},"by_tier":{by_tier},"load":{{"running":{}.0,"waiting":0.0,"kv_usage":0.25,"scraped_at_ms":{}}},"state":"fresh"}}"#,
        rank + 1,
        1000 + rank
    )
}

/// The `/match` answer to A B C listing `workers` (relay index, rank) in that order.
fn answer_json(urls: &[String], workers: &[(usize, u32)]) -> String {
    let list: Vec<String> = workers.iter().map(|&(r, rank)| worker_json(&urls[r], rank)).collect();
    format!(r#"{{"blocks":3,"workers":[{}]}}"#, list.join(","))
}

/// A worker of an answer: relay, rank, matched blocks, `by_tier`.
type Row = (String, u32, u32, Vec<(String, u32)>);

#[tokio::test]
async fn matches_list_every_worker_or_the_matched_or_the_best_exactly() {
    let (f, urls, stops) = two_relays().await;
    let (u0, u1) = (urls[0].as_str(), urls[1].as_str());
    let q = [A, B, C];
    let rows = |opts: MatchOptions| -> Vec<Row> {
        f.matches(&q, opts)
            .iter()
            .map(|m| {
                let tiers = m.by_tier.iter().map(|(n, b)| (n.to_string(), b)).collect();
                (m.relay.to_string(), m.dp_rank, m.matched_blocks, tiers)
            })
            .collect()
    };
    let row = |u: &str, rank: u32| {
        let tiers: Vec<(String, u32)> = match rank {
            0 => vec![("device".into(), 3), ("host".into(), 1)],
            1 => vec![("archive".into(), 2), ("device".into(), 1)],
            _ => vec![],
        };
        let blocks = tiers.iter().map(|t| t.1).max().unwrap_or(0);
        (u.to_string(), rank, blocks, tiers)
    };
    let limit = |k| NonZeroUsize::new(k);

    // Every worker, by relay then rank.
    let all = f.matches(&q, MatchOptions::default());
    assert_eq!(all.len(), 8);
    assert_eq!(
        rows(MatchOptions::default()),
        [0, 1, 2, 3].map(|r| row(u0, r)).into_iter().chain([0, 1, 2, 3].map(|r| row(u1, r))).collect::<Vec<_>>()
    );
    assert_eq!(all.iter().nth(1).unwrap().by_tier.get("archive"), 2);
    assert_eq!(all.iter().nth(1).unwrap().by_tier.get("host"), 0);
    // The same answer as match_blocks, and the same JSON as its owned matches.
    let owned = f.match_blocks(&q);
    assert_eq!(all.to_vec(), owned);
    assert_eq!(serde_json::to_string(&all).unwrap(), serde_json::to_string(&owned).unwrap());
    assert_eq!(
        owned[1].by_tier.iter().map(|(n, b)| (n.as_str(), *b)).collect::<Vec<_>>(),
        [("archive", 2), ("device", 1)]
    );

    // Only the workers holding A, by relay then rank.
    let matched = MatchOptions { matched_only: true, limit: None };
    assert_eq!(rows(matched), [row(u0, 0), row(u0, 1), row(u1, 0), row(u1, 1)]);
    // The best 3: most blocks first, ties by relay then rank.
    assert_eq!(rows(MatchOptions { matched_only: false, limit: limit(3) }), [row(u0, 0), row(u1, 0), row(u0, 1)]);
    // A bound above the matched workers lists them all, best first.
    assert_eq!(
        rows(MatchOptions { matched_only: true, limit: limit(10) }),
        [row(u0, 0), row(u1, 0), row(u0, 1), row(u1, 1)]
    );
    // Without matched_only the bound fills up with workers of 0 blocks, by relay then rank.
    assert_eq!(
        rows(MatchOptions { matched_only: false, limit: limit(6) }),
        [row(u0, 0), row(u1, 0), row(u0, 1), row(u1, 1), row(u0, 2), row(u0, 3)]
    );
    assert_eq!(rows(MatchOptions { matched_only: false, limit: limit(1) }), [row(u0, 0)]);
    // Held by nobody: no worker matched, every worker otherwise.
    assert!(f.matches(&[E, A], matched).is_empty());
    assert!(f.matches(&[], matched).is_empty());
    assert_eq!(
        f.matches(&[E, A], MatchOptions::default()).iter().map(|m| m.matched_blocks).collect::<Vec<_>>(),
        [0; 8]
    );
    // B C: rank 0 on the device, rank 1 on its archive tier alone, rank 3 on the device.
    let bc = |opts| {
        f.matches(&[B, C], opts)
            .iter()
            .map(|m| (m.relay.to_string(), m.dp_rank, m.matched_blocks, format!("{:?}", m.by_tier)))
            .collect::<Vec<_>>()
    };
    let (r0, r1, r3) =
        (r#"{"device": 2}"#.to_string(), r#"{"archive": 1}"#.to_string(), r#"{"device": 2}"#.to_string());
    assert_eq!(
        bc(MatchOptions { matched_only: true, limit: None }),
        [
            (urls[0].clone(), 0, 2, r0.clone()),
            (urls[0].clone(), 1, 1, r1.clone()),
            (urls[0].clone(), 3, 2, r3.clone()),
            (urls[1].clone(), 0, 2, r0.clone()),
            (urls[1].clone(), 1, 1, r1),
            (urls[1].clone(), 3, 2, r3.clone()),
        ]
    );
    assert_eq!(
        bc(MatchOptions { matched_only: true, limit: limit(3) }),
        [(urls[0].clone(), 0, 2, r0.clone()), (urls[0].clone(), 3, 2, r3), (urls[1].clone(), 0, 2, r0)]
    );
    // D: rank 2 of each relay.
    assert_eq!(
        f.matches(&[D], matched).iter().map(|m| (m.relay.to_string(), m.dp_rank, m.matched_blocks)).collect::<Vec<_>>(),
        [(urls[0].clone(), 2, 1), (urls[1].clone(), 2, 1)]
    );

    // The same over HTTP, to the byte.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop_http, http_stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(http::serve(listener, f.clone(), async {
        let _ = http_stopped.await;
    }));
    let post = |body: String| async move { http_call(addr, "POST", "/match", &body).await };
    let abc = format!("\"block_hashes\":[{A},{B},{C}]");
    let every: Vec<(usize, u32)> = (0..2).flat_map(|r| (0..4).map(move |k| (r, k))).collect();
    assert_eq!(post(format!("{{{abc}}}")).await, (200, answer_json(&urls, &every)));
    assert_eq!(post(format!("{{{abc},\"matched_only\":false}}")).await, (200, answer_json(&urls, &every)));
    assert_eq!(
        post(format!("{{{abc},\"matched_only\":true}}")).await,
        (200, answer_json(&urls, &[(0, 0), (0, 1), (1, 0), (1, 1)]))
    );
    assert_eq!(post(format!("{{{abc},\"limit\":3}}")).await, (200, answer_json(&urls, &[(0, 0), (1, 0), (0, 1)])));
    assert_eq!(
        post(format!("{{{abc},\"matched_only\":true,\"limit\":100}}")).await,
        (200, answer_json(&urls, &[(0, 0), (1, 0), (0, 1), (1, 1)]))
    );
    assert_eq!(
        post(format!("{{\"block_hashes\":[{E}],\"matched_only\":true}}")).await,
        (200, r#"{"blocks":1,"workers":[]}"#.to_string())
    );
    // Invalid options: a clear 400.
    assert_eq!(
        post(format!("{{{abc},\"limit\":0}}")).await,
        (400, r#"{"error":"\"limit\" must be at least 1 (leave it out to list every worker)"}"#.to_string())
    );
    // Malformed options: serde's words, where the body went wrong.
    for (body, want) in [
        (format!("{{{abc},\"limit\":-1}}"), "invalid value: integer `-1`, expected u64 at line 1 column 40"),
        (format!("{{{abc},\"limit\":2.5}}"), "invalid type: floating point `2.5`, expected u64 at line 1 column 41"),
        (format!("{{{abc},\"matched_only\":1}}"), "invalid type: integer `1`, expected a boolean at line 1 column 46"),
        (
            format!("{{{abc},\"matched\":true}}"),
            "unknown field `matched`, expected one of `block_hashes`, `token_ids`, `hash`, `cache_salt`, `lora`, \
             `matched_only`, `limit` at line 1 column 39",
        ),
    ] {
        let error = serde_json::json!({ "error": format!("invalid request: {want}") }).to_string();
        assert_eq!(post(body.clone()).await, (400, error), "{body}");
    }

    let _ = stop_http.send(());
    server.await.unwrap().unwrap();
    f.shutdown().await;
    for s in stops {
        let _ = s.send(());
    }
}

#[tokio::test]
async fn syncing_workers_are_left_out_of_every_answer() {
    let (resyncing, end) = Fixed::resyncing();
    let (f, urls, stops) = follow(vec![Fixed::default(), resyncing]).await;
    let (steady, syncing) = (urls[0].as_str(), urls[1].as_str());
    // The second relay's stream ends; its next one stays in a snapshot: its workers are syncing,
    // and the index still holds what they held (a snapshot is staged outside it).
    end.notify_one();
    until("the second relay resyncing", || {
        f.relays().iter().any(|r| &*r.url == syncing && r.connected && r.syncing && r.staging)
    })
    .await;
    let states: Vec<(String, u32, WorkerState)> =
        f.workers().iter().map(|w| (w.relay.to_string(), w.dp_rank, w.state)).collect();
    let mut want_states: Vec<(String, u32, WorkerState)> =
        [(steady, WorkerState::Fresh), (syncing, WorkerState::Syncing)]
            .iter()
            .flat_map(|&(u, s)| (0..4).map(move |r| (u.to_string(), r, s)))
            .collect();
    // By relay URL (ports are the system's choice), then rank.
    want_states.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
    assert_eq!(states, want_states);
    let q = [A, B, C];
    assert_eq!(f.index().lookup(&q).len(), 4);

    let ranks = |opts: MatchOptions| -> Vec<(String, u32, u32)> {
        f.matches(&q, opts).iter().map(|m| (m.relay.to_string(), m.dp_rank, m.matched_blocks)).collect()
    };
    let of_steady = |list: &[(u32, u32)]| -> Vec<(String, u32, u32)> {
        list.iter().map(|&(rank, blocks)| (steady.to_string(), rank, blocks)).collect()
    };
    let limit = NonZeroUsize::new;
    assert_eq!(ranks(MatchOptions::default()), of_steady(&[(0, 3), (1, 2), (2, 0), (3, 0)]));
    assert_eq!(ranks(MatchOptions { matched_only: true, limit: None }), of_steady(&[(0, 3), (1, 2)]));
    assert_eq!(ranks(MatchOptions { matched_only: true, limit: limit(1) }), of_steady(&[(0, 3)]));
    assert_eq!(ranks(MatchOptions { matched_only: false, limit: limit(3) }), of_steady(&[(0, 3), (1, 2), (2, 0)]));
    assert_eq!(
        ranks(MatchOptions { matched_only: false, limit: limit(8) }),
        of_steady(&[(0, 3), (1, 2), (2, 0), (3, 0)])
    );
    assert_eq!(f.match_blocks(&q), f.matches(&q, MatchOptions::default()).to_vec());
    // `/match`'s answer, to the byte.
    let answer = |body: &str| {
        let req: http::MatchRequest = serde_json::from_str(body).unwrap();
        serde_json::to_string(&http::answer_match(&f, &req).unwrap()).unwrap()
    };
    let abc = format!("\"block_hashes\":[{A},{B},{C}]");
    let urls = [steady.to_string()];
    assert_eq!(answer(&format!("{{{abc}}}")), answer_json(&urls, &[(0, 0), (0, 1), (0, 2), (0, 3)]));
    assert_eq!(answer(&format!("{{{abc},\"matched_only\":true}}")), answer_json(&urls, &[(0, 0), (0, 1)]));
    assert_eq!(answer(&format!("{{{abc},\"limit\":2}}")), answer_json(&urls, &[(0, 0), (0, 1)]));

    f.shutdown().await;
    for s in stops {
        let _ = s.send(());
    }
}
