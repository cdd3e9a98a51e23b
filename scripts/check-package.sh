#!/usr/bin/env bash
# Usage: scripts/check-package.sh [--quick]
#
# Builds the Debian packages (scripts/package.sh, passing --quick on: CI packages the debug build)
# and checks them as an operator would get them:
#   1. contents: each package's files and directories, with their modes, equal the expected
#      list exactly; the kv-relay package's conffile is /etc/kv-relay/default.toml and its
#      maintainer scripts are relay/debian/'s;
#   2. extracted into a scratch root (dpkg-deb -x): `kv-relay --version`, `relayctl --help` and
#      `kv-router --version` run and print what they should; the installed config is one the
#      daemon accepts (`kv-relay --config .../default.toml check-config`, output compared whole);
#      the man pages render and the bash completions load;
#   3. the installed unit: scripts/check-systemd.sh on it (systemd-analyze verify, security
#      exposure at most 2.0), its ExecStart pointed at the extracted kv-relay;
#   4. install, upgrade, remove and purge with dpkg into a scratch root, in a private mount
#      namespace where systemd looks running and `systemctl` is a stub that logs its arguments:
#      an upgrade reloads systemd and try-restarts the instances; a relay's store made before
#      the upgrade is byte for byte the same after it, after removal and after purge, and the
#      extracted relay opens it again with the same epoch.
set -euo pipefail
cd "$(dirname "$0")/.."

quick=()
case "${1:-}" in
    "") ;;
    --quick) quick=(--quick) ;;
    *) echo "usage: $0 [--quick]" >&2; exit 2 ;;
esac

fail() {
    echo "FAIL: check-package: $*" >&2
    exit 1
}

# Compares two texts; on a difference prints it and fails with $3.
same() {
    if ! diff -u --label expected --label got <(printf '%s\n' "$1") <(printf '%s\n' "$2"); then
        fail "$3"
    fi
}

./scripts/package.sh "${quick[@]}"
if [ ${#quick[@]} = 1 ]; then dir=target/debian-quick; else dir=target/debian; fi
version=$(cargo metadata --no-deps --format-version 1 --locked |
    python3 -c 'import json,sys; print(next(p["version"] for p in json.load(sys.stdin)["packages"] if p["name"]=="kv-relay"))')
arch=$(dpkg --print-architecture)
relay_deb="$dir/kv-relay_${version}-1_${arch}.deb"
router_deb="$dir/kv-router_${version}-1_${arch}.deb"
for deb in "$relay_deb" "$router_deb"; do [ -f "$deb" ] || fail "no $deb"; done

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# --- 1. Contents ---------------------------------------------------------------------------------
echo "== contents of $relay_deb"
# `dpkg-deb -c` lines are "mode uid/gid size date time path": mode, owner and path are kept.
contents() { dpkg-deb -c "$1" | awk '{print $1, $2, $6}'; }
docs=$(for f in docs/*.md; do echo "-rw-r--r-- 0/0 ./usr/share/doc/kv-relay/docs/${f#docs/}"; done)
expected_relay="drwxr-xr-x 0/0 ./etc/
drwxr-xr-x 0/0 ./etc/kv-relay/
-rw-r--r-- 0/0 ./etc/kv-relay/default.toml
drwxr-xr-x 0/0 ./usr/
drwxr-xr-x 0/0 ./usr/bin/
-rwxr-xr-x 0/0 ./usr/bin/kv-relay
-rwxr-xr-x 0/0 ./usr/bin/relayctl
drwxr-xr-x 0/0 ./usr/lib/
drwxr-xr-x 0/0 ./usr/lib/systemd/
drwxr-xr-x 0/0 ./usr/lib/systemd/system/
-rw-r--r-- 0/0 ./usr/lib/systemd/system/kv-relay@.service
drwxr-xr-x 0/0 ./usr/share/
drwxr-xr-x 0/0 ./usr/share/bash-completion/
drwxr-xr-x 0/0 ./usr/share/bash-completion/completions/
-rw-r--r-- 0/0 ./usr/share/bash-completion/completions/kv-relay
-rw-r--r-- 0/0 ./usr/share/bash-completion/completions/relayctl
drwxr-xr-x 0/0 ./usr/share/doc/
drwxr-xr-x 0/0 ./usr/share/doc/kv-relay/
-rw-r--r-- 0/0 ./usr/share/doc/kv-relay/README.md
-rw-r--r-- 0/0 ./usr/share/doc/kv-relay/copyright
drwxr-xr-x 0/0 ./usr/share/doc/kv-relay/docs/
$docs
drwxr-xr-x 0/0 ./usr/share/doc/kv-relay/examples/
-rw-r--r-- 0/0 ./usr/share/doc/kv-relay/examples/kv-relay-alerts.yaml
-rw-r--r-- 0/0 ./usr/share/doc/kv-relay/examples/kv-relay-dashboard.json
-rw-r--r-- 0/0 ./usr/share/doc/kv-relay/examples/kv-relay.env
-rw-r--r-- 0/0 ./usr/share/doc/kv-relay/examples/vllm-with-kv-relay.yaml
drwxr-xr-x 0/0 ./usr/share/fish/
drwxr-xr-x 0/0 ./usr/share/fish/vendor_completions.d/
-rw-r--r-- 0/0 ./usr/share/fish/vendor_completions.d/kv-relay.fish
-rw-r--r-- 0/0 ./usr/share/fish/vendor_completions.d/relayctl.fish
drwxr-xr-x 0/0 ./usr/share/man/
drwxr-xr-x 0/0 ./usr/share/man/man1/
-rw-r--r-- 0/0 ./usr/share/man/man1/kv-relay-check-config.1.gz
-rw-r--r-- 0/0 ./usr/share/man/man1/kv-relay.1.gz
-rw-r--r-- 0/0 ./usr/share/man/man1/relayctl-decode.1.gz
-rw-r--r-- 0/0 ./usr/share/man/man1/relayctl-history.1.gz
-rw-r--r-- 0/0 ./usr/share/man/man1/relayctl-snapshot.1.gz
-rw-r--r-- 0/0 ./usr/share/man/man1/relayctl-status.1.gz
-rw-r--r-- 0/0 ./usr/share/man/man1/relayctl.1.gz
drwxr-xr-x 0/0 ./usr/share/zsh/
drwxr-xr-x 0/0 ./usr/share/zsh/vendor-completions/
-rw-r--r-- 0/0 ./usr/share/zsh/vendor-completions/_kv-relay
-rw-r--r-- 0/0 ./usr/share/zsh/vendor-completions/_relayctl"
same "$(sort <<<"$expected_relay")" "$(contents "$relay_deb" | sort)" "$relay_deb: contents differ"

echo "== contents of $router_deb"
expected_router="drwxr-xr-x 0/0 ./usr/
drwxr-xr-x 0/0 ./usr/bin/
-rwxr-xr-x 0/0 ./usr/bin/kv-router
drwxr-xr-x 0/0 ./usr/share/
drwxr-xr-x 0/0 ./usr/share/bash-completion/
drwxr-xr-x 0/0 ./usr/share/bash-completion/completions/
-rw-r--r-- 0/0 ./usr/share/bash-completion/completions/kv-router
drwxr-xr-x 0/0 ./usr/share/doc/
drwxr-xr-x 0/0 ./usr/share/doc/kv-router/
-rw-r--r-- 0/0 ./usr/share/doc/kv-router/copyright
-rw-r--r-- 0/0 ./usr/share/doc/kv-router/router-client.md
drwxr-xr-x 0/0 ./usr/share/fish/
drwxr-xr-x 0/0 ./usr/share/fish/vendor_completions.d/
-rw-r--r-- 0/0 ./usr/share/fish/vendor_completions.d/kv-router.fish
drwxr-xr-x 0/0 ./usr/share/man/
drwxr-xr-x 0/0 ./usr/share/man/man1/
-rw-r--r-- 0/0 ./usr/share/man/man1/kv-router.1.gz
drwxr-xr-x 0/0 ./usr/share/zsh/
drwxr-xr-x 0/0 ./usr/share/zsh/vendor-completions/
-rw-r--r-- 0/0 ./usr/share/zsh/vendor-completions/_kv-router"
same "$(sort <<<"$expected_router")" "$(contents "$router_deb" | sort)" "$router_deb: contents differ"

echo "== control of the packages"
same "kv-relay" "$(dpkg-deb -f "$relay_deb" Package)" "Package of $relay_deb"
same "${version}-1" "$(dpkg-deb -f "$relay_deb" Version)" "Version of $relay_deb"
same "kv-router" "$(dpkg-deb -f "$router_deb" Package)" "Package of $router_deb"
same "/etc/kv-relay/default.toml" "$(dpkg-deb -I "$relay_deb" conffiles)" "conffiles of $relay_deb"
same "" "$(dpkg-deb -I "$router_deb" conffiles 2>/dev/null || true)" "conffiles of $router_deb"
for script in postinst prerm postrm; do
    same "$(cat "relay/debian/$script")" "$(dpkg-deb -I "$relay_deb" "$script")" "$script of $relay_deb"
done
for deb in "$relay_deb" "$router_deb"; do
    depends=$(dpkg-deb -f "$deb" Depends)
    grep -q '^libc6 (>= 2\.[0-9]*)' <<<"$depends" || fail "$deb depends on '$depends', not on libc6 first"
    echo "$(basename "$deb"): Depends: $depends"
done
echo "contents: ok"

# --- 2. Extracted --------------------------------------------------------------------------------
root="$work/root"
dpkg-deb -x "$relay_deb" "$root"
dpkg-deb -x "$router_deb" "$root"
echo "== extracted into $root"

same "kv-relay $version" "$("$root/usr/bin/kv-relay" --version)" "kv-relay --version"
same "kv-router $version" "$("$root/usr/bin/kv-router" --version)" "kv-router --version"
help=$("$root/usr/bin/relayctl" --help) || fail "relayctl --help exited non-zero"
same "Inspect a kv-relay, or decode an engine's KV-event wire

Usage: relayctl [OPTIONS] <COMMAND>

Commands:
  status    The relay at a glance: epoch, engine, ranks and their state, cursors, history, counters
  history   Committed batches and rank events (default: the newest 20)
  snapshot  The live blocks, summarized per rank, tier and group
  decode    Decode a capture file (JSON Lines of recorded ZeroMQ messages) and print every batch
  help      Print this message or the help of the given subcommand(s)" "$(sed -n '1,/^  help/p' <<<"$help")" "relayctl --help"
echo "binaries: ok"

# The installed config, as the unit runs it (StateDirectory= sets STATE_DIRECTORY), with no
# KV_RELAY_* from this environment.
effective=$(env -i PATH="$PATH" STATE_DIRECTORY=/var/lib/kv-relay/default \
    "$root/usr/bin/kv-relay" --config "$root/etc/kv-relay/default.toml" check-config) ||
    fail "kv-relay check-config refused the installed /etc/kv-relay/default.toml"
expected_config=$(cat <<'EOF'
# kv-relay: effective configuration (flags > environment > file > defaults)
endpoint = "tcp://127.0.0.1:5557"
replay_endpoint = "tcp://127.0.0.1:5567"
dp_ranks = [0]
topic = ""
# engine_metrics_url: not set (no engine load)
# engine_url: not set (routers learn no engine URL)
engine_health_url = "off" # the engine's liveness is not watched
load_poll_ms = 250
heartbeat_ms = 1000
state_dir = "/var/lib/kv-relay/default"
history_batches = 10000
history_bytes = 268435456
store_cache_bytes = 67108864
listen = "127.0.0.1:50051"
metrics_listen = "127.0.0.1:9464"
queue = 256
replay_timeout_ms = 2000
tail_probe_ms = 3000
max_message_bytes = 16777216
log_format = "text"
hash_check = false

[server]
# tls_cert: not set (plaintext)
# tls_key: not set (plaintext)
# tls_client_ca: not set (no client certificates required)
# token_file: not set (no bearer token required)
rate_per_second = 10
rate_burst = 20
max_subscribers = 256
max_snapshots = 8
threads = 1
EOF
)
same "$expected_config" "$effective" "check-config of the installed /etc/kv-relay/default.toml"
echo "installed config: ok (check-config accepts it)"

if ! command -v man >/dev/null 2>&1; then
    # shellcheck source=scripts/apt-install.sh
    . scripts/apt-install.sh
    apt_install man-db || fail "man is missing and $apt_why"
fi
for page in kv-relay relayctl relayctl-status kv-router; do
    name=$(MANWIDTH=200 man -l "$root/usr/share/man/man1/$page.1.gz" 2>"$work/man.err" | sed -n '/^NAME/{n;p;q}' | sed 's/^ *//')
    [ ! -s "$work/man.err" ] || { cat "$work/man.err"; fail "man $page: warnings"; }
    case "$page" in
        kv-relay) want="kv-relay - Relays an inference engine's KV-cache events to KV-aware routers, losslessly" ;;
        relayctl) want="relayctl - Inspect a kv-relay, or decode an engine's KV-event wire" ;;
        relayctl-status) want="relayctl-status - The relay at a glance: epoch, engine, ranks and their state, cursors, history, counters" ;;
        kv-router) want="kv-router - Follows kv-relays and answers \"which worker holds this request's prefix\" over HTTP" ;;
    esac
    same "$want" "$name" "NAME of man page $page"
done
echo "man pages: ok"

# Each loads and completes: the function it registers, then what it offers for a prefix.
completes() { # COMMAND WORD -> "complete -p" line, then the completions of WORD after COMMAND
    bash -c '. "$1" && complete -p "$2" && fn=$(complete -p "$2" | sed "s/.* -F \([^ ]*\) .*/\1/") &&
        COMP_WORDS=("$2" "$3") && COMP_CWORD=1 && "$fn" "$2" "$3" "$2" && echo "${COMPREPLY[*]}"' \
        _ "$root/usr/share/bash-completion/completions/$1" "$1" "$2"
}
same "complete -o bashdefault -o default -o nosort -F _kv__relay kv-relay
--hash-seed --hash-sample" "$(completes kv-relay --hash-s)" "bash completion of kv-relay"
same "complete -o bashdefault -o default -o nosort -F _relayctl relayctl
status snapshot" "$(completes relayctl s)" "bash completion of relayctl"
same "complete -o bashdefault -o default -o nosort -F _kv__router kv-router
--relay --relays-file --relays-dns --relay-token --relay-ca" "$(completes kv-router --relay)" "bash completion of kv-router"
echo "bash completions: ok"

# --- 3. The installed unit -----------------------------------------------------------------------
echo "== the installed unit"
KV_RELAY_REQUIRE_SYSTEMD=1 KV_RELAY_BIN="$root/usr/bin/kv-relay" \
    ./scripts/check-systemd.sh "$root/usr/lib/systemd/system/kv-relay@.service"

# --- 4. Install, upgrade, remove, purge ----------------------------------------------------------
echo "== dpkg: install, upgrade, remove, purge (scratch root, stub systemctl)"
./scripts/check-package-dpkg.sh "$relay_deb" "$work/dpkg"

echo "check-package: ok"
