//! Discovery: DNS names through a resolver the tests answer for, relays files re-read, driven
//! poll by poll with explicit instants (a set that records what it was told), and once over a
//! real follower and a real relay on `127.0.0.1:0`.

use std::io;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kv_relay::store::HistoryLimits;
use kv_router_client::discovery::{
    parse_relays_file, relay_url, Changes, Discovery, DiscoveryCounters, DiscoveryStats, DnsName, Lookup, RelaySet,
    Resolver,
};
use kv_router_client::{ClientError, Follower};
use tokio::time::Instant;

use crate::relay::{open_store, until, Server};

/// Answers every name with what the test set last (an error string: a failed resolution).
struct Answers(Mutex<Result<Vec<IpAddr>, String>>);

impl Default for Answers {
    fn default() -> Self {
        Answers(Mutex::new(Ok(Vec::new())))
    }
}

impl Answers {
    fn set(&self, ips: &[&str]) {
        *self.0.lock().unwrap() = Ok(ips.iter().map(|s| s.parse().unwrap()).collect());
    }

    fn fail(&self, why: &str) {
        *self.0.lock().unwrap() = Err(why.to_string());
    }
}

impl Resolver for Answers {
    fn lookup<'a>(&'a self, _name: &'a str) -> Lookup<'a> {
        let answer = self.0.lock().unwrap().clone();
        Box::pin(async move { answer.map_err(io::Error::other) })
    }
}

/// A relay set that only records.
#[derive(Default)]
struct Recorder {
    relays: Mutex<Vec<String>>,
    stats: DiscoveryStats,
}

impl RelaySet for Recorder {
    fn add_relay(&self, url: &str) -> Result<(), ClientError> {
        self.relays.lock().unwrap().push(url.to_string());
        Ok(())
    }

    fn remove_relay(&self, url: &str) -> Result<(), ClientError> {
        self.relays.lock().unwrap().retain(|r| r != url);
        Ok(())
    }

    fn discovery_stats(&self) -> &DiscoveryStats {
        &self.stats
    }
}

const NAME: &str = "kv-relay.inference.svc.cluster.local:50051";

fn changes(added: &[&str], removed: &[&str]) -> Changes {
    Changes {
        added: added.iter().map(|s| s.to_string()).collect(),
        removed: removed.iter().map(|s| s.to_string()).collect(),
    }
}

/// Discovery of `NAME` with a 30 s grace, the resolver's answers, and the recorder's relays.
fn dns() -> (Discovery<Recorder>, Arc<Answers>) {
    let answers = Arc::new(Answers::default());
    let mut d = Discovery::new(Recorder::default(), answers.clone()).with_grace(Duration::from_secs(30));
    d.add_name(NAME.parse().unwrap());
    (d, answers)
}

fn at(start: Instant, ms: u64) -> Instant {
    start + Duration::from_millis(ms)
}

fn followed<S: RelaySet>(d: &Discovery<S>) -> Vec<String> {
    d.followed().map(str::to_string).collect()
}

const A: &str = "http://10.0.0.1:50051";
const B: &str = "http://10.0.0.2:50051";

#[tokio::test]
async fn an_address_is_followed_at_the_first_poll_that_finds_it() {
    let (mut d, answers) = dns();
    let t0 = Instant::now();
    answers.set(&["10.0.0.1"]);
    assert_eq!(d.poll(t0).await, changes(&[A], &[]));
    assert_eq!(d.poll(at(t0, 5_000)).await, changes(&[], &[]));
    answers.set(&["10.0.0.2", "10.0.0.1"]);
    assert_eq!(d.poll(at(t0, 10_000)).await, changes(&[B], &[]));
    assert_eq!(followed(&d), [A, B]);
}

#[tokio::test]
async fn a_flapping_record_keeps_its_relay_and_one_gone_for_the_grace_period_is_removed() {
    let (mut d, answers) = dns();
    let t0 = Instant::now();
    answers.set(&["10.0.0.1", "10.0.0.2"]);
    assert_eq!(d.poll(t0).await, changes(&[A, B], &[]));
    // B missing at 5 s, back at 10 s: the grace starts again from its next absence (15 s).
    answers.set(&["10.0.0.1"]);
    assert_eq!(d.poll(at(t0, 5_000)).await, changes(&[], &[]));
    answers.set(&["10.0.0.1", "10.0.0.2"]);
    assert_eq!(d.poll(at(t0, 10_000)).await, changes(&[], &[]));
    answers.set(&["10.0.0.1"]);
    for ms in [15_000, 20_000, 40_000, 44_999] {
        assert_eq!(d.poll(at(t0, ms)).await, changes(&[], &[]), "at {ms} ms");
    }
    assert_eq!(d.poll(at(t0, 45_000)).await, changes(&[], &[B]));
    assert_eq!(followed(&d), [A]);
    // B reappearing after its removal is followed again at once.
    answers.set(&["10.0.0.2", "10.0.0.1"]);
    assert_eq!(d.poll(at(t0, 50_000)).await, changes(&[B], &[]));
    let c = d_counters(&d);
    assert_eq!((c.added, c.removed, c.dns_errors), (3, 1, 0));
}

fn d_counters(d: &Discovery<Recorder>) -> DiscoveryCounters {
    d.relay_set().discovery_stats().get()
}

#[tokio::test]
async fn failed_resolutions_are_counted_and_never_remove_a_relay() {
    let (mut d, answers) = dns();
    let t0 = Instant::now();
    answers.set(&["10.0.0.1"]);
    assert_eq!(d.poll(t0).await, changes(&[A], &[]));
    answers.fail("NXDOMAIN");
    // Far past the grace: failures say nothing about the relays.
    for ms in [5_000, 40_000, 100_000] {
        assert_eq!(d.poll(at(t0, ms)).await, changes(&[], &[]), "at {ms} ms");
    }
    assert_eq!(d_counters(&d).dns_errors, 3);
    // An answer without it starts the grace period.
    answers.set(&[]);
    assert_eq!(d.poll(at(t0, 105_000)).await, changes(&[], &[]));
    answers.fail("resolver timed out");
    assert_eq!(d.poll(at(t0, 120_000)).await, changes(&[], &[]));
    answers.set(&[]);
    assert_eq!(d.poll(at(t0, 134_999)).await, changes(&[], &[]));
    assert_eq!(d.poll(at(t0, 135_000)).await, changes(&[], &[A]));
    assert_eq!(d.relay_set().relays.lock().unwrap().len(), 0);
    assert_eq!(d_counters(&d), DiscoveryCounters { dns_errors: 4, file_errors: 0, added: 1, removed: 1 });
}

#[tokio::test]
async fn ipv6_addresses_become_bracketed_urls() {
    let (mut d, answers) = dns();
    answers.set(&["fd00::5", "10.0.0.5", "::1"]);
    let got = d.poll(Instant::now()).await;
    assert_eq!(got, changes(&["http://10.0.0.5:50051", "http://[::1]:50051", "http://[fd00::5]:50051"], &[]));
    assert_eq!(*d.relay_set().relays.lock().unwrap(), got.added);
    assert_eq!(relay_url("[fe80::1%2]:7".parse().unwrap()), "http://[fe80::1]:7");
    assert_eq!(relay_url("127.0.0.1:50051".parse().unwrap()), "http://127.0.0.1:50051");
}

#[tokio::test]
async fn a_relays_file_is_read_again_at_every_poll() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("relays.txt");
    std::fs::write(&path, "# the relays\nhttp://10.0.0.1:50051\n\n  http://10.0.0.2:50051  \n").unwrap();
    let mut d = Discovery::new(Recorder::default(), Arc::new(Answers::default()));
    d.add_file(&path);
    let t0 = Instant::now();
    assert_eq!(d.poll(t0).await, changes(&[A, B], &[]));
    assert_eq!(d.poll(at(t0, 5_000)).await, changes(&[], &[]));
    // Edited: B out, C in, at the next poll (no grace for the file).
    std::fs::write(&path, "http://10.0.0.1:50051\nhttp://10.0.0.3:50051\n").unwrap();
    assert_eq!(d.poll(at(t0, 10_000)).await, changes(&["http://10.0.0.3:50051"], &[B]));
    // A line that is not a URL, then no file at all: counted, relays kept.
    std::fs::write(&path, "http://10.0.0.1:50051\n10.0.0.3:50051\n").unwrap();
    assert_eq!(d.poll(at(t0, 15_000)).await, changes(&[], &[]));
    std::fs::remove_file(&path).unwrap();
    assert_eq!(d.poll(at(t0, 20_000)).await, changes(&[], &[]));
    assert_eq!(followed(&d), [A, "http://10.0.0.3:50051"]);
    // Emptied: every relay of the file leaves.
    std::fs::write(&path, "# none\n").unwrap();
    assert_eq!(d.poll(at(t0, 25_000)).await, changes(&[], &[A, "http://10.0.0.3:50051"]));
    assert_eq!(d_counters(&d), DiscoveryCounters { dns_errors: 0, file_errors: 2, added: 3, removed: 3 });
}

#[tokio::test]
async fn a_fixed_relay_stays_when_its_address_leaves_dns() {
    let (mut d, answers) = dns();
    d.add_url(A).unwrap();
    let t0 = Instant::now();
    answers.set(&["10.0.0.1", "10.0.0.2"]);
    assert_eq!(d.poll(t0).await, changes(&[A, B], &[]));
    answers.set(&[]);
    assert_eq!(d.poll(at(t0, 1_000)).await, changes(&[], &[]));
    assert_eq!(d.poll(at(t0, 31_000)).await, changes(&[], &[B]));
    assert_eq!(followed(&d), [A]);
}

#[test]
fn bad_names_and_files_are_refused_with_the_reason() {
    assert_eq!(
        "kv-relay.default.svc:50051".parse::<DnsName>(),
        Ok(DnsName { name: "kv-relay.default.svc".into(), port: 50051 })
    );
    let err = |s: &str| s.parse::<DnsName>().unwrap_err();
    let eg = "e.g. kv-relay.default.svc.cluster.local:50051";
    assert_eq!(err("kv-relay"), format!("\"kv-relay\" is not NAME:PORT (no port), {eg}"));
    assert_eq!(err(":50051"), format!("\":50051\" is not NAME:PORT (no name), {eg}"));
    assert_eq!(
        err("kv-relay:0"),
        format!("\"kv-relay:0\" is not NAME:PORT (the port is not a number from 1 to 65535), {eg}")
    );
    assert_eq!(
        err("kv-relay:http"),
        format!("\"kv-relay:http\" is not NAME:PORT (the port is not a number from 1 to 65535), {eg}")
    );
    assert_eq!(
        err("http://kv-relay:50051"),
        format!("\"http://kv-relay:50051\" is not NAME:PORT (a host name, not a URL or an address), {eg}")
    );
    assert_eq!(
        err("[::1]:50051"),
        format!("\"[::1]:50051\" is not NAME:PORT (a host name, not a URL or an address), {eg}")
    );
    assert_eq!(
        parse_relays_file("# x\n\nhttp://a:1\nb:2\n").unwrap_err(),
        "line 4: invalid relay url \"b:2\": must start with http:// or https://"
    );
    assert_eq!(parse_relays_file(" http://a:1 \n# c\n").unwrap(), ["http://a:1"]);
}

/// Over a real follower: a relay found by its name is followed (its stream opens), and dropped
/// once its address has left the answers for the grace period.
#[tokio::test]
async fn a_follower_follows_the_relays_its_name_resolves_to() {
    let dir = tempfile::tempdir().unwrap();
    let store = open_store(dir.path(), HistoryLimits::default());
    let server = Server::start(&store, None).await;
    let answers = Arc::new(Answers::default());
    answers.set(&["127.0.0.1"]);
    let follower = Follower::new(crate::relay::follow_cfg());
    let mut d = Discovery::new(follower.clone(), answers.clone()).with_grace(Duration::ZERO);
    d.add_name(DnsName { name: "relays.test".into(), port: server.addr.port() });
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(d.run(Duration::from_millis(20), async {
        let _ = stopped.await;
    }));
    until("the relay followed", || follower.relays().first().is_some_and(|r| r.connected)).await;
    assert_eq!(follower.relays().iter().map(|r| r.url.to_string()).collect::<Vec<_>>(), [server.url()]);
    answers.set(&[]);
    until("the relay dropped", || follower.relays().is_empty()).await;
    assert_eq!(
        follower.discovery_counters(),
        DiscoveryCounters { dns_errors: 0, file_errors: 0, added: 1, removed: 1 }
    );
    let _ = stop.send(());
    run.await.unwrap();
    follower.shutdown().await;
    server.stop().await;
}

/// The Kubernetes example's arguments are ones `kv-router` takes, its name one `NAME:PORT`.
#[test]
fn the_kubernetes_example_parses() {
    use clap::Parser as _;
    let manifest =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/kubernetes/kv-router.yaml")).unwrap();
    let args: Vec<String> = manifest
        .lines()
        .filter_map(|l| {
            let l = l.trim();
            // A quoted argument (YAML's single quotes around JSON) is one argument.
            l.strip_prefix("- --").or_else(|| l.strip_prefix("- '--").and_then(|a| a.strip_suffix('\'')))
        })
        .map(|a| format!("--{}", a.replace("$(POD_NAMESPACE)", "inference")))
        .collect();
    assert_eq!(args.len(), 5, "{args:?}");
    let parsed = kv_router::cli::Args::try_parse_from(std::iter::once("kv-router".to_string()).chain(args)).unwrap();
    assert_eq!(
        parsed.relays_dns,
        [DnsName { name: "vllm-llama-kv-relay.inference.svc.cluster.local.".into(), port: 50051 }]
    );
    assert_eq!((parsed.dns_interval_ms, parsed.dns_grace_ms), (5000, 30000));
    // The front's hash settings are ones the router resolves.
    let hash: kv_router::http::HashSettings = serde_json::from_str(parsed.engine_hash.as_deref().unwrap()).unwrap();
    let want = kv_relay_proto::hash::EngineHashConfig::vllm(
        "0.11.0".parse().unwrap(),
        kv_relay_proto::hash::VllmHashAlgo::Sha256,
        Some("0"),
        16,
    );
    assert_eq!(hash.resolve().unwrap(), want.unwrap());
}
