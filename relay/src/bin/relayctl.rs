//! `relayctl`: inspect a kv-relay (`status`, `history`, `snapshot`), or decode a capture of an
//! engine's wire (`decode`).

use anyhow::Context as _;
use clap::Parser as _;
use kv_relay::ctl::cli::{Cli, Cmd};
use kv_relay::ctl::{self, CtlError, SnapshotSummary, Target};
use kv_relay_proto::pb;
use std::io::{IsTerminal as _, Write as _};
use std::process::ExitCode;

fn out(s: &str) -> anyhow::Result<()> {
    std::io::stdout().write_all(s.as_bytes()).context("writing to stdout")
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let tls = cli.target.tls_ca.is_some() || cli.target.tls_cert.is_some();
    let t = Target {
        url: with_scheme(&cli.target.relay, tls),
        token: cli.target.token.clone(),
        tls_ca: cli.target.tls_ca.clone(),
        tls_cert: cli.target.tls_cert.clone(),
        tls_key: cli.target.tls_key.clone(),
        tls_domain: cli.target.tls_domain.clone(),
    };
    let url = t.url.clone();
    let rpc = |s: tonic::Status| CtlError::rpc(&url, s);
    match cli.cmd {
        Cmd::Decode { file, json } => {
            let messages = kv_relay::capture::read(&file)?;
            let walk = kv_relay::capture::walk(&messages);
            out(&if json {
                kv_relay::decode_cmd::render_json(&messages, &walk)
            } else {
                kv_relay::decode_cmd::render_table(&messages, &walk)
            })?;
        }
        Cmd::Status { json } => {
            let mut c = ctl::connect(&t).await?;
            let s = c.status(pb::StatusRequest {}).await.map_err(rpc)?.into_inner();
            if json {
                out(&format!("{}\n", serde_json::to_string_pretty(&ctl::status_json(&url, &s))?))?;
            } else {
                out(&ctl::status_table(&url, &s))?;
            }
        }
        Cmd::History { rank, from, to, limit, follow, json } => {
            let mut c = ctl::connect(&t).await?;
            let s = c.status(pb::StatusRequest {}).await.map_err(rpc)?.into_inner();
            if !json {
                out(&format!("{}\n", ctl::HISTORY_HEADER))?;
            }
            // Lines go to stdout as they come; when that is a file and stderr a terminal, a count.
            let progress = Progress::new("records", !std::io::stdout().is_terminal());
            let print = |r: &pb::HistoryResponse| {
                progress.add(1);
                out(&format!("{}\n", if json { ctl::record_json(r).to_string() } else { ctl::record_line(r) }))
            };
            // Where a follow resumes: after the last record listed.
            let last = match from {
                Some(from) => {
                    let mut last = from.saturating_sub(1);
                    if s.newest_cursor >= from {
                        let req = pb::HistoryRequest {
                            from_cursor: from,
                            to_cursor: to.unwrap_or(0),
                            limit: limit.unwrap_or(0),
                            ranks: rank.clone(),
                            epoch: s.epoch,
                        };
                        let mut stream = c.history(req).await.map_err(rpc)?.into_inner();
                        while let Some(r) = stream.message().await.map_err(rpc)? {
                            last = record_cursor(&r).unwrap_or(last);
                            print(&r)?;
                        }
                    }
                    last
                }
                None => {
                    let top = to.unwrap_or(s.newest_cursor).min(s.newest_cursor);
                    for r in newest(&mut c, &s, top, &rank, limit.unwrap_or(20)).await.map_err(rpc)? {
                        print(&r)?;
                    }
                    top
                }
            };
            progress.done();
            if follow {
                let req = pb::SubscribeRequest {
                    epoch: s.epoch,
                    after_cursor: last,
                    incarnation: s.incarnation,
                    allow_snapshot: false,
                    ranks: rank,
                    snapshot_token_ids: false,
                    omit_token_ids: false,
                };
                let mut stream = c.subscribe(req).await.map_err(rpc)?.into_inner();
                while let Some(m) = stream.message().await.map_err(rpc)? {
                    let line = match m.message {
                        Some(pb::subscribe_response::Message::Batch(b)) if json => ctl::batch_json(&b).to_string(),
                        Some(pb::subscribe_response::Message::Batch(b)) => ctl::batch_line(&b),
                        Some(pb::subscribe_response::Message::Control(c)) if json => ctl::control_json(&c).to_string(),
                        Some(pb::subscribe_response::Message::Control(c)) => ctl::control_line(&c),
                        Some(pb::subscribe_response::Message::Resync(r)) => {
                            anyhow::bail!("the relay asked to resync: {} (oldest cursor {})", r.reason, r.oldest_cursor)
                        }
                        _ => continue,
                    };
                    out(&format!("{line}\n"))?;
                }
            }
        }
        Cmd::Snapshot { blocks, include_token_ids, rank, tier, json } => {
            let mut c = ctl::connect(&t).await?;
            let req = pb::SnapshotRequest { ranks: rank, tiers: tier, include_token_ids };
            let mut stream = c.snapshot(req).await.map_err(rpc)?.into_inner();
            let mut sum = SnapshotSummary::default();
            let progress = Progress::new("blocks", true);
            while let Some(m) = stream.message().await.map_err(rpc)? {
                match m.message {
                    Some(pb::snapshot_response::Message::Begin(b)) => {
                        sum.cursor = b.cursor;
                        sum.epoch = b.epoch;
                        sum.incarnation = b.incarnation;
                    }
                    Some(pb::snapshot_response::Message::Chunk(ch)) => {
                        progress.add(ch.blocks.len() as u64);
                        for b in ch.blocks {
                            sum.add(b, blocks);
                        }
                    }
                    Some(pb::snapshot_response::Message::End(e)) => sum.cursor = e.cursor,
                    None => {}
                }
            }
            progress.done();
            if json {
                out(&format!("{}\n", serde_json::to_string_pretty(&sum.json(blocks, include_token_ids))?))?;
            } else {
                out(&sum.table(blocks))?;
            }
        }
    }
    Ok(())
}

/// What a long command has received so far, counted on stderr when stderr is a terminal (and
/// `also` holds): `received 12000 records`.
struct Progress {
    on: bool,
    what: &'static str,
    n: std::cell::Cell<u64>,
}

impl Progress {
    fn new(what: &'static str, also: bool) -> Self {
        Progress { on: also && std::io::stderr().is_terminal(), what, n: std::cell::Cell::new(0) }
    }

    fn add(&self, k: u64) {
        let before = self.n.get();
        self.n.set(before + k);
        // Every 1,000 (a chunk of a snapshot is 1,024 blocks: every chunk).
        if self.on && (before / 1000 != (before + k) / 1000) {
            eprint!("\rreceived {} {}", before + k, self.what);
        }
    }

    fn done(&self) {
        if self.on && self.n.get() >= 1000 {
            eprintln!("\rreceived {} {}", self.n.get(), self.what);
        }
    }
}

/// `HOST:PORT` as a URL: `http://HOST:PORT`, or `https://` when TLS is asked for.
fn with_scheme(relay: &str, tls: bool) -> String {
    if relay.contains("://") {
        relay.to_string()
    } else {
        format!("{}://{relay}", if tls { "https" } else { "http" })
    }
}

fn record_cursor(r: &pb::HistoryResponse) -> Option<u64> {
    match &r.record {
        Some(pb::history_response::Record::Batch(b)) => Some(b.cursor),
        Some(pb::history_response::Record::Control(c)) => Some(c.cursor),
        None => None,
    }
}

/// The newest `limit` records of `ranks` (every rank when empty) at or before cursor `top`, in
/// cursor order. The History RPC reads forwards, so with a rank filter the window is widened
/// until it holds `limit` matching records or reaches the oldest cursor.
async fn newest(
    c: &mut ctl::Client,
    s: &pb::StatusResponse,
    top: u64,
    ranks: &[u32],
    limit: u32,
) -> Result<Vec<pb::HistoryResponse>, tonic::Status> {
    if limit == 0 || top < s.oldest_cursor.max(1) {
        return Ok(Vec::new());
    }
    let mut span = u64::from(limit);
    loop {
        let from = top.saturating_sub(span - 1).max(s.oldest_cursor).max(1);
        let req =
            pb::HistoryRequest { from_cursor: from, to_cursor: top, limit: 0, ranks: ranks.to_vec(), epoch: s.epoch };
        let mut stream = c.history(req).await?.into_inner();
        let mut got = Vec::new();
        while let Some(r) = stream.message().await? {
            got.push(r);
        }
        if got.len() >= limit as usize || from <= s.oldest_cursor.max(1) {
            let skip = got.len().saturating_sub(limit as usize);
            return Ok(got.split_off(skip));
        }
        span = span.saturating_mul(4);
    }
}

/// A call the connection failed under: with TLS 1.3 a relay that refuses the client
/// certificate says so only at the first call.
fn broke(e: &CtlError) -> bool {
    matches!(e, CtlError::Broken { .. })
}

/// The exit status of a failure: 69 (`EX_UNAVAILABLE`) when the relay cannot be reached, 77
/// (`EX_NOPERM`) when it refuses the token or certificate, 2 for a bad relay address (as for any
/// other bad flag), and 1 otherwise.
fn exit_code(e: &anyhow::Error) -> u8 {
    match e.chain().find_map(|c| c.downcast_ref::<CtlError>()) {
        Some(CtlError::Connect { .. }) => 69,
        Some(CtlError::Rpc { code: tonic::Code::Unavailable, .. }) => 69,
        Some(CtlError::Broken { .. }) => 69,
        Some(CtlError::Rpc { code: tonic::Code::Unauthenticated | tonic::Code::PermissionDenied, .. }) => 77,
        Some(CtlError::Address { .. }) => 2,
        _ => 1,
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("relayctl: cannot start: {e}");
            return ExitCode::from(1);
        }
    };
    match rt.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            if e.chain().any(|c| {
                c.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
            }) {
                return ExitCode::SUCCESS;
            }
            eprintln!("relayctl: {e}");
            for cause in e.chain().skip(1) {
                eprintln!("  caused by: {cause}");
            }
            if e.chain().filter_map(|c| c.downcast_ref::<CtlError>()).any(broke) {
                eprintln!(
                    "  the connection failed during the call: check --relay, and the TLS settings (--tls-ca; \
                     --tls-cert and --tls-key when the relay requires a client certificate)"
                );
            }
            ExitCode::from(exit_code(&e))
        }
    }
}
