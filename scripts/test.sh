#!/usr/bin/env bash
# The project's test command (the README's second quick-start command; CI runs it via .ci/run).
# Everything it needs comes from crates.io (libzmq and protoc are built or vendored by crates);
# scripts/check-systemd.sh installs systemd-analyze with apt-get when it is missing, and
# scripts/package.sh cargo-deb (cargo install --locked) and dpkg-dev (apt-get), and
# scripts/python.sh maturin and pytest (pip, into a virtual environment it makes).
# The declared MSRV (rust-version in Cargo.toml) is checked by the lint step: clippy's
# incompatible_msrv fails on any std item newer than it.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }

# A CI clone is built once: incremental state would only cost disk (1.5 GB of a clean build).
if [ "${CI:-}" = true ]; then export CARGO_INCREMENTAL=0; fi
disk() { df -h --output=avail,target . | tail -n 1 | awk '{print "disk free on " $2 ": " $1}'; }
disk

step "the repository stands alone"
# Tests, benchmarks and tools read their data from testdata/ (the kv-relay-testdata crate finds
# it), never from beside the checkout: a clone has nothing there. CI's own clone may have such a
# folder beside it, so only this check can catch a path that leaves the repository.
if outside=$(git grep -n -I -E '\.\./shared/|shared/(fixtures|data|specs)|/work/' -- . ':!scripts/test.sh'); then
  printf '%s\n' "$outside" >&2
  echo "these lines name files outside the repository (a clone does not have them):" \
    "read testdata/ through kv-relay-testdata, or bring what a doc needs into docs/" >&2
  exit 1
fi
echo "no path leaves the repository"

step "format"
cargo fmt --all -- --check

step "build (every target)"
cargo build --workspace --all-targets --locked

disk

step "lint"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "docs (rustdoc, warnings denied: every intra-doc link resolves)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked

step "the fuzz targets compile (relay/fuzz, outside the workspace)"
# Its lock file keeps the workspace's versions, so the dependencies checked by the lint step
# are reused from target/.
cargo check --manifest-path relay/fuzz/Cargo.toml --target-dir target --locked

step "tests"
# A hung test fails the run with a message instead of holding CI until its own timeout
# (cargo names every test that runs for over 60 s above this line).
timeout -k 30 1200 cargo test --workspace --locked || {
  rc=$?
  [ "$rc" -eq 124 ] && echo "tests did not finish within 20 minutes: a test hangs (see the 'running for over 60 seconds' lines)" >&2
  exit "$rc"
}

step "tests that need root (a full disk and a read-only one, on a tmpfs they mount)"
if [ "$(id -u)" -eq 0 ]; then
  cargo test --locked -p kv-relay --test store -- --ignored --exact \
    disk::a_full_disk_refuses_commits_until_there_is_room_and_loses_nothing \
    disk::a_read_only_state_directory_is_a_clear_error
else
  echo "NOT RUN: not root. Run them as root: cargo test -p kv-relay --test store -- --ignored"
fi

step "the Python wheel (maturin and pytest from the Python registry, in target/python-venv)"
# Builds the wheel, installs it into a fresh virtual environment, and runs its tests against
# the mock engine, kv-relay and kv-router binaries of the build step.
./scripts/python.sh

step "benchmarks, quick mode (debug build; figures here are not the documented ones)"
KV_RELAY_BENCH_QUICK=1 cargo test --locked -p kv-relay --bench store --bench decode
cargo test --locked -p kv-router-client --bench index -- --blocks 20000 --lookups 2000
cargo test --locked -p kv-router-client --bench index -- --blocks 20000 --lookups 2000 --placement uniform --capacity 10000 --half-rate
# A router's resync from a relay's snapshot (decode, stage, swap; lookups checked): seconds.
cargo test --locked -p kv-router-client --bench resync -- --blocks 20000 --runs 1
# The relay end to end (mock engine, kv-relay process from the build step, subscribers): ~1 min.
KV_RELAY_BENCH_QUICK=1 cargo test --locked -p kv-router-client --bench relay
# A router following a fleet (20 relays, a kv-router process, DNS, a snapshot storm): seconds.
cargo test --locked -p kv-router --bench fleet -- --quick
# What a `/match` answer costs (10 relays x 2 ranks), checked against the old path byte for byte.
cargo test --locked -p kv-router --bench match -- --quick
# A routing decision (Router::route + report) against Follower::matches, /route over HTTP, misses.
cargo test --locked -p kv-router --bench route -- --quick
# What the front adds to a request (2k-token prompts, direct against through it): seconds.
cargo test --locked -p kv-router --bench front -- --quick
# Routing quality on a simulated fleet (Mooncake, 4 engines with the cost model): ~15 s.
cargo test --locked -p kv-router --bench serve -- --quick

disk

step "systemd unit"
./scripts/check-systemd.sh

step "packages, quick mode (the debug build packaged; contents, extracted binaries, unit, dpkg upgrade)"
./scripts/check-package.sh --quick
