//! The engine's liveness and URL are additive: a client built before them (messages without
//! the new fields) reads a new relay's messages with every old field intact, and a new client
//! reads an old relay's messages with the new fields absent.

use kv_relay_proto::pb;
use prost::Message;

/// `Batch` as it was before `liveness = 8`.
#[derive(Clone, PartialEq, prost::Message)]
struct OldBatch {
    #[prost(uint64, tag = "1")]
    cursor: u64,
    #[prost(uint32, tag = "2")]
    incarnation: u32,
    #[prost(uint32, tag = "3")]
    dp_rank: u32,
    #[prost(uint64, tag = "4")]
    engine_seq: u64,
    #[prost(double, tag = "5")]
    engine_ts: f64,
    #[prost(message, repeated, tag = "6")]
    events: Vec<pb::Event>,
    #[prost(message, optional, tag = "7")]
    load: Option<pb::Load>,
}

/// `Heartbeat` as it was before `liveness = 5`.
#[derive(Clone, PartialEq, prost::Message)]
struct OldHeartbeat {
    #[prost(uint32, tag = "1")]
    dp_rank: u32,
    #[prost(message, optional, tag = "2")]
    load: Option<pb::Load>,
    #[prost(uint64, tag = "3")]
    newest_cursor: u64,
    #[prost(uint64, tag = "4")]
    sent_at_ms: u64,
}

/// `StatusResponse`'s first fields and a rank, as before `engine_url = 12` and
/// `RankStatus.liveness = 8`.
#[derive(Clone, PartialEq, prost::Message)]
struct OldStatus {
    #[prost(fixed64, tag = "1")]
    epoch: u64,
    #[prost(message, repeated, tag = "4")]
    ranks: Vec<OldRankStatus>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct OldRankStatus {
    #[prost(uint32, tag = "1")]
    dp_rank: u32,
    #[prost(string, tag = "3")]
    reason: String,
}

fn liveness() -> pb::Liveness {
    pb::Liveness {
        state: pb::EngineLiveness::Wedged as i32,
        reason: "requests running, no progress for 3.0 s".into(),
        since_ms: 1_700_000_000_000,
        observed_at_ms: 1_700_000_003_000,
    }
}

#[test]
fn an_old_client_reads_a_new_batch_and_heartbeat_whole() {
    let load = pb::Load { running: 2.0, waiting: 1.0, kv_usage: 0.5, scraped_at_ms: 7 };
    let new = pb::Batch {
        cursor: 9,
        incarnation: 2,
        dp_rank: 1,
        engine_seq: 44,
        engine_ts: 1.5,
        events: vec![pb::Event { event: Some(pb::event::Event::Cleared(pb::Cleared::default())) }],
        load: Some(load),
        liveness: Some(liveness()),
    };
    let old = OldBatch::decode(new.encode_to_vec().as_slice()).unwrap();
    assert_eq!(
        old,
        OldBatch {
            cursor: 9,
            incarnation: 2,
            dp_rank: 1,
            engine_seq: 44,
            engine_ts: 1.5,
            events: new.events.clone(),
            load: Some(load),
        }
    );
    // And back: what an old relay sends reads as no liveness (not watched).
    let back = pb::Batch::decode(old.encode_to_vec().as_slice()).unwrap();
    assert_eq!(back, pb::Batch { liveness: None, ..new });

    let hb =
        pb::Heartbeat { dp_rank: 3, load: Some(load), newest_cursor: 12, sent_at_ms: 99, liveness: Some(liveness()) };
    let old = OldHeartbeat::decode(hb.encode_to_vec().as_slice()).unwrap();
    assert_eq!(old, OldHeartbeat { dp_rank: 3, load: Some(load), newest_cursor: 12, sent_at_ms: 99 });
    assert_eq!(pb::Heartbeat::decode(old.encode_to_vec().as_slice()).unwrap().liveness, None);
}

#[test]
fn an_old_client_reads_a_new_status_whole() {
    let new = pb::StatusResponse {
        epoch: 0xfeed,
        engine_url: "http://10.0.0.1:8000".into(),
        ranks: vec![pb::RankStatus {
            dp_rank: 2,
            reason: "gap".into(),
            liveness: Some(liveness()),
            ..Default::default()
        }],
        ..Default::default()
    };
    let old = OldStatus::decode(new.encode_to_vec().as_slice()).unwrap();
    assert_eq!(old, OldStatus { epoch: 0xfeed, ranks: vec![OldRankStatus { dp_rank: 2, reason: "gap".into() }] });
    let back = pb::StatusResponse::decode(old.encode_to_vec().as_slice()).unwrap();
    assert_eq!((back.engine_url.as_str(), back.ranks[0].liveness.as_ref()), ("", None));
}

/// `SubscribeRequest` as it was before `omit_token_ids = 7`.
#[derive(Clone, PartialEq, prost::Message)]
struct OldSubscribeRequest {
    #[prost(fixed64, tag = "1")]
    epoch: u64,
    #[prost(uint64, tag = "2")]
    after_cursor: u64,
    #[prost(uint32, tag = "3")]
    incarnation: u32,
    #[prost(bool, tag = "4")]
    allow_snapshot: bool,
    #[prost(uint32, repeated, tag = "5")]
    ranks: Vec<u32>,
    #[prost(bool, tag = "6")]
    snapshot_token_ids: bool,
}

#[test]
fn a_lean_request_reads_as_the_same_full_one_before_omit_token_ids_and_an_old_one_as_full() {
    let new = pb::SubscribeRequest {
        epoch: 0xfeed,
        after_cursor: 41,
        incarnation: 3,
        allow_snapshot: true,
        ranks: vec![0, 2],
        snapshot_token_ids: true,
        omit_token_ids: true,
    };
    // An old relay reads the request as it always did: the new field is skipped.
    let seen_by_old = OldSubscribeRequest::decode(new.encode_to_vec().as_slice()).unwrap();
    assert_eq!(
        seen_by_old,
        OldSubscribeRequest {
            epoch: 0xfeed,
            after_cursor: 41,
            incarnation: 3,
            allow_snapshot: true,
            ranks: vec![0, 2],
            snapshot_token_ids: true
        }
    );
    // A new relay reads an old client's request as full records.
    let seen_by_new = pb::SubscribeRequest::decode(seen_by_old.encode_to_vec().as_slice()).unwrap();
    assert_eq!(seen_by_new, pb::SubscribeRequest { omit_token_ids: false, ..new });
}
