//! `relayctl status | history | snapshot`: a gRPC client of the relay, and the renderings of its
//! answers: readable tables, and stable JSON (documented in `docs/relayctl.md`).

pub mod cli;

use crate::server::convert;
use kv_relay_proto::pb;
use pb::relay_client::RelayClient;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

/// How to reach a relay.
#[derive(Debug, Clone, Default)]
pub struct Target {
    pub url: String,
    pub token: Option<String>,
    /// CA certificate (PEM) to verify the relay's certificate; enables TLS.
    pub tls_ca: Option<PathBuf>,
    /// Client certificate and key (PEM), for mutual TLS.
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    /// The name to verify in the relay's certificate (default: the url's host).
    pub tls_domain: Option<String>,
}

/// Why a relay could not be asked.
#[derive(Debug, thiserror::Error)]
pub enum CtlError {
    #[error("invalid relay address {url:?}: {why}")]
    Address { url: String, why: String },
    #[error("reading {path}: {source}")]
    File { path: String, source: std::io::Error },
    #[error("cannot connect to the relay at {url}: {why} (is kv-relay running and listening there? check --relay or KV_RELAY_ADDR{tls})")]
    Connect { url: String, why: String, tls: &'static str },
    #[error("the relay at {url} answered {code:?}: {message}{hint}")]
    Rpc { url: String, code: tonic::Code, message: String, hint: &'static str },
    /// The connection failed under a call (`Unknown: transport error`, or the transport's
    /// `Cancelled`): with TLS 1.3 a relay that refuses the client certificate says so only then.
    #[error("the connection to the relay at {url} failed during the call")]
    Broken { url: String },
}

impl CtlError {
    pub fn rpc(url: &str, s: tonic::Status) -> CtlError {
        let broken = (s.code() == tonic::Code::Unknown && s.message().starts_with("transport error"))
            || (s.code() == tonic::Code::Cancelled && s.message() == "operation was canceled");
        if broken {
            return CtlError::Broken { url: url.to_string() };
        }
        let hint = match s.code() {
            tonic::Code::Unauthenticated => " (check --token or KV_RELAY_TOKEN)",
            tonic::Code::ResourceExhausted => " (rate limited: retry later)",
            tonic::Code::Unavailable => " (is kv-relay running? check --relay, TLS settings)",
            _ => "",
        };
        CtlError::Rpc { url: url.to_string(), code: s.code(), message: s.message().to_string(), hint }
    }
}

/// Adds `authorization: Bearer <token>` to every call.
#[derive(Clone)]
pub struct Auth(Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>);

impl tonic::service::Interceptor for Auth {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

pub type Client = RelayClient<InterceptedService<Channel, Auth>>;

fn read(path: &PathBuf) -> Result<Vec<u8>, CtlError> {
    std::fs::read(path).map_err(|source| CtlError::File { path: path.display().to_string(), source })
}

/// Connects to the relay.
pub async fn connect(t: &Target) -> Result<Client, CtlError> {
    let mut ep = Channel::from_shared(t.url.clone())
        .map_err(|e| CtlError::Address { url: t.url.clone(), why: e.to_string() })?
        .connect_timeout(std::time::Duration::from_secs(5));
    let with_tls = t.tls_ca.is_some() || t.tls_cert.is_some() || t.url.starts_with("https://");
    if with_tls {
        let mut tls = ClientTlsConfig::new();
        if let Some(ca) = &t.tls_ca {
            tls = tls.ca_certificate(Certificate::from_pem(read(ca)?));
        }
        if let (Some(c), Some(k)) = (&t.tls_cert, &t.tls_key) {
            tls = tls.identity(Identity::from_pem(read(c)?, read(k)?));
        }
        if let Some(d) = &t.tls_domain {
            tls = tls.domain_name(d.clone());
        }
        ep = ep.tls_config(tls).map_err(|e| CtlError::Address { url: t.url.clone(), why: e.to_string() })?;
    }
    let tls = if with_tls { ", and the --tls-* settings against the relay's certificate" } else { "" };
    let channel =
        ep.connect().await.map_err(|e| CtlError::Connect { url: t.url.clone(), why: error_chain(&e), tls })?;
    let auth = match &t.token {
        Some(tok) => Some(
            format!("Bearer {tok}")
                .parse()
                .map_err(|_| CtlError::Address { url: t.url.clone(), why: "the token is not valid ASCII".into() })?,
        ),
        None => None,
    };
    Ok(RelayClient::with_interceptor(channel, Auth(auth)).max_decoding_message_size(64 << 20))
}

/// An error and its sources, `a: b: c`, each said once (the transport's layers often repeat
/// the one below them).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut last = s.clone();
    let mut cur = e.source();
    while let Some(c) = cur {
        let text = c.to_string();
        if !last.contains(&text) {
            let _ = write!(s, ": {text}");
        }
        last = text;
        cur = c.source();
    }
    s
}

fn state_name(s: i32) -> &'static str {
    match pb::RankState::try_from(s).unwrap_or(pb::RankState::Unspecified) {
        pb::RankState::Ok => "ok",
        pb::RankState::Degraded => "degraded",
        pb::RankState::Incomplete => "incomplete",
        pb::RankState::Stopped => "stopped",
        pb::RankState::Unspecified => "unknown",
    }
}

fn load_json(l: Option<&pb::Load>) -> Value {
    match l {
        Some(l) => {
            json!({"running": l.running, "waiting": l.waiting, "kv_usage": l.kv_usage, "scraped_at_ms": l.scraped_at_ms})
        }
        None => Value::Null,
    }
}

fn liveness_name(l: Option<&pb::Liveness>) -> &'static str {
    let state = l.map_or(pb::EngineLiveness::Unspecified, |l| {
        pb::EngineLiveness::try_from(l.state).unwrap_or(pb::EngineLiveness::Unspecified)
    });
    match state {
        pb::EngineLiveness::Unspecified => "-",
        pb::EngineLiveness::Alive => "alive",
        pb::EngineLiveness::Unreachable => "unreachable",
        pb::EngineLiveness::Wedged => "wedged",
        pb::EngineLiveness::Stopped => "stopped",
    }
}

fn liveness_json(l: Option<&pb::Liveness>) -> Value {
    match l {
        Some(v) => json!({
            "state": liveness_name(l),
            "reason": v.reason,
            "since_ms": v.since_ms,
            "observed_at_ms": v.observed_at_ms,
        }),
        None => Value::Null,
    }
}

fn bytes(n: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut i = 0;
    while v >= 1024.0 && i < U.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", U[i])
    }
}

/// `relayctl status --json`: a stable object.
pub fn status_json(url: &str, s: &pb::StatusResponse) -> Value {
    json!({
        "relay": url,
        "relay_version": s.relay_version,
        "engine": s.engine,
        "engine_url": (!s.engine_url.is_empty()).then_some(&s.engine_url),
        "epoch": format!("{:016x}", s.epoch),
        "incarnation": s.incarnation,
        "oldest_cursor": s.oldest_cursor,
        "newest_cursor": s.newest_cursor,
        "history_records": s.history_records,
        "history_bytes": s.history_bytes,
        "subscribers": s.subscribers,
        "ranks": s.ranks.iter().map(|r| {
            let mut rank = json!({
                "dp_rank": r.dp_rank,
                "state": state_name(r.state),
                "reason": r.reason,
                "last_engine_seq": r.last_engine_seq,
                "lag_ms": r.lag_ms,
                "load": load_json(r.load.as_ref()),
                "liveness": liveness_json(r.liveness.as_ref()),
            });
            // Only where the relay checks the engine's block hashes.
            if let Some(h) = &r.hash_check {
                rank["hash_check"] = json!({
                    "checked_blocks": h.checked_blocks,
                    "mismatched_blocks": h.mismatched_blocks,
                    "skipped_blocks": h.skipped_blocks,
                    "mismatch_rate": h.mismatch_rate,
                });
            }
            rank
        }).collect::<Vec<_>>(),
        "counters": s.counters.iter().collect::<BTreeMap<_, _>>(),
    })
}

/// `relayctl status`: the relay at a glance.
pub fn status_table(url: &str, s: &pb::StatusResponse) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "relay        {url} (kv-relay {})", s.relay_version);
    let _ = writeln!(o, "engine       {}", s.engine);
    if !s.engine_url.is_empty() {
        let _ = writeln!(o, "engine url   {}", s.engine_url);
    }
    let _ = writeln!(o, "epoch        {:016x}  incarnation {}", s.epoch, s.incarnation);
    let _ = writeln!(o, "cursors      oldest {}  newest {}", s.oldest_cursor, s.newest_cursor);
    let _ = writeln!(o, "history      {} records, {}", s.history_records, bytes(s.history_bytes));
    let _ = writeln!(o, "subscribers  {}", s.subscribers);
    let _ = writeln!(o);
    let _ = writeln!(o, "RANK  STATE      ENGINE       LAST SEQ     LAG  RUNNING  WAITING  KV USE  REASON");
    for r in &s.ranks {
        let (run, wait, kv) = r.load.as_ref().map_or(("-".into(), "-".into(), "-".into()), |l| {
            (format!("{}", l.running), format!("{}", l.waiting), format!("{:.1}%", l.kv_usage * 100.0))
        });
        // The rank's own reason, then the engine's when it is not alive, with how long.
        let mut reason = r.reason.clone();
        if let Some(l) = r.liveness.as_ref().filter(|l| l.state != pb::EngineLiveness::Alive as i32 && l.state != 0) {
            let secs = l.observed_at_ms.saturating_sub(l.since_ms) as f64 / 1000.0;
            let engine = format!("engine {} for {secs:.1} s: {}", liveness_name(Some(l)), l.reason);
            reason = if reason.is_empty() { engine } else { format!("{reason}; {engine}") };
        }
        let line = format!(
            "{:<5} {:<10} {:<11} {:>9} {:>7} {:>8} {:>8} {:>7}  {}",
            r.dp_rank,
            state_name(r.state),
            liveness_name(r.liveness.as_ref()),
            r.last_engine_seq,
            format!("{}ms", r.lag_ms),
            run,
            wait,
            kv,
            reason
        );
        // No trailing blanks when a rank has no reason.
        let _ = writeln!(o, "{}", line.trim_end());
    }
    if s.ranks.iter().any(|r| r.hash_check.is_some()) {
        let _ = writeln!(o);
        let _ = writeln!(o, "RANK  HASHES CHECKED  MISMATCHED  MISMATCH RATE  SKIPPED");
        for r in &s.ranks {
            if let Some(h) = &r.hash_check {
                let _ = writeln!(
                    o,
                    "{:<5} {:>14} {:>11} {:>14} {:>8}",
                    r.dp_rank,
                    h.checked_blocks,
                    h.mismatched_blocks,
                    format!("{:.2}%", h.mismatch_rate * 100.0),
                    h.skipped_blocks
                );
            }
        }
    }
    if !s.counters.is_empty() {
        let _ = writeln!(o);
        let _ = writeln!(o, "counters");
        for (k, v) in s.counters.iter().collect::<BTreeMap<_, _>>() {
            let _ = writeln!(o, "  {k:<50} {v}");
        }
    }
    o
}

/// One history record as a stable JSON object (events in the relay's normalized model).
pub fn record_json(r: &pb::HistoryResponse) -> Value {
    match &r.record {
        Some(pb::history_response::Record::Batch(b)) => batch_json(b),
        Some(pb::history_response::Record::Control(c)) => control_json(c),
        None => json!({"record": "unknown"}),
    }
}

pub fn batch_json(b: &pb::Batch) -> Value {
    let events: Vec<Value> = b
        .events
        .iter()
        .map(|e| match convert::event_from_pb(e) {
            Ok(ev) => serde_json::to_value(ev).unwrap_or(Value::Null),
            Err(err) => json!({"type": "unreadable", "error": err.to_string()}),
        })
        .collect();
    json!({
        "record": "batch",
        "cursor": b.cursor,
        "incarnation": b.incarnation,
        "dp_rank": b.dp_rank,
        "engine_seq": b.engine_seq,
        "engine_ts": b.engine_ts,
        "events": events,
        "load": load_json(b.load.as_ref()),
        "liveness": liveness_json(b.liveness.as_ref()),
    })
}

fn control_name(k: i32) -> &'static str {
    match pb::ControlKind::try_from(k).unwrap_or(pb::ControlKind::Unspecified) {
        pb::ControlKind::RankReset => "rank_reset",
        pb::ControlKind::RankDegraded => "rank_degraded",
        pb::ControlKind::RankIncomplete => "rank_incomplete",
        pb::ControlKind::RankRecovered => "rank_recovered",
        pb::ControlKind::Unspecified => "unknown",
    }
}

pub fn control_json(c: &pb::Control) -> Value {
    json!({
        "record": "control",
        "cursor": c.cursor,
        "incarnation": c.incarnation,
        "dp_rank": c.dp_rank,
        "kind": control_name(c.kind),
        "reason": c.reason,
    })
}

/// The header of `relayctl history`'s table.
pub const HISTORY_HEADER: &str = "  CURSOR  RANK  ENGINE SEQ  STORED  REMOVED  CLEARED  BLOCKS  DETAIL";

/// One line of `relayctl history`.
pub fn record_line(r: &pb::HistoryResponse) -> String {
    match &r.record {
        Some(pb::history_response::Record::Batch(b)) => batch_line(b),
        Some(pb::history_response::Record::Control(c)) => control_line(c),
        None => "(unknown record)".into(),
    }
}

pub fn batch_line(b: &pb::Batch) -> String {
    let (mut st, mut rm, mut cl, mut blocks) = (0, 0, 0, 0usize);
    for e in &b.events {
        match &e.event {
            Some(pb::event::Event::Stored(s)) => {
                st += 1;
                blocks += s.blocks.len();
            }
            Some(pb::event::Event::Removed(r)) => {
                rm += 1;
                blocks += r.block_hashes.len();
            }
            Some(pb::event::Event::Cleared(_)) => cl += 1,
            None => {}
        }
    }
    let load = b.load.as_ref().map(|l| format!("load {}/{} kv {:.1}%", l.running, l.waiting, l.kv_usage * 100.0));
    format!(
        "{:>8}  {:>4}  {:>10}  {:>6}  {:>7}  {:>7}  {:>6}  {}",
        b.cursor,
        b.dp_rank,
        b.engine_seq,
        st,
        rm,
        cl,
        blocks,
        load.unwrap_or_default()
    )
}

pub fn control_line(c: &pb::Control) -> String {
    format!("{:>8}  {:>4}  {:>10}  {}: {}", c.cursor, c.dp_rank, "-", control_name(c.kind), c.reason)
}

/// One (rank, tier, group) of a snapshot: blocks, copies, distinct namespaces.
#[derive(Debug, Default)]
pub struct GroupTotals {
    pub blocks: u64,
    pub copies: u64,
    pub namespaces: std::collections::BTreeSet<String>,
}

/// Live blocks summarized per (rank, tier, group).
#[derive(Debug, Default)]
pub struct SnapshotSummary {
    pub cursor: u64,
    pub incarnation: u32,
    pub epoch: u64,
    /// (rank, tier, group) → totals
    pub groups: BTreeMap<(u32, String, u32), GroupTotals>,
    pub blocks: Vec<pb::SnapshotBlock>,
}

pub fn tier_name(b: &pb::SnapshotBlock) -> String {
    match convert::tier_from_pb(b.tier, &b.tier_name) {
        Ok(Some(t)) => t.to_string(),
        _ => "unknown".into(),
    }
}

fn ns_key(n: Option<&pb::Namespace>) -> String {
    let n = convert::namespace_from_pb(n);
    if n.is_default() {
        "default".into()
    } else {
        serde_json::to_string(&n).unwrap_or_default()
    }
}

impl SnapshotSummary {
    pub fn add(&mut self, b: pb::SnapshotBlock, keep_blocks: bool) {
        let e = self.groups.entry((b.dp_rank, tier_name(&b), b.group)).or_default();
        e.blocks += 1;
        e.copies += u64::from(b.copies);
        e.namespaces.insert(ns_key(b.namespace.as_ref()));
        if keep_blocks {
            self.blocks.push(b);
        }
    }

    pub fn table(&self, with_blocks: bool) -> String {
        let mut o = String::new();
        let _ = writeln!(
            o,
            "snapshot at cursor {} (epoch {:016x}, incarnation {})",
            self.cursor, self.epoch, self.incarnation
        );
        let _ = writeln!(o, "RANK  TIER      GROUP    BLOCKS    COPIES  NAMESPACES");
        for ((r, t, g), x) in &self.groups {
            let _ = writeln!(o, "{r:<5} {t:<9} {g:>5} {:>9} {:>9}  {}", x.blocks, x.copies, x.namespaces.len());
        }
        if self.groups.is_empty() {
            let _ = writeln!(o, "(no live blocks)");
        }
        if with_blocks {
            let _ = writeln!(o);
            let _ =
                writeln!(o, "RANK  TIER      GROUP                  HASH                PARENT  COPIES  SIZE  TOKENS");
            for b in &self.blocks {
                let parent = b.parent.map(|p| p.to_string()).unwrap_or_else(|| "-".into());
                let toks = if b.token_ids.is_empty() { String::new() } else { format!("{:?}", b.token_ids) };
                let _ = writeln!(
                    o,
                    "{:<5} {:<9} {:>5} {:>21} {:>21} {:>7} {:>5}  {}",
                    b.dp_rank,
                    tier_name(b),
                    b.group,
                    b.hash,
                    parent,
                    b.copies,
                    b.block_size,
                    toks
                );
            }
        }
        o
    }

    pub fn json(&self, with_blocks: bool, include_token_ids: bool) -> Value {
        let groups: Vec<Value> = self
            .groups
            .iter()
            .map(|((r, t, g), x)| {
                json!({"dp_rank": r, "tier": t, "group": g, "blocks": x.blocks, "copies": x.copies, "namespaces": x.namespaces.len()})
            })
            .collect();
        let mut v = json!({
            "cursor": self.cursor,
            "epoch": format!("{:016x}", self.epoch),
            "incarnation": self.incarnation,
            "groups": groups,
        });
        if with_blocks {
            let blocks: Vec<Value> = self
                .blocks
                .iter()
                .map(|b| {
                    let mut o = json!({
                        "dp_rank": b.dp_rank,
                        "tier": tier_name(b),
                        "group": b.group,
                        "hash": b.hash,
                        "parent": b.parent,
                        "copies": b.copies,
                        "block_size": b.block_size,
                        "namespace": serde_json::to_value(convert::namespace_from_pb(b.namespace.as_ref())).unwrap_or(Value::Null),
                    });
                    if include_token_ids {
                        o["token_ids"] = json!(b.token_ids);
                    }
                    o
                })
                .collect();
            v["blocks"] = Value::Array(blocks);
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(hash_check: Option<pb::HashCheckStatus>) -> pb::StatusResponse {
        pb::StatusResponse {
            ranks: vec![pb::RankStatus {
                dp_rank: 0,
                state: pb::RankState::Ok as i32,
                hash_check,
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    #[test]
    fn the_engines_liveness_is_shown_with_its_reason_and_age() {
        let mut s = status(None);
        s.engine_url = "http://10.0.0.1:8000".into();
        s.ranks.push(pb::RankStatus {
            dp_rank: 1,
            state: pb::RankState::Ok as i32,
            liveness: Some(pb::Liveness {
                state: pb::EngineLiveness::Wedged as i32,
                reason: "requests running, no progress for 4.0 s".into(),
                since_ms: 10_000,
                observed_at_ms: 11_500,
            }),
            ..Default::default()
        });
        s.ranks[0].liveness = Some(pb::Liveness { state: pb::EngineLiveness::Alive as i32, ..Default::default() });
        let table = status_table("u", &s);
        assert!(table.contains("\nengine url   http://10.0.0.1:8000\n"), "{table}");
        let rows: Vec<&str> = table.lines().skip_while(|l| !l.starts_with("RANK")).take(3).collect();
        assert_eq!(
            rows,
            [
                "RANK  STATE      ENGINE       LAST SEQ     LAG  RUNNING  WAITING  KV USE  REASON",
                "0     ok         alive               0     0ms        -        -       -",
                "1     ok         wedged              0     0ms        -        -       -  engine wedged for 1.5 s: requests running, no progress for 4.0 s",
            ]
        );
        let j = status_json("u", &s);
        assert_eq!(j["engine_url"], json!("http://10.0.0.1:8000"));
        assert_eq!(
            j["ranks"][1]["liveness"],
            json!({"state": "wedged", "reason": "requests running, no progress for 4.0 s", "since_ms": 10_000, "observed_at_ms": 11_500})
        );
        assert_eq!(status_json("u", &status(None))["ranks"][0]["liveness"], Value::Null);
        assert_eq!(status_json("u", &status(None))["engine_url"], Value::Null);
    }

    #[test]
    fn the_hash_check_is_shown_only_where_it_is_on() {
        let off = status(None);
        assert!(!status_table("u", &off).contains("HASHES CHECKED"));
        assert_eq!(status_json("u", &off)["ranks"][0].get("hash_check"), None);
        let on = status(Some(pb::HashCheckStatus {
            checked_blocks: 200,
            mismatched_blocks: 3,
            skipped_blocks: 7,
            mismatch_rate: 0.015,
        }));
        let table = status_table("u", &on);
        let lines: Vec<&str> = table.lines().skip_while(|l| !l.contains("HASHES CHECKED")).take(2).collect();
        assert_eq!(
            lines,
            [
                "RANK  HASHES CHECKED  MISMATCHED  MISMATCH RATE  SKIPPED",
                "0                200           3          1.50%        7"
            ]
        );
        assert_eq!(
            status_json("u", &on)["ranks"][0]["hash_check"],
            json!({"checked_blocks": 200, "mismatched_blocks": 3, "skipped_blocks": 7, "mismatch_rate": 0.015})
        );
    }
}
