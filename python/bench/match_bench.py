"""What a lookup costs from Python: `Follower.match` of 512 block hashes over 128 workers,
against the same Rust lookup timed inside the extension in the same run (the peer), so the
ratio is the crossing: argument conversion, the GIL released and taken back, and the answer
built as Python objects.

The fleet: one mock engine of 128 DP ranks (block size 4) and a kv-relay beside it, placed as
the Rust routing bench places its requests: every rank holds a 512-block prompt of its own; a
tenth of the ranks (13) also hold the first 256 blocks of a shared chain, and one of them all
512. Two probes: a rank's own prompt (one worker holds it), and the shared chain.

    cargo build --workspace --bins     # the mock engine and kv-relay (debug builds serve)
    scripts/python.sh --release        # builds and installs the optimized wheel
    PYTHONPATH=$(target/python-fresh-venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
      target/python-venv/bin/python python/bench/match_bench.py [--runs 20000] [--no-gc]

It prints p50/p99 per call for each form and the Python/Rust ratio. The goal: `match` of 512
hashes over 128 workers, p99 <= 50 us."""

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import harness  # noqa: E402

import kv_router_client as k  # noqa: E402

RANKS, BLOCKS = 128, 512


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def us(ns):
    return f"{ns / 1000:7.2f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20000, help="timed calls per form")
    ap.add_argument("--no-gc", action="store_true", help="the cyclic garbage collector off while timing")
    a = ap.parse_args()
    engine = k.Engine.from_json(harness.HASH)

    def own(rank):
        return [1_000_000 * (rank + 1) + i for i in range(BLOCKS * harness.BLOCK)]

    chain = list(range(1, BLOCKS * harness.BLOCK + 1))
    sharers = RANKS // 10 + 1
    probes = [("one worker holds it", engine.block_hashes(own(RANKS // 2)), {RANKS // 2: BLOCKS}),
              ("a shared chain", engine.block_hashes(chain),
               {0: BLOCKS, **{r: BLOCKS // 2 for r in range(1, sharers)}})]
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        print(f"fleet: mock engine of {RANKS} ranks, one relay; placing the prompts", file=sys.stderr)
        e = harness.EngineProc(d, dp=RANKS, cache_blocks=2048)
        r = harness.RelayProc(e, d)
        try:
            for rank in range(RANKS):
                e.complete(own(rank), rank)
                if rank < sharers:
                    e.complete(chain if rank == 0 else chain[: BLOCKS // 2 * harness.BLOCK], rank)
            with k.Follower([r.url], start_jitter_ms=0) as f:
                for _, hashes, held in probes:
                    harness.wait_until("the follower holds every placed prompt", lambda: {
                        (m.dp_rank): m.matched_blocks for m in f.match(hashes, matched_only=True)} == held,
                        timeout=120)
                assert len(f.match(probes[0][1])) == RANKS
                # (name, keyword arguments, whether each Match of the answer is then made)
                forms = [("all 128 workers", {}, False), ("all 128, every Match read", {}, True),
                         ("matched_only, limit=8", {"matched_only": True, "limit": 8}, False)]
                print(f"{'probe, form':<46} {'python p50':>10} {'p99':>8} {'rust p50':>9} {'p99':>8} {'p99 ratio':>9}")
                for probe, hashes, _ in probes:
                    for name, kw, read in forms:
                        for _ in range(1000):
                            f.match(hashes, **kw)
                        # Interleaved, one call each, so both see the same machine: a stall
                        # of this shared host lands on either side alike.
                        py, rust = [], []
                        gc.collect()
                        gc.disable() if a.no_gc else None
                        for _ in range(a.runs):
                            t = time.perf_counter_ns()
                            answer = f.match(hashes, **kw)
                            if read:
                                list(answer)
                            py.append(time.perf_counter_ns() - t)
                            rust += f._time_match(hashes, 1, **kw)
                        gc.enable()
                        print(f"{probe + ', ' + name:<46} {us(pct(py, .5)):>10} {us(pct(py, .99)):>8} "
                              f"{us(pct(rust, .5)):>9} {us(pct(rust, .99)):>8} {pct(py, .99) / pct(rust, .99):>8.2f}x")
                print(f"({a.runs} calls per form, microseconds; the goal: all 128 workers, python p99 <= 50 us)")
        finally:
            r.stop()
            e.stop()


if __name__ == "__main__":
    main()
