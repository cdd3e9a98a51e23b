//! Runs the fault drills and prints each drill's rule, what it measured, and
//! PASS / FAIL / SKIPPED. `--long` runs the soak rows at full length (engine gone 10 s, 64
//! subscribers for 10 minutes, ...); `--only NAME` runs one drill (names: `--list`).
//! Needs the `kv-relay` binary (`cargo build -p kv-relay --bins`, or `KV_RELAY_BIN`). Run `--long`
//! in release, with `KV_RELAY_BIN=target/release/kv-relay` (docs/drills.md).

use clap::Parser;
use kv_relay_testkit::drills::{Scale, DRILLS};

#[derive(Parser)]
#[command(name = "drills", about = "kv-relay's end-to-end fault drills")]
struct Args {
    /// The soak rows at full length.
    #[arg(long)]
    long: bool,
    /// Only this drill (repeatable).
    #[arg(long)]
    only: Vec<String>,
    /// List the drills' names.
    #[arg(long)]
    list: bool,
}

fn main() {
    let a = Args::parse();
    if a.list {
        for (name, _) in DRILLS {
            println!("{name}");
        }
        return;
    }
    if let Some(bad) = a.only.iter().find(|n| !DRILLS.iter().any(|(d, _)| d == n)) {
        eprintln!("no drill named {bad:?} (see --list)");
        std::process::exit(2);
    }
    let mut failed = Vec::new();
    for (name, f) in DRILLS {
        if !a.only.is_empty() && !a.only.iter().any(|n| n == name) {
            continue;
        }
        let started = std::time::Instant::now();
        let r = f(Scale { long: a.long });
        println!("[{name}] ({:.1} s)\n{}", started.elapsed().as_secs_f64(), r.text());
        if !r.passed() && r.skipped.is_none() {
            failed.push(*name);
        }
    }
    if failed.is_empty() {
        println!("all drills passed");
    } else {
        println!("FAILED: {}", failed.join(", "));
        std::process::exit(1);
    }
}
