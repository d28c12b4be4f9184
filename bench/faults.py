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

``--spool`` runs the spool's faults instead (``spool_faults``): kill -9 aimed between the writer's insert and its
commit (``--aimed-kills``, session_stats against the raw table), the spool on a full tmpfs (root), and keys spelled
like other batches' ids.

Then the spool is drained, the server stopped, and the store counted: acked rows (rows of batches
answered 200 and not duplicate), lost (acked rows missing from the store) and duplicated (rows stored
more than once). Prints a table, then LAST the ratio stored/acked (baseline: every acked row stored once).

    python bench/faults.py --http-faults            # ~2 min: only the connection and body faults below

``--http-faults`` instead holds 200 slow and idle connections (a head, a body sent a byte every 0.25 s,
and silent ones; the server's default deadlines, api/http_limits.py) while an ordinary client keeps
posting, and posts a zstd body that decodes to 2,000,000 rows; it prints when each kind was closed,
what was answered, the server's peak RSS, and LAST the ordinary client's median latency while the
connections are held over its median without them (measured in the same run).
"""

from __future__ import annotations

import argparse
import hashlib
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
    def __init__(self, work: Path, spool_dir: Path | None = None, env: dict[str, str] | None = None):
        self.work = work
        self.spool_dir = spool_dir or work / "spool"
        self.extra_env = env or {}
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.refuse = work / "refuse-writes"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = {**os.environ, "LIVESTEP_INGEST_TOKENS": TOKEN, "LIVESTEP_FAULT_REFUSE_WRITES_FILE": str(self.refuse),
               "LIVESTEP_FLUSH_INTERVAL_S": "0.1", "LIVESTEP_RETRY_MAX_S": "1", "LIVESTEP_SPOOL_MAX_BYTES": str(2 << 30), **self.extra_env}
        cmd = [sys.executable, "-m", "api.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port), "--role",
               "collector", "--dsn", f"chdb://{self.work / 'chdb'}", "--spool-dir", str(self.spool_dir),
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


def _rss_peak_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _ordinary_latencies(url: str, seconds: float) -> list[float]:
    """An ordinary worker's requests for ``seconds``: a 100-row batch, then a health check; latency each."""
    out, t0, i, run = [], datetime.now(UTC), 0, random.getrandbits(32)
    end = time.monotonic() + seconds
    with httpx.Client(base_url=url, timeout=60) as h:
        while time.monotonic() < end:
            t = time.perf_counter()
            r = h.post("/v1/telemetry", content=body(10_000_000 + i, t0), headers={
                "Authorization": f"Bearer {TOKEN}", "content-type": ARROW, "idempotency-key": f"ordinary-{run}-{i}"})
            out.append(time.perf_counter() - t)
            if r.status_code != 200:
                raise RuntimeError(f"ordinary client refused: {r.status_code} {r.text[:200]}")
            i += 1
            time.sleep(0.05)
    return out


def slow_clients_fault(srv: Server, n: int = 200, until_s: float = 300.0) -> dict:
    """``n`` connections, a third each: a head, a body (Content-Length 100000) sent a byte every 0.25 s,
    and silent ones, held until the server closes them; an ordinary client posts meanwhile."""
    import selectors

    kinds = ("head", "body", "idle")
    head = (b"POST /v1/telemetry HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode()
            + b"\r\nContent-Type: " + ARROW.encode() + b"\r\nContent-Length: 100000\r\n\r\n")
    conns = []
    sel = selectors.DefaultSelector()
    for i in range(n):
        sock = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        kind = kinds[i % 3]
        sock.sendall({"head": b"GET /v1/health HTTP/1.1\r\n", "body": head, "idle": b""}[kind])
        sock.setblocking(False)
        c = {"kind": kind, "sock": sock, "t0": time.monotonic(), "closed": None, "answer": b""}
        conns.append(c)
        sel.register(sock, selectors.EVENT_READ, c)
    latencies: list[float] = []
    errors: list[str] = []

    def ordinary() -> None:
        try:
            latencies.extend(_ordinary_latencies(srv.url, 15.0))
        except Exception as e:  # noqa: BLE001 - reported in the table, not lost in a thread
            errors.append(f"{type(e).__name__}: {e}"[:300])

    side = threading.Thread(target=ordinary, daemon=True)
    side.start()
    end, drip = time.monotonic() + until_s, 0.0
    while time.monotonic() < end and any(c["closed"] is None for c in conns):
        for key, _ in sel.select(timeout=0.05):
            c = key.data
            try:
                data = c["sock"].recv(65536)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            c["answer"] += data
            if not data:
                c["closed"] = time.monotonic() - c["t0"]
                sel.unregister(c["sock"])
                c["sock"].close()
        if time.monotonic() >= drip:
            for c in conns:
                if c["closed"] is None and c["kind"] != "idle":
                    try:
                        c["sock"].send(b"X" if c["kind"] == "head" else b"\x00")
                    except OSError:
                        pass
            drip = time.monotonic() + 0.25
    side.join(60)
    out = {}
    for kind in kinds:
        mine = [c for c in conns if c["kind"] == kind]
        closed = sorted(c["closed"] for c in mine if c["closed"] is not None)
        out[kind] = {"held": len(mine), "closed": len(closed),
                     "answered_408": sum(c["answer"].startswith(b"HTTP/1.1 408") for c in mine),
                     "first_s": closed[0] if closed else None, "last_s": closed[-1] if closed else None}
        for c in mine:
            if c["closed"] is None:
                c["sock"].close()
    out["latencies"], out["errors"] = latencies, errors
    return out


def bomb_fault(srv: Server, rows: int = 2_000_000) -> dict:
    """A zstd Arrow body of ``rows`` step rows (10,000 rows written ``rows / 10,000`` times): the answer
    and the server's peak RSS around it."""
    one = records.to_arrow("step", [{"worker_id": "w1", "session_id": "bomb", "release": "r1", "gpu_kind": "cpu",
                                     "ts": datetime.now(UTC), "step": 1, "diffusion_ms": 150.5,
                                     "step_period_ms": 166.5, "late": False, "playout_depth": 2,
                                     "reset_step": False, "mem_allocated_bytes": 1000, "mem_reserved_bytes": 4096,
                                     "buffers_registered": 1, "switches": "ring_cache"}] * 10_000)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, one.schema, options=pa.ipc.IpcWriteOptions(compression="zstd")) as w:
        for _ in range(rows // 10_000):
            w.write_table(one)
    bomb = sink.getvalue().to_pybytes()
    before = _rss_peak_mb(srv.proc.pid)
    t = time.perf_counter()
    r = httpx.post(f"{srv.url}/v1/telemetry", content=bomb, timeout=300,
                   headers={"Authorization": f"Bearer {TOKEN}", "content-type": ARROW})
    return {"body_mb": len(bomb) / 1e6, "decoded_mb": rows * one.get_total_buffer_size() / 10_000 / 1e6,
            "status": r.status_code, "detail": r.json().get("detail", "")[:90], "seconds": time.perf_counter() - t,
            "rss_before_mb": before, "rss_after_mb": _rss_peak_mb(srv.proc.pid)}


def http_faults_main() -> int:
    """``--http-faults``: slow and idle connections, then a decompression bomb; a table, the ratio last."""
    import statistics

    work = Path(tempfile.mkdtemp(prefix="livestep-http-faults-"))
    srv = Server(work)
    srv.start()
    try:
        baseline = _ordinary_latencies(srv.url, 10.0)
        held = slow_clients_fault(srv)
        bomb = bomb_fault(srv)
        alive = httpx.get(f"{srv.url}/v1/health", timeout=30).status_code
    finally:
        srv.stop()
        shutil.rmtree(work, ignore_errors=True)
    limits = {"idle": "LIVESTEP_IDLE_TIMEOUT_S", "head": "LIVESTEP_HEADER_TIMEOUT_S", "body": "LIVESTEP_BODY_TIMEOUT_S"}
    from api.http_limits import HttpLimits

    deadline = {"idle": HttpLimits().idle_timeout_s, "head": HttpLimits().header_timeout_s,
                "body": HttpLimits().body_timeout_s}
    print(f"{'connection':10s} {'held':>5s} {'closed':>7s} {'408':>5s} {'deadline s':>11s} {'first s':>8s} "
          f"{'last s':>8s}  bound")
    for kind in ("head", "body", "idle"):
        k = held[kind]
        print(f"{kind:10s} {k['held']:5d} {k['closed']:7d} {k['answered_408']:5d} {deadline[kind]:11.1f} "
              f"{k['first_s'] or float('nan'):8.2f} {k['last_s'] or float('nan'):8.2f}  {limits[kind]}")
    print()
    print(f"zstd bomb: {bomb['body_mb']:.1f} MB body, {bomb['decoded_mb']:.0f} MB decoded -> {bomb['status']} in "
          f"{bomb['seconds']:.2f} s ({bomb['detail']}...)")
    print(f"server peak RSS: {bomb['rss_before_mb']:.0f} MB before the bomb, {bomb['rss_after_mb']:.0f} MB after")
    print(f"server answers after both: {alive}")
    if held["errors"]:
        print(f"ordinary client failed while the connections were held: {held['errors'][0]}")
        return 1
    base, loaded = statistics.median(baseline), statistics.median(held["latencies"])
    print(f"ordinary POST median: {base * 1e3:.1f} ms alone ({len(baseline)} requests), {loaded * 1e3:.1f} ms with "
          f"200 slow connections held ({len(held['latencies'])} requests)")
    print(f"ordinary latency held/alone (baseline: no slow connections = 1.00): {loaded / base:.2f}")
    closed_all = all(held[k]["closed"] == held[k]["held"] for k in ("head", "body", "idle"))
    return 0 if closed_all and bomb["status"] == 413 and alive == 200 else 1


def main() -> int:
    if "--http-faults" in sys.argv[1:]:
        return http_faults_main()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_spool_args(p)
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--kill-every-s", type=float, default=6.0)
    p.add_argument("--outage-s", type=float, default=120.0)
    p.add_argument("--storm-s", type=float, default=20.0)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--rate", type=float, default=40.0, help="batches per second offered (all threads)")
    a = p.parse_args()
    if a.spool:
        return spool_faults(a)
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



# -- the spool's faults (issue 30 items 1, 2, 4): ``python bench/faults.py --spool`` ------------------------
def add_spool_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the spool's faults (--spool runs these instead of the bad day above)")
    g.add_argument("--spool", action="store_true", help="aimed kills, a full spool disk, keys in their own namespace")
    g.add_argument("--aimed-kills", type=int, default=20, help="kill -9 between the writer's insert and its commit")
    g.add_argument("--disk-mib", type=int, default=6, help="the spool's tmpfs (needs root; skipped otherwise)")


def stats_vs_raw(work: Path) -> tuple[int, int, int]:
    """(raw steps, steps counted by session_stats, sessions whose two counts differ)."""
    code = ("import sys, chdb; print(chdb.query(\"SELECT (SELECT count() FROM livestep.steps), "
            "(SELECT countMerge(steps) FROM livestep.session_stats), (SELECT count() FROM (SELECT session_id, "
            "countMerge(steps) AS n FROM livestep.session_stats GROUP BY session_id) AS v FULL JOIN (SELECT "
            "session_id, count() AS m FROM livestep.steps GROUP BY session_id) AS r USING session_id WHERE n != m)\", "
            "'CSV', path=sys.argv[1]))")
    out = subprocess.run([sys.executable, "-c", code, str(work / "chdb")], capture_output=True, text=True, check=True)
    raw, view, off = out.stdout.strip().split(",")
    return int(raw), int(view), int(off)


class AckedLoad(Load):
    """``Load`` that also remembers every batch answered 200, duplicate or not: a batch whose first ack
    a kill cut off is acked by its retry as a duplicate, and must be stored all the same."""

    def __init__(self, *args):
        super().__init__(*args)
        self.any_ack: set[int] = set()

    def _post(self, h: httpx.Client, i: int) -> bool:
        ok = super()._post(h, i)
        if ok:
            with self.lock:
                self.any_ack.add(i)
        return ok


def whole_sessions(work: Path) -> set[int]:
    """The batches (sessions ``f<i>``) stored whole: all their ROWS steps."""
    code = ("import sys, chdb; print(chdb.query(\"SELECT session_id FROM livestep.steps GROUP BY session_id "
            f"HAVING uniqExact(step) = {ROWS}\", 'CSV', path=sys.argv[1]))")
    out = subprocess.run([sys.executable, "-c", code, str(work / "chdb")], capture_output=True, text=True, check=True)
    return {int(ln.strip().strip('"')[1:]) for ln in out.stdout.split() if ln.strip()}


def aimed_kills(kills: int, threads: int, rate: float) -> tuple[list[tuple[str, str]], float]:
    """kill -9 while the writer holds a block stored and not committed (the drill hook
    ``LIVESTEP_FAULT_PAUSE_BEFORE_COMMIT_FILE``), ``kills`` times: each start replays that block."""
    work = Path(tempfile.mkdtemp(prefix="livestep-aimed-"))
    pause = work / "pause-before-commit"
    paused = pause.with_name(pause.name + ".paused")
    srv = Server(work, env={"LIVESTEP_FAULT_PAUSE_BEFORE_COMMIT_FILE": str(pause)})
    srv.start()
    load = AckedLoad(srv.url, threads, rate)
    load.start()
    aimed = 0
    for _ in range(kills):
        time.sleep(1.0)  # traffic flows into a fresh process
        pause.touch()
        deadline = time.monotonic() + 60
        while not paused.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        aimed += paused.exists()
        srv.kill()  # the block is in the store, its spool commit not logged
        pause.unlink()
        paused.unlink(missing_ok=True)
        srv.start()
    load.finish()
    while srv.health()["spool"]["batches"]:
        time.sleep(0.5)
    srv.stop()
    stored, distinct = count(work)
    raw, view, off = stats_vs_raw(work)
    whole = whole_sessions(work)
    shutil.rmtree(work, ignore_errors=True)
    return [("kills aimed between insert and commit", f"{aimed} of {kills}"),
            ("batches acked (200, duplicate or not)", str(len(load.any_ack))),
            ("rows acked", str(ROWS * len(load.any_ack))),
            ("rows lost (acked, not stored)", str(ROWS * len(load.any_ack - whole))),
            ("rows stored, ack cut off by a kill", str(ROWS * len(whole - load.any_ack))),
            ("rows duplicated (stored twice)", str(stored - distinct)),
            ("session_stats steps / raw steps", f"{view} / {raw}"),
            ("sessions where session_stats != raw", str(off))], (view / raw if raw else float("nan"))


def full_disk(disk_mib: int) -> list[tuple[str, str]]:
    """The spool on a ``disk_mib`` tmpfs, the store refusing writes: ingest until the disk is full, then the
    store recovers; how long after the spool drained ingest is taken again, and what health said."""
    if os.geteuid() != 0:
        return [("full spool disk", "skipped: mounting a tmpfs needs root")]
    work = Path(tempfile.mkdtemp(prefix="livestep-disk-"))
    mnt = work / "disk"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={disk_mib}m", "tmpfs", str(mnt)], check=True)
    try:
        srv = Server(work, spool_dir=mnt)
        srv.start()
        srv.refuse.touch()
        t0 = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=1)
        refused, i = None, 0
        with httpx.Client(base_url=srv.url, timeout=10) as h:
            def post(n: int) -> int:
                return h.post("/v1/telemetry", content=body(n, t0), headers={
                    "authorization": f"Bearer {TOKEN}", "content-type": ARROW, "idempotency-key": f"d{n}"}).status_code
            while refused is None and i < 100_000:
                code = post(i)
                i += 1
                refused = code if code != 200 else None
            health = srv.health()
            srv.refuse.unlink()
            while srv.health()["spool"]["batches"]:
                time.sleep(0.05)
            drained = time.monotonic()
            while post(i) != 200:
                time.sleep(0.05)
            back_s = time.monotonic() - drained
            after = srv.health()
        srv.stop()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
        shutil.rmtree(work, ignore_errors=True)
    return [(f"spool on a {disk_mib} MiB tmpfs, store refusing", f"{i - 1} batches taken, then {refused}"),
            ("health while refused", f"{health['status']}: " + "; ".join(r[:60] for r in health["reasons"])),
            ("ingest back after the spool drained (s)", f"{back_s:.2f}"),
            ("health after", after["status"])]


def key_namespace() -> list[tuple[str, str]]:
    """Keys spelled like other batches' spool ids, and a previous release's bare key with another body:
    each must be stored (duplicate: false), never acked as a duplicate and dropped."""
    from collector.spool import Spool

    work = Path(tempfile.mkdtemp(prefix="livestep-keys-"))
    second = "faults-bench-token-2"
    t0 = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=1)
    old = Spool(work / "spool", max_bytes=1 << 26)  # a previous release spooled batch "legacy-1" under the bare key
    old.submit("legacy-1", {"step": pa.ipc.open_stream(body(900, t0)).read_all()}).result()
    old.close()
    srv = Server(work, env={"LIVESTEP_INGEST_TOKENS": f"{TOKEN},{second}"})
    srv.start()
    wrong = 0
    cases = []
    with httpx.Client(base_url=srv.url, timeout=10) as h:
        def post(n: int, key: str | None, token: str = TOKEN) -> dict:
            hd = {"authorization": f"Bearer {token}", "content-type": ARROW}
            if key is not None:
                hd["idempotency-key"] = key
            return h.post("/v1/telemetry", content=body(n, t0), headers=hd).json()
        unkeyed = post(1, None)["batch_id"]
        post(2, "k-2")
        scoped = f"{hashlib.sha256(TOKEN.encode()).hexdigest()[:16]}/k-2#{hashlib.sha256(body(2, t0)).hexdigest()[:32]}"
        for name, n, key, token in [("key = an unkeyed batch's sha256 id", 3, unkeyed, TOKEN),
                                    ("key = another token's scoped id", 4, scoped, second),
                                    ("previous release's bare key, other rows", 5, "legacy-1", TOKEN)]:
            dup = post(n, key, token)["duplicate"]
            wrong += dup
            cases.append((name, "acked as duplicate (dropped)" if dup else "stored"))
        cases.append(("previous release's bare key, same rows", "duplicate" if post(900, "legacy-1")["duplicate"]
                      else "stored again"))
    while srv.health()["spool"]["batches"]:
        time.sleep(0.2)
    srv.stop()
    stored, _ = count(work)
    shutil.rmtree(work, ignore_errors=True)
    return [*cases, ("bodies dropped as false duplicates", str(wrong)),
            ("rows stored (baseline 6 batches x 100)", str(stored))]


def spool_faults(a: argparse.Namespace) -> int:
    aimed, ratio = aimed_kills(a.aimed_kills, a.threads, a.rate)
    rows = [("-- aimed kills --", ""), *aimed]
    rows += [("-- full spool disk --", ""), *full_disk(a.disk_mib)]
    rows += [("-- keys in their own namespace --", ""), *key_namespace()]
    print(f"{'fault / measure':52s} value")
    for name, value in rows:
        print(f"{name:52s} {value}")
    print(f"session_stats/raw steps after the aimed kills (baseline: the raw table = 1.0000): {ratio:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
