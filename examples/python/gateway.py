"""A small OpenAI-compatible gateway in front of vLLM (or SGLang) workers, routed by
kv_router_client: each request goes to the live worker that holds most of its prefix at an
acceptable load, and its end is reported back so the in-flight counts and the breakers see it.

    pip install kv_router_client-*.whl        # the wheel (see docs/router-client.md)
    python examples/python/gateway.py --relay http://10.0.0.5:50051 --relay http://10.0.0.6:50051 \\
        --engine vllm --engine-version 0.32 --block-size 16 --listen 127.0.0.1:8000

It serves POST /v1/completions and /v1/chat/completions (streaming or not, passed through
byte for byte with the engine's status), GET /v1/models, and GET /gateway/status (its counts,
and the follower's workers and counters). Token-id prompts are routed as
they are; text prompts and chat messages are tokenized by the engine's own POST /tokenize on a
routable worker first (one more round trip; kv-router's front tokenizes in process instead).
The chosen DP rank goes in vLLM's X-data-parallel-rank header. A worker that refuses the
connection is reported ("connect_failed": it leaves routing) and the next choice is tried once.

The server is the standard library's threaded HTTP server, with no dependency beyond the wheel:
a Follower's calls release the GIL, so a lookup never holds up the other requests' threads.
This is an example of the API, not a production front: kv-router's own front (docs/serving.md)
is that."""

import argparse
import http.client
import json
import sys
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import kv_router_client as k

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
              "proxy-authorization", "proxy-authenticate", "content-length"}


class Upstream:
    """One HTTP/1.1 request to an engine; `send` raises OSError before any byte came back."""

    def __init__(self, engine_url, timeout):
        u = urllib.parse.urlsplit(engine_url)
        self.conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)
        self.base = u.path.rstrip("/")

    def send(self, method, path, body, headers):
        self.conn.request(method, self.base + path, body=body, headers=headers)
        return self.conn.getresponse()

    def close(self):
        self.conn.close()


class Gateway:
    def __init__(self, follower, engine, timeout):
        self.f, self.engine, self.timeout = follower, engine, timeout
        self.lock = threading.Lock()
        self.stats = {"requests": 0, "retried": 0, "no_worker": 0}

    def engine_urls(self):
        """The routable workers' engine URLs, each once."""
        seen = []
        for w in self.f.workers():
            url = w.get("engine_url")
            if url and w["routing"]["routing"] == "routable" and url not in seen:
                seen.append(url)
        return seen

    def token_ids(self, path, req):
        """The request's prompt as token ids: given, or from an engine's POST /tokenize."""
        prompt = req.get("prompt")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        if path.endswith("/chat/completions"):
            ask = {"model": req.get("model", ""), "messages": req.get("messages", [])}
        elif isinstance(prompt, str):
            ask = {"model": req.get("model", ""), "prompt": prompt}
        else:
            raise ValueError("prompt must be a string or a list of token ids")
        for url in self.engine_urls():
            up = Upstream(url, self.timeout)
            try:
                r = up.send("POST", "/tokenize", json.dumps(ask), {"Content-Type": "application/json"})
                body = r.read()
                if r.status == 200:
                    return json.loads(body)["tokens"]
            except OSError:
                continue
            finally:
                up.close()
        raise k.NoWorker("no routable worker answered POST /tokenize")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    gw: Gateway = None  # set in main

    def log_message(self, fmt, *args):  # one line per request on stderr, as the default does
        sys.stderr.write("%s %s\n" % (self.address_string(), fmt % args))

    def reply_json(self, status, obj):
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def error(self, status, message, kind="invalid_request_error"):
        self.reply_json(status, {"error": {"message": message, "type": kind, "code": status}})

    def do_GET(self):
        if self.path == "/gateway/status":
            with self.gw.lock:
                stats = dict(self.gw.stats)
            return self.reply_json(200, {**stats, "workers": self.gw.f.workers(), "relays": self.gw.f.relays(),
                                         "counters": self.gw.f.counters()})
        if self.path != "/v1/models":
            return self.error(404, f"no route for GET {self.path}")
        for url in self.gw.engine_urls():
            up = Upstream(url, self.gw.timeout)
            try:
                r = up.send("GET", "/v1/models", None, {})
                return self.relay_response(r)
            except OSError:
                continue
            finally:
                up.close()
        self.error(503, "no routable worker", "service_unavailable")

    def do_POST(self):
        if self.path not in ("/v1/completions", "/v1/chat/completions"):
            return self.error(404, f"no route for POST {self.path}")
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            req = json.loads(raw)
            tokens = self.gw.token_ids(self.path, req)
        except (ValueError, KeyError) as e:
            return self.error(400, f"bad request: {e}")
        except k.NoWorker as e:
            return self.error(503, str(e), "service_unavailable")
        with self.gw.lock:
            self.gw.stats["requests"] += 1
        last_error = None
        for attempt in range(2):  # the first choice, and once more after a refused connection
            try:
                routed = self.gw.f.route(token_ids=tokens, engine=self.gw.engine,
                                         cache_salt=req.get("cache_salt"))
            except k.RouteFailed as e:
                with self.gw.lock:
                    self.gw.stats["no_worker"] += 1
                return self.error(503, str(e), "service_unavailable")
            if not routed["engine_url"]:
                self.gw.f.report(routed["request_id"], "connect_failed")
                last_error = f"worker {routed['relay']} rank {routed['dp_rank']} has no engine URL"
                continue
            up = Upstream(routed["engine_url"], self.gw.timeout)
            headers = {"Content-Type": "application/json", "X-data-parallel-rank": str(routed["dp_rank"])}
            try:
                r = up.send("POST", self.path, raw, headers)
            except OSError as e:
                up.close()
                self.gw.f.report(routed["request_id"], "connect_failed")
                last_error = f"{routed['engine_url']} (rank {routed['dp_rank']}): {e!r}"
                with self.gw.lock:
                    self.gw.stats["retried"] += 1
                continue
            try:
                usage = self.relay_response(r)
                outcome = "done"
            except OSError:
                usage, outcome = {}, "failed"  # the engine or the client went away mid-answer
            finally:
                up.close()
            details = usage.get("prompt_tokens_details") or {}
            self.gw.f.report(routed["request_id"], outcome,
                             prompt_tokens=usage.get("prompt_tokens", 0),
                             completion_tokens=usage.get("completion_tokens", 0),
                             cached_tokens=details.get("cached_tokens"))
            return
        self.error(502, f"no chosen worker took the request; the last: {last_error}", "bad_gateway")

    def relay_response(self, r):
        """Passes the engine's answer through (status, headers, body; SSE chunk by chunk) and
        returns its `usage` (the last SSE chunk's, for a stream), or {}."""
        self.send_response(r.status)
        for name, value in r.getheaders():
            if name.lower() not in HOP_BY_HOP:
                self.send_header(name, value)
        streaming = r.getheader("Content-Type", "").startswith("text/event-stream")
        if not streaming:
            body = r.read()
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            try:
                return json.loads(body).get("usage") or {}
            except ValueError:
                return {}
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        usage = {}
        while True:
            line = r.readline()
            if not line:
                break
            if line.startswith(b"data: {"):
                try:
                    usage = json.loads(line[6:]).get("usage") or usage
                except ValueError:
                    pass
            self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")
        return usage


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--relay", action="append", default=[], help="a relay's gRPC URL (repeat)")
    ap.add_argument("--dns", action="append", default=[], help="NAME:PORT resolving to relays (repeat)")
    ap.add_argument("--engine", default="vllm", choices=["vllm", "sglang"])
    ap.add_argument("--engine-version", default="0.32")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--hash-algo", default="sha256", help="vLLM's --prefix-caching-hash-algo")
    ap.add_argument("--python-hash-seed", default=None, help="vLLM's PYTHONHASHSEED, when set")
    ap.add_argument("--listen", default="127.0.0.1:8000", help="HOST:PORT (port 0: any)")
    ap.add_argument("--policy", default="cache_aware", choices=["cache_aware", "least_load", "round_robin"])
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds an engine may take to answer")
    a = ap.parse_args()
    if a.engine == "vllm":
        engine = k.Engine.vllm(a.engine_version, a.block_size, algo=a.hash_algo, python_hash_seed=a.python_hash_seed)
    else:
        engine = k.Engine.sglang(a.engine_version, a.block_size)
    follower = k.Follower(a.relay, dns=a.dns or None, policy=a.policy)
    host, port = a.listen.rsplit(":", 1)
    Handler.gw = Gateway(follower, engine, a.timeout)
    server = ThreadingHTTPServer((host, int(port)), Handler)
    server.daemon_threads = True
    print(f"listening http://{server.server_address[0]}:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        follower.close()


if __name__ == "__main__":
    main()
