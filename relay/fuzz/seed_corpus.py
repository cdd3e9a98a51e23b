#!/usr/bin/env python3
"""Writes the fuzzers' seed corpora from the capture fixtures (not committed: regenerate).

    python3 relay/fuzz/seed_corpus.py [FIXTURES_DIR]   # default: testdata/fixtures

corpus/decode_batch/: every distinct batch payload of every fixture.
corpus/frames/: every fixture cut into runs of up to 8 consecutive messages, in the `frames`
target's layout (mode byte, then u16-LE-length-prefixed frames).
"""
import base64, hashlib, json, os, pathlib, sys

here = pathlib.Path(__file__).resolve().parent
fixtures = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else here / "../../testdata/fixtures")
out_batch = here / "corpus/decode_batch"
out_frames = here / "corpus/frames"
out_batch.mkdir(parents=True, exist_ok=True)
out_frames.mkdir(parents=True, exist_ok=True)


def write(d, data):
    (d / hashlib.sha1(data).hexdigest()).write_bytes(data)


def encode(msg):
    frames = [base64.b64decode(f) for f in msg["frames"]]
    mode = (1 if msg["socket"] == "replay" else 0) | ((len(frames) - 1) & 7) << 1
    out = bytes([mode])
    for f in frames:
        f = f[:0xFFFF]
        out += len(f).to_bytes(2, "little") + f
    return out


n_batch = n_frames = 0
for path in sorted(fixtures.glob("*.jsonl")):
    msgs = [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
    for m in msgs:
        frames = [base64.b64decode(f) for f in m["frames"]]
        if frames and frames[-1]:
            write(out_batch, frames[-1])
            n_batch += 1
    for i in range(0, len(msgs), 8):
        write(out_frames, b"".join(encode(m) for m in msgs[i : i + 8]))
        n_frames += 1
print(f"decode_batch: {n_batch} payloads, frames: {n_frames} runs (before dedup)")
