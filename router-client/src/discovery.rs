//! Following a changing set of relays: fixed URLs, files of URLs re-read when they change, and
//! DNS names whose A and AAAA records are resolved again and again (a Kubernetes headless
//! Service over the relays). A helper over [`Follower::add_relay`] / [`Follower::remove_relay`].
//!
//! [`Discovery::poll`] reads every source once and brings the follower's relays to their union;
//! [`Discovery::run`] polls at an interval. Names are resolved through a [`Resolver`], so tests
//! drive discovery with addresses of their own ([`SystemResolver`]: the system's resolver,
//! `getaddrinfo` through tokio's `lookup_host`).
//!
//! Rules:
//! - An address that appears in a name's answer is followed at that poll.
//! - An address missing from a name's answer is dropped only once it has been missing from every
//!   answer for the grace period (a record that flaps, such as a relay pod failing a readiness
//!   probe for a few seconds, must not drop its workers' index and force a snapshot on return).
//! - A failed resolution (NXDOMAIN, a resolver timeout) or an unreadable file changes nothing: it
//!   is logged and counted ([`DiscoveryCounters`]), and relays are kept.
//! - A file's relays are added and removed as soon as the file says so (the file is the
//!   operator's word: no grace).

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::pin::Pin;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::error::ClientError;
use crate::follower::{validate_url, Follower};

/// How long an address may be missing from its name's answers before its relay is dropped, by
/// default: longer than a readiness probe's flap or a relay pod's restart (its workers show
/// `relay_unreachable` meanwhile, and a relay that comes back resumes without a snapshot), short
/// enough that a relay gone for good leaves within half a minute.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(30);

/// How often sources are read again, by default.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(5);

/// A resolution's answer, boxed so that [`Resolver`] stays object safe.
pub type Lookup<'a> = Pin<Box<dyn Future<Output = io::Result<Vec<IpAddr>>> + Send + 'a>>;

/// Resolves a name to its addresses (A and AAAA records).
pub trait Resolver: Send + Sync {
    /// The name's addresses now; an error for NXDOMAIN or a failed resolver.
    fn lookup<'a>(&'a self, name: &'a str) -> Lookup<'a>;
}

/// The system's resolver (`getaddrinfo` on tokio's blocking pool, both address families).
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemResolver;

impl Resolver for SystemResolver {
    fn lookup<'a>(&'a self, name: &'a str) -> Lookup<'a> {
        Box::pin(async move {
            let addrs = tokio::net::lookup_host((name, 0)).await?;
            Ok(addrs.map(|a| a.ip()).collect())
        })
    }
}

/// A DNS name and the port its relays listen on (`--relays-dns NAME:PORT`).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct DnsName {
    /// The name, e.g. `kv-relay.inference.svc.cluster.local`.
    pub name: String,
    /// The relays' gRPC port.
    pub port: u16,
}

impl FromStr for DnsName {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = |why: &str| format!("{s:?} is not NAME:PORT ({why}), e.g. kv-relay.default.svc.cluster.local:50051");
        let (name, port) = s.rsplit_once(':').ok_or_else(|| bad("no port"))?;
        if name.is_empty() {
            return Err(bad("no name"));
        }
        if name.contains([':', '/', '[', ']']) || name.chars().any(char::is_whitespace) {
            return Err(bad("a host name, not a URL or an address"));
        }
        let port: u16 = port.parse().map_err(|_| bad("the port is not a number from 1 to 65535"))?;
        if port == 0 {
            return Err(bad("the port is not a number from 1 to 65535"));
        }
        Ok(DnsName { name: name.to_string(), port })
    }
}

impl std::fmt::Display for DnsName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.name, self.port)
    }
}

/// The relay URL of an address: `http://10.0.0.5:50051`, `http://[fd00::5]:50051`.
pub fn relay_url(addr: SocketAddr) -> String {
    match addr.ip() {
        IpAddr::V4(ip) => format!("http://{ip}:{}", addr.port()),
        IpAddr::V6(ip) => format!("http://[{ip}]:{}", addr.port()),
    }
}

/// The relay URLs of a relays file's text: one a line, blank lines and `#` comments ignored.
/// A line that is not a relay URL is an error naming its line.
pub fn parse_relays_file(text: &str) -> Result<Vec<String>, String> {
    let mut urls = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        validate_url(line).map_err(|e| format!("line {}: {e}", i + 1))?;
        urls.push(line.to_string());
    }
    Ok(urls)
}

/// Discovery's counters (exported by the example router as `kv_router_discovery_*`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct DiscoveryCounters {
    /// Resolutions that failed (NXDOMAIN, resolver errors); nothing was removed for them.
    pub dns_errors: u64,
    /// Reads of a relays file that failed (unreadable, or a line that is not a URL).
    pub file_errors: u64,
    /// Relays discovery added.
    pub added: u64,
    /// Relays discovery removed.
    pub removed: u64,
}

/// Discovery's counters as it counts them: kept by the [`RelaySet`] it drives (a [`Follower`]
/// reports them beside its own).
#[derive(Debug, Default)]
pub struct DiscoveryStats {
    dns_errors: AtomicU64,
    file_errors: AtomicU64,
    added: AtomicU64,
    removed: AtomicU64,
}

impl DiscoveryStats {
    /// The counters now.
    pub fn get(&self) -> DiscoveryCounters {
        DiscoveryCounters {
            dns_errors: self.dns_errors.load(Ordering::Relaxed),
            file_errors: self.file_errors.load(Ordering::Relaxed),
            added: self.added.load(Ordering::Relaxed),
            removed: self.removed.load(Ordering::Relaxed),
        }
    }
}

fn count(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

struct FileSource {
    path: PathBuf,
    /// The text last read (a failed read keeps it).
    text: Option<String>,
    urls: BTreeSet<String>,
}

struct DnsSource {
    name: DnsName,
    /// Every URL the name answered with and not yet dropped: `None` while it is in the answers,
    /// else since when it has been missing.
    urls: BTreeMap<String, Option<Instant>>,
}

/// What one poll changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Changes {
    /// Relays added, in URL order.
    pub added: Vec<String>,
    /// Relays removed, in URL order.
    pub removed: Vec<String>,
}

/// What discovery drives: a [`Follower`], or in tests a set that only records.
pub trait RelaySet {
    /// Starts following a relay.
    fn add_relay(&self, url: &str) -> Result<(), ClientError>;
    /// Stops following a relay.
    fn remove_relay(&self, url: &str) -> Result<(), ClientError>;
    /// Where discovery counts.
    fn discovery_stats(&self) -> &DiscoveryStats;
}

impl RelaySet for Follower {
    fn add_relay(&self, url: &str) -> Result<(), ClientError> {
        Follower::add_relay(self, url)
    }

    fn remove_relay(&self, url: &str) -> Result<(), ClientError> {
        Follower::remove_relay(self, url)
    }

    fn discovery_stats(&self) -> &DiscoveryStats {
        Follower::discovery_stats(self)
    }
}

/// Keeps a follower's relays equal to the union of its sources. It owns the follower's relay
/// set: a relay in no source is removed, whoever added it.
pub struct Discovery<S: RelaySet = Follower> {
    follower: S,
    resolver: Arc<dyn Resolver>,
    grace: Duration,
    fixed: BTreeSet<String>,
    files: Vec<FileSource>,
    names: Vec<DnsSource>,
    /// The relays discovery follows.
    followed: BTreeSet<String>,
}

impl<S: RelaySet> std::fmt::Debug for Discovery<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Discovery")
            .field("grace", &self.grace)
            .field("followed", &self.followed)
            .finish_non_exhaustive()
    }
}

impl<S: RelaySet> Discovery<S> {
    /// Discovery for `follower`, with no source yet and the [`DEFAULT_GRACE`].
    pub fn new(follower: S, resolver: Arc<dyn Resolver>) -> Self {
        Discovery {
            follower,
            resolver,
            grace: DEFAULT_GRACE,
            fixed: BTreeSet::new(),
            files: Vec::new(),
            names: Vec::new(),
            followed: BTreeSet::new(),
        }
    }

    /// How long an address may be missing from its name's answers before its relay is removed.
    pub fn with_grace(mut self, grace: Duration) -> Self {
        self.grace = grace;
        self
    }

    /// A relay always followed.
    pub fn add_url(&mut self, url: &str) -> Result<(), ClientError> {
        validate_url(url.trim())?;
        self.fixed.insert(url.trim().to_string());
        Ok(())
    }

    /// A file of relay URLs, read at every poll (see [`parse_relays_file`]).
    pub fn add_file(&mut self, path: impl Into<PathBuf>) {
        self.files.push(FileSource { path: path.into(), text: None, urls: BTreeSet::new() });
    }

    /// A DNS name whose addresses are relays on its port.
    pub fn add_name(&mut self, name: DnsName) {
        self.names.push(DnsSource { name, urls: BTreeMap::new() });
    }

    /// The relay set driven (the follower).
    pub fn relay_set(&self) -> &S {
        &self.follower
    }

    /// The relays discovery follows now.
    pub fn followed(&self) -> impl Iterator<Item = &str> {
        self.followed.iter().map(String::as_str)
    }

    /// Reads every source once (at time `now`) and adds and removes relays to match.
    pub async fn poll(&mut self, now: Instant) -> Changes {
        let counters = self.follower.discovery_stats();
        for f in &mut self.files {
            let read = tokio::fs::read_to_string(&f.path).await;
            let text = match read {
                Ok(t) => t,
                Err(e) => {
                    count(&counters.file_errors);
                    tracing::warn!(path = %f.path.display(), error = %e, "relays file unreadable; relays kept");
                    continue;
                }
            };
            if f.text.as_deref() == Some(text.as_str()) {
                continue;
            }
            match parse_relays_file(&text) {
                Ok(urls) => f.urls = urls.into_iter().collect(),
                Err(e) => {
                    count(&counters.file_errors);
                    tracing::warn!(path = %f.path.display(), error = %e, "relays file invalid; relays kept");
                }
            }
            f.text = Some(text);
        }
        for d in &mut self.names {
            let answer = self.resolver.lookup(&d.name.name).await;
            let addrs = match answer {
                Ok(a) => a,
                Err(e) => {
                    count(&counters.dns_errors);
                    tracing::warn!(name = %d.name, error = %e, "relays' name did not resolve; relays kept");
                    continue;
                }
            };
            let now_in: BTreeSet<String> =
                addrs.into_iter().map(|ip| relay_url(SocketAddr::new(ip, d.name.port))).collect();
            for u in &now_in {
                d.urls.insert(u.clone(), None);
            }
            let grace = self.grace;
            d.urls.retain(|u, missing| {
                if now_in.contains(u) {
                    return true;
                }
                let since = *missing.get_or_insert(now);
                now.saturating_duration_since(since) < grace
            });
        }
        let mut wanted = self.fixed.clone();
        wanted.extend(self.files.iter().flat_map(|f| f.urls.iter().cloned()));
        wanted.extend(self.names.iter().flat_map(|d| d.urls.keys().cloned()));
        let mut changes = Changes::default();
        for u in wanted.difference(&self.followed) {
            match self.follower.add_relay(u) {
                // Followed already (added by someone else): discovery's from now on.
                Ok(()) | Err(ClientError::AlreadyFollowing(_)) => {
                    count(&counters.added);
                    tracing::info!(relay = %u, "relay discovered; following");
                    changes.added.push(u.clone());
                }
                Err(e) => tracing::warn!(relay = %u, error = %e, "relay discovered but not followed"),
            }
        }
        for u in self.followed.difference(&wanted) {
            // Not followed any more (removed by someone else) is as good as removed.
            let _ = self.follower.remove_relay(u);
            count(&counters.removed);
            tracing::info!(relay = %u, "relay gone from its sources; removed");
            changes.removed.push(u.clone());
        }
        self.followed.extend(changes.added.iter().cloned());
        for u in &changes.removed {
            self.followed.remove(u);
        }
        changes
    }

    /// Polls every `interval` (the first at once) until `stop` completes.
    pub async fn run(mut self, interval: Duration, stop: impl Future<Output = ()>) {
        let mut tick = tokio::time::interval(interval.max(Duration::from_millis(1)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tokio::pin!(stop);
        loop {
            tokio::select! {
                biased;
                _ = &mut stop => return,
                _ = tick.tick() => {}
            }
            self.poll(Instant::now()).await;
        }
    }
}
