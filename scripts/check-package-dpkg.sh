#!/usr/bin/env bash
# Usage: scripts/check-package-dpkg.sh KV_RELAY_DEB WORKDIR   (run by scripts/check-package.sh)
#
# Installs, upgrades, removes and purges the kv-relay package with dpkg into a scratch root
# (WORKDIR/root, its own dpkg database; the maintainer scripts run without chroot), and checks
# what the maintainer scripts do and what they leave:
#   install  systemd reloads, nothing starts;
#   upgrade  (the same package as version <v>-1+upgrade) systemd reloads and the running
#            instances restart: `systemctl try-restart kv-relay@*.service`; an operator's edit of
#            the conffile and their own instance file are kept; a store the relay made before is
#            the same, file for file and byte for byte, and the relay opens it again with the
#            same epoch;
#   remove   the instances stop, systemd reloads; the store and the conffile stay;
#   purge    the conffile goes; the instance file and the store stay.
#
# It runs in a private mount namespace (unshare, root) with a tmpfs on /run holding
# /run/systemd/system, so the scripts see a running systemd, and with a `systemctl` first in PATH
# that logs its arguments instead of acting. The host's /run, dpkg database and systemd are not
# touched.
set -euo pipefail
[ $# = 2 ] || { echo "usage: $0 KV_RELAY_DEB WORKDIR" >&2; exit 2; }

fail() {
    echo "FAIL: check-package-dpkg: $*" >&2
    exit 1
}
same() {
    if ! diff -u --label expected --label got <(printf '%s\n' "$1") <(printf '%s\n' "$2"); then
        fail "$3"
    fi
}

if [ "${KV_RELAY_PACKAGE_NS:-}" != 1 ]; then
    [ "$(id -u)" = 0 ] || fail "needs root (a mount namespace and dpkg)"
    command -v unshare >/dev/null || fail "needs unshare (util-linux)"
    exec unshare --mount --propagation private env KV_RELAY_PACKAGE_NS=1 "$0" "$@"
fi

deb=$(realpath "$1")
work=$2
mkdir -p "$work"
work=$(realpath "$work")
mount -t tmpfs tmpfs /run
mkdir -p /run/systemd/system

root="$work/root"
mkdir -p "$root/var/lib/dpkg/info" "$root/var/lib/dpkg/updates"
: >"$root/var/lib/dpkg/status"
stub="$work/stub"
mkdir -p "$stub"
log="$work/systemctl.log"
printf '#!/bin/sh\necho "$*" >>%s\n' "$log" >"$stub/systemctl"
chmod 0755 "$stub/systemctl"

# dpkg into the scratch root; the package's Depends (libc6, ...) are the host's, not in its
# database.
pkg() {
    : >"$log"
    PATH="$stub:$PATH" dpkg --root="$root" --log="$work/dpkg.log" --force-script-chrootless \
        --force-depends --force-confdef --force-confold "$@" >"$work/dpkg.out" 2>&1 || {
        cat "$work/dpkg.out"
        fail "dpkg $*"
    }
}
calls() { cat "$log"; }

store="$root/var/lib/private/kv-relay/engine-a"
digest() { (cd "$store" && find . -type f -print0 | sort -z | xargs -0 sha256sum); }

# Runs the installed relay on the store until it is ready; prints its epoch and incarnation.
relay_epoch() {
    local port pid status
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    env -i PATH="$PATH" "$root/usr/bin/kv-relay" --config "$root/etc/kv-relay/engine-a.toml" \
        --state-dir "$store" --listen "127.0.0.1:$port" --metrics-listen off \
        >"$work/relay.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 100); do
        if status=$("$root/usr/bin/relayctl" --relay "127.0.0.1:$port" status --json 2>/dev/null); then
            break
        fi
        kill -0 "$pid" 2>/dev/null || { cat "$work/relay.log"; fail "the installed kv-relay exited at start"; }
        sleep 0.1
    done
    kill -TERM "$pid"
    wait "$pid" || { cat "$work/relay.log"; fail "the installed kv-relay did not stop cleanly on SIGTERM"; }
    [ -n "${status:-}" ] || { cat "$work/relay.log"; fail "the installed kv-relay never answered status"; }
    python3 -c 'import json,sys; s=json.load(sys.stdin); print(s["epoch"], s["incarnation"])' <<<"$status"
}

echo "-- install $(basename "$deb")"
pkg --install "$deb"
same "daemon-reload" "$(calls)" "systemctl calls on install"
[ -x "$root/usr/bin/kv-relay" ] || fail "install left no /usr/bin/kv-relay"

# An operator's instance: its own file, an edit of the conffile, and a store the relay made.
cp "$root/etc/kv-relay/default.toml" "$root/etc/kv-relay/engine-a.toml"
echo '# edited by the operator' >>"$root/etc/kv-relay/default.toml"
edited=$(sha256sum <"$root/etc/kv-relay/default.toml")
opened=$(relay_epoch)
read -r epoch incarnation <<<"$opened"
echo "store made: epoch $epoch, incarnation $incarnation"
before=$(digest)
[ -n "$before" ] || fail "the relay left no files in $store"

echo "-- upgrade"
version=$(dpkg-deb -f "$deb" Version)
dpkg-deb -R "$deb" "$work/next"
sed -i "s/^Version: .*/Version: ${version}+upgrade/" "$work/next/DEBIAN/control"
dpkg-deb --build --root-owner-group "$work/next" "$work/next.deb" >/dev/null
pkg --install "$work/next.deb"
same "daemon-reload
try-restart kv-relay@*.service" "$(calls)" "systemctl calls on upgrade"
same "${version}+upgrade" "$(dpkg-query --admindir="$root/var/lib/dpkg" -W -f '${Version}' kv-relay)" "installed version"
same "$edited" "$(sha256sum <"$root/etc/kv-relay/default.toml")" "the operator's edit of default.toml after the upgrade"
[ -f "$root/etc/kv-relay/engine-a.toml" ] || fail "the upgrade removed /etc/kv-relay/engine-a.toml"
same "$before" "$(digest)" "the store after the upgrade"
opened=$(relay_epoch)
read -r epoch2 incarnation2 <<<"$opened"
same "$epoch $((incarnation + 1))" "$epoch2 $incarnation2" "epoch and incarnation of the store reopened after the upgrade"
echo "store kept: epoch $epoch2, incarnation $incarnation2"
before=$(digest)

echo "-- remove"
pkg --remove kv-relay
same "stop kv-relay@*.service
daemon-reload" "$(calls)" "systemctl calls on remove"
[ ! -e "$root/usr/bin/kv-relay" ] || fail "remove left /usr/bin/kv-relay"
[ -f "$root/etc/kv-relay/default.toml" ] || fail "remove took the conffile (only purge should)"
same "$before" "$(digest)" "the store after remove"

echo "-- purge"
pkg --purge kv-relay
same "daemon-reload" "$(calls)" "systemctl calls on purge"
[ ! -e "$root/etc/kv-relay/default.toml" ] || fail "purge left the conffile"
[ -f "$root/etc/kv-relay/engine-a.toml" ] || fail "purge removed the operator's /etc/kv-relay/engine-a.toml"
same "$before" "$(digest)" "the store after purge"
echo "dpkg: ok"
