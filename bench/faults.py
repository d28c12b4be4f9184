"""Acked, lost and duplicated rows through a bad day: kill -9 x N, a write-refusing outage, a retry storm.

    python bench/faults.py                          # ~4 min on 2 cores: 5 kills, a 120 s outage, a 20 s storm
    python bench/faults.py --kills 2 --outage-s 10 --storm-s 5     # a quick look

Starts ``livestep serve --role collector`` (embedded chDB, fsync'd spool) as a subprocess on a fresh
directory and an ephemeral loopback port, and loads it from threads posting 100-row Arrow batches,
each its own session with a unique Idempotency-Key; a client retries a batch (same body, same key)
until it is acked, as the shipping client does. In one run:

1. ``--kills`` times: SIGKILL the server while traffic flows, restart it at once;
2. a write-refusing outage of ``--outage-s``: the store refuses every insert while it answers pings
   (the drill hook ``LIVESTEP_FAULT_REFUSE_WRITES_FILE``, as ClickHouse's TOO_MANY_PARTS would; the
   real store's refusal is tests/collector/test_store_refusing_writes.py), then recovers;
3. a retry storm of ``--storm-s``: every batch posted 3 times at once, plus re-posts of acked ones.

Then the spool is drained, the server stopped, and the store counted: acked rows (rows of batches
answered 200 and not duplicate), lost (acked rows missing from the store) and duplicated (rows stored
more than once). Prints a table, then LAST the ratio stored/acked (baseline: every acked row stored once).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import httpx
import pyarrow as pa

from collector import records

TOKEN = "faults-bench-token"
ARROW = "application/vnd.apache.arrow.stream"
ROWS = 100


def body(i: int, t0: datetime) -> bytes:
    rows = [{"worker_id": "w1", "session_id": f"f{i}", "release": "r1", "gpu_kind": "cpu",
             "ts": t0 + timedelta(milliseconds=166 * j), "step": j, "diffusion_ms": 150.5, "step_period_ms": 166.5,
             "late": False, "playout_depth": 2, "reset_step": False, "mem_allocated_bytes": 1000,
             "mem_reserved_bytes": 4096, "buffers_registered": 1, "switches": "ring_cache,rope_at_write"}
            for j in range(ROWS)]
    table = records.to_arrow("step", rows)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


class Server:
    def __init__(self, work: Path):
        self.work = work
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.refuse = work / "refuse-writes"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = {**os.environ, "LIVESTEP_INGEST_TOKENS": TOKEN, "LIVESTEP_FAULT_REFUSE_WRITES_FILE": str(self.refuse),
               "LIVESTEP_FLUSH_INTERVAL_S": "0.1", "LIVESTEP_RETRY_MAX_S": "1", "LIVESTEP_SPOOL_MAX_BYTES": str(2 << 30)}
        cmd = [sys.executable, "-m", "api.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port), "--role",
               "collector", "--dsn", f"chdb://{self.work / 'chdb'}", "--spool-dir", str(self.work / "spool"),
               "--log-level", "warning"]
        log = open(self.work / "serve.log", "ab")  # noqa: SIM115 (the child writes it)
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/v1/health", timeout=2).status_code in (200, 503):
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError("server did not start: " + (self.work / "serve.log").read_text()[-2000:])

    def health(self) -> dict:
        return httpx.get(f"{self.url}/v1/health", timeout=10).json()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)


class Load:
    """Threads posting batch after batch; each batch retried (same body, key) until acked."""

    def __init__(self, url: str, threads: int, rate: float):
        self.url, self.threads, self.rate = url, threads, rate
        self.t0 = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=1)
        self.next = 0
        self.acked: dict[int, int] = {}  # batch -> rows, first ack that was not a duplicate
        self.dup_acks = 0
        self.attempts = 0
        self.storm = threading.Event()
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.bodies: dict[int, bytes] = {}

    def _post(self, h: httpx.Client, i: int) -> bool:
        try:
            r = h.post("/v1/telemetry", content=self.bodies[i],
                       headers={"authorization": f"Bearer {TOKEN}", "content-type": ARROW, "idempotency-key": f"b{i}"})
        except httpx.HTTPError:
            return False
        with self.lock:
            self.attempts += 1
            if r.status_code != 200:
                return False
            if r.json()["duplicate"]:
                self.dup_acks += 1
            else:
                self.acked.setdefault(i, sum(r.json()["rows"].values()))
        return True

    def _worker(self) -> None:
        with httpx.Client(base_url=self.url, timeout=10) as h:
            while not self.stop.is_set():
                with self.lock:
                    i, self.next = self.next, self.next + 1
                self.bodies[i] = body(i, self.t0)
                copies = 3 if self.storm.is_set() else 1
                while True:
                    ok = [self._post(h, i) for _ in range(copies)]
                    if self.storm.is_set() and self.acked:  # and a re-post of an earlier acked batch
                        self._post(h, random.choice(list(self.acked)))
                    if any(ok):
                        break
                    time.sleep(0.2)  # refused (429, down): retry the same batch
                time.sleep(self.threads / self.rate)

    def start(self) -> None:
        self.ts = [threading.Thread(target=self._worker, daemon=True) for _ in range(self.threads)]
        for t in self.ts:
            t.start()

    def finish(self) -> None:
        self.stop.set()
        for t in self.ts:
            t.join(300)


def count(work: Path) -> tuple[int, int]:
    code = ("import sys, chdb; print(chdb.query('SELECT count(), uniqExact(session_id, step) FROM livestep.steps', "
            "'CSV', path=sys.argv[1]))")
    out = subprocess.run([sys.executable, "-c", code, str(work / "chdb")], capture_output=True, text=True, check=True)
    n, distinct = out.stdout.strip().split(",")
    return int(n), int(distinct)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--kill-every-s", type=float, default=6.0)
    p.add_argument("--outage-s", type=float, default=120.0)
    p.add_argument("--storm-s", type=float, default=20.0)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--rate", type=float, default=40.0, help="batches per second offered (all threads)")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="livestep-faults-"))
    srv = Server(work)
    srv.start()
    load = Load(srv.url, a.threads, a.rate)
    load.start()
    phases = []
    t = time.monotonic()
    time.sleep(5)
    for _ in range(a.kills):
        time.sleep(a.kill_every_s)
        srv.kill()
        srv.start()
    phases.append(("kill -9 + restart", f"x{a.kills}", time.monotonic() - t))
    t = time.monotonic()
    srv.refuse.touch()
    degraded = False
    while time.monotonic() - t < a.outage_s:
        time.sleep(2)
        h = srv.health()
        degraded |= h["status"] == "degraded" and h["store"]["reachable"]
    srv.refuse.unlink()
    phases.append(("writes refused, pings answer", f"health degraded: {degraded}", time.monotonic() - t))
    t = time.monotonic()
    load.storm.set()
    time.sleep(a.storm_s)
    load.storm.clear()
    phases.append(("retry storm (3 copies + re-posts)", "", time.monotonic() - t))
    load.finish()
    t = time.monotonic()
    while srv.health()["spool"]["batches"]:
        time.sleep(0.5)
    phases.append(("drain", "", time.monotonic() - t))
    quarantined = srv.health()["quarantine"]["batches"]
    srv.stop()
    stored, distinct = count(work)
    acked = sum(load.acked.values())
    lost = acked - distinct  # every batch is its own session of steps 0..99: distinct (session, step) rows
    dup = stored - distinct
    print(f"{'phase':36s} {'note':28s} {'seconds':>8s}")
    for name, note, s in phases:
        print(f"{name:36s} {note:28s} {s:8.1f}")
    print()
    print(f"{'batches acked':36s} {len(load.acked):>10d}")
    print(f"{'requests (all attempts)':36s} {load.attempts:>10d}")
    print(f"{'acks marked duplicate':36s} {load.dup_acks:>10d}")
    print(f"{'rows acked':36s} {acked:>10d}")
    print(f"{'rows stored':36s} {stored:>10d}")
    print(f"{'rows lost (acked, not stored)':36s} {lost:>10d}")
    print(f"{'rows duplicated (stored twice)':36s} {dup:>10d}")
    print(f"{'batches quarantined':36s} {quarantined:>10d}")
    print(f"stored/acked (baseline: every acked row stored once = 1.0000): {stored / acked:.4f}")
    shutil.rmtree(work, ignore_errors=True)
    return 0 if lost == 0 and dup == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
