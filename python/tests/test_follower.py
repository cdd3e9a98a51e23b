"""The package against a real fleet: mock engines, kv-relay processes, and kv-router (the Rust
library) following the same relays. Every lookup's answer must equal the Rust library's."""

import contextlib
import json
import threading

import pytest

import kv_router_client as k
from harness import BLOCK, HASH, ROOT, wait_until

ENGINE = k.Engine.from_json(HASH)


def prompts():
    """Token-id prompts: a shared 16-token preamble, then each its own, of 8 to 11 blocks."""
    pre = list(range(1, 17))
    return [pre + [1000 + 100 * i + j for j in range(16 + 4 * (i % 4))] for i in range(8)]


def place(engines, ps):
    """Prompt i on engine i % 2, rank (i // 2) % 2: returns [(engine, rank)]."""
    at = []
    for i, p in enumerate(ps):
        e, rank = engines[i % 2], (i // 2) % 2
        e.complete(p, rank)
        at.append((e, rank))
    return at


def caught_up(f, router):
    """Both followers hold every relay at the relay's newest cursor, the same cursor."""
    mine = {r["url"]: r for r in f.relays()}
    theirs = router.relays()
    return all(
        r["connected"] and not r["syncing"] and r["cursor"] == r["relay_newest"] > 0
        and theirs.get(u, {}).get("cursor") == r["cursor"] and theirs[u]["epoch"] == r["epoch"]
        for u, r in mine.items()
    )


def comparable(m):
    """A match without its load. A load rides on batches and on the relay's heartbeats, and two
    followers take a heartbeat at their own moments: loads are compared apart, once settled."""
    m = dict(m)
    m.pop("load")
    return m


def loads(matches):
    """(relay, rank) -> the load, without its scrape time."""
    return {
        (m["relay"], m["dp_rank"]): m["load"] and {k: v for k, v in m["load"].items() if k != "scraped_at_ms"}
        for m in matches
    }


def same_as_rust(f, router, lookups):
    """Every lookup: the package's answer equals kv-router's /match, worker by worker; and the
    loads the two report agree once no heartbeat is between them."""
    for tokens in lookups:
        by_tokens = [m.to_dict() for m in f.match_tokens(tokens, engine=ENGINE)]
        hashes = ENGINE.block_hashes(tokens)
        by_hashes = [m.to_dict() for m in f.match(hashes)]
        rust = router.match({"token_ids": tokens, "hash": HASH})
        rust_hashes = router.match({"block_hashes": hashes})
        assert [comparable(m) for m in by_tokens] == [comparable(m) for m in rust], tokens
        assert [comparable(m) for m in by_hashes] == [comparable(m) for m in rust_hashes] \
            == [comparable(m) for m in rust], tokens
        assert all(m["load"] is not None for m in by_tokens + rust), tokens
    probe = lookups[0]
    wait_until("the two followers' loads agree", lambda: loads(
        m.to_dict() for m in f.match_tokens(probe, engine=ENGINE)
    ) == loads(router.match({"token_ids": probe, "hash": HASH})))


def idle(f):
    return all(w["load"] and w["load"]["running"] == 0 for w in f.workers())


def test_answers_equal_the_rust_librarys(fleet):
    engines, relays, router = fleet
    ps = prompts()
    at = place(engines, ps)
    with k.Follower([r.url for r in relays], start_jitter_ms=0) as f:
        wait_until("both followers caught up, engines idle", lambda: caught_up(f, router) and idle(f))
        assert len(f.workers()) == 4
        # Each prompt's full blocks are held by the worker it ran on, and only the preamble's 4
        # blocks by the others that ran a prompt.
        for p, (e, rank) in zip(ps, at):
            relay = relays[engines.index(e)].url
            got = {(m.relay, m.dp_rank): m.matched_blocks for m in f.match_tokens(p, engine=ENGINE)}
            assert got == {
                (r.url, d): (len(p) // BLOCK if (r.url, d) == (relay, rank) else 4)
                for r in relays for d in range(2)
            }
            best = f.match_tokens(p, engine=ENGINE, limit=1)
            assert [(b.relay, b.dp_rank, b.matched_blocks, b.by_tier, b.state) for b in best] == [
                (relay, rank, len(p) // BLOCK, {"device": len(p) // BLOCK}, "fresh")
            ]
        # The hashes are the engine's own: every prompt's blocks are in its engine's cache.
        for p, (e, rank) in zip(ps, at):
            truth = json.loads(e.command("truth"))["truth"]
            held = {h for t in truth if t["dp_rank"] == rank for h in t["block_hashes"]}
            assert set(ENGINE.block_hashes(p)) <= held
        lookups = ps + [p[:9] for p in ps] + [[7, 7, 7, 7, 7, 7, 7, 7], [], ps[0] + ps[1]]
        same_as_rust(f, router, lookups)
        assert f.match_tokens(ps[0], engine=ENGINE, matched_only=True, limit=2)[0].matched_blocks == 8
        assert [m.matched_blocks for m in f.match([1, 2, 3], matched_only=True)] == []


def test_route_and_report(fleet):
    engines, relays, router = fleet
    ps = prompts()
    at = place(engines, ps)
    with k.Follower([r.url for r in relays], start_jitter_ms=0, seed=7) as f:
        wait_until("caught up, engines idle", lambda: caught_up(f, router) and idle(f))
        e, rank = at[3]
        routed = f.route(token_ids=ps[3], engine=ENGINE)
        assert (routed["relay"], routed["dp_rank"], routed["engine_url"]) == (
            relays[engines.index(e)].url, rank, e.url)
        assert (routed["blocks"], routed["matched_blocks"], routed["device_blocks"]) == (11, 11, 11)
        assert (routed["reason"], routed["policy"]) == ("cached_prefix", "cache_aware")
        assert f.counters()["routing"]["in_flight"] == 1
        w = {(x["relay"], x["dp_rank"]): x for x in f.workers()}[(routed["relay"], rank)]
        assert (w["routing"]["routing"], w["routing"]["in_flight"], w["routing"]["routed"]) == ("routable", 1, 1)
        at_ = f.report(routed["request_id"], "done", prompt_tokens=44, completion_tokens=2, cached_tokens=44)
        assert at_ == {"relay": routed["relay"], "dp_rank": rank}
        c = f.counters()["routing"]
        assert (c["in_flight"], c["tracker"]["done"], c["prompt_tokens"], c["cached_tokens"]) == (0, 1, 44, 44)
        assert c["routed"]["cached_prefix"] == 1
        with pytest.raises(k.ReportRejected, match="no routed request"):
            f.report(routed["request_id"])
        # By hashes, the same choice.
        again = f.route(ENGINE.block_hashes(ps[3]))
        assert (again["relay"], again["dp_rank"], again["matched_blocks"]) == (routed["relay"], rank, 11)
        f.report(again["request_id"], "failed")
        assert f.counters()["routing"]["tracker"]["failures"] == 1


@contextlib.contextmanager
def following(fleet, placed):
    """The first `placed` prompts run on the engines, and a Follower caught up with them (the
    same cursors as kv-router's, every engine idle): yields it and the prompts."""
    engines, relays, router = fleet
    ps = prompts()
    place(engines, ps[:placed])
    with k.Follower([r.url for r in relays], start_jitter_ms=0) as f:
        wait_until("caught up", lambda: caught_up(f, router) and idle(f))
        yield f, ps


def test_an_answer_is_a_sequence_of_matches(fleet):
    _, relays, _ = fleet
    with following(fleet, 2) as (f, ps):
        answer = f.match_tokens(ps[0], engine=ENGINE)
        items = list(answer)
        assert isinstance(answer, k.Matches) and len(answer) == len(items) == 4
        assert [(m.relay, m.dp_rank) for m in items] == sorted((r.url, d) for r in relays for d in range(2))
        assert answer[0] == items[0] and answer[-1] == items[3] and answer[1:3] == items[1:3]
        assert answer[::-2] == items[::-2] and answer[5:] == []
        assert answer == items and answer == tuple(items) and answer != items[:3]
        assert answer == f.match_tokens(ps[0], engine=ENGINE) and answer != items[::-1]
        assert answer.to_dicts() == [m.to_dict() for m in items]
        assert [m.matched_blocks for m in answer] == [m.matched_blocks for m in answer]  # iterates twice
        with pytest.raises(IndexError, match="match index 4 out of range"):
            answer[4]
        with pytest.raises(IndexError, match="match index -5 out of range"):
            answer[-5]
        with pytest.raises(TypeError):
            answer["relay"]
        assert repr(answer).startswith("Matches([Match(relay=")


def test_a_relay_restart_and_a_snapshot_resync_are_followed(fleet):
    engines, relays, router = fleet
    with following(fleet, 4) as (f, ps):
        first = {r["url"]: r for r in f.relays()}
        # Restarted on its state: the follower resumes at its cursor, with no snapshot.
        relays[0].restart()
        place(engines, ps[4:6])
        wait_until("resumed after the restart", lambda: caught_up(f, router) and idle(f)
                   and f.relays()[0]["counters"]["reconnects"] >= 1)
        now = {r["url"]: r for r in f.relays()}
        assert now[relays[0].url]["epoch"] == first[relays[0].url]["epoch"]
        # Both relays' histories reach back to their start: the first subscribes streamed them.
        assert (f.counters()["relays"]["snapshots"], f.counters()["relays"]["epoch_changes"]) == (0, 0)
        same_as_rust(f, router, ps)
        # Restarted on a fresh state directory: another epoch, so a snapshot (primed from the
        # engine's replay), and the same answers.
        relays[0].restart(fresh_state=True)
        wait_until("resynced from a snapshot", lambda: {r["url"]: r for r in f.relays()}[relays[0].url]["epoch"]
                   != first[relays[0].url]["epoch"] and caught_up(f, router) and idle(f))
        c = f.counters()["relays"]
        assert (c["snapshots"], c["epoch_changes"]) == (1, 1)
        place(engines, ps[6:])
        wait_until("caught up after the resync", lambda: caught_up(f, router) and idle(f))
        same_as_rust(f, router, ps + [p[:12] for p in ps])
        held = {(m.relay, m.dp_rank): m.matched_blocks for m in f.match_tokens(ps[0], engine=ENGINE)}
        assert held[(relays[0].url, 0)] == 8


def test_relays_added_removed_and_found_by_dns(fleet):
    engines, relays, router = fleet
    place(engines, prompts()[:2])
    with k.Follower(start_jitter_ms=0) as f:
        assert f.wait_ready(timeout=0.05) is False  # no relay yet
        f.add_relay(relays[0].url)
        assert f.wait_ready(timeout=20)
        wait_until("relay 0's workers", lambda: len(f.workers()) == 2)
        with pytest.raises(ValueError, match="already followed"):
            f.add_relay(relays[0].url)
        f.remove_relay(relays[0].url)
        assert (f.relays(), f.workers()) == ([], [])
        with pytest.raises(ValueError, match="is not followed"):
            f.remove_relay(relays[0].url)
    port = relays[1].url.rsplit(":", 1)[1]
    with k.Follower(dns=[f"localhost:{port}"], dns_interval_ms=100, start_jitter_ms=0) as f:
        wait_until("the relay behind the name", lambda: any(
            r["url"] == relays[1].url and r["connected"] for r in f.relays()))
        assert f.counters()["discovery"]["added"] >= 1


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="invalid relay url"):
        k.Follower(["ftp://relay:1"])
    with pytest.raises(ValueError, match="is not NAME:PORT"):
        k.Follower(dns=["relay.example"])
    with pytest.raises(ValueError, match="unknown policy"):
        k.Follower(policy="fastest")
    with pytest.raises(ValueError, match="stale_after_ms must be"):
        k.Follower(stale_after_ms=-1)
    with pytest.raises(TypeError):
        k.Follower(relay_list=["http://127.0.0.1:1"])
    with pytest.raises(ValueError, match="block size must be at least 1"):
        k.Engine.vllm("0.32", 0)
    with pytest.raises(ValueError, match="unknown variant"):
        k.Engine.from_json({"engine": "trt", "version": "1"})
    with pytest.raises(ValueError, match="unknown hash algorithm"):
        k.Engine.vllm("0.32", 16, algo="md5")
    with pytest.raises(TypeError, match="engine must be an Engine"):
        k.Follower().match_tokens([1, 2, 3, 4], engine=16)
    with k.Follower(start_jitter_ms=0) as f:
        with pytest.raises(OverflowError):
            f.match([-1])
        with pytest.raises(TypeError):
            f.match("1234")
        with pytest.raises(ValueError, match="limit must be at least 1"):
            f.match([1], limit=0)
        with pytest.raises(ValueError, match="token_ids need engine="):
            f.route(token_ids=[1, 2, 3, 4])
        with pytest.raises(ValueError, match="give either block_hashes"):
            f.route()
        with pytest.raises(k.NoWorker, match="no worker is routable"):
            f.route([1, 2])
        with pytest.raises(ValueError, match="outcome \"finished\""):
            f.report(1, "finished")
        with pytest.raises(k.ReportRejected):
            f.report(1)
        with pytest.raises(ValueError, match="lora_path needs lora_name"):
            f.match_tokens([1, 2, 3, 4], engine=ENGINE, lora_path="/a")
    assert f.closed
    with pytest.raises(k.Closed):
        f.match([1])
    f.close()  # twice: a no-op
    assert issubclass(k.NoWorker, k.RouteFailed) and issubclass(k.RouteFailed, k.Error)


FIXTURES = ROOT / "testdata" / "fixtures"


def requests_of(manifest):
    """The token-id requests a capture's engine ran (vLLM: `requests`; SGLang: its operations)."""
    ops = manifest["requests"] if "requests" in manifest else manifest["extra"]["operations_in_order"]
    return [r for r in ops if "prompt_token_ids" in r]


@pytest.mark.parametrize("capture,engine", [
    ("vllm-basic", lambda: k.Engine.vllm("0.32", 32, python_hash_seed="0")),
    ("vllm-salt", lambda: k.Engine.vllm("0.32", 32, python_hash_seed="0")),
    ("vllm-sha256cbor", lambda: k.Engine.vllm("0.32", 32, algo="sha256_cbor")),
    ("sglang-basic", lambda: k.Engine.sglang("0.5.23", 16)),
])
def test_engine_hashes_are_the_engines(capture, engine):
    """Recorded from real engines: every block the engine held at the end of the capture is a
    block of one of its requests as the package hashes them (salts and LoRA names included), and
    the last request's blocks are all held."""
    m = json.loads((FIXTURES / f"{capture}.manifest.json").read_text())
    e = engine()
    live = {h for x in m["expected"] for h in x["block_hashes"]}
    ours, last = set(), []
    for r in requests_of(m):
        last = e.block_hashes(r["prompt_token_ids"] + r["output_token_ids"],
                              cache_salt=r.get("cache_salt"), lora_name=r.get("lora_name"))
        ours |= set(last)
    assert live and live <= ours
    assert last and set(last) <= live


def test_engine_hash_shapes():
    e = k.Engine.vllm("0.32", 4, algo="sha256_cbor")
    assert len(e.block_hashes(list(range(1, 10)))) == 2
    assert e.block_hashes(list(range(1, 9)))[:1] == e.block_hashes(list(range(1, 5)))
    assert e.block_hashes([1, 2, 3, 4], cache_salt="a") != e.block_hashes([1, 2, 3, 4])
    assert e.block_hashes([1, 2, 3]) == []
    assert "sha256_cbor" in repr(e)


def test_calls_release_the_gil(fleet):
    """A thread blocked in wait_ready() does not hold the interpreter: the main thread adds the
    relay it is waiting for while it waits."""
    _, relays, _ = fleet
    with k.Follower(start_jitter_ms=0) as f:
        got = []
        t = threading.Thread(target=lambda: got.append(f.wait_ready(timeout=30)))
        t.start()
        f.add_relay(relays[0].url)
        t.join()
        assert got == [True]
