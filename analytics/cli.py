"""``livestep simulate`` and ``livestep analyze``: the fleet simulator and on-demand analytics jobs.

    livestep simulate --weeks 3 --incident august --incident fix          # through a running collector
    livestep simulate --direct --dsn chdb:///tmp/db --workers 200         # bulk Arrow into the store
    livestep analyze all                                                  # every job now, print findings
    livestep analyze weekly_fps --week 2026-W47
    livestep analyze regressions --start 2026-11-01 --end 2026-11-29

The store DSN defaults to ``LIVESTEP_CLICKHOUSE_DSN`` (the server's setting); the collector URL to
``LIVESTEP_URL`` or http://127.0.0.1:8000, its token to ``LIVESTEP_TOKEN``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from collector.settings import default_paths


def _dsn(args) -> str:
    if args.dsn:
        return args.dsn
    from collector.settings import CollectorSettings

    return CollectorSettings().clickhouse_dsn


def _incident(text: str):
    from analytics.simulate import INCIDENTS

    name, _, day = text.partition("@")
    if name.partition(":")[0] not in INCIDENTS:
        raise argparse.ArgumentTypeError(f"unknown incident {name!r}; valid: {', '.join(INCIDENTS)} (optionally "
                                         ":GPU_KIND or :SWITCH to scope it, and @DAY)")
    return (name, float(day)) if day else name


def register(subparsers) -> None:
    from analytics.jobs import JOBS

    p = subparsers.add_parser("simulate", help="simulate fleet telemetry (marked simulated) with incidents",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--weeks", type=float, default=3.0, help="weeks of fleet history, ending now (default 3)")
    p.add_argument("--incident", action="append", type=_incident, default=[],
                   help="an incident of analytics.simulate.INCIDENTS (august, sync, benign, fix, leak_resolution, "
                        "leak_prompt, leak_prompt_tight, leak_session, drift, variance), optionally :GPU_KIND or "
                        ":SWITCH (only those workers) and @DAY from the start (repeatable)")
    p.add_argument("--seed", type=int, default=0, help="random seed: the same seed gives the same fleet")
    p.add_argument("--workers", type=int, default=8, help="simulated workers in the fleet (default 8)")
    p.add_argument("--sessions-per-day", type=float, default=24.0, help="sessions per worker per day (default 24)")
    p.add_argument("--session-median-s", type=float, default=30.0,
                   help="median streamed seconds of a session (log-normal; default 30)")
    p.add_argument("--rollout-days", type=float, default=2.0,
                   help="days a new release takes to reach every worker (default 2)")
    p.add_argument("--direct", action="store_true", help="bulk Arrow blocks into the store (no collector)")
    p.add_argument("--dsn", default=None, help="store DSN for --direct (default: LIVESTEP_CLICKHOUSE_DSN)")
    p.add_argument("--url", default=os.environ.get("LIVESTEP_URL", "http://127.0.0.1:8000"),
                   help="collector URL (default LIVESTEP_URL or http://127.0.0.1:8000); checked before the run")
    p.add_argument("--token", default=os.environ.get("LIVESTEP_TOKEN"),
                   help="the collector's ingest bearer token (default LIVESTEP_TOKEN)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--turns", action="store_true", help="conversational turns too (a turn every 2-5 s per session)")
    p.add_argument("--turn-queue", default=None, metavar="RELEASE",
                   help="with --turns: the release (e.g. v1.2) whose workers keep the whole buffer at a turn")
    p.set_defaults(func=_simulate)

    a = subparsers.add_parser("analyze", help="run analytics jobs now and print their findings")
    a.add_argument("job", choices=[*JOBS, "all"], help="the job to run now, or all of them")
    a.add_argument("--week", default=None, help="ISO week for weekly jobs, e.g. 2026-W47")
    a.add_argument("--start", default=None, help="window start (ISO 8601, UTC)")
    a.add_argument("--end", default=None, help="window end (ISO 8601, UTC)")
    paths = default_paths()
    a.add_argument("--dsn", default=None, help=f"store DSN (default: LIVESTEP_CLICKHOUSE_DSN, else chdb://<LIVESTEP_HOME "
                   f"or ./var>/chdb: here {paths['dsn']})")
    a.add_argument("--reports-dir", default=None,
                   help=f"where weekly_report writes (default: LIVESTEP_REPORTS_DIR, else <LIVESTEP_HOME or ./var>/reports: "
                        f"here {paths['reports']}); another --dsn does not move it")
    a.set_defaults(func=_analyze)


def _simulate(args) -> int:
    from analytics.simulate import simulate_fleet, summarize

    kwargs = {"weeks": args.weeks, "incidents": args.incident, "seed": args.seed, "workers": args.workers,
              "sessions_per_day": args.sessions_per_day, "session_median_s": args.session_median_s,
              "rollout_days": args.rollout_days, "progress": False if args.no_progress else None,
              "turns": args.turns, "turn_queue": args.turn_queue}
    if args.direct:
        from collector.store import open_store

        store = open_store(_dsn(args))
        store.migrate()
        result = simulate_fleet(store, **kwargs)
    else:
        from collector.client import TelemetryClient

        check_collector(args.url)
        client = TelemetryClient(args.url, token=args.token, batch_rows=5000, max_queue=1_000_000)
        try:
            result = simulate_fleet(client, **kwargs)
        finally:
            client.close(timeout_s=30.0)
    for line in summarize(result):
        print(line)
    return 0


class CollectorDownError(Exception):
    """No collector answers at the URL ``simulate`` was given."""


def check_collector(url: str, timeout_s: float = 3.0) -> None:
    """Any HTTP answer from ``GET /v1/health`` within ``timeout_s`` means a collector is there (a 503
    too: it spools while its store is down); no answer is a ``CollectorDownError`` within seconds,
    not a minute of retries."""
    import httpx

    try:
        httpx.get(url.rstrip("/") + "/v1/health", timeout=timeout_s)
    except httpx.HTTPError as e:
        raise CollectorDownError(f"no collector answers at {url} ({type(e).__name__}: {e or 'no answer'} "
                                 f"within {timeout_s:.0f} s); start one (livestep serve), pass --url, or "
                                 f"write straight into the store with --direct") from None


def print_findings(rows: list[dict]) -> None:
    from analytics.describe import describe

    if not rows:
        print("no findings")
        return
    for r in sorted(rows, key=lambda r: (r["kind"], r["scope"], r["metric"], r["window_start"])):
        blame = f" -> {r['attribution']}" if r["attribution"] else ""
        print(f"{r['severity']:<8} {r['kind']:<14} {r['scope']:<32} {r['window_start']:%Y-%m-%d %H:%M}  "
              f"{describe(r)}{blame}")


def _analyze(args) -> int:
    from analytics import jobs
    from collector.store import open_store

    if args.reports_dir:  # the report job reads the setting's variable (analytics/jobs.py _report_dir)
        os.environ["LIVESTEP_REPORTS_DIR"] = str(Path(args.reports_dir).resolve())
    store = open_store(_dsn(args))
    store.migrate()
    if args.job == "all":
        rows = jobs.run_all(store, now=args.end)
    else:
        rows = jobs.run_job(args.job, store, week=args.week, start=args.start, end=args.end)
    if args.job in ("weekly_report", "all"):
        print(f"weekly report (HTML + JSON) under {jobs._report_dir()}")
    print_findings(rows)
    return 0
