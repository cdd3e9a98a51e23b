#!/usr/bin/env bash
# Usage: scripts/check-systemd.sh [UNIT]
#
# Checks the systemd unit UNIT (default systemd/kv-relay@.service; scripts/check-package.sh
# passes the unit the package installs):
#   1. `systemd-analyze verify` passes on an instance of the template;
#   2. `systemd-analyze security` rates it 2.0 or better (exposure, lower is better).
#
# Installs systemd with apt-get (non-interactive) when systemd-analyze is missing. When it cannot
# be had, prints a visible "SKIPPED: systemd-analyze unavailable (why)" line and exits 0; with
# KV_RELAY_REQUIRE_SYSTEMD=1 it fails instead. It never skips silently.
#
# ExecStart: `verify` checks that the binary exists and is executable, and the unit names the
# installed path (/usr/bin/kv-relay, where the package puts it). The check runs on a copy of the
# unit, in a temporary directory, whose ExecStart points at a built kv-relay when there is one
# (KV_RELAY_BIN, else target/release or target/debug), else at a stub script: the unit's
# directives, not the binary, are what is checked. Everything else in the copy is the unit
# verbatim. `verify` runs with --man=no: the unit's `Documentation=man:kv-relay(1)` is a page the
# package installs, not one on the machine that checks (check-package.sh checks the page).
set -euo pipefail
unit=systemd/kv-relay@.service
if [ $# -gt 1 ]; then
    echo "usage: $0 [UNIT]" >&2
    exit 2
elif [ $# = 1 ]; then
    [ -f "$1" ] || { echo "check-systemd: no unit file $1" >&2; exit 2; }
    unit=$(realpath "$1")
fi
cd "$(dirname "$0")/.."

max_exposure=2.0
installed_bin=/usr/bin/kv-relay

skip() {
    echo "SKIPPED: systemd-analyze unavailable ($1)"
    if [ "${KV_RELAY_REQUIRE_SYSTEMD:-0}" = 1 ]; then
        echo "check-systemd: KV_RELAY_REQUIRE_SYSTEMD=1: failing" >&2
        exit 1
    fi
    exit 0
}

if ! command -v systemd-analyze >/dev/null 2>&1; then
    # shellcheck source=scripts/apt-install.sh
    . scripts/apt-install.sh
    echo "check-systemd: systemd-analyze is missing"
    apt_install systemd || skip "not installed, and $apt_why"
    command -v systemd-analyze >/dev/null 2>&1 || skip "installed systemd has no systemd-analyze"
fi

version=$(systemd-analyze --version | awk 'NR==1 {print $2}')
if ! [ "${version%%[!0-9]*}" -ge 250 ] 2>/dev/null; then
    skip "systemd $version is older than 250: no 'security --offline'"
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

bin="${KV_RELAY_BIN:-}"
if [ -z "$bin" ]; then
    for b in target/release/kv-relay target/debug/kv-relay; do
        if [ -x "$b" ]; then bin="$PWD/$b"; break; fi
    done
fi
if [ -z "$bin" ]; then
    bin="$work/kv-relay"
    printf '#!/bin/sh\nexit 0\n' >"$bin"
    chmod 0755 "$bin"
    echo "check-systemd: no built kv-relay; ExecStart points at a stub ($bin)"
else
    echo "check-systemd: ExecStart points at $bin"
fi
grep -q "^ExecStart=$installed_bin " "$unit" || { echo "check-systemd: $unit does not start $installed_bin" >&2; exit 1; }

# The template, and an instance of it (verify wants a concrete unit; %i expands to "ci").
sed "s#$installed_bin#$bin#g" "$unit" >"$work/kv-relay@.service"
cp "$work/kv-relay@.service" "$work/kv-relay@ci.service"

echo "== systemd-analyze verify ($(systemd-analyze --version | head -n1))"
if ! out=$(systemd-analyze verify --man=no "$work/kv-relay@ci.service" 2>&1); then
    echo "$out"
    echo "FAIL: systemd-analyze verify" >&2
    exit 1
fi
# Warnings about this unit (unknown keys, bad values) fail too; lines about the host's other
# units (a container's missing /dev nodes, say) are shown and do not.
if [ -n "$out" ]; then echo "$out"; fi
if grep -q 'kv-relay' <<<"$out"; then
    echo "FAIL: systemd-analyze verify warned about the unit" >&2
    exit 1
fi
echo "verify: ok"

echo "== systemd-analyze security"
sec=$(systemd-analyze security --offline=true "$work/kv-relay@ci.service" 2>&1) || true
grep '✗' <<<"$sec" || true
score=$(sed -n 's/.*Overall exposure level for .*: \([0-9][0-9.]*\).*/\1/p' <<<"$sec" | tail -n1)
if [ -z "$score" ]; then
    echo "$sec"
    echo "FAIL: no exposure level in systemd-analyze security's output" >&2
    exit 1
fi
echo "security: exposure $score (must be <= $max_exposure)"
if awk -v s="$score" -v m="$max_exposure" 'BEGIN { exit !(s > m) }'; then
    echo "FAIL: systemd-analyze security rates $unit $score, above $max_exposure" >&2
    exit 1
fi
echo "check-systemd: ok"
