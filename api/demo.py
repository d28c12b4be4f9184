"""``livestep demo``: the README's main job on the embedded store — the whole story, in ~30 s.

    livestep demo                     the story below, then exit
    livestep demo --keep-serving      ... then keep serving (open the dashboards) until Ctrl-C
    livestep demo --quick             step 1 only
    livestep demo --dsn chdb:///tmp/x?database=demo --port 0

A fresh ``demo`` database (and spool) each run, the app on a uvicorn thread in this process (chDB
allows one process per data directory, so the demo reads the server's own store). Steps, each a
function: 1. ``stream_session`` — a synthetic ~24 fps session through ``TelemetryClient`` over HTTP,
then ``wait_stored`` / ``session_summary``; 2-6. ``rollback_story`` — simulated fleet history through
the collector (a sync-bug release, then the August incident, whose b200 workers' static FP8 scales
also drift into saturation), a live tiny worker of the leaking release polling the control plane, the
analytics jobs, whose findings the scheduler hands to the incident logic: one incident per root cause
(the leak's per-process findings are one incident's evidence), one signed notification each to a
receiver standing in for the on-call's webhook, one flip at the incident's scope (``fused_allreduce``
off for the leaking release, ``static_scales`` for the saturating b200 cohort), the worker applying it
at its next step boundary, and this week's report; ``print_links`` ends with the dashboard URLs.

Why one module over ~450 lines: it is one story told in order (the README's steps 1-6), each
step a function; split, a reader would follow the story across files.
"""

from __future__ import annotations

import argparse
import math
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from collector import catalog
from collector.settings import default_paths

CHUNK_MS = catalog.CHUNK_DEADLINE_MS  # one 4-frame chunk every 166.7 ms


class DemoError(Exception):
    """The demo could not run; the message says why and what to do."""


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "demo", help="the main job: serve, stream a session, summarize (embedded store)"
    )
    p.add_argument(
        "--keep-serving", action="store_true", help="keep the server up after the summary (Ctrl-C stops)"
    )
    p.add_argument(
        "--dsn", default=None, help="store DSN (default: database demo in chdb://<LIVESTEP_HOME or ./var>/chdb: "
        f"here {default_paths()['dsn']}?database=demo)"
    )
    p.add_argument(
        "--port", type=int, default=None, help="port on 127.0.0.1 (default: LIVESTEP_PORT or 8000; 0 = any)"
    )
    p.add_argument(
        "--spool-dir", default=None, help="spool directory (default: <LIVESTEP_HOME or ./var>/demo-spool: here "
        f"{default_paths()['home']}/demo-spool)"
    )
    p.add_argument(
        "--steps", type=int, default=300, help="steps in the demo session (default 300, ~50 s of video)"
    )
    p.add_argument("--quick", action="store_true", help="only the first session (no history, analytics, rollback)")
    p.add_argument("--weeks", type=float, default=2.0, help="weeks of simulated fleet history (default 2)")
    p.add_argument("--live-seconds", type=float, default=12.0,
                   help="least length of the live worker's session (it runs on until the story's flip reached it)")
    p.set_defaults(func=run)


# -- step 1: the server --------------------------------------------------------------------------
@dataclass
class DemoServer:
    """The app on a uvicorn thread in this process; ``store`` is the app's own store."""

    app: Any
    server: Any
    thread: threading.Thread
    url: str

    @property
    def store(self):
        return self.app.state.store

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)


def start_server(
    dsn: str | None = None, port: int | None = None, spool_dir: str | None = None, timeout_s: float = 30.0,
    webhook_urls: str | None = None,
) -> DemoServer:
    import uvicorn

    from api.app import create_app
    from api.settings import load_settings

    settings = load_settings(clickhouse_dsn=dsn, host="127.0.0.1", port=port, spool_dir=spool_dir,
                             webhook_urls=webhook_urls)
    app = create_app(settings)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="livestep-demo-server", daemon=True)
    thread.start()
    end = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive():
            raise DemoError(
                f"the server did not start on 127.0.0.1:{settings.port} (port in use? try --port 0; "
                f"store locked by another livestep process? use another --dsn)"
            )
        if time.monotonic() > end:
            server.should_exit = True
            raise DemoError(f"the server did not start within {timeout_s:.0f} s")
        time.sleep(0.05)
    bound = server.servers[0].sockets[0].getsockname()[1]
    return DemoServer(app, server, thread, f"http://127.0.0.1:{bound}")


# -- step 2: a session's records -----------------------------------------------------------------
@dataclass
class SessionSpec:
    """A synthetic session close to the paper's optimized worker (~24.5 fps, reset every 42 steps)."""

    steps: int = 300
    worker_id: str = "demo-w1"
    release: str = "demo"
    gpu_kind: str = "h100"
    tp_size: int = 3
    gpus: int = 4  # TP group + one decoder GPU
    shape: str = "prod57b"
    diffusion_ms: float = 157.7
    reset_every: int = 42
    reset_ms: float = 263.0
    seed: int = 0
    session_id: str = field(default_factory=lambda: f"demo-{uuid.uuid4().hex[:8]}")
    switches: str = "decoder_own_gpu,delta_rotation,fp8_cache,ring_cache,rope_at_write,triton_kernels"

    @property
    def labels(self) -> dict[str, str]:
        return {
            "worker_id": self.worker_id,
            "session_id": self.session_id,
            "release": self.release,
            "gpu_kind": self.gpu_kind,
        }


def session_records(spec: SessionSpec, end: datetime | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
    """(kind, row) pairs of one session ending at ``end`` (now): start, steps, GPU samples, end."""
    rng = random.Random(spec.seed)
    periods = []
    for i in range(spec.steps):
        diffusion = spec.reset_ms if i and i % spec.reset_every == 0 else rng.gauss(spec.diffusion_ms, 2.5)
        periods.append((diffusion, diffusion + abs(rng.gauss(1.6, 0.4))))  # decoder overlapped: +1.6 ms
    streamed_ms = sum(p for _, p in periods)
    end = end or datetime.now(UTC) - timedelta(seconds=1)
    t0 = end - timedelta(milliseconds=streamed_ms)
    first_tokens = rng.randint(200, 900)
    common = {**spec.labels, "simulated": True}
    session = {
        **common,
        "first_forward_tokens": first_tokens,
        "tp_size": spec.tp_size,
        "shape": spec.shape,
        "switches": spec.switches,
    }
    yield (
        "session",
        {
            **session,
            "ts": t0,
            "phase": "start",
            "streamed_s": 0.0,
            "frames": 0,
            "avg_fps": None,
            "late_chunks": 0,
            "stall_ms": 0.0,
        },
    )
    yield (
        "event",
        {**common, "ts": t0, "kind": "session_start", "detail": {"first_forward_tokens": first_tokens}},
    )

    depth, late_chunks, stall_ms, t = 3.0, 0, 0.0, 0.0
    energy = [0.0] * spec.gpus
    next_sample = 0.0
    for i, (diffusion, period) in enumerate(periods):
        t += period
        depth += (CHUNK_MS - period) / CHUNK_MS  # the player drains one chunk per 166.7 ms
        late = depth < 0
        if late:
            late_chunks += 1
            stall_ms += -depth * CHUNK_MS
            depth = 0.0
        depth = min(depth, 4.0)
        ts = t0 + timedelta(milliseconds=t)
        reset = i > 0 and i % spec.reset_every == 0
        yield (
            "step",
            {
                **common,
                "ts": ts,
                "step": i,
                "diffusion_ms": diffusion,
                "step_period_ms": period,
                "decode_ms": rng.gauss(114.0, 1.5),
                "cache_upkeep_ms": rng.gauss(6.2, 0.3) if not reset else 6.2 + 95.0,
                "attention_ms": rng.gauss(9.5, 0.4),
                "allreduce_ms": rng.gauss(12.0, 0.8),
                "late": late,
                "playout_depth": int(depth),
                "reset_step": reset,
                "energy_mj": spec.gpus * 650.0 * period,  # W x ms = mJ
                "mem_allocated_bytes": 58 << 30,
                "mem_reserved_bytes": 62 << 30,
                "buffers_registered": 1,
                "switches": spec.switches,
            },
        )
        if reset:
            yield (
                "event",
                {**common, "ts": ts, "kind": "reset", "detail": {"step": i, "delta_rotation": True}},
            )
        while next_sample <= t:  # NVML at 10 Hz per GPU
            sample_ts = t0 + timedelta(milliseconds=next_sample)
            for g in range(spec.gpus):
                power = rng.gauss(650.0 if g < spec.tp_size else 420.0, 15.0)
                energy[g] += power * 100.0
                yield (
                    "gpu_sample",
                    {
                        **common,
                        "ts": sample_ts,
                        "gpu_index": g,
                        "power_w": power,
                        "energy_mj": energy[g],
                        "sm_clock_mhz": 1980,
                        "mem_used_bytes": (66 if g < spec.tp_size else 30) << 30,
                        "temp_c": rng.gauss(62.0, 1.0),
                        "throttle_reasons": 0,
                    },
                )
            next_sample += 100.0
    frames = 4 * spec.steps
    streamed_s = streamed_ms / 1000.0
    yield (
        "session",
        {
            **session,
            "ts": end,
            "phase": "end",
            "streamed_s": streamed_s,
            "frames": frames,
            "avg_fps": frames / streamed_s,
            "late_chunks": late_chunks,
            "stall_ms": stall_ms,
        },
    )
    yield "event", {**common, "ts": end, "kind": "session_end", "detail": {"frames": frames}}


# -- step 3: ship it through the client ----------------------------------------------------------
def stream_session(url: str, spec: SessionSpec, token: str | None = None) -> dict[str, Any]:
    """Put every record through a ``TelemetryClient``, close it; per-kind counts and its counters."""
    from collector.client import TelemetryClient

    client = TelemetryClient(url, token=token, batch_rows=500, flush_interval_s=0.2)
    put = Counter()
    for kind, row in session_records(spec):
        client.put(kind, row)
        put[kind] += 1
    client.close(timeout_s=10.0)
    return {"put": dict(put), **client.stats()}


# -- step 4: wait until the store has it ---------------------------------------------------------
KINDS = ("step", "gpu_sample", "session", "event")


def stored_counts(store, session_id: str) -> dict[str, int]:
    from analytics.queries import stored_counts

    return stored_counts(store, session_id, KINDS)


def wait_stored(store, session_id: str, expected: dict[str, int], timeout_s: float = 15.0) -> dict[str, int]:
    """Poll the store until every kind of the session has its expected rows (or the time is up)."""
    end = time.monotonic() + timeout_s
    while True:
        got = stored_counts(store, session_id)
        if all(got.get(k, 0) >= n for k, n in expected.items()) or time.monotonic() > end:
            return got
        time.sleep(0.1)


# -- step 5: what it says ------------------------------------------------------------------------
def session_summary(store, session_id: str) -> dict[str, Any]:
    from analytics.queries import session_row

    r = session_row(store, session_id) or {"steps": 0, "fps": None, "late_chunks": 0, "period_ms_q": [],
                                           "diffusion_ms_q": []}
    steps, fps, late, period_q, diffusion_q = (r["steps"], r["fps"], r["late_chunks"], r["period_ms_q"],
                                               r["diffusion_ms_q"])
    return {
        "steps": int(steps),
        "fps": float(fps) if fps is not None and math.isfinite(fps) else None,
        "late_chunks": int(late),
        "step_period_ms_p50_p95_p99": [round(float(x), 1) for x in period_q],
        "diffusion_ms_p50_p95_p99": [round(float(x), 1) for x in diffusion_q],
    }


def print_summary(url: str, spec: SessionSpec, shipped: dict, stored: dict, summary: dict) -> None:
    from collector import records

    total_put = sum(shipped["put"].values())
    print(
        f"livestep demo: session {spec.session_id} ({spec.steps} steps, {spec.gpu_kind} x{spec.gpus}, "
        f"release {spec.release})"
    )
    print(
        f"  shipped   {total_put} records through the client: sent {shipped['sent']}, dropped "
        f"{shipped['dropped']}, failed batches {shipped['failed_batches']}, retries {shipped['retries']}"
    )
    print(
        "  stored    " + ", ".join(f"{records.TABLES[k]} {stored.get(k, 0)}/{n}" for k, n in shipped["put"].items())
    )
    fps = f"{summary['fps']:.2f}" if summary["fps"] is not None else "n/a"
    p50, p95, p99 = summary["step_period_ms_p50_p95_p99"]
    print(
        f"  session   {fps} fps, step period p50/p95/p99 {p50}/{p95}/{p99} ms, late chunks "
        f"{summary['late_chunks']}"
    )
    print("  look at")
    for path, what in (
        ("/v1/health", "liveness, store and spool"),
        ("/v1/sessions", "sessions with filters and paging"),
        (f"/v1/sessions/{spec.session_id}/steps", "this session's steps"),
        ("/docs", "the OpenAPI schema, interactive"),
    ):
        print(f"    {url}{path:<40} {what}")


def run(args: argparse.Namespace) -> int:
    """The whole story (``--quick``: only the first two steps)."""
    started = time.monotonic()
    dsn, spool_dir = fresh_demo_store(args.dsn, args.spool_dir)
    receiver = Receiver.start()  # stands in for the on-call's webhook (Slack, PagerDuty, ...)
    server = start_server(dsn, args.port, spool_dir, webhook_urls=receiver.url)
    token = _ingest_token(server)
    try:
        print(f"livestep demo: server on {server.url} (collector + api + scheduler, store {dsn})")
        _title("1. a session's telemetry through the shipping client -> collector -> ClickHouse")
        spec = SessionSpec(steps=args.steps)
        shipped = stream_session(server.url, spec, token=token)
        expected = dict(shipped["put"])
        stored = wait_stored(server.store, spec.session_id, expected)
        print_summary(server.url, spec, shipped, stored, session_summary(server.store, spec.session_id))
        complete = all(stored.get(k, 0) == n for k, n in expected.items())
        if not complete:
            print("  WARNING: not every record was stored (see the counts above)")
        if not args.quick:
            story = rollback_story(server, token, weeks=args.weeks, live_seconds=args.live_seconds,
                                   receiver=receiver)
            complete = complete and story["applied"]
        print_links(server.url, quick=args.quick)
        print(f"done in {time.monotonic() - started:.1f} s")
        if args.keep_serving:
            print(f"serving on {server.url} (Ctrl-C stops)")
            try:
                while server.thread.is_alive():
                    server.thread.join(0.5)
            except KeyboardInterrupt:
                pass
        else:
            print("the server stops now: `./dev demo --keep-serving` keeps it up to open the dashboards")
        return 0 if complete else 1
    finally:
        server.stop()
        receiver.stop()


class Receiver:
    """A stdlib HTTP endpoint on 127.0.0.1 that records the incident notifications posted to it."""

    def __init__(self, httpd, thread):
        self.httpd, self.thread, self.got = httpd, thread, []
        self.url = f"http://127.0.0.1:{httpd.server_address[1]}/hook"

    @classmethod
    def start(cls) -> Receiver:
        import json
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        box: list[Receiver] = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                box[0].got.append({"signed": bool(self.headers.get("X-Livestep-Signature")), **json.loads(body)})
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):  # quiet
                pass

        httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        thread = threading.Thread(target=httpd.serve_forever, name="demo-receiver", daemon=True)
        thread.start()
        box.append(cls(httpd, thread))
        return box[0]

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def fresh_demo_store(dsn: str | None, spool_dir: str | None) -> tuple[str, str]:
    """The demo's own database and spool, emptied first, so every run tells the same story."""
    import shutil

    from collector.migrations import recreate_database
    from collector.settings import data_home
    from collector.store import open_store, parse_dsn

    root = data_home()
    dsn = dsn or f"chdb://{root / 'chdb'}?database=demo"
    spool_dir = spool_dir or str(root / "demo-spool")
    shutil.rmtree(spool_dir, ignore_errors=True)
    store = open_store(dsn)  # the server reuses this store object (one chDB directory per process)
    database = parse_dsn(dsn).database
    recreate_database(store, database)
    return dsn, spool_dir


def _title(text: str) -> None:
    print(f"\n{text}")


# -- step 6: the loop closed: history, finding, webhook, switch off, a live worker picks it up ---
_LIVE_CAP_S = 600.0  # the live session never runs longer than --live-seconds + this


def _handed_source():
    from worker.switches import HttpSource

    class HandedSource(HttpSource):
        """The live worker's switch source, noting the version of the last state it handed the session."""

        handed_version = None

        def poll(self, step: int):
            got = super().poll(step)
            if got is not None:
                self.handed_version = self.version
            return got

    return HandedSource


def _HandedSource(*args, **kw):
    return _handed_source()(*args, **kw)


def rollback_story(server: DemoServer, token: str | None, weeks: float, live_seconds: float,
                   receiver: Receiver | None = None) -> dict[str, Any]:
    """Simulated history with the August incident -> analytics -> incidents (one per root cause, one
    signed notification, one flip at its scope) -> a live tiny worker applies the flip at its next step
    boundary -> the week's report shows it."""
    import httpx

    from analytics import queries as aq
    from analytics.cli import print_findings
    from analytics.jobs import run_all
    from analytics.queries import iso_week_of
    from analytics.simulate import simulate_fleet
    from api.report import build_weekly_report
    from collector.client import TelemetryClient
    from worker.config import Switches
    from worker.session import run_session

    store = server.store
    _title(f"2. {weeks:g} weeks of fleet history through the collector: a sync-bug release, then the "
           "August incident (a fused kernel that keeps a buffer per prompt length; on its b200 workers the static "
           "FP8 scales drift into saturation)")
    t0 = time.monotonic()
    client = TelemetryClient(server.url, token=token, batch_rows=5000, flush_interval_s=0.2,
                             max_queue=2_000_000)
    sim = simulate_fleet(client, weeks=weeks, incidents=[("sync", 2), ("august", weeks * 7 - 4)], seed=1,
                         workers=8, progress=False, fp8_drift=("august", "b200"))
    client.close(timeout_s=120)
    wait_until(lambda: server.app.state.spool.depth == 0, 120)  # every acked batch is in ClickHouse
    n_steps = aq.step_count(store, simulated=True)
    print(f"  {n_steps:,} simulated steps from {len(sim.workers)} workers, releases "
          + ", ".join(f"{r.name} ({r.kind})" for r in sim.releases)
          + f"; shipped in {time.monotonic() - t0:.1f} s, dropped {client.dropped}")
    leaking = sim.release("august").name

    _title(f"3. a live tiny worker of release {leaking}, every optimization on, polling /v1/switches")
    source = _HandedSource(server.url, "live-demo", leaking, "cpu", interval_s=0.5)
    box: dict[str, Any] = {}
    told: dict[str, Any] = {}  # the switch state's version once the story's flips are decided (step 5)
    t_live = time.monotonic()

    def enough() -> bool:
        """At least ``live_seconds``, and on until the session was handed the switches decided by the story
        (a loaded machine runs the analytics slower than the session: a fixed length raced the flip)."""
        return (time.monotonic() - t_live >= live_seconds and "version" in told
                and source.handed_version == told["version"])

    live = threading.Thread(target=lambda: box.update(summary=run_session(
        "tiny", seconds=live_seconds + _LIVE_CAP_S, collector_url=server.url, token=token,
        switches=Switches.all_on(), switch_source=source, release=leaking, worker_id="live-demo",
        stop_when=enough)), name="live-worker", daemon=True)
    live.start()
    wait_until(lambda: aq.step_count(store, worker_id="live-demo") > 3, 60)
    print(f"  streaming: session of worker live-demo, switches {Switches.all_on().encode()}")

    _title("4. the analytics jobs (as the scheduler runs them): findings")
    findings = run_all(store, now=datetime.now(UTC))
    notable = sorted((f for f in findings if f["severity"] in ("warning", "critical")),
                     key=lambda f: (f["severity"] != "critical", f["kind"] not in ("memory_growth", "fp8_saturation"),
                                    f["scope"]))
    print_findings(notable[:14])
    if len(notable) > 14:
        print(f"  ... and {len(notable) - 14} more warning/critical findings ({len(findings)} in all): "
              "/dashboard/findings")
    critical = [f for f in findings if f["severity"] == "critical" and f["attribution"]]

    _title("5. findings -> incidents (one per root cause) -> one notification and one flip each")
    from api.incidents import list_incidents

    for inc in sorted(list_incidents(store), key=lambda i: (i["switch"] == "", i["key"])):
        act = (f"{inc['switch']} off for {inc['scope']}" if inc["flips"] else
               "no switch explains it: alert only" if not inc["switch"] else "not critical: alert only")
        print(f"  [{inc['state']}] {inc['kind']} {inc['scope']}: {inc['evidence_count']} finding(s) as evidence, "
              f"{inc['notifications']} notification(s), {inc['flips']} flip(s) ({act})")
        print(f"      {inc['summary'][:160]}")
    if receiver is not None:
        print(f"  the receiver ({receiver.url}) got {len(receiver.got)} signed notification(s): "
              + ", ".join(f"{n['incident']['kind']} {n['incident']['scope']} {n['incident']['state']}"
                          for n in receiver.got))
    decided = aq.applied_changes(store)
    for ts, name, scope, source_, actor, why in decided:
        print(f"  {ts:%H:%M:%S} {name} off for {scope} (by {actor} via {source_}): {why[:160]}")
    told["version"] = httpx.get(source.endpoint, params=source.params, timeout=30,
                                headers={"Authorization": f"Bearer {token}"} if token else {}).json().get("version")
    live.join(live_seconds + _LIVE_CAP_S + 60)
    summary = box.get("summary")
    applied = [e for e in (summary.switch_events if summary else []) if e.get("changed")]
    for e in applied:
        print(f"  live-demo applied {e['changed']} at step {e['step']} (a step boundary; the session went on)")
    if summary is not None:
        print(f"  live-demo session: {summary.steps} steps, late chunks {summary.late_chunks}; the tiny model "
              f"generates {summary.avg_fps or 0:.0f} fps on this CPU (the player takes 24); "
              f"switches at the end: {summary.switches or '(none)'}")

    _title("6. this week's regression report")
    week = iso_week_of(datetime.now(UTC))
    reports_dir = Path(server.app.state.settings.reports_dir)
    html, js = build_weekly_report(store, week, reports_dir)
    print(f"  {html}\n  {js}")
    return {"findings": findings, "critical": critical, "applied": bool(applied), "report": html}


def wait_until(fn, timeout_s: float, every_s: float = 0.1):
    end = time.monotonic() + timeout_s
    while True:
        v = fn()
        if v or time.monotonic() > end:
            return v
        time.sleep(every_s)


def print_links(url: str, quick: bool) -> None:
    _title("look at")
    pages = [("/dashboard/incidents", "incidents: one per root cause, with their findings as evidence"),
             ("/dashboard/", "fleet overview: weekly fps fractions, releases"),
             ("/dashboard/releases", "release comparison"),
             ("/dashboard/memory", "memory against distinct prompt shapes (the leak)"),
             ("/dashboard/findings", "findings"),
             ("/dashboard/switches", "switch state and audit"),
             ("/v1/reports", "weekly reports"),
             ("/docs", "the REST API (OpenAPI)")]
    for path, what in (pages[-1:] if quick else pages):
        print(f"  {url}{path:<24} {what}")


def _ingest_token(server: DemoServer) -> str | None:
    tokens = getattr(server.app.state.settings, "ingest_tokens", None) or []
    return tokens[0] if tokens else None
