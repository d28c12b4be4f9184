"""Ingest throughput: 100-row batches over HTTP into chDB with the durable ack, vs raw inserts.

    python bench/ingest.py                         # ~70 s on 2 cores: Arrow, JSON, raw baseline
    python bench/ingest.py --duration 10 --load python

Starts ``livestep serve`` (embedded chDB, spool with fsync before the ack) as a subprocess on a
fresh directory and an ephemeral loopback port, then loads it from separate processes: ``wrk``
(Debian package; a Lua script posts a prebuilt 100-row body with a unique ``Idempotency-Key`` per
request) or, with ``--load python`` or without wrk, N processes of httpx loops. A phase's figure is
rows *stored* in ClickHouse (counted in the store once the server is stopped) over the time from
the load's start until the writer had stored every acked row. The baseline, measured in the same
run in a separate process on a separate chDB directory: ``Store.insert_arrow`` of the same 100-row
batches in a loop (and, for reference, of 50,000-row blocks: what the server's writer does).
Prints a table, then LAST the ratio ingest/raw (Arrow path over raw 100-row inserts).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TOKEN = "bench-token"
BATCH_ROWS = 100

WRK_LUA = r"""
local f = assert(io.open(os.getenv("BENCH_BODY"), "rb"))
local body = f:read("*a")
f:close()
local ctype = os.getenv("BENCH_CTYPE")
local auth = "Bearer " .. os.getenv("BENCH_TOKEN")
local run = os.getenv("BENCH_RUN")
local n = 0
local prefix = ""
local counter = 1
function setup(thread)
  thread:set("tid", counter)
  counter = counter + 1
end
function init(args)
  prefix = run .. "-" .. tostring(tid) .. "-"
end
function request()
  n = n + 1
  return wrk.format("POST", nil, {
    ["Host"] = wrk.headers["Host"],
    ["Content-Type"] = ctype,
    ["Authorization"] = auth,
    ["Idempotency-Key"] = prefix .. n,
  }, body)
end
"""


# -- bodies ----------------------------------------------------------------------------------------
def step_rows(n: int, session_id: str) -> list[dict]:
    t0 = datetime.now(UTC) - timedelta(minutes=2)
    return [
        {
            "worker_id": "bench-w1",
            "session_id": session_id,
            "release": "bench",
            "gpu_kind": "H200",
            "ts": t0 + timedelta(milliseconds=167 * i),
            "simulated": True,
            "step": i,
            "diffusion_ms": 150.0 + (i % 13) * 0.7,
            "step_period_ms": 166.7 + (i % 5) * 0.1,
            "decode_ms": 114.0,
            "cache_upkeep_ms": 6.2,
            "attention_ms": 9.1,
            "allreduce_ms": 2.5,
            "late": i % 50 == 0,
            "playout_depth": 3,
            "reset_step": i % 42 == 0,
            "energy_mj": 120_000.0 + i,
            "mem_allocated_bytes": 60 << 30,
            "mem_reserved_bytes": 64 << 30,
            "buffers_registered": 2,
            "switches": "delta_rotation,fp8_cache,ring_cache,rope_at_write",
        }
        for i in range(n)
    ]


def arrow_table(session_id: str):
    from collector import records

    return records.to_arrow("step", step_rows(BATCH_ROWS, session_id))


def arrow_body(session_id: str) -> bytes:
    from collector.client import encode_arrow

    return encode_arrow("step", step_rows(BATCH_ROWS, session_id))


def json_body(session_id: str) -> bytes:
    import orjson

    return orjson.dumps({"schema_version": 1, "steps": step_rows(BATCH_ROWS, session_id)})


# -- the server --------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A ``livestep serve`` subprocess on its own chDB and spool directories."""

    def __init__(self, workdir: Path, port: int):
        self.workdir, self.port = workdir, port
        self.url = f"http://127.0.0.1:{port}"
        self.chdb_dir = workdir / "chdb"
        env = dict(
            os.environ,
            LIVESTEP_CLICKHOUSE_DSN=f"chdb://{self.chdb_dir}",
            LIVESTEP_SPOOL_DIR=str(workdir / "spool"),
            LIVESTEP_INGEST_TOKENS=TOKEN,  # the load sends it: auth is in the measured path
            PYTHONPATH=str(REPO),
        )
        cmd = [sys.executable, "-m", "api.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
        self.log = open(workdir / "server.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        import httpx

        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"livestep serve exited with {self.proc.returncode}: {self.tail()}")
            try:
                if httpx.get(self.url + "/v1/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"livestep serve not ready after {timeout_s} s: {self.tail()}")

    def health(self) -> dict:
        import httpx

        return httpx.get(self.url + "/v1/health", timeout=5.0).json()

    def stored_by_writer(self) -> int | None:
        """Rows the server's block writer has inserted, from /v1/health (None if not reported)."""
        return _find_writer_rows(self.health())

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def tail(self, n: int = 2000) -> str:
        self.log.flush()
        return (self.workdir / "server.log").read_bytes()[-n:].decode(errors="replace")


def _find_writer_rows(obj) -> int | None:
    if isinstance(obj, dict) and isinstance(obj.get("writer"), dict) and "rows" in obj["writer"]:
        return int(obj["writer"]["rows"])
    if isinstance(obj, dict):
        if "rows" in obj and "blocks" in obj and isinstance(obj["rows"], int):
            return obj["rows"]
        for v in obj.values():
            found = _find_writer_rows(v)
            if found is not None:
                return found
    return None


def wait_stored(server: Server, at_least: int, timeout_s: float) -> float | None:
    """Poll until the writer has stored ``at_least`` rows; the monotonic time it did, or None."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        n = server.stored_by_writer()
        if n is None:
            return None
        if n >= at_least:
            return time.monotonic()
        time.sleep(0.05)
    return None


# -- load ---------------------------------------------------------------------------------------------
def run_wrk(url: str, body_file: Path, ctype: str, duration_s: float, connections: int, threads: int) -> dict:
    lua = body_file.with_suffix(".lua")
    lua.write_text(WRK_LUA)
    env = dict(
        os.environ,
        BENCH_BODY=str(body_file),
        BENCH_CTYPE=ctype,
        BENCH_TOKEN=TOKEN,
        BENCH_RUN=uuid.uuid4().hex,
    )
    cmd = [
        "wrk",
        "-t",
        str(threads),
        "-c",
        str(connections),
        "-d",
        f"{int(duration_s)}s",
        "-s",
        str(lua),
        "--latency",
    ]
    out = subprocess.run(
        [*cmd, url + "/v1/telemetry"], env=env, capture_output=True, text=True, check=True
    ).stdout
    total = non2xx = 0
    p99 = ""
    for line in out.splitlines():
        parts = line.split()
        if "requests in" in line:
            total = int(parts[0])
        elif line.strip().startswith("Non-2xx or 3xx responses:"):
            non2xx = int(parts[-1])
        elif line.strip().startswith("99%"):
            p99 = parts[1]
    return {"requests": total, "ok": total - non2xx, "non2xx": non2xx, "p99": p99, "raw": out}


def _py_loader(url: str, body: bytes, ctype: str, duration_s: float, conns: int, q) -> None:
    import threading

    import httpx

    ok = bad = 0
    lock = threading.Lock()
    end = time.monotonic() + duration_s

    def loop():
        nonlocal ok, bad
        with httpx.Client(timeout=30.0) as c:
            prefix = uuid.uuid4().hex
            i = 0
            while time.monotonic() < end:
                i += 1
                h = {
                    "Content-Type": ctype,
                    "Authorization": f"Bearer {TOKEN}",
                    "Idempotency-Key": f"{prefix}-{i}",
                }
                try:
                    r = c.post(url + "/v1/telemetry", content=body, headers=h)
                    good = r.status_code == 200
                except httpx.HTTPError:
                    good = False
                with lock:
                    ok, bad = ok + good, bad + (not good)

    ts = [threading.Thread(target=loop) for _ in range(conns)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    q.put((ok, bad))


def run_python_load(url: str, body: bytes, ctype: str, duration_s: float, procs: int, conns: int) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=_py_loader, args=(url, body, ctype, duration_s, conns, q)) for _ in range(procs)]
    for p in ps:
        p.start()
    res = [q.get(timeout=duration_s + 60) for _ in ps]
    for p in ps:
        p.join()
    ok, bad = sum(r[0] for r in res), sum(r[1] for r in res)
    return {"requests": ok + bad, "ok": ok, "non2xx": bad, "p99": "", "raw": ""}


# -- where the server's time goes ---------------------------------------------------------------------
def start_profile(server: Server, workdir: Path, duration_s: float) -> subprocess.Popen | None:
    if not shutil.which("py-spy"):
        print("bench: --profile needs py-spy (pip install py-spy); not profiling", file=sys.stderr)
        return None
    secs = str(max(1, int(duration_s) - 2))
    cmd = [
        "py-spy",
        "record",
        "-p",
        str(server.proc.pid),
        "-d",
        secs,
        "-r",
        "50",
        "-f",
        "raw",
        "--threads",
        "--gil",
    ]
    out = workdir / "profile.txt"
    return subprocess.Popen([*cmd, "-o", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def summarize_profile(path: Path, top: int = 14, dur_s: float = 0.0) -> str:
    """Samples per thread and the project's functions by inclusive samples (py-spy raw output)."""
    from collections import Counter

    if not path.exists():
        return "profile: no samples (py-spy failed: needs ptrace permission)"
    threads, funcs, leaves = Counter(), Counter(), Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        n = int(n)
        total += n
        frames = stack.split(";")
        threads[frames[0].rpartition(": ")[2]] += n
        leaf_fn, _, leaf_where = frames[-1].partition(" (")
        leaves[f"{leaf_fn} ({leaf_where.split('site-packages/')[-1].rstrip(')')})"] += n
        seen = set()
        for f in frames[1:]:
            fn, _, where = f.partition(" (")
            file = where.split(":")[0]
            if ("collector/" in file or "api/routes" in file) and (
                key := f"{fn} ({file.rsplit('/', 2)[-2:][0]}/{file.rsplit('/', 1)[-1]})"
            ) not in seen:
                seen.add(key)
                funcs[key] += n
    lines = [f"\nserver profile during the Arrow load: {total} samples (50 Hz, the thread holding the GIL)"]
    lines += [f"  {100 * n / total:5.1f}%  thread {t}" for t, n in threads.most_common(6)]
    if dur_s:
        lines += [
            f"  (the GIL was held {100 * total / 50 / dur_s:.0f}% of the time: Python runs on one core at a time)"
        ]
    lines += ["  project functions (inclusive):"]
    lines += [f"  {100 * n / total:5.1f}%  {f}" for f, n in funcs.most_common(top)]
    lines += ["  leaf lines (self):"]
    lines += [f"  {100 * n / total:5.1f}%  {f}" for f, n in leaves.most_common(8)]
    return "\n".join(lines)


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds per thread id -> (name, seconds); Python threads are all named 'python'."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    for tid in tids:
        try:
            st = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        name = st[st.index("(") + 1 : st.rindex(")")]
        f = st.rsplit(")", 1)[1].split()
        out[tid] = (name, (int(f[11]) + int(f[12])) / tick)
    return out


def thread_split(before: dict, after: dict) -> str:
    """'Python threads 62%, chDB threads 38% (MergeMutate 6%, ...)' between two snapshots."""
    from collections import Counter

    by = Counter()
    for tid, (name, secs) in after.items():
        by["python" if name == "python" else name] += secs - before.get(tid, (name, 0.0))[1]
    total = sum(by.values())
    if total <= 0:
        return "no CPU accounted"
    py = by.pop("python", 0.0)
    top = ", ".join(f"{n} {100 * v / total:.0f}%" for n, v in by.most_common(4) if v > 0)
    return f"{total:.1f} CPU-s: Python threads {100 * py / total:.0f}%, chDB native threads {100 - 100 * py / total:.0f}% ({top})"


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (Linux /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


# -- raw baseline (own process, own chDB directory) -------------------------------------------------
def raw_worker(chdb_dir: str, duration_s: float, block_rows: int) -> dict:
    import pyarrow as pa

    from collector.store import open_store

    store = open_store(f"chdb://{chdb_dir}")
    store.migrate()
    one = arrow_table("raw")
    table = pa.concat_tables([one] * max(1, block_rows // BATCH_ROWS))
    n = 0
    cpu0 = time.process_time()
    start = time.perf_counter()
    while time.perf_counter() - start < duration_s:
        store.insert_arrow("steps", table, dedup_token=uuid.uuid4().hex)
        n += table.num_rows
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu0
    stored = store.query_rows("SELECT count() FROM steps")[0][0]
    return {"rows": n, "stored": stored, "seconds": elapsed, "rows_per_s": stored / elapsed, "cpu_s": cpu}


def run_raw(workdir: Path, duration_s: float, block_rows: int) -> dict:
    d = workdir / f"raw-{block_rows}"
    cmd = [
        sys.executable,
        __file__,
        "--raw-worker",
        str(d),
        "--duration",
        str(duration_s),
        "--block-rows",
        str(block_rows),
        "--batch-rows",
        str(BATCH_ROWS),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO).stdout
    return json.loads(out.strip().splitlines()[-1])


def count_stored(chdb_dir: Path) -> dict[str, int]:
    """Rows per session in the server's store, read after the server has exited (one process per dir)."""
    from collector.store import open_store

    store = open_store(f"chdb://{chdb_dir}")
    return dict(store.query_rows("SELECT session_id, count() FROM steps GROUP BY session_id"))


def _count_worker(chdb_dir: str) -> None:
    print(json.dumps(count_stored(Path(chdb_dir))))


# -- main ---------------------------------------------------------------------------------------------
def main() -> int:
    global BATCH_ROWS  # one setting for every phase and subprocess of this run
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of Arrow load")
    ap.add_argument("--json-duration", type=float, default=8.0, help="seconds of JSON load")
    ap.add_argument("--raw-duration", type=float, default=6.0, help="seconds of each raw insert baseline")
    ap.add_argument("--connections", type=int, default=32, help="concurrent connections (clients)")
    ap.add_argument("--threads", type=int, default=1, help="wrk threads (or python load processes)")
    ap.add_argument("--load", choices=["auto", "wrk", "python"], default="auto")
    ap.add_argument("--drain-timeout", type=float, default=30.0)
    ap.add_argument("--keep", action="store_true", help="keep the work directory (server log)")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="py-spy the server during the Arrow load; print where its time goes",
    )
    ap.add_argument("--raw-worker", metavar="DIR", help=argparse.SUPPRESS)
    ap.add_argument("--count-worker", metavar="DIR", help=argparse.SUPPRESS)
    ap.add_argument("--block-rows", type=int, default=100, help=argparse.SUPPRESS)
    ap.add_argument("--batch-rows", type=int, default=100, help="rows per request (default 100)")
    args = ap.parse_args()
    BATCH_ROWS = args.batch_rows

    if args.raw_worker:
        print(json.dumps(raw_worker(args.raw_worker, args.duration, args.block_rows)))
        return 0
    if args.count_worker:
        _count_worker(args.count_worker)
        return 0

    load = args.load
    if load == "auto":
        load = "wrk" if shutil.which("wrk") else "python"
    if load == "wrk" and not shutil.which("wrk"):
        print(
            "bench: wrk not found (apt-get install -y wrk) and --load wrk asked; valid: --load python",
            file=sys.stderr,
        )
        return 2

    workdir = Path(tempfile.mkdtemp(prefix="livestep-bench-ingest-"))
    results: list[tuple[str, dict]] = []
    profile_text = ""
    splits: dict[str, str] = {}
    load_before = os.getloadavg()
    try:
        server = Server(workdir, free_port())
        server.wait_ready()
        phases = [
            ("arrow", "application/vnd.apache.arrow.stream", arrow_body, args.duration),
            ("json", "application/json", json_body, args.json_duration),
        ]
        stored_before = server.stored_by_writer() or 0
        for name, ctype, make_body, duration in phases:
            if duration <= 0:
                continue
            session = f"bench-{name}"
            body = make_body(session)
            body_file = workdir / f"{name}.body"
            body_file.write_bytes(body)
            spy = start_profile(server, workdir, duration) if args.profile and name == "arrow" else None
            t0 = time.monotonic()
            cpu0 = proc_cpu_s(server.proc.pid)
            threads0 = thread_cpu_s(server.proc.pid)
            if load == "wrk":
                res = run_wrk(server.url, body_file, ctype, duration, args.connections, args.threads)
            else:
                per = max(1, args.connections // max(1, args.threads))
                res = run_python_load(server.url, body, ctype, duration, args.threads, per)
            t_load = time.monotonic() - t0
            if spy is not None:
                spy.wait(30)
                profile_text = summarize_profile(workdir / "profile.txt", dur_s=max(1, int(duration) - 2))
            acked = res["ok"] * BATCH_ROWS
            t_stored = wait_stored(server, stored_before + acked, args.drain_timeout)
            stored_before = server.stored_by_writer() or stored_before + acked
            elapsed = (t_stored - t0) if t_stored is not None else None
            cpu = proc_cpu_s(server.proc.pid) - cpu0
            splits[name] = thread_split(threads0, thread_cpu_s(server.proc.pid))
            results.append(
                (
                    name,
                    {
                        **res,
                        "acked_rows": acked,
                        "load_s": t_load,
                        "stored_s": elapsed,
                        "session": session,
                        "cpu_s": cpu,
                    },
                )
            )
            if res["non2xx"]:
                print(f"bench: {name}: {res['non2xx']} non-2xx responses", file=sys.stderr)
        server.stop()
        counts = json.loads(
            subprocess.run(
                [sys.executable, __file__, "--count-worker", str(server.chdb_dir)],
                capture_output=True,
                text=True,
                check=True,
                cwd=REPO,
            )
            .stdout.strip()
            .splitlines()[-1]
        )
        raw100 = run_raw(workdir, args.raw_duration, BATCH_ROWS)
        raw_big = run_raw(workdir, args.raw_duration, 50_000)
    finally:
        if "server" in locals() and server.proc.poll() is None:
            server.stop()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)

    if profile_text:
        print(profile_text)
    print(
        f"\ningest bench: {os.cpu_count()} CPUs, load={load}, connections={args.connections}, "
        f"{BATCH_ROWS}-row batches, durable ack (spool fsync), embedded chDB; load average before "
        f"{load_before[0]:.1f}, after {os.getloadavg()[0]:.1f} (other processes share the CPUs)"
    )
    print(
        f"{'path':<28}{'req ok':>10}{'non2xx':>8}{'acked rows':>12}{'stored rows':>13}{'seconds':>9}"
        f"{'rows/s stored':>15}{'rows/CPU-s':>12}{'p99':>9}"
    )
    rates: dict[str, float] = {}
    per_cpu: dict[str, float] = {}
    for name, r in results:
        stored = counts.get(r["session"], 0)
        secs = r["stored_s"] or r["load_s"]
        rates[name] = stored / secs
        per_cpu[name] = stored / r["cpu_s"] if r["cpu_s"] > 0 else float("nan")
        note = "" if r["stored_s"] else " (drain not observed)"
        print(
            f"{'HTTP ' + name + ' -> chDB':<28}{r['ok']:>10}{r['non2xx']:>8}{r['acked_rows']:>12}{stored:>13}"
            f"{secs:>9.1f}{rates[name]:>15,.0f}{per_cpu[name]:>12,.0f}{r['p99']:>9}{note}"
        )
    for label, r in ((f"raw insert_arrow {BATCH_ROWS}-row", raw100), ("raw insert_arrow 50k-row", raw_big)):
        print(
            f"{label:<28}{'':>10}{'':>8}{r['rows']:>12}{r['stored']:>13}{r['seconds']:>9.1f}{r['rows_per_s']:>15,.0f}"
            f"{r['stored'] / r['cpu_s']:>12,.0f}"
        )
    print("(rows/CPU-s: rows stored per CPU-second of the server process, or of the raw inserting process)")
    for name, split in splits.items():
        print(f"server CPU, {name} phase: {split}")
    if "arrow" in rates:
        print(f"ratio HTTP arrow / raw 50k-row blocks: {rates['arrow'] / raw_big['rows_per_s']:.2f}")
        raw_cpu = raw100["stored"] / raw100["cpu_s"]
        print(
            f"ratio per CPU-second, HTTP arrow / raw {BATCH_ROWS}-row batches: {per_cpu['arrow'] / raw_cpu:.2f}"
        )
        if "json" in rates:
            print(
                f"ratio HTTP json / raw {BATCH_ROWS}-row batches: {rates['json'] / raw100['rows_per_s']:.2f}"
            )
        print(
            f"ratio ingest/raw (HTTP arrow / raw insert_arrow of the same {BATCH_ROWS}-row batches): "
            f"{rates['arrow'] / raw100['rows_per_s']:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
