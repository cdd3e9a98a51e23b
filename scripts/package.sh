#!/usr/bin/env bash
# Usage: scripts/package.sh [--quick]
#
# Builds the Debian packages with cargo-deb:
#   target/debian/kv-relay_<version>-1_<arch>.deb   kv-relay, relayctl, the unit, the conffile, docs
#   target/debian/kv-router_<version>-1_<arch>.deb  the example router kv-router
# (docs/operations.md, Install, says what each holds and how to install it).
#
# Steps: cargo-deb (the version pinned below) is installed with `cargo install --locked` when
# missing, and dpkg-dev with apt-get (for the packages' shared-library dependencies); `xtask
# dist-assets` writes the man pages and completions into dist/; `cargo deb` builds
# the release binaries and the packages.
#
# --quick (CI): packages the debug binaries of scripts/test.sh's `cargo build --workspace
# --all-targets` (run first: nothing to do after test.sh) instead of building release ones, into
# target/debian-quick/ (same contents, slower binaries: a check of the packaging, not a release).
set -euo pipefail
cd "$(dirname "$0")/.."

# Pinned: the package check lists the packages' exact contents, and cargo-deb's defaults (the
# copyright file, compression of man pages) are part of them.
cargo_deb_version=3.8.0

quick=0
case "${1:-}" in
    "") ;;
    --quick) quick=1 ;;
    *) echo "usage: $0 [--quick]" >&2; exit 2 ;;
esac

have=$(cargo deb --version 2>/dev/null | awk '{print $NF}' || true)
if [ "$have" != "$cargo_deb_version" ]; then
    echo "package: installing cargo-deb $cargo_deb_version (found: ${have:-none})"
    cargo install cargo-deb --locked --version "$cargo_deb_version"
fi
if ! command -v dpkg-shlibdeps >/dev/null 2>&1; then
    # shellcheck source=scripts/apt-install.sh
    . scripts/apt-install.sh
    apt_install dpkg-dev || { echo "package: dpkg-shlibdeps is missing and $apt_why" >&2; exit 1; }
fi

if [ "$quick" = 1 ]; then
    # scripts/test.sh's build command, so that after it this builds nothing: building fewer
    # packages would resolve the dependencies' features differently and rebuild them.
    cargo build --workspace --all-targets --locked
    out=target/debian-quick
    # cargo-deb warns that the dev profile is for checks, not releases: that is what this is.
    # --fast: lighter compression (the debug binaries are large; the package is thrown away).
    build=(--profile dev --no-build --fast)
else
    cargo build --locked -p xtask
    out=target/debian
    build=()
fi
target/debug/xtask dist-assets --out dist
mkdir -p "$out"
rm -f "$out"/kv-relay_*.deb "$out"/kv-router_*.deb
# --strip: the release profile keeps debug info for profiling (relay binaries of 95 and 75 MB
# with it); the packages ship the binaries without it.
cargo deb --locked -p kv-relay "${build[@]}" --strip --output "$out/"
cargo deb --locked -p kv-router "${build[@]}" --strip --output "$out/"
echo "package: built"
ls -l "$out"/*.deb
