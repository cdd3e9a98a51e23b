"""A small fleet for the package's tests: mock-engine processes (the test kit's), a kv-relay
process beside each, and the kv-router binary following the same relays (the Rust library's
answers, to hold the package's to). Every server binds 127.0.0.1.

The binaries come from `cargo build --workspace --bins` (target/debug), or from the
MOCK_ENGINE_BIN, KV_RELAY_BIN and KV_ROUTER_BIN variables."""

import json
import os
import queue
import random
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 4
HASH = {"engine": "vllm", "version": "0.32", "algo": "sha256_cbor", "block_size": BLOCK}


def binary(name, env):
    p = os.environ.get(env)
    if p:
        return p
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    path = target / "debug" / name
    if not path.exists():
        raise RuntimeError(f"{path} is missing: run `cargo build --workspace --bins` first (or set {env})")
    return str(path)


def free_ports(n):
    """The first of `n` consecutive free ports on 127.0.0.1, below the kernel's ephemeral range
    (where every closed client connection holds its port in TIME_WAIT for a minute)."""
    low, high = 10000, 32768
    try:
        high = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    rng = random.Random()
    for _ in range(500):
        base = rng.randrange(low, max(low + 1, high - n))
        held = []
        try:
            for i in range(n):
                t = socket.socket()
                held.append(t)
                t.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for t in held:
                t.close()
    raise RuntimeError(f"no {n} consecutive free ports in {low}-{high}")


def wait_until(what, f, timeout=20.0):
    deadline = time.monotonic() + timeout
    while True:
        v = f()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def http(url, body=None, headers=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


class EngineProc:
    """A mock-engine process: `dp` ranks on consecutive ports, its HTTP face, commands on stdin."""

    def __init__(self, log_dir, dp=2, cache_blocks=1024, block=BLOCK, name="engine"):
        self.dp = dp
        base = free_ports(2 * dp)
        self.endpoint = f"tcp://127.0.0.1:{base}"
        self.replay = f"tcp://127.0.0.1:{base + dp}"
        self.log = open(Path(log_dir) / f"{name}.log", "w")
        self.proc = subprocess.Popen(
            [binary("mock-engine", "MOCK_ENGINE_BIN"), "--endpoint", self.endpoint, "--replay-endpoint", self.replay,
             "--dp-size", str(dp), "--topic", "kv", "--block-size", str(block), "--cache-blocks", str(cache_blocks),
             "--http-listen", "127.0.0.1:0"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, bufsize=1)
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"mock-engine exited at start (see {self.log.name})")
            if line.startswith("ready "):
                ready = json.loads(line[len("ready "):])
                break
        self.url = ready["url"]
        self.metrics = ready["metrics"]
        self.answers = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.answers.put(line.strip())

    def command(self, line):
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.answers.get(timeout=10)

    def complete(self, tokens, rank):
        """A completion of a token-id prompt on `rank`, through the engine's face."""
        return http(f"{self.url}/v1/completions", {"model": "m", "prompt": tokens, "max_tokens": 2},
                    {"X-data-parallel-rank": str(rank)})

    def stop(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=5)
            except Exception:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class RelayProc:
    """A kv-relay process beside an engine, on fixed ports, restartable."""

    def __init__(self, engine, log_dir, name="relay"):
        self.engine = engine
        self.port = free_ports(1)
        self.url = f"http://127.0.0.1:{self.port}"
        self.state = tempfile.mkdtemp(prefix="kv-relay-", dir=log_dir)
        self.log_path = Path(log_dir) / f"{name}.log"
        self.proc = None
        self.start()

    def start(self, fresh_state=False):
        if fresh_state:
            self.state = tempfile.mkdtemp(prefix="kv-relay-", dir=Path(self.state).parent)
        e = self.engine
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen(
            [binary("kv-relay", "KV_RELAY_BIN"), "--endpoint", e.endpoint, "--replay-endpoint", e.replay,
             "--dp-size", str(e.dp), "--topic", "kv", "--state-dir", self.state, "--listen", f"127.0.0.1:{self.port}",
             "--metrics-listen", "off", "--engine-metrics-url", e.metrics, "--engine-url", e.url,
             "--load-poll-ms", "50", "--heartbeat-ms", "200", "--tail-probe-ms", "300"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, env={**os.environ, "RUST_LOG": "warn"})
        log.close()

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def restart(self, fresh_state=False):
        self.stop()
        self.start(fresh_state)


class RouterProc:
    """The kv-router binary following `relays` (the Rust library's answers)."""

    def __init__(self, relays, log_dir):
        log = open(Path(log_dir) / "router.log", "w")
        args = [binary("kv-router", "KV_ROUTER_BIN"), "--listen", "127.0.0.1:0", "--start-jitter-ms", "0",
                "--engine-hash", json.dumps(HASH)]
        for r in relays:
            args += ["--relay", r]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, text=True,
                                     env={**os.environ, "RUST_LOG": "warn"})
        log.close()
        line = self.proc.stdout.readline()
        if "http://" not in line:
            raise RuntimeError(f"kv-router said {line!r}")
        self.url = "http://" + line.split("http://")[1].split()[0]
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()

    def match(self, body):
        return http(f"{self.url}/match", body)["workers"]

    def relays(self):
        return {r["url"]: r for r in http(f"{self.url}/workers")["relays"]}

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
