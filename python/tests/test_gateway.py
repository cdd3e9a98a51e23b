"""examples/python/gateway.py in front of the mock engines: routing by prefix, pass-through
(JSON and SSE), text prompts tokenized by the engine, and the retry after a refused connection."""

import json
import subprocess
import sys
import urllib.error
import urllib.request

from harness import BLOCK, ROOT, http, wait_until


def urlopen(req):
    """urllib's urlopen, with an error answer's body in the exception."""
    try:
        return urllib.request.urlopen(req, timeout=10)
    except urllib.error.HTTPError as e:
        raise AssertionError(f"{e.code}: {e.read()[:500]!r}") from e


class Gateway:
    def __init__(self, relays, log_dir):
        self.log = open(log_dir / "gateway.log", "w")
        args = [sys.executable, str(ROOT / "examples" / "python" / "gateway.py"), "--listen", "127.0.0.1:0",
                "--engine", "vllm", "--engine-version", "0.32", "--hash-algo", "sha256_cbor",
                "--block-size", str(BLOCK)]
        for r in relays:
            args += ["--relay", r.url]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=self.log, text=True)
        line = self.proc.stdout.readline()
        assert line.startswith("listening "), line
        self.url = line.split()[1]

    def status(self):
        return http(f"{self.url}/gateway/status")

    def worker(self, relay, rank):
        return {(w["relay"], w["dp_rank"]): w for w in self.status()["workers"]}.get((relay, rank), {})

    def stop(self):
        self.proc.terminate()
        self.proc.wait(10)
        self.log.close()


def test_the_gateway_routes_by_prefix_and_passes_answers_through(fleet, tmp_path):
    engines, relays, _ = fleet
    g = Gateway(relays, tmp_path)
    try:
        prompt = list(range(1, 30))  # 7 full blocks
        engines[0].complete(prompt, 1)
        wait_until("the gateway sees engine 0 rank 1 hold the prompt",
                   lambda: g.worker(relays[0].url, 1).get("held_blocks") == 7)
        # Every worker routable: one the follower lists before its stream said anything of it
        # waits as "not_yet_heard", and routes at its first heartbeat without a probe.
        wait_until("every worker routable", lambda: [
            (w["routing"]["routing"], w["routing"]["outs"], bool(w["engine_url"])) for w in g.status()["workers"]
        ] == [("routable", 0, True)] * 4)
        before = g.status()
        routed0 = g.worker(relays[0].url, 1)["routing"]["routed"]
        direct = http(f"{engines[0].url}/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 2},
                      {"X-data-parallel-rank": "1"})
        got = http(f"{g.url}/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 2})
        assert got == direct and got["usage"]["prompt_tokens_details"]["cached_tokens"] == 28
        w = g.worker(relays[0].url, 1)
        assert (w["routing"]["routed"], w["routing"]["in_flight"]) == (routed0 + 1, 0)
        # Streaming: SSE passed through chunk by chunk, ended by [DONE].
        req = urllib.request.Request(f"{g.url}/v1/completions", method="POST", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"model": "m", "prompt": prompt, "stream": True}).encode())
        with urlopen(req) as r:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            events = [line for line in r.read().decode().split("\n") if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["usage"]["prompt_tokens_details"]["cached_tokens"] == 28
        assert g.worker(relays[0].url, 1)["routing"]["routed"] == routed0 + 2
        # A text prompt: tokenized by an engine's /tokenize, then routed like its token ids.
        text = http(f"{g.url}/v1/completions", {"model": "m", "prompt": "hello there", "max_tokens": 2})
        assert text["object"] == "text_completion"
        models = http(f"{g.url}/v1/models")
        assert [m["id"] for m in models["data"]] == ["mock-model"]
        # Engine 0 refuses connections: its worker leaves routing and the request goes to the next.
        engines[0].command("fault listener-gone")
        again = http(f"{g.url}/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 2})
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        s = g.status()
        assert (s["requests"] - before["requests"], s["retried"], s["no_worker"]) == (4, 1, 0)
        # Both of engine 0's ranks left routing: one HTTP server serves them both, so the retry
        # went to engine 1, not to engine 0's other rank.
        w = {(x["relay"], x["dp_rank"]): x["routing"] for x in s["workers"]}
        assert [(w[(relays[0].url, d)]["routing"], w[(relays[0].url, d)]["cause"]) for d in (0, 1)] == [
            ("out", "connect_failed")] * 2
        assert s["counters"]["routing"]["in_flight"] == 0
    finally:
        g.stop()
