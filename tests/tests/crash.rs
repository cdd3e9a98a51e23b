//! Crash safety: `kv-relay` as a separate process, killed with SIGKILL at seeded random
//! points while it ingests steady traffic from a mock engine, restarted each time on the same
//! state directory. After every restart:
//!
//! 1. the history (never trimmed here) is contiguous: cursors 1..newest, no hole;
//! 2. the snapshot at its cursor C equals every history record up to C replayed over nothing
//!    (`LiveBlocks`: batches applied, a rank reset clears the rank);
//! 3. once the relay has refilled from the engine's replay socket, its snapshot equals the
//!    engine's truth;
//! 4. a subscriber's position from before the kill is never silently skipped: resuming it with
//!    `allow_snapshot = false` either continues at exactly the next cursor (the record was
//!    durable) or fails with FAILED_PRECONDITION (the relay lost it: the tail after the last
//!    durable commit, or a cursor ahead of the relay);
//! 5. a following router (the client library's follower: it resumes or resyncs from a snapshot
//!    on its own) equals the truth.
//!
//! 20 kills by default (about a minute); `KV_RELAY_CRASH_KILLS` for more, `KV_RELAY_CRASH_SEED`
//! for another seed. Needs `target/debug/kv-relay` (`cargo build -p kv-relay --bins`).

use kv_relay::live::LiveBlocks;
use kv_relay::model::{ControlKind, RecordBody};
use kv_relay_proto::pb;
use kv_relay_testkit::drills::harness::*;
use kv_relay_testkit::drills::router::Router;
use kv_router_client::{FollowConfig, Position};
use std::time::{Duration, Instant};

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// The history records up to `upto` replayed into live blocks.
fn replay(records: &[pb::HistoryResponse], upto: u64) -> Blocks {
    let mut live = LiveBlocks::new();
    for r in records {
        let m = pb::SubscribeResponse {
            message: Some(match r.record.clone() {
                Some(pb::history_response::Record::Batch(b)) => pb::subscribe_response::Message::Batch(b),
                Some(pb::history_response::Record::Control(c)) => pb::subscribe_response::Message::Control(c),
                None => continue,
            }),
        };
        let rec = kv_relay::server::convert::record_from_subscribe(&m).expect("a record").expect("decodes");
        if rec.cursor > upto {
            break;
        }
        match &rec.body {
            RecordBody::Batch { batch, .. } => live.apply(batch),
            RecordBody::Control(c) => {
                if matches!(c.kind, ControlKind::RankReset { .. }) {
                    live.reset_rank(c.dp_rank);
                }
            }
        }
    }
    live.blocks.retain(|_, s| !s.is_empty());
    live.blocks
}

fn record_incarnation(r: &pb::HistoryResponse) -> u32 {
    match &r.record {
        Some(pb::history_response::Record::Batch(b)) => b.incarnation,
        Some(pb::history_response::Record::Control(c)) => c.incarnation,
        None => 0,
    }
}

/// Resumes `pos` with `allow_snapshot = false`: `Ok(first cursor streamed)` or the error code.
fn resume_without_snapshot(url: &str, pos: &Position) -> Result<u64, tonic::Code> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    rt.block_on(async {
        let mut c = kv_relay::ctl::connect(&kv_relay::ctl::Target { url: url.to_string(), ..Default::default() })
            .await
            .map_err(|_| tonic::Code::Unavailable)?;
        let req = pb::SubscribeRequest {
            epoch: pos.epoch,
            after_cursor: pos.cursor,
            incarnation: pos.incarnation,
            allow_snapshot: false,
            ranks: vec![],
            snapshot_token_ids: false,
            omit_token_ids: false,
        };
        let mut s = c.subscribe(req).await.map_err(|e| e.code())?.into_inner();
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let m = tokio::time::timeout(Duration::from_secs(5), s.message())
                .await
                .map_err(|_| tonic::Code::DeadlineExceeded)?
                .map_err(|e| e.code())?;
            use pb::subscribe_response::Message as M;
            match m.and_then(|m| m.message) {
                Some(M::Batch(b)) => return Ok(b.cursor),
                Some(M::Control(c)) => return Ok(c.cursor),
                Some(M::SnapshotBegin(_)) => return Err(tonic::Code::Unknown),
                Some(_) => {}
                None => return Err(tonic::Code::Ok),
            }
            if Instant::now() > deadline {
                return Err(tonic::Code::DeadlineExceeded);
            }
        }
    })
}

#[test]
fn sigkill_at_random_points_keeps_history_contiguous_snapshot_consistent_and_converges() {
    let kills = env_u64("KV_RELAY_CRASH_KILLS", 20);
    let mut seed = env_u64("KV_RELAY_CRASH_SEED", 4);
    let mut rand = move |n: u64| {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (seed >> 33) % n
    };
    let dir = tempfile::tempdir().unwrap();
    let e = engine(2, 100_000);
    let mut r = RelayProc::start(
        &e,
        &dir.path().join("state"),
        &dir.path().join("relay.log"),
        &["--history-batches", "1000000", "--history-bytes", "1000000000"],
    );
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let t = Traffic::start(&e, 40, 44);
    let follower = Router::start(rt.handle(), r.url(), FollowConfig::default());
    let epoch = status(&r.url()).unwrap().epoch;
    let (mut lost_tails, mut durable_resumes, mut lost_records) = (0, 0, 0u64);
    let started = Instant::now();
    for k in 1..=kills {
        // Run for a random while, then kill at that point of the ingest.
        std::thread::sleep(Duration::from_millis(150 + rand(1200)));
        let before = follower.get().position;
        r.kill();
        let killed_at = status(&r.url()).is_err();
        assert!(killed_at, "kill {k}: the relay still answers after SIGKILL");
        std::thread::sleep(Duration::from_millis(rand(300)));
        r.spawn();
        let url = r.url();
        let st = status(&url).unwrap();
        assert_eq!(st.epoch, epoch, "kill {k}: the epoch changed across a crash");

        // 1. Contiguous history; the new incarnation begins right after the last durable commit.
        let h = history(&url, 0, 100_000).unwrap();
        let cursors: Vec<u64> = h.iter().map(record_cursor).collect();
        assert_eq!(cursors.first().copied(), Some(1), "kill {k}: the history does not start at 1");
        if let Some(w) = cursors.windows(2).find(|w| w[1] != w[0] + 1) {
            panic!("kill {k}: hole in the history after cursor {} (next {})", w[0], w[1]);
        }
        let durable =
            h.iter().take_while(|r| record_incarnation(r) < st.incarnation).map(record_cursor).last().unwrap_or(0);

        // 2. The snapshot at C equals the history up to C replayed.
        let (c, snap) = snapshot(&url).unwrap();
        let mut h = h;
        h.extend(history(&url, cursors.last().copied().unwrap_or(0) + 1, 100_000).unwrap());
        let replayed = replay(&h, c);
        assert!(snap == replayed, "kill {k}: the snapshot at cursor {c} is not the history replayed to it");

        // 4. The follower's position from before the kill: continued exactly, or told to resync.
        if before.cursor > 0 {
            match resume_without_snapshot(&url, &before) {
                Ok(first) => {
                    assert!(before.cursor <= durable, "kill {k}: cursor {} was lost but resumed", before.cursor);
                    assert_eq!(first, before.cursor + 1, "kill {k}: resuming after {} skipped records", before.cursor);
                    durable_resumes += 1;
                }
                Err(code) => {
                    assert_eq!(
                        code,
                        tonic::Code::FailedPrecondition,
                        "kill {k}: resuming {} gave {code:?}",
                        before.cursor
                    );
                    assert!(before.cursor > durable, "kill {k}: durable cursor {} refused", before.cursor);
                    lost_tails += 1;
                    lost_records += before.cursor - durable;
                }
            }
        }

        // 3. After the refill from the replay socket, the relay's state is the engine's truth.
        let equal = wait_until(Duration::from_secs(10), || {
            t.hold(|| {
                let _ = e.flush();
                let want = truth_as_live(&e.truth());
                wait_until(Duration::from_millis(400), || snapshot(&url).map(|(_, b)| b == want).unwrap_or(false))
                    .is_some()
            })
        });
        assert!(equal.is_some(), "kill {k}: the relay's snapshot never equalled the truth; log:\n{}", r.log_tail());
        // 5. The follower too.
        assert!(
            equal_now(&e, Some(&t), &[&follower], Duration::from_secs(5)),
            "kill {k}: the follower is not equal: {}",
            diff(&e, &follower.get())
        );
        println!(
            "kill {k}: history 1..{} contiguous, durable up to {durable}, snapshot at {c} = replayed history, \
             follower was at {} ({}), equal",
            cursors.last().unwrap(),
            before.cursor,
            if before.cursor > durable { "lost tail: FAILED_PRECONDITION" } else { "resumed exactly" }
        );
    }
    let s = follower.get();
    println!(
        "{kills} kills in {:.1} s: {durable_resumes} exact resumes, {lost_tails} lost tails ({lost_records} records) \
         told to resync; follower snapshots {:?}, gaps {}",
        started.elapsed().as_secs_f64(),
        s.snapshots,
        s.counters.gaps
    );
    assert_eq!(s.counters.gaps, 0, "the follower saw a cursor gap");
}
