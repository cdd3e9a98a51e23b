"""The independent recorder of scripts/live-vllm.sh: one ZeroMQ SUB per engine rank, started
before any traffic, writing every message the engines publish as one JSON line, decoded with
vLLM's own msgspec classes (vllm.distributed.kv_events), not with kv-relay's decoder.

    python record.py OUT.jsonl NAME:RANK:tcp://127.0.0.1:PORT ...

Each line: {"src": NAME, "rank": RANK, "seq": N, "ts": T, "events": [...]}, events as
{"type": "stored", "hashes": [...], "parent": H|null, "medium": M, "group": G, "block_size": B,
"ntokens": N} | {"type": "removed", "hashes": [...], "medium": M, "group": G} |
{"type": "cleared", "medium": M}. Writes OUT.ready once every SUB is connected; stops on SIGTERM.
"""

import json
import signal
import sys
import time

import msgspec
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

stop = False


def on_term(*_):
    global stop
    stop = True


def as_int(h):
    # vLLM sends ints unless VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 (digests: their last 8 bytes).
    if isinstance(h, (bytes, bytearray)):
        return int.from_bytes(h[-8:], "big")
    return int(h) & (2**64 - 1)


def event_json(ev):
    if isinstance(ev, BlockStored):
        return {
            "type": "stored",
            "hashes": [as_int(h) for h in ev.block_hashes],
            "parent": None if ev.parent_block_hash is None else as_int(ev.parent_block_hash),
            "medium": ev.medium,
            "group": getattr(ev, "group_idx", None),
            "block_size": ev.block_size,
            "ntokens": len(ev.token_ids),
        }
    if isinstance(ev, BlockRemoved):
        return {
            "type": "removed",
            "hashes": [as_int(h) for h in ev.block_hashes],
            "medium": ev.medium,
            "group": getattr(ev, "group_idx", None),
        }
    if isinstance(ev, AllBlocksCleared):
        return {"type": "cleared", "medium": getattr(ev, "medium", None)}
    return {"type": "other", "repr": repr(ev)}


def main():
    out_path = sys.argv[1]
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    ctx = zmq.Context()
    poller = zmq.Poller()
    socks = {}
    for spec in sys.argv[2:]:
        name, rank, endpoint = spec.split(":", 2)
        s = ctx.socket(zmq.SUB)
        s.setsockopt(zmq.RCVHWM, 0)  # never drop: the recorder is the ground truth
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SUBSCRIBE, b"")
        s.connect(endpoint)
        poller.register(s, zmq.POLLIN)
        socks[s] = (name, int(rank))
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    with open(out_path, "w") as out:
        open(out_path + ".ready", "w").close()
        while not stop:
            for s, _ in poller.poll(100):
                frames = s.recv_multipart()
                name, rank = socks[s]
                line = {"src": name, "rank": rank, "t": time.time()}
                if len(frames) != 3 or len(frames[1]) != 8:
                    line["error"] = f"unexpected frames: {[len(f) for f in frames]}"
                else:
                    line["seq"] = int.from_bytes(frames[1], "big")
                    try:
                        batch = decoder.decode(frames[2])
                        line["ts"] = batch.ts
                        line["dp_rank"] = batch.data_parallel_rank
                        line["events"] = [event_json(e) for e in batch.events]
                    except Exception as e:  # noqa: BLE001 - recorded, judged by the driver
                        line["error"] = f"undecodable: {e}"
                out.write(json.dumps(line) + "\n")
                out.flush()
    for s in socks:
        s.close()
    ctx.term()


if __name__ == "__main__":
    main()
