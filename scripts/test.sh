#!/usr/bin/env bash
# The project's test command (the README's second quick-start command).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --workspace --all-targets --locked
cargo test --workspace --locked
