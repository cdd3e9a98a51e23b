"""The traffic and the checks of scripts/live-vllm.sh (run with the vLLM venv's python).

The fleet is already running when this starts: engines A (2 DP ranks) and B (1 rank), a kv-relay
for each, one kv-router following both, and record.py writing what the engines publish. This
sends seeded token-id prompts through four phases and compares:

  (a) each relay's live blocks (relayctl snapshot --blocks --json) with the recorder's, copy for
      copy, after every phase;
  (b) per request: the blocks kv-router predicted on the chosen worker, capped by vLLM's rule
      (below), times the block size, with usage.prompt_tokens_details.cached_tokens; and the
      router's matched blocks for every worker with the recorder's (computed with vLLM's own
      block-hash code from the recorder's live blocks);
  (c) the hit rate (cached / prompt tokens) of routed traffic, round-robin and the oracle (each
      request to the worker whose live blocks, as recorded, hold most of its prefix);
  (d) (a) and (b) again after kill -9 of each relay in turn, mid-request, and a restart;
  (e) text prompts and chat conversations sent through kv-router's OpenAI front (the engines
      tokenize them with the tiny model's tokenizer and apply its chat template): per request,
      the router's tokens (its POST /tokenize) == vLLM's (POST /tokenize), the router's
      prediction (x-kv-router-matched-blocks, capped by vLLM's rule) == cached_tokens, the
      hit rate against the oracle (the best cached prefix any worker held, as recorded, when the
      request was sent), and the front's added latency against the same request sent to the
      same engine directly.

vLLM's rule for cached_tokens (vllm/v1/core/kv_cache_manager.py, get_computed_blocks): a hit is
looked up over at most `num_tokens - 1` tokens (the last prompt token is always computed, to get
its logits), in whole blocks. So a prompt of L tokens that matches M leading blocks reports
min(M, (L - 1) // block_size) * block_size cached tokens.

Exit status: 0 when every comparison agreed, 1 on any difference (each named on stderr and in the
summary), 2 on a failure to run.
"""

import argparse
import collections
import concurrent.futures
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash
import vllm.v1.core.kv_cache_utils as kcu


def log(msg):
    print(msg, flush=True)


class RunError(Exception):
    """A failure to run (not a difference): exit 2."""


# --- HTTP -----------------------------------------------------------------------------------------


def http(method, url, body=None, headers=None, timeout=60):
    return http_full(method, url, body, headers, timeout)[0]


def http_full(method, url, body=None, headers=None, timeout=60):
    """The answer's JSON and its headers."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            got = {k.lower(): v for k, v in r.headers.items()}
    except urllib.error.HTTPError as e:
        raise RunError(f"{method} {url}: HTTP {e.code}: {e.read()[:500]!r}") from e
    except OSError as e:
        raise RunError(f"{method} {url}: {e}") from e
    return (json.loads(raw) if raw.strip() else None), got


# --- vLLM's block hashes (its own code) -----------------------------------------------------------


class Hasher:
    def __init__(self, algo, block_size):
        self.fn = get_hash_fn_by_name(algo)
        init_none_hash(self.fn)  # NONE_HASH from PYTHONHASHSEED, as in the engine
        self.block_size = block_size

    def event_hashes(self, tokens):
        """The ints vLLM's BlockStored events carry for the prompt's full blocks."""
        out, parent = [], kcu.NONE_HASH
        bs = self.block_size
        for i in range(len(tokens) // bs):
            h = hash_block_tokens(self.fn, parent, tokens[i * bs:(i + 1) * bs], None)
            out.append(int.from_bytes(h, "big") & (2**64 - 1))
            parent = h
        return out


# --- The recorder's view --------------------------------------------------------------------------

TIERS = {"GPU": "device", "CPU": "host", "CPU_PINNED": "host", "DISK": "disk"}


class Truth:
    """Follows record.py's file: each (engine, rank)'s live blocks, copy counts, last seq."""

    def __init__(self, path):
        self.path = path
        self.f = None
        self.buf = ""
        self.live = collections.defaultdict(collections.Counter)  # (src, rank) -> {(tier, group, hash): copies}
        self.last_seq = {}
        self.errors = []
        self.messages = 0
        self.last_change = time.monotonic()

    def poll(self):
        if self.f is None:
            self.f = open(self.path)
        chunk = self.f.read()
        if not chunk:
            return
        self.buf += chunk
        *lines, self.buf = self.buf.split("\n")
        for line in lines:
            if line.strip():
                self.apply(json.loads(line))
        self.last_change = time.monotonic()

    def apply(self, m):
        key = (m["src"], m["rank"])
        self.messages += 1
        if "error" in m:
            self.errors.append(f"recorder {key}: {m['error']}")
            return
        prev = self.last_seq.get(key)
        if prev is not None and m["seq"] != prev + 1:
            self.errors.append(f"recorder {key}: seq {m['seq']} after {prev} (the recorder missed batches)")
        if m.get("dp_rank") not in (None, m["rank"]):
            self.errors.append(f"recorder {key}: batch says dp_rank {m['dp_rank']}")
        self.last_seq[key] = m["seq"]
        live = self.live[key]
        for ev in m["events"]:
            tier = TIERS.get(ev.get("medium") or "GPU", (ev.get("medium") or "").lower())
            group = ev.get("group") or 0
            if ev["type"] == "stored":
                for h in ev["hashes"]:
                    live[(tier, group, h)] += 1
            elif ev["type"] == "removed":
                for h in ev["hashes"]:
                    k = (tier, group, h)
                    if live[k] <= 0:
                        self.errors.append(f"recorder {key}: removed block {h} that was not live")
                    live[k] -= 1
                    if live[k] <= 0:
                        del live[k]
            elif ev["type"] == "cleared":
                if ev.get("medium") is None:
                    live.clear()
                else:
                    for k in [k for k in live if k[0] == tier]:
                        del live[k]
            else:
                self.errors.append(f"recorder {key}: unknown event {ev}")

    def wait_quiet(self, quiet, limit=30.0):
        """Returns once nothing new was recorded for `quiet` seconds from now."""
        start = time.monotonic()
        end = start + limit
        while time.monotonic() < end:
            self.poll()
            if time.monotonic() - max(start, self.last_change) >= quiet:
                return
            time.sleep(0.02)
        raise RunError(f"the engines did not go quiet within {limit:.0f} s")

    def matched(self, key, hashes):
        live = self.live.get(key, {})
        n = 0
        for h in hashes:
            if live.get(("device", 0, h), 0) <= 0:
                break
            n += 1
        return n


# --- The fleet -----------------------------------------------------------------------------------


class Relay:
    def __init__(self, name, url, relayctl, launch, pidfile, log_path):
        self.name, self.url, self.relayctl = name, url, relayctl
        self.launch, self.pidfile, self.log_path = launch, pidfile, log_path

    def ctl(self, *args):
        r = subprocess.run([self.relayctl, "--relay", self.url, *args], capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise RunError(f"relayctl {' '.join(args)} on relay {self.name}: exit {r.returncode}: {r.stderr.strip()}")
        return json.loads(r.stdout)

    def status(self, limit=60.0):
        # A relay just restarted answers once it has opened its store and bound its listener.
        end = time.monotonic() + limit
        while True:
            try:
                return self.ctl("status", "--json")
            except RunError:
                if time.monotonic() > end:
                    raise
                time.sleep(0.1)

    def newest_engine_seq(self, rank):
        r = subprocess.run(
            [self.relayctl, "--relay", self.url, "history", "--rank", str(rank), "--limit", "20", "--json"],
            capture_output=True, text=True, timeout=60,
        )
        if r.returncode != 0:
            raise RunError(f"relayctl history on relay {self.name}: exit {r.returncode}: {r.stderr.strip()}")
        seqs = [json.loads(l).get("engine_seq") for l in r.stdout.splitlines() if l.strip()]
        seqs = [s for s in seqs if s is not None]
        return max(seqs) if seqs else None

    def snapshot(self):
        return self.ctl("snapshot", "--blocks", "--json")

    def kill9(self):
        pid = int(open(self.pidfile).read())
        os.kill(pid, signal.SIGKILL)
        for _ in range(200):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return pid
            # a killed child stays a zombie of its parent (the script) until reaped; that is gone enough
            try:
                if open(f"/proc/{pid}/stat").read().split()[2] == "Z":
                    return pid
            except OSError:
                return pid
            time.sleep(0.05)
        raise RunError(f"relay {self.name} (pid {pid}) did not die")

    def start(self):
        with open(self.log_path, "a") as lf:
            p = subprocess.Popen(["bash", self.launch], stdout=lf, stderr=lf, start_new_session=True)
        with open(self.pidfile, "w") as f:
            f.write(str(p.pid))
        return p.pid


class Fleet:
    def __init__(self, args):
        self.args = args
        self.bs = args.block_size
        self.hasher = Hasher(args.hash_algo, args.block_size)
        self.truth = Truth(args.record)
        self.router = args.router
        self.relays = {
            "A": Relay("A", args.relay_a, args.relayctl, args.relay_a_launch, args.relay_a_pid, args.relay_a_log),
            "B": Relay("B", args.relay_b, args.relayctl, args.relay_b_launch, args.relay_b_pid, args.relay_b_log),
        }
        self.engines = {"A": args.engine_a, "B": args.engine_b}
        # Workers in a fixed order: (engine, rank)
        self.workers = [("A", r) for r in range(args.dp_a)] + [("B", 0)]
        self.relay_of_url = {args.relay_a: "A", args.relay_b: "B"}
        self.hash_settings = {
            "engine": "vllm",
            "version": args.vllm_version,
            "algo": args.hash_algo,
            "block_size": args.block_size,
        }
        if args.hash_seed is not None:
            self.hash_settings["python_hash_seed"] = args.hash_seed
        self.down = set()  # relays killed and not yet back
        self.failures = []

    def fail(self, msg):
        self.failures.append(msg)
        print(f"DIFFERENCE: {msg}", file=sys.stderr, flush=True)

    # Settling: the engines quiet, every relay holding the recorder's last seq of each rank, and
    # the router holding every relay's newest cursor, all read again on each try (a relay that
    # has just restarted is still refilling from the replay socket).
    def settle(self, limit=60.0):
        self.truth.wait_quiet(self.args.quiet)
        end = time.monotonic() + limit
        while True:
            self.truth.poll()
            newest, behind = {}, []
            for name, relay in self.relays.items():
                if name in self.down:
                    continue
                st = relay.status()
                seqs = {r["dp_rank"]: r["last_engine_seq"] for r in st["ranks"]}
                want = {rank: seq for (src, rank), seq in self.truth.last_seq.items() if src == name}
                for rank, seq in want.items():
                    if seqs.get(rank) != seq:
                        # A restarted relay's status shows 0 until a batch commits; its history
                        # has the rank's newest committed batch either way.
                        seqs[rank] = relay.newest_engine_seq(rank)
                if any(seqs.get(rank) != seq for rank, seq in want.items()):
                    behind.append(f"relay {name} has engine seqs {seqs}, the recorder {want}")
                newest[relay.url] = st["newest_cursor"]
            if not behind:
                w = http("GET", self.router + "/workers")
                have = {r["url"]: (r["connected"], r["cursor"]) for r in w["relays"]}
                if all(have.get(url) == (True, c) for url, c in newest.items()):
                    return w
                behind.append(f"kv-router has (connected, cursor) {have}, the relays' newest cursors are {newest}")
            if time.monotonic() > end:
                raise RunError(f"not settled within {limit:.0f} s: " + "; ".join(behind))
            time.sleep(0.05)

    def reset_caches(self):
        for name, url in self.engines.items():
            http("POST", url + "/reset_prefix_cache")
        # vLLM queues the AllBlocksCleared of a reset and publishes it with the rank's next engine
        # step (scheduler.update_from_output): one request of a single token per rank (no full
        # block, so nothing stored) makes every rank publish it now.
        for w in self.workers:
            self.send(w, [1])
        self.settle()
        for key, live in self.truth.live.items():
            if live:
                raise RunError(f"{key} still holds {len(live)} blocks after /reset_prefix_cache")

    # (a)
    def compare_relays(self, label):
        for name, relay in self.relays.items():
            snap = relay.snapshot()
            got = collections.Counter()
            for b in snap.get("blocks", []):
                got[(b["dp_rank"], b["tier"], b["group"], b["hash"])] += b["copies"]
            want = collections.Counter()
            for (src, rank), live in self.truth.live.items():
                if src == name:
                    for (tier, group, h), c in live.items():
                        want[(rank, tier, group, h)] += c
            missing = want - got
            extra = got - want
            blocks = sum(want.values())
            per_rank = ", ".join(
                f"rank {r}: {sum(c for k, c in want.items() if k[0] == r)}" for r in sorted({k[0] for k in want} | {0})
            )
            if missing or extra:
                self.fail(
                    f"(a) {label}: relay {name} (cursor {snap['cursor']}, incarnation {snap['incarnation']}) "
                    f"differs from the recorder: {sum(missing.values())} copies missing "
                    f"{sorted(missing)[:5]}, {sum(extra.values())} extra {sorted(extra)[:5]}"
                )
            else:
                log(
                    f"  (a) {label}: relay {name} == recorder: {blocks} live block copies ({per_rank}), "
                    f"relay cursor {snap['cursor']}, incarnation {snap['incarnation']}"
                )

    def hash_check_counts(self):
        out = {}
        for name, relay in self.relays.items():
            for r in relay.status()["ranks"]:
                h = r.get("hash_check")
                if h:
                    out[(name, r["dp_rank"])] = (h["checked_blocks"], h["mismatched_blocks"], h["skipped_blocks"])
        return out

    # One request: route, send, compare.
    def pick(self, policy, i, tokens, hashes, sent):
        truth_m = {w: self.truth.matched(w, hashes) for w in self.workers}
        router_m, state, load = {}, {}, {}
        if policy in ("routed", "crash"):
            ans = http("POST", self.router + "/match", {"token_ids": tokens, "hash": self.hash_settings})
            if ans["blocks"] != len(hashes):
                self.fail(f"(b) request {i}: kv-router hashed {ans['blocks']} blocks, vLLM's code {len(hashes)}")
            for m in ans["workers"]:
                w = (self.relay_of_url[m["relay"]], m["dp_rank"])
                router_m[w] = m["matched_blocks"]
                state[w] = m["state"]
                ld = m.get("load") or {}
                load[w] = (ld.get("running") or 0) + (ld.get("waiting") or 0)
            if set(router_m) != set(self.workers):
                raise RunError(f"kv-router knows workers {sorted(router_m)}, expected {self.workers}")
            order = sorted(self.workers, key=lambda w: (-router_m[w], load[w], sent[w], self.workers.index(w)))
            chosen = order[0]
        elif policy == "round-robin":
            chosen = self.workers[i % len(self.workers)]
        elif policy == "oracle":
            chosen = sorted(self.workers, key=lambda w: (-truth_m[w], sent[w], self.workers.index(w)))[0]
        else:
            raise ValueError(policy)
        return chosen, truth_m, router_m, state

    def send(self, worker, tokens, on_sent=None):
        engine, rank = worker
        headers = {"X-data-parallel-rank": str(rank)} if engine == "A" else {}
        body = {"model": self.args.model_name, "prompt": tokens, "max_tokens": 1, "temperature": 0.0}
        url = self.engines[engine] + "/v1/completions"
        if on_sent is None:
            r = http("POST", url, body, headers)
        else:
            # Something to do (kill -9 a relay) while this request is in flight.
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                fut = pool.submit(http, "POST", url, body, headers)
                on_sent()
                r = fut.result()
        usage = r["usage"]
        if usage["prompt_tokens"] != len(tokens):
            self.fail(f"the engine counted {usage['prompt_tokens']} prompt tokens for a prompt of {len(tokens)}")
        details = usage.get("prompt_tokens_details")
        if details is None or details.get("cached_tokens") is None:
            raise RunError(f"engine {engine} reports no usage.prompt_tokens_details.cached_tokens "
                           "(is it run with --enable-prompt-tokens-details?)")
        return details["cached_tokens"]

    def run_phase(self, policy, prompts, events=None):
        events = events or {}
        self.reset_caches()
        sent = collections.Counter()
        stats = collections.Counter()
        rows = []
        for i, tokens in enumerate(prompts):
            before = events.get(("before", i))
            if before:
                before()
                self.settle()
            hashes = self.hasher.event_hashes(tokens)
            chosen, truth_m, router_m, state = self.pick(policy, i, tokens, hashes, sent)
            cap = (len(tokens) - 1) // self.bs
            cached = self.send(chosen, tokens, events.get(("during", i)))
            sent[chosen] += 1
            stats["prompt_tokens"] += len(tokens)
            stats["cached_tokens"] += cached
            stats["requests"] += 1
            # The engine's truth for the chosen worker at routing time, capped by vLLM's rule.
            truth_cached = min(truth_m[chosen], cap) * self.bs
            if truth_cached != cached:
                self.fail(
                    f"request {i} ({policy}) to {chosen}: vLLM cached {cached} tokens, but the recorder "
                    f"had {truth_m[chosen]} of its {len(hashes)} blocks live there (expected {truth_cached})"
                )
            if router_m:
                outage = {w for w in self.workers if w[0] in self.down}
                for w in self.workers:
                    if w in outage:
                        continue
                    stats["router_compared"] += 1
                    if router_m[w] != truth_m[w]:
                        self.fail(
                            f"(b) request {i} ({policy}): kv-router matched {router_m[w]} blocks on {w} "
                            f"({state[w]}), the recorder {truth_m[w]}"
                        )
                predicted = min(router_m[chosen], cap) * self.bs
                kind = "outage" if chosen in outage else ("B" if chosen[0] == "B" else "A")
                stats[f"predicted_{kind}"] += 1
                stats[f"predicted_tokens_{kind}"] += predicted
                stats[f"cached_{kind}"] += cached
                if predicted == cached:
                    stats[f"predicted_ok_{kind}"] += 1
                    if router_m[chosen] > cap:
                        stats["last_block_rule"] += 1
                elif kind != "outage":
                    self.fail(
                        f"(b) request {i} ({policy}) to engine {chosen[0]} rank {chosen[1]}: kv-router predicted "
                        f"{router_m[chosen]} blocks (capped at {cap}: {predicted} tokens), vLLM reports "
                        f"cached_tokens {cached} (prompt {len(tokens)} tokens)"
                    )
            rows.append((i, chosen, len(tokens), cached))
            after = events.get(("after", i))
            if after:
                after()
            self.settle()
            # The request's rank must hold its full blocks now (else it ran elsewhere).
            if self.truth.matched(chosen, hashes) != len(hashes):
                self.fail(f"request {i} ({policy}): {chosen} does not hold the request's blocks after it ran")
        stats["per_worker"] = dict(sent)
        return stats, rows


    # (e) One text or chat request through the front.
    def run_front(self, requests):
        self.reset_caches()
        stats = collections.Counter()
        sent = collections.Counter()
        worker_of = {}
        for i, (path, body) in enumerate(requests):
            kind = "chat" if path.endswith("/chat/completions") else "completion"
            ask = {k: v for k, v in body.items() if k in ("model", "prompt", "messages")}
            engine_tokens = http("POST", self.engines["A"] + "/tokenize", ask)["tokens"]
            router_tokens = http("POST", self.router + "/tokenize", ask)["tokens"]
            stats[f"tokenized_{kind}"] += 1
            if router_tokens == engine_tokens:
                stats[f"tokens_equal_{kind}"] += 1
            else:
                first = next((j for j, (a, b) in enumerate(zip(router_tokens, engine_tokens)) if a != b),
                             min(len(router_tokens), len(engine_tokens)))
                self.fail(f"(e) request {i} ({kind}): kv-router made {len(router_tokens)} tokens, vLLM "
                          f"{len(engine_tokens)}; first difference at {first}")
            hashes = self.hasher.event_hashes(engine_tokens)
            truth_m = {w: self.truth.matched(w, hashes) for w in self.workers}
            cap = (len(engine_tokens) - 1) // self.bs
            oracle = max(min(m, cap) for m in truth_m.values()) * self.bs
            t0 = time.monotonic()
            r, headers = http_full("POST", self.router + path, body)
            stats["front_seconds"] += time.monotonic() - t0
            url, rank = headers["x-kv-router-worker"].rsplit(" ", 1)
            w = (self.relay_of_url[url], int(rank))
            worker_of[i] = w
            sent[w] += 1
            matched = int(headers["x-kv-router-matched-blocks"])
            usage = r["usage"]
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            if usage["prompt_tokens"] != len(engine_tokens):
                self.fail(f"(e) request {i}: the engine counted {usage['prompt_tokens']} prompt tokens, "
                          f"its /tokenize {len(engine_tokens)}")
            predicted = min(matched, cap) * self.bs
            stats["requests"] += 1
            stats["prompt_tokens"] += len(engine_tokens)
            stats["cached_tokens"] += cached
            stats["oracle_tokens"] += oracle
            if predicted == cached:
                stats["predicted_ok"] += 1
                if matched > cap:
                    stats["last_block_rule"] += 1
            else:
                self.fail(f"(e) request {i} ({kind}) to {w}: kv-router predicted {matched} blocks (capped at "
                          f"{cap}: {predicted} tokens), vLLM cached {cached}")
            if min(truth_m[w], cap) * self.bs != cached:
                self.fail(f"(e) request {i} to {w}: vLLM cached {cached} tokens, the recorder had "
                          f"{truth_m[w]} of its {len(hashes)} blocks live there")
            self.settle()
        stats["per_worker"] = dict(sent)
        return stats, worker_of

    # (e) The front's added latency: the same request (its prefix cached) through the front and
    # to the worker's engine directly, alternately.
    def front_latency(self, path, body, rounds):
        _, headers = http_full("POST", self.router + path, body)
        url, rank = headers["x-kv-router-worker"].rsplit(" ", 1)
        engine = self.relay_of_url[url]
        direct_headers = {"X-data-parallel-rank": rank}
        front, direct = [], []
        for _ in range(rounds):
            t0 = time.monotonic()
            _, h = http_full("POST", self.router + path, body)
            front.append(time.monotonic() - t0)
            if h["x-kv-router-worker"] != headers["x-kv-router-worker"]:
                continue
            t0 = time.monotonic()
            http("POST", self.engines[engine] + path, body, direct_headers)
            direct.append(time.monotonic() - t0)
        self.settle()
        return front, direct


# --- Prompts -------------------------------------------------------------------------------------


def make_text_requests(seed, n, families, corpus):
    """Text prompts and chat conversations in families, from the paragraphs of `corpus`: each
    family a shared system text; each request a completion of the system text and a question, or
    a chat (the system message and a user turn), or the next turn of an earlier chat of its family
    (its messages, an assistant answer and a new user turn). About one in eight is a verbatim
    repeat."""
    rng = random.Random(seed)
    with open(corpus) as f:
        paras = [p.strip() for p in f.read().split("\n\n") if 60 < len(p.strip()) < 700 and not p.startswith("```")]
    systems = [" ".join(rng.sample(paras, 2)) for _ in range(families)]
    chats = [[] for _ in range(families)]
    out = []
    for _ in range(n):
        if out and rng.random() < 1 / 8:
            out.append(rng.choice(out))
            continue
        fam = rng.randrange(families)
        question = rng.choice(paras)[: rng.randrange(40, 300)]
        if rng.random() < 0.4:
            body = {"prompt": systems[fam] + "\n\nQuestion: " + question}
            out.append(("/v1/completions", body))
            continue
        if chats[fam] and rng.random() < 0.6 and len(json.dumps(chats[fam][-1])) < 1400:
            msgs = chats[fam][-1] + [
                {"role": "assistant", "content": rng.choice(paras)[:120]},
                {"role": "user", "content": question},
            ]
        else:
            msgs = [{"role": "system", "content": systems[fam]}, {"role": "user", "content": question}]
        chats[fam].append(msgs)
        out.append(("/v1/chat/completions", {"messages": msgs}))
    return out




def make_prompts(seed, n, families, block_size, max_len):
    """Token-id prompts in families: each family a shared system prefix; each request a new
    conversation (prefix + a user turn) or the next turn of an earlier one of its family (its
    whole previous prompt + a new turn). About one in six is padded to a whole number of blocks,
    where vLLM's last-block rule shows."""
    rng = random.Random(seed)
    vocab = range(1, 1000)
    systems = [[rng.choice(vocab) for _ in range(rng.randrange(2 * block_size, 6 * block_size))] for _ in range(families)]
    convs = [[] for _ in range(families)]
    prompts = []
    for i in range(n):
        whole = [p for p in prompts if len(p) % block_size == 0]
        if prompts and rng.random() < 1 / 8:
            # A verbatim repeat (a retry), of a whole-block prompt when there is one: its every
            # block is cached, and vLLM still computes the last one.
            prompts.append(list(rng.choice(whole or prompts)))
            continue
        f = rng.randrange(families)
        turn = [rng.choice(vocab) for _ in range(rng.randrange(10, 90))]
        if convs[f] and rng.random() < 0.6:
            base = rng.choice(convs[f])
        else:
            base = systems[f]
        p = base + turn
        if rng.random() < 1 / 6:
            p += [rng.choice(vocab) for _ in range(-len(p) % block_size)]
        if len(p) > max_len:
            p = systems[f] + turn
        convs[f].append(p)
        prompts.append(p)
    return prompts


def main():
    ap = argparse.ArgumentParser()
    for k in ("router", "relay-a", "relay-b", "engine-a", "engine-b", "record", "relayctl", "model-name", "vllm-version"):
        ap.add_argument("--" + k, required=True)
    for k in ("relay-a-launch", "relay-b-launch", "relay-a-pid", "relay-b-pid", "relay-a-log", "relay-b-log"):
        ap.add_argument("--" + k, required=True)
    ap.add_argument("--dp-a", type=int, default=2)
    ap.add_argument("--block-size", type=int, required=True)
    ap.add_argument("--hash-algo", default="sha256")
    ap.add_argument("--hash-seed", default=os.environ.get("PYTHONHASHSEED"))
    ap.add_argument("--seed", type=int, default=29)
    ap.add_argument("--requests", type=int, default=36)
    ap.add_argument("--families", type=int, default=6)
    ap.add_argument("--max-len", type=int, default=440)
    ap.add_argument("--corpus", required=True, help="text of the front phase's prompts (paragraphs)")
    ap.add_argument("--front-requests", type=int, default=36)
    ap.add_argument("--latency-rounds", type=int, default=30)
    ap.add_argument("--quiet", type=float, default=0.25, help="seconds without a KV event that count as settled")
    args = ap.parse_args()

    fleet = Fleet(args)
    prompts = make_prompts(args.seed, args.requests, args.families, args.block_size, args.max_len)
    lens = [len(p) for p in prompts]
    log(
        f"prompts: {len(prompts)} (seed {args.seed}, {args.families} families), {min(lens)}-{max(lens)} tokens, "
        f"{sum(lens)} in all, {sum(1 for n in lens if n % args.block_size == 0)} a whole number of blocks"
    )
    fleet.settle()
    results = {}

    for policy in ("routed", "round-robin", "oracle"):
        log(f"phase {policy}: {len(prompts)} requests")
        stats, _ = fleet.run_phase(policy, prompts)
        results[policy] = stats
        fleet.compare_relays(f"after {policy}")

    # (e): text and chat through the front.
    texts = make_text_requests(args.seed, args.front_requests, args.families, args.corpus)
    for path, body in texts:
        body.update({"model": args.model_name, "max_tokens": 1, "temperature": 0.0})
    # Only requests that fit the engines' 512-token context (with room for the output token).
    fitting = []
    for path, body in texts:
        ask = {k: v for k, v in body.items() if k in ("model", "prompt", "messages")}
        if len(http("POST", fleet.engines["A"] + "/tokenize", ask)["tokens"]) <= args.max_len:
            fitting.append((path, body))
    chats = sum(1 for p, _ in fitting if p.endswith("/chat/completions"))
    log(f"phase front: {len(fitting)} requests through kv-router's front ({chats} chat, {len(fitting) - chats} text; "
        f"{len(texts) - len(fitting)} over {args.max_len} tokens left out)")
    results["front"], _ = fleet.run_front(fitting)
    fleet.compare_relays("after the front")
    lat = {}
    for path, body in (fitting[0], next(((p, b) for p, b in fitting if p.endswith("/chat/completions")), fitting[0])):
        front, direct = fleet.front_latency(path, body, args.latency_rounds)
        lat[path] = (front, direct)

    # (d): kill -9 each relay in turn while a request is in flight, send more with it down, restart it.
    n = len(prompts)
    k = [n // 5, 2 * n // 5, 3 * n // 5, 4 * n // 5]

    def kill(name):
        def go():
            time.sleep(0.02)
            pid = fleet.relays[name].kill9()
            fleet.down.add(name)
            log(f"  kill -9 relay {name} (pid {pid}) with a request in flight")

        return go

    def restart(name):
        def go():
            pid = fleet.relays[name].start()
            log(f"  relay {name} restarted (pid {pid}) on its state directory")
            fleet.down.discard(name)

        return go

    events = {
        ("during", k[0]): kill("B"),
        ("before", k[1]): restart("B"),
        ("during", k[2]): kill("A"),
        ("before", k[3]): restart("A"),
    }
    hc_before = fleet.hash_check_counts()
    log(f"phase crash: {n} requests routed; relay B killed during request {k[0]}, restarted before {k[1]}; "
        f"relay A killed during {k[2]}, restarted before {k[3]}")
    stats, _ = fleet.run_phase("crash", prompts, events)
    results["crash"] = stats
    fleet.compare_relays("after the crashes")
    hc_after = fleet.hash_check_counts()
    for name, relay in fleet.relays.items():
        c = relay.status()["counters"]
        refilled = ", ".join(f"rank {r}: {c.get(f'rank{r}.refilled_batches', 0)}" for r in range(args.dp_a if name == "A" else 1))
        log(f"  (d) relay {name} after its restart: batches refilled from the engine's replay socket ({refilled})")
    metrics = urllib.request.urlopen(fleet.router + "/metrics", timeout=10).read().decode()
    picked = {}
    for line in metrics.splitlines():
        for k in ("kv_router_reconnects_total", "kv_router_snapshots_total", "kv_router_gaps_total", "kv_router_duplicates_total", "kv_router_index_missing_removes_total"):
            if line.startswith(k + " "):
                picked[k.removeprefix("kv_router_")] = int(float(line.split()[1]))
    log("  (d) kv-router: " + ", ".join(f"{k} {v}" for k, v in picked.items()))
    if picked.get("index_missing_removes_total"):
        fleet.fail(f"kv-router's index met {picked['index_missing_removes_total']} removes of blocks it did not hold")

    # Summary
    log("")
    log("summary")
    for policy in ("routed", "round-robin", "oracle"):
        s = results[policy]
        log(
            f"  (c) {policy:<12} hit rate {s['cached_tokens'] / s['prompt_tokens']:.3f} "
            f"({s['cached_tokens']} of {s['prompt_tokens']} prompt tokens cached), requests per worker "
            + ", ".join(f"{w[0]}{w[1]}={s['per_worker'].get(w, 0)}" for w in fleet.workers)
        )
    for policy in ("routed", "crash"):
        s = results[policy]
        log(
            f"  (b) {policy}: predicted == cached_tokens for {s['predicted_ok_B']}/{s['predicted_B']} requests to "
            f"engine B ({s['predicted_tokens_B']} tokens predicted, {s['cached_B']} cached) and "
            f"{s['predicted_ok_A']}/{s['predicted_A']} to engine A; {s['last_block_rule']} capped by the "
            f"last-block rule; kv-router's matched blocks == the recorder's on {s['router_compared']} "
            f"(request, worker) pairs"
            + (f"; {s['predicted_ok_outage']}/{s['predicted_outage']} right while the worker's relay was down "
               f"(not required)" if s["predicted_outage"] else "")
        )
    s = results["front"]
    log(
        f"  (e) front: tokens == vLLM's /tokenize for {s['tokens_equal_completion']}/{s['tokenized_completion']} text "
        f"prompts and {s['tokens_equal_chat']}/{s['tokenized_chat']} chats; predicted == cached_tokens for "
        f"{s['predicted_ok']}/{s['requests']} ({s['last_block_rule']} capped by the last-block rule); hit rate "
        f"{s['cached_tokens'] / max(1, s['prompt_tokens']):.3f}, against the oracle "
        f"{s['cached_tokens'] / max(1, s['oracle_tokens']):.3f} ({s['cached_tokens']} of the oracle's "
        f"{s['oracle_tokens']} tokens); requests per worker "
        + ", ".join(f"{w[0]}{w[1]}={s['per_worker'].get(w, 0)}" for w in fleet.workers)
    )
    for path, (front, direct) in lat.items():
        med = lambda xs: sorted(xs)[len(xs) // 2] * 1000 if xs else float("nan")
        p90 = lambda xs: sorted(xs)[int(len(xs) * 0.9)] * 1000 if xs else float("nan")
        log(
            f"  (e) {path}: through the front p50 {med(front):.2f} ms, p90 {p90(front):.2f} ms; the engine "
            f"directly p50 {med(direct):.2f} ms, p90 {p90(direct):.2f} ms; added p50 {med(front) - med(direct):.2f} ms "
            f"({len(front)} and {len(direct)} requests, max_tokens 1, prefix cached)"
        )
    for label, hc in (("before the crashes", hc_before), ("after the restarts", hc_after)):
        for (name, rank), (checked, mism, skipped) in sorted(hc.items()):
            log(f"  relay {name} rank {rank} hash check {label}: {checked} blocks re-hashed, {mism} mismatched, {skipped} skipped")
            if mism:
                fleet.fail(f"relay {name} rank {rank}: {mism} engine block hashes differ from kv-relay's hashing")
    r, rr, o = (results[p]["cached_tokens"] for p in ("routed", "round-robin", "oracle"))
    if r < rr:
        fleet.fail(f"(c) routed traffic cached {r} tokens, fewer than round-robin's {rr}")
    if fleet.truth.errors:
        for e in fleet.truth.errors:
            fleet.fail(e)
    log(f"  recorder: {fleet.truth.messages} messages")
    if fleet.failures:
        log(f"FAIL: {len(fleet.failures)} difference(s)")
        for f in fleet.failures[:50]:
            log(f"  {f}")
        return 1
    log("PASS: every comparison agreed")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except RunError as e:
        print(f"live-vllm: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
