"""A seeded corpus of mangled Arrow IPC bodies, and the check that decoding each one answers cleanly.

    python -m tests.collector.fuzz_bodies --cases 3000 --seed 17     # prints one JSON line of counts

Valid bodies of every record kind (1, 3 and 40 rows, nulls in optional columns) are mangled four
ways: one byte flipped, a few bytes flipped, truncated, and truncated with the end-of-stream marker
put back (which gets past the quick truncation check into the IPC reader). Each case goes through
``collector.routes.parse_body`` as the ingest route calls it; a case must either be refused with a
4xx ``BadBatchError`` or give tables that re-encode, decode and validate fully (what the spool and
the writer do next). Run as a child process by the tests, so a crash (a segfault in native code)
is a failed test, not a dead test run: exit status 0 only when every case answered cleanly.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections import Counter
from datetime import UTC, datetime, timedelta

import orjson
import pyarrow as pa

from collector import records
from collector.routes import ARROW_STREAM, BadBatchError, parse_body
from collector.spool import IpcStream, decode_payload, encode_payload
from tests.collector.helpers import arrow_body, event_row, step_rows

_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"


def _rows(kind: str, n: int) -> list[dict]:
    now = datetime.now(UTC) - timedelta(hours=1)
    if kind == "step":
        return step_rows(n, decode_ms=None if n % 2 else 3.5, fp8_saturated=0.25)
    if kind == "event":
        return [event_row(session_id=f"s{i}", detail={"i": i, "text": "x" * i}) for i in range(n)]
    common = {"worker_id": "w1", "release": "r1", "gpu_kind": "NVIDIA H200"}
    if kind == "gpu_sample":
        return [{**common, "session_id": "s1", "ts": now + timedelta(seconds=i), "gpu_index": i % 8,
                 "power_w": 500.5, "energy_mj": None, "sm_clock_mhz": 1980, "mem_used_bytes": 10 + i,
                 "temp_c": 61.0, "throttle_reasons": 0} for i in range(n)]
    return [{**common, "session_id": f"s{i}", "ts": now, "phase": "end", "first_forward_tokens": 1560,
             "streamed_s": 30.0, "frames": 720, "avg_fps": 24.0, "late_chunks": 0, "stall_ms": 0.0,
             "tp_size": 1, "shape": "1x4x60x104", "switches": "ring_cache"} for i in range(n)]


def crafted_invalid_offsets() -> bytes:
    """A step body whose ``session_id`` offsets are ``[0, -5, 22, 33]`` (framing intact): before full
    validation, pyarrow compute read out of bounds on it and the server process hung."""
    import numpy as np

    t = records.to_arrow("step", step_rows(3))
    i = t.schema.get_field_index("session_id")
    offsets = pa.py_buffer(np.array([0, -5, 22, 33], dtype=np.int32).tobytes())
    bad = pa.Array.from_buffers(pa.string(), 3, [None, offsets, pa.py_buffer(b"s1" * 20)])
    cols = [bad if j == i else c.combine_chunks() for j, c in enumerate(t.columns)]
    return arrow_body("step", [], pa.Table.from_batches([pa.RecordBatch.from_arrays(cols, schema=t.schema)]))


def seeds() -> list[bytes]:
    """Valid bodies: every kind, a few sizes."""
    return [arrow_body(kind, _rows(kind, n)) for kind in ("step", "gpu_sample", "session", "event") for n in (1, 3, 40)]


def mangle(body: bytes, rng: random.Random) -> bytes:
    how = rng.randrange(4)
    b = bytearray(body)
    if how == 0:  # one byte
        b[rng.randrange(len(b))] = rng.randrange(256)
    elif how == 1:  # a few bytes, often in the record batch (past the schema message)
        lo = rng.choice((0, len(b) // 2))
        for _ in range(rng.randint(2, 8)):
            b[rng.randrange(lo, len(b))] = rng.randrange(256)
    elif how == 2:  # truncated
        del b[rng.randrange(len(b)):]
    else:  # truncated, then closed again: into the IPC reader
        del b[rng.randrange(len(b)):]
        b += _EOS
    return bytes(b)


def check(body: bytes) -> str:
    """One case -> its outcome ("refused 4xx", "accepted"); raises on anything else."""
    try:
        tables = parse_body(ARROW_STREAM, body)
    except BadBatchError as e:
        if not 400 <= e.status < 500:
            raise AssertionError(f"status {e.status}: {e}") from e
        return f"refused {e.status}"
    # what the spool and the writer do with an accepted batch
    _, back = decode_payload(encode_payload("fuzz", tables)[0])
    for kind, t in tables.items():
        t = t.table if isinstance(t, IpcStream) else t
        t.validate(full=True)
        if t.schema != records.ARROW_SCHEMAS[kind] or not back[kind].equals(t):
            raise AssertionError(f"accepted {kind} table does not round-trip through the spool")
    return "accepted"


def run(cases: int, seed: int) -> Counter:
    rng = random.Random(seed)
    corpus = seeds()
    out: Counter = Counter()
    for i in range(cases):
        body = mangle(corpus[i % len(corpus)], rng)
        try:
            out[check(body)] += 1
        except Exception as e:  # noqa: BLE001 (reported with the case, so it can be replayed)
            print(f"case {i} (seed {seed}) failed: {type(e).__name__}: {e}; body {body.hex()}", file=sys.stderr)
            out["failed"] += 1
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=3000)
    p.add_argument("--seed", type=int, default=17)
    p.add_argument("--crafted", action="store_true", help="only the crafted invalid-offsets body")
    a = p.parse_args(argv)
    if a.crafted:
        try:
            parse_body(ARROW_STREAM, crafted_invalid_offsets())
        except BadBatchError as e:
            print(orjson.dumps({"status": e.status, "detail": str(e)}).decode(), flush=True)
            return 0
        print("the crafted body was accepted", file=sys.stderr)
        return 1
    counts = run(a.cases, a.seed)
    print(orjson.dumps(dict(counts)).decode(), flush=True)
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
