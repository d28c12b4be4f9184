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

It is one story told in order (the README's steps 1-6), each step a function: ``run`` below tells it, and
the steps live in api/demo_session.py (step 1), api/demo_rollback.py (steps 2-6) and api/demo_server.py
(the server, the store and the webhook receiver they run against).
"""

from __future__ import annotations

import argparse
import time

from api.demo_rollback import rollback_story, title, wait_until  # noqa: F401 (re-exported: imported from here)
from api.demo_server import (  # noqa: F401 (as above)
    DemoError,
    DemoServer,
    Receiver,
    fresh_demo_store,
    ingest_token,
    start_server,
)
from api.demo_session import (  # noqa: F401 (as above)
    CHUNK_MS,
    KINDS,
    SessionSpec,
    print_summary,
    session_records,
    session_summary,
    stored_counts,
    stream_session,
    wait_stored,
)
from collector.settings import default_paths


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


def run(args: argparse.Namespace) -> int:
    """The whole story (``--quick``: only the first two steps)."""
    started = time.monotonic()
    dsn, spool_dir = fresh_demo_store(args.dsn, args.spool_dir)
    receiver = Receiver.start()  # stands in for the on-call's webhook (Slack, PagerDuty, ...)
    server = start_server(dsn, args.port, spool_dir, webhook_urls=receiver.url)
    token = ingest_token(server)
    try:
        print(f"livestep demo: server on {server.url} (collector + api + scheduler, store {dsn})")
        title("1. a session's telemetry through the shipping client -> collector -> ClickHouse")
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


def print_links(url: str, quick: bool) -> None:
    title("look at")
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
