//! Every capture and golden stream of `testdata/fixtures`, played by the mock engine into the full
//! relay daemon (with its hash check on where the engine's hash settings are known), followed
//! by a `Follower` over gRPC: the follower's index holds, per worker and tier, exactly the
//! manifest's expected blocks with their copies (under the relay's hybrid policy), every
//! recorded request looked up by token ids matches the leading blocks the manifest's final
//! state holds on each rank, and the relay's Status reports the hash check's exact figures.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use kv_relay::hashcheck::CheckCounts;
use kv_relay::server::RelayStatusHandle;
use kv_relay_proto::hash::block_event_hashes;
use kv_relay_testkit::engine::EngineConfig;
use kv_relay_testkit::fixtures::{self, Fixture, HASH_CHECK_FIGURES};
use kv_router_client::Follower;

/// The manifest's blocks per (rank, tier name, hash) with copies, groups merged: the client's
/// index knows workers and tiers, not groups.
fn expected_by_worker(f: &Fixture) -> BTreeMap<(u32, String, u64), u32> {
    let mut out = BTreeMap::new();
    for (key, blocks) in f.expected() {
        for (h, c) in blocks {
            *out.entry((key.dp_rank, key.tier.as_str().to_string(), h)).or_default() += c;
        }
    }
    out
}

/// Whether the follower's index holds exactly `want`.
fn index_equals(follower: &Follower, url: &str, want: &BTreeMap<(u32, String, u64), u32>) -> Result<(), String> {
    let index = follower.index();
    if index.stats().blocks != want.len() {
        return Err(format!("index holds {} keys, the manifest {}", index.stats().blocks, want.len()));
    }
    for ((rank, tier, h), &copies) in want {
        let worker = index.worker(url, *rank).map_err(|e| e.to_string())?;
        let tier_id = index.tier(tier).map_err(|e| e.to_string())?;
        let got = index.copies(worker, tier_id, *h);
        if got != copies {
            return Err(format!("rank {rank} {tier} {h}: {got} copies, the manifest {copies}"));
        }
    }
    Ok(())
}

fn wait_until(what: &str, mut f: impl FnMut() -> Result<(), String>) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match f() {
            Ok(()) => return,
            Err(why) if Instant::now() > deadline => panic!("{what}: {why}"),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// What one fixture played end to end showed.
#[derive(Debug, PartialEq)]
struct Outcome {
    /// Recorded requests looked up, and the leading blocks matched over every worker.
    lookups: usize,
    matched_blocks: u64,
    /// The relay's hash check per rank: (checked, mismatched, skipped).
    hash_check: Option<Vec<(u64, u64, u64)>>,
}

async fn replay_through_relay_and_follower(name: &str, full_records: bool) -> Outcome {
    let f = Fixture::load(name);
    let ranks = f.ranks();
    let mut cfg = EngineConfig::new(f.wire());
    cfg.dp_size = ranks;
    let e = kv_relay_testkit::client::start_engine_on_free_ports(cfg, true);
    let c = e.config().clone();
    let state = tempfile::tempdir().unwrap();
    let mut argv: Vec<String> = [
        "kv-relay",
        "--endpoint",
        &c.endpoint,
        "--replay-endpoint",
        c.replay_endpoint.as_deref().unwrap(),
        "--dp-size",
        &ranks.to_string(),
        "--state-dir",
        &state.path().display().to_string(),
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "off",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let settings = f.hash_settings();
    argv.extend(settings.iter().flat_map(|s| s.relay_args()));
    let daemon = crate::util::Daemon::start(&argv).await;
    let (status, store): (RelayStatusHandle, _) = (daemon.running.status.clone(), daemon.running.store.clone());
    let url = daemon.url();
    let follower = crate::util::quick_follower_of(full_records);
    follower.add_relay(&url).unwrap();

    let want = expected_by_worker(&f);
    let (fol, u, st) = (follower.clone(), url.clone(), status.clone());
    let outcome = tokio::task::spawn_blocking(move || {
        // vllm-restart: the relay commits the first publisher's last batch before the restart.
        f.play(&e, |before| {
            wait_until("the first publisher's batches", || {
                let seq = st.rank(0).map(|r| r.last_engine_seq);
                if seq == Some(before) {
                    Ok(())
                } else {
                    Err(format!("committed seq {seq:?}"))
                }
            })
        });
        // Everything committed (each rank's last batch), and the follower at the newest cursor:
        // only then is the index compared (the state may equal the final one on the way).
        let mut last_seq: BTreeMap<u32, u64> = BTreeMap::new();
        for l in f.lines.iter().filter(|l| l.socket == "pub") {
            last_seq.insert(l.dp_rank.unwrap_or(0), u64::from_be_bytes(l.frames[1].as_slice().try_into().unwrap()));
        }
        wait_until("every rank's last batch committed", || {
            let committed: BTreeMap<u32, u64> =
                last_seq.keys().map(|&r| (r, st.rank(r).map_or(0, |s| s.last_engine_seq))).collect();
            if committed == last_seq {
                Ok(())
            } else {
                Err(format!("{committed:?} of {last_seq:?}"))
            }
        });
        let newest = store.newest_cursor();
        wait_until("the follower at the newest cursor", || {
            let at = fol.relays().first().map(|r| r.position().cursor);
            if at == Some(newest) {
                Ok(())
            } else {
                Err(format!("follower at {at:?}, relay at {newest}"))
            }
        });
        index_equals(&fol, &u, &want).unwrap_or_else(|why| panic!("{}: {why}", f.name));
        // Lookups by token ids, with the engine's hash settings, against the final state.
        let mut held: BTreeMap<u32, BTreeSet<u64>> = BTreeMap::new();
        for (rank, _, h) in want.keys() {
            held.entry(*rank).or_default().insert(*h);
        }
        let (mut lookups, mut matched_blocks) = (0, 0);
        if let Some(engine) = f.engine_hash() {
            for r in f.recorded_requests() {
                let hashes = block_event_hashes(&engine, &r.keys()).unwrap();
                let mut got: Vec<(u32, u32)> = fol
                    .match_tokens(&engine, &r.keys())
                    .unwrap()
                    .into_iter()
                    .map(|m| (m.dp_rank, m.matched_blocks))
                    .collect();
                got.sort_unstable();
                let expect: Vec<(u32, u32)> = (0..ranks)
                    .map(|rank| {
                        let set = held.get(&rank);
                        let n = hashes.iter().take_while(|h| set.is_some_and(|s| s.contains(h))).count();
                        (rank, n as u32)
                    })
                    .collect();
                assert_eq!(got, expect, "{}: lookup of a recorded request", f.name);
                lookups += 1;
                matched_blocks += got.iter().map(|(_, n)| u64::from(*n)).sum::<u64>();
            }
        }
        // The relay's Status, as relayctl shows it: every batch counted once.
        let hash_check = settings.map(|_| {
            let pubs = f.lines.iter().filter(|l| l.socket == "pub").count() as u64;
            wait_until("the status to count every batch", || {
                let st = st.get();
                let n: u64 =
                    (0..ranks).map(|r| st.counters.get(&format!("rank{r}.batches")).copied().unwrap_or(0)).sum();
                let hc: Option<Vec<CheckCounts>> = (0..ranks).map(|r| st.ranks.get(&r)?.hash_check.clone()).collect();
                if n == pubs && hc.is_some() {
                    Ok(())
                } else {
                    Err(format!("{n} of {pubs} batches"))
                }
            });
            (0..ranks)
                .map(|r| {
                    let h = st.rank(r).unwrap().hash_check.unwrap();
                    (h.checked, h.mismatched, h.skipped_total())
                })
                .collect()
        });
        Outcome { lookups, matched_blocks, hash_check }
    })
    .await
    .unwrap();

    follower.shutdown().await;
    daemon.stop().await;
    outcome
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_captures_replay_through_the_relay_into_the_client_equal_to_each_manifest() {
    let names = fixtures::names();
    assert_eq!(names.len(), 22);
    let mut lookups = Vec::new();
    for name in &names {
        let o = replay_through_relay_and_follower(name, false).await;
        let figures = HASH_CHECK_FIGURES.iter().find(|(n, _)| n == name).map(|(_, c)| c.to_vec());
        assert_eq!(o.hash_check, figures, "{name}: the relay's hash check");
        if o.lookups > 0 {
            lookups.push((name.as_str(), o.lookups, o.matched_blocks));
        }
    }
    // (fixture, recorded requests looked up, leading blocks matched over every worker)
    assert_eq!(
        lookups,
        [
            ("sglang-basic", 44, 65),
            ("sglang-dp2", 55, 162),
            ("sglang-eagle", 24, 102),
            ("vllm-basic", 44, 94),
            ("vllm-byteshash", 44, 94),
            ("vllm-dp2", 44, 114),
            ("vllm-hybrid", 25, 44),
            ("vllm-restart", 36, 163),
            ("vllm-salt", 10, 41),
            ("vllm-sha256cbor", 44, 94),
        ]
    );
}

/// A relay that predates lean records sends full ones however it is asked: the follower takes
/// them to the same index (the captures above run lean, the follower's default).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_records_from_a_relay_build_the_same_index_as_lean_ones() {
    for name in ["vllm-dp2", "sglang-dp2", "vllm-hybrid"] {
        let (lean, full) =
            (replay_through_relay_and_follower(name, false).await, replay_through_relay_and_follower(name, true).await);
        assert_eq!((full.lookups, full.matched_blocks), (lean.lookups, lean.matched_blocks), "{name}");
        assert_eq!(full.hash_check, lean.hash_check, "{name}");
    }
}
