#!/usr/bin/env bash
# The whole product against real engines, as a fleet runs it, on one host (opt-in, outside CI;
# docs/real-engine.md says what it shows):
#   - vLLM engine A with --data-parallel-size 2 and engine B with one rank (CPU build, tiny
#     random-weight Llama), both with prefix caching, KV events with a replay endpoint and
#     --enable-prompt-tokens-details;
#   - a kv-relay for each (own state directory and ports, as if on two hosts), one kv-router
#     following both, and an independent ZeroMQ recorder (scripts/live-vllm/record.py, one SUB
#     per rank) started before any traffic;
#   - seeded token-id prompts in families sharing prefixes, each routed by kv-router's
#     POST /match and sent to the chosen engine (and rank) with max_tokens 1; then text prompts
#     and chat conversations through kv-router's OpenAI front, which tokenizes them with the
#     model's own tokenizer and chat template (the tiny model's BPE, router/tests/data/tokenize/
#     tiny, made on this machine by scripts/tokenizer/make.sh), as the engines do
#     (scripts/live-vllm/drive.py, which also makes every comparison).
# Checks, exiting 1 on any difference: (a) each relay's live blocks == the recorder's; (b) per
# request, the router's predicted blocks x block size == vLLM's cached_tokens; (c) hit rates of
# routed, round-robin and oracle traffic (routed may not lose to round-robin); (d) (a) and (b)
# again after kill -9 of each relay mid-request and a restart; (e) through the front: the router's
# tokens == vLLM's /tokenize, prediction == cached_tokens, hit rate against the oracle, and the
# front's added latency. Exit 2: it could not run.
#
# It installs what it needs: scripts/real-engine/install.sh puts vLLM 0.32 (CPU) and the model
# into LIVE_VLLM_ENGINE_DIR (default: ../real-engine beside the checkout; ~6 GB, ~5 minutes the
# first time), and cargo builds the release binaries. Run as root, the fleet runs in a network
# namespace of its own with loopback only, so every socket is on 127.0.0.1 (ports
# LIVE_VLLM_PORT_BASE, 18100, to +60); otherwise the engines' KV-event PUB sockets bind every
# interface (vLLM binds them only for tcp://*:PORT). Every process it starts is stopped on exit
# (trap). Logs and the recorder's capture stay in the run directory it prints when the run fails
# (or with LIVE_VLLM_KEEP=1); LIVE_VLLM_HOLD=1 keeps the fleet up after the checks.
#
# Settings (environment): LIVE_VLLM_SEED (29) and LIVE_VLLM_REQUESTS (36 per phase) for the
# prompts; LIVE_VLLM_HASH_SEED (0: the engines' PYTHONHASHSEED); LIVE_VLLM_BLOCKS (24 KV blocks
# per rank: small, so blocks are evicted); LIVE_VLLM_TIMEOUT (900 s for the traffic and checks).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
ENGINE_DIR=${LIVE_VLLM_ENGINE_DIR:-$(dirname "$repo")/real-engine}
BASE=${LIVE_VLLM_PORT_BASE:-18100}
SEED=${LIVE_VLLM_SEED:-29}
REQUESTS=${LIVE_VLLM_REQUESTS:-36}
HASH_SEED=${LIVE_VLLM_HASH_SEED:-0}
BLOCKS=${LIVE_VLLM_BLOCKS:-24}
TIMEOUT=${LIVE_VLLM_TIMEOUT:-900}
BS=32                 # the CPU backend needs a multiple of 32
VLLM_VERSION=0.32.0   # what scripts/real-engine/install.sh installs
HASH_ALGO=sha256      # vLLM's default --prefix-caching-hash-algo, named explicitly

A_HTTP=$BASE B_HTTP=$((BASE + 1))
A_PUB=$((BASE + 10)) A_REPLAY=$((BASE + 20))     # rank r at port + r
B_PUB=$((BASE + 30)) B_REPLAY=$((BASE + 40))
A_DP_RPC=$((BASE + 45))
RELAY_A=$((BASE + 50)) RELAY_A_METRICS=$((BASE + 51))
RELAY_B=$((BASE + 52)) RELAY_B_METRICS=$((BASE + 53))
ROUTER=$((BASE + 60))

say() { printf '==> %s\n' "$*"; }
die() { printf 'live-vllm: %s\n' "$*" >&2; exit 2; }

if [ "${LIVE_VLLM_STAGE:-}" != fleet ]; then
  # Stage 1, in the host's network: install and build (they need the package registries).
  say "engine: $ENGINE_DIR (scripts/real-engine/install.sh)"
  bash "$repo/scripts/real-engine/install.sh" "$ENGINE_DIR"
  say "relay binaries (cargo build --release)"
  (cd "$repo" && cargo build -q --release --locked -p kv-relay -p kv-router --bins)
  # Stage 2, the fleet, in a network namespace of its own whose only interface is loopback:
  # vLLM 0.32 binds its KV-event PUB socket only for an endpoint with `*` (tcp://*:PORT, every
  # interface; with a host address it connects instead, to a collector that binds), so this is
  # what keeps every socket on 127.0.0.1, and no port can collide with another program's.
  if [ "$(id -u)" = 0 ] && command -v unshare >/dev/null && command -v ip >/dev/null \
    && unshare -n true 2>/dev/null; then
    LIVE_VLLM_STAGE=fleet LIVE_VLLM_NETNS=1 exec unshare -n -- bash "$0" "$@"
  fi
  say "no network namespace (needs root, unshare and ip): the engines' PUB sockets bind every interface (tcp://*:PORT)"
  export LIVE_VLLM_STAGE=fleet LIVE_VLLM_NETNS=0
fi
if [ "${LIVE_VLLM_NETNS:-0}" = 1 ]; then
  ip link set lo up || die "cannot bring up loopback in the network namespace"
  say "in a network namespace of its own (loopback only)"
fi

RUN=$(mktemp -d "${TMPDIR:-/tmp}/live-vllm.XXXXXX")
keep=${LIVE_VLLM_KEEP:-0}

# Every process started here runs in a process group of its own (setsid; timeout makes its own),
# its pid in RUN/*.pid, so the trap can stop it and all its children (vLLM's engine cores) by
# process group: SIGTERM, then SIGKILL to whatever is left after 20 s.
signal_group() { kill "$1" -- "-$2" 2>/dev/null || kill "$1" "$2" 2>/dev/null; }
cleanup() {
  local rc=$? pids=() f pid alive
  trap - EXIT INT TERM
  for f in "$RUN"/*.pid; do
    [ -f "$f" ] || continue
    pid=$(cat "$f")
    if signal_group -0 "$pid"; then pids+=("$pid"); signal_group -TERM "$pid"; fi
  done
  for _ in $(seq 1 100); do
    alive=0
    for pid in "${pids[@]}"; do signal_group -0 "$pid" && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 0.2
  done
  for pid in "${pids[@]}"; do signal_group -KILL "$pid" || true; done
  [ "${#pids[@]}" -gt 0 ] && say "stopped ${#pids[@]} process groups (engines, relays, router, recorder, driver)"
  if [ "$rc" -ne 0 ] || [ "$keep" = 1 ]; then
    say "logs and the recorder's capture: $RUN"
  else
    rm -rf "$RUN"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

start() { # NAME COMMAND...: in its own session, output to RUN/NAME.log
  local name=$1; shift
  setsid "$@" >"$RUN/$name.log" 2>&1 < /dev/null &
  echo $! >"$RUN/$name.pid"
  disown $!  # the trap stops it; bash need not report it (the driver kills relays on purpose)
}

alive_or_die() { # NAME
  local pid; pid=$(cat "$RUN/$1.pid")
  kill -0 "$pid" 2>/dev/null || { tail -n 30 "$RUN/$1.log" >&2; die "$1 exited (log above: $RUN/$1.log)"; }
}

wait_http() { # NAME URL SECONDS
  local end=$((SECONDS + $3))
  until curl -sf -o /dev/null "$2"; do
    alive_or_die "$1"
    [ "$SECONDS" -lt "$end" ] || die "$1 did not answer $2 within $3 s (log: $RUN/$1.log)"
    sleep 1
  done
}

PY=$ENGINE_DIR/vllmenv/bin/python
MODEL=$ENGINE_DIR/tiny-llama
[ -x "$PY" ] && [ -f "$MODEL/config.json" ] || die "no engine in $ENGINE_DIR"
# The model's tokenizer and chat template (the engines and the router read the same files).
cp "$repo"/router/tests/data/tokenize/tiny/* "$MODEL/" || die "cannot give $MODEL its tokenizer"
BIN=${CARGO_TARGET_DIR:-$repo/target}/release
for b in kv-relay relayctl kv-router; do [ -x "$BIN/$b" ] || die "no $BIN/$b after the build"; done
command -v curl >/dev/null || die "curl is needed"

for p in $A_HTTP $B_HTTP $A_PUB $((A_PUB + 1)) $A_REPLAY $((A_REPLAY + 1)) $B_PUB $B_REPLAY $A_DP_RPC \
  $RELAY_A $RELAY_A_METRICS $RELAY_B $RELAY_B_METRICS $ROUTER; do
  "$PY" -c 'import socket,sys; s=socket.socket(); s.bind(("127.0.0.1", int(sys.argv[1])))' "$p" 2>/dev/null \
    || die "port $p on 127.0.0.1 is taken (set LIVE_VLLM_PORT_BASE)"
done
say "run directory $RUN; ports $BASE-$ROUTER on 127.0.0.1"

# The recorder first: it must see every batch from the engines' first.
start recorder "$PY" "$repo/scripts/live-vllm/record.py" "$RUN/recorded.jsonl" \
  "A:0:tcp://127.0.0.1:$A_PUB" "A:1:tcp://127.0.0.1:$((A_PUB + 1))" "B:0:tcp://127.0.0.1:$B_PUB"
for _ in $(seq 1 300); do [ -f "$RUN/recorded.jsonl.ready" ] && break; alive_or_die recorder; sleep 0.2; done
[ -f "$RUN/recorded.jsonl.ready" ] || die "the recorder did not start"

engine_env=(env VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind VLLM_CPU_NUM_OF_RESERVED_CPU=0
  OMP_NUM_THREADS=1 VLLM_SERVER_DEV_MODE=1 PYTHONHASHSEED="$HASH_SEED" VLLM_LOGGING_LEVEL=WARNING)
engine() { # NAME HTTP_PORT PUB REPLAY EXTRA...
  local name=$1 port=$2 pub=$3 replay=$4; shift 4
  start "$name" "${engine_env[@]}" "$PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" \
    --served-model-name tiny-llama --host 127.0.0.1 --port "$port" \
    --enable-prefix-caching --prefix-caching-hash-algo "$HASH_ALGO" --block-size "$BS" \
    --max-model-len 512 --dtype bfloat16 --enforce-eager --num-gpu-blocks-override "$BLOCKS" \
    --max-num-seqs 4 --seed 0 --enable-prompt-tokens-details \
    --kv-events-config "{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:$pub\", \"replay_endpoint\": \"tcp://127.0.0.1:$replay\", \"topic\": \"kv\"}" \
    "$@"
}
say "starting vLLM engine A (2 DP ranks, http $A_HTTP) and engine B (1 rank, http $B_HTTP)"
engine engine-a "$A_HTTP" "$A_PUB" "$A_REPLAY" --data-parallel-size 2 \
  --data-parallel-address 127.0.0.1 --data-parallel-rpc-port "$A_DP_RPC"
engine engine-b "$B_HTTP" "$B_PUB" "$B_REPLAY"
wait_http engine-b "http://127.0.0.1:$B_HTTP/health" 600
wait_http engine-a "http://127.0.0.1:$A_HTTP/health" 600
say "engines up after ${SECONDS} s"

relay_launch() { # NAME PUB REPLAY DP HTTP LISTEN METRICS
  cat >"$RUN/relay-$1.sh" <<EOF
exec "$BIN/kv-relay" --endpoint tcp://127.0.0.1:$2 --replay-endpoint tcp://127.0.0.1:$3 --dp-size $4 \\
  --topic kv --engine-metrics-url http://127.0.0.1:$5/metrics --engine-url http://127.0.0.1:$5 \
  --state-dir "$RUN/relay-$1-state" \\
  --listen 127.0.0.1:$6 --metrics-listen 127.0.0.1:$7 --hash-check --hash-engine vllm \\
  --hash-engine-version $VLLM_VERSION --hash-algo $HASH_ALGO --hash-seed $HASH_SEED
EOF
  start "relay-$1" bash "$RUN/relay-$1.sh"
}
relay_launch a "$A_PUB" "$A_REPLAY" 2 "$A_HTTP" "$RELAY_A" "$RELAY_A_METRICS"
relay_launch b "$B_PUB" "$B_REPLAY" 1 "$B_HTTP" "$RELAY_B" "$RELAY_B_METRICS"
start router "$BIN/kv-router" --relay "http://127.0.0.1:$RELAY_A" --relay "http://127.0.0.1:$RELAY_B" \
  --listen "127.0.0.1:$ROUTER" --model-dir "$MODEL" \
  --engine-hash "{\"engine\": \"vllm\", \"version\": \"$VLLM_VERSION\", \"algo\": \"$HASH_ALGO\", \"block_size\": $BS, \"python_hash_seed\": \"$HASH_SEED\"}"
wait_http relay-a "http://127.0.0.1:$RELAY_A_METRICS/metrics" 60
wait_http relay-b "http://127.0.0.1:$RELAY_B_METRICS/metrics" 60
wait_http router "http://127.0.0.1:$ROUTER/workers" 60
say "relays and router up: kv-router on http://127.0.0.1:$ROUTER following relays :$RELAY_A (A) and :$RELAY_B (B)"

drive=("${engine_env[@]}" "$PY" "$repo/scripts/live-vllm/drive.py" \
  --router "http://127.0.0.1:$ROUTER" --relayctl "$BIN/relayctl" \
  --relay-a "http://127.0.0.1:$RELAY_A" --relay-b "http://127.0.0.1:$RELAY_B" \
  --engine-a "http://127.0.0.1:$A_HTTP" --engine-b "http://127.0.0.1:$B_HTTP" \
  --relay-a-launch "$RUN/relay-a.sh" --relay-b-launch "$RUN/relay-b.sh" \
  --relay-a-pid "$RUN/relay-a.pid" --relay-b-pid "$RUN/relay-b.pid" \
  --relay-a-log "$RUN/relay-a.log" --relay-b-log "$RUN/relay-b.log" \
  --record "$RUN/recorded.jsonl" --model-name tiny-llama --vllm-version "$VLLM_VERSION" \
  --block-size "$BS" --hash-algo "$HASH_ALGO" --hash-seed "$HASH_SEED" \
  --seed "$SEED" --requests "$REQUESTS" --corpus "$repo/router/tests/data/tokenize/corpus.md")
# In the background, so that a signal to this script runs the trap at once (bash runs traps only
# between foreground commands); the driver is stopped with the rest.
timeout -k 10 "$TIMEOUT" "${drive[@]}" &
echo $! >"$RUN/drive.pid"
rc=0
wait "$(cat "$RUN/drive.pid")" || rc=$?
rm -f "$RUN/drive.pid"
[ "$rc" -eq 124 ] && die "the traffic and checks did not finish within $TIMEOUT s"
if [ "${LIVE_VLLM_HOLD:-0}" = 1 ]; then
  printf '%q ' "${drive[@]}" >"$RUN/drive.sh"
  say "LIVE_VLLM_HOLD=1: the fleet keeps running until this script is interrupted (driver: $RUN/drive.sh; pid $$ for nsenter -t $$ -n)"
  setsid sleep infinity &
  echo $! >"$RUN/hold.pid"
  wait "$(cat "$RUN/hold.pid")" || true
fi
exit "$rc"
