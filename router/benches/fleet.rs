//! A router following a fleet of relays: the fleet goals, measured by hand, and a fleet that a
//! `kv-router` can be pointed at.
//!
//! The fleet is the test kit's (`kv_relay_testkit::fleet`): every relay is the relay's own server
//! code (`kv_relay::server::serve`, the real `kv_relay.v1` contract) over its own store, on its
//! own port of 127.0.0.1, in this process; a thread commits a steady stream of records into the
//! stores in turn. The router is the real `kv-router` binary in a process of its own, so its RSS
//! and CPU are its own; it is driven and read over its HTTP API (`/workers`, `/metrics`,
//! `/match`). Parts:
//! - `router`: start to every worker ready (every relay's cursor its newest, every worker
//!   `fresh`), the router's RSS and index bytes, then a stream of records for `--load-s`
//!   seconds: the rate the fleet achieved, the router's CPU (per thread name), each relay's lag
//!   (the store's newest cursor minus the router's), `/match` latency for 512-block requests
//!   (keep-alive HTTP, one request at a time at `--match-rate` a second, from a thread at the
//!   router's niceness, 0, as a caller on its own host), with the same requests for half of
//!   `--load-s` before the stream as its peer; then, under the same
//!   stream, a relay restarts with a new epoch: the time until the router holds the new epoch at
//!   the new store's cursor, and whether any other worker left `fresh` meanwhile.
//! - `dns`: discovery through the resolver seam (the code `--relays-dns` runs, in this process):
//!   relays on 127.0.0.2.. of one port; the time from an address appearing to its relay being
//!   followed, and from its disappearing to its relay being dropped.
//! - `storm`: one relay (a child process: this binary with `--serve`, so its RSS and CPU are its
//!   own) and `--routers` followers in this process starting at once against a history too short
//!   for them: every one takes a snapshot, at most the relay's `max_snapshots` (8) at once. The
//!   time until all equal the relay, the relay's RSS and CPU.
//!
//! ```text
//! cargo bench --locked -p kv-router --bench fleet                       # 1,000 relays x 10,000 blocks
//! cargo bench --locked -p kv-router --bench fleet -- --only storm,dns
//! cargo test --locked -p kv-router --bench fleet -- --quick              # seconds (CI)
//! cargo bench --locked -p kv-router --bench fleet -- --serve --relays-file F   # serve only
//! ```
//! Options: `--relays N` (1,000), `--blocks N` live blocks a relay (10,000), `--rate R` records
//! a second a relay (50), `--ops N` block operations a record (40: half stores, half removals of
//! the oldest), `--load-s S` (20), `--match-rate R` (200), `--match-limit K` (each `/match` asks for the `K` best workers;
//! default: every worker), `--routers N` (64), `--storm-blocks N`
//! (100,000), `--only router,dns,storm`, `--router-malloc default` (glibc's own settings instead
//! of the relay's shipped `MALLOC_ARENA_MAX` and `GLIBC_TUNABLES`). A thousand relays need about 4,000 file descriptors
//! (`ulimit -n`).
//!
//! `--serve` only serves the fleet: it writes the relays' URLs to `--relays-file` (one a line,
//! what `kv-router --relays-file` reads), streams records at `--rate`, and reads commands on
//! standard input until it closes: `restart I`, `disappear I`, `slow I BYTES_PER_S` (0 stalls),
//! `recover I`.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kv_relay::store::HistoryLimits;
use kv_relay_testkit::drills::harness::{announced_addr, metric, status, wait_until, SHIPPED_ENV};
use kv_relay_testkit::fleet::{serve_store, Fleet, FleetOptions, StreamConfig};
use kv_relay_testkit::pace::Pace;
use kv_router_client::discovery::{Discovery, Lookup, Resolver};
use kv_router_client::{FollowConfig, Follower};
use serde_json::Value;

struct Opts {
    quick: bool,
    serve: bool,
    relays: usize,
    blocks: usize,
    rate: f64,
    ops: usize,
    load: Duration,
    match_rate: f64,
    /// `"limit"` in each `/match` body (`--match-limit K`); none: every worker listed.
    match_limit: Option<u64>,
    routers: usize,
    storm_blocks: usize,
    relays_file: Option<PathBuf>,
    /// kv-router runs with the relay's shipped malloc settings.
    malloc_env: bool,
    only: Vec<String>,
}

impl Opts {
    fn parse() -> Opts {
        let args: Vec<String> = std::env::args().skip(1).collect();
        let quick = args.iter().any(|a| a == "--quick");
        let get = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
        let num = |name: &str, full: f64, quick_value: f64| {
            get(name).map(|v| v.parse::<f64>().expect(name)).unwrap_or(if quick { quick_value } else { full })
        };
        Opts {
            quick,
            serve: args.iter().any(|a| a == "--serve"),
            relays: num("--relays", 1000.0, 20.0) as usize,
            blocks: num("--blocks", 10_000.0, 400.0) as usize,
            rate: num("--rate", 50.0, 50.0),
            ops: num("--ops", 40.0, 40.0) as usize,
            load: Duration::from_secs_f64(num("--load-s", 20.0, 2.0)),
            match_rate: num("--match-rate", 200.0, 50.0),
            match_limit: get("--match-limit").map(|k| k.parse().expect("--match-limit: a whole number")),
            routers: num("--routers", 64.0, 8.0) as usize,
            storm_blocks: num("--storm-blocks", 100_000.0, 2_000.0) as usize,
            relays_file: get("--relays-file").map(PathBuf::from),
            malloc_env: get("--router-malloc").as_deref() != Some("default"),
            only: get("--only").map(|s| s.split(',').map(str::to_string).collect()).unwrap_or_default(),
        }
    }

    fn part(&self, name: &str) -> bool {
        self.only.is_empty() || self.only.iter().any(|o| o == name)
    }

    /// The fleet: records of `ops` stores each until `blocks` are live.
    fn fleet(&self, relays: usize, blocks: usize, history: HistoryLimits) -> FleetOptions {
        let per = self.ops.max(1);
        FleetOptions { history, ..FleetOptions::new(relays, blocks.div_ceil(per), per) }
    }

    fn stream(&self, relays: usize) -> StreamConfig {
        StreamConfig {
            records_per_second: self.rate * relays as f64,
            stores: self.ops / 2,
            removes: self.ops - self.ops / 2,
            limit: None,
        }
    }
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

fn th(v: f64) -> String {
    let s = format!("{:.0}", v);
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[path = "fleet/router_process.rs"]
mod router_process;
use router_process::*;
#[path = "fleet/parts.rs"]
mod parts;
use parts::*;

fn main() {
    let opts = Opts::parse();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    if opts.serve {
        serve(&opts, &rt);
        return;
    }
    println!(
        "router fleet ({} mode): {} relays x {} blocks, {} records/s a relay of {} ops; load {}",
        if opts.quick { "quick" } else { "full" },
        opts.relays,
        opts.blocks,
        opts.rate,
        opts.ops,
        loadavg()
    );
    let mut rows = Vec::new();
    if opts.part("dns") {
        part_dns(&opts, &rt, &mut rows);
    }
    if opts.part("storm") {
        part_storm(&opts, &rt, &mut rows);
    }
    if opts.part("router") {
        part_router(&opts, &rt, &mut rows);
    }
    println!("\n| measure | figure | goal | load |\n|---|---|---|---|");
    for r in rows {
        println!("{r}");
    }
}
