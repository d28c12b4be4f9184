"""The analytics schedule (APScheduler 3.11, in the server process) and on-demand job runs.

    scheduler = start_scheduler(store)            # started; the app's lifespan shuts it down
    rows = run_job("memory", store)               # on demand; window kwargs: start, end, week, now
    rows = run_all(store, now=...)                # every job once (the demo), returns the findings
    add_findings_listener(fn)                     # fn(list of finding dicts) after every detector run
                                                  # (api/incidents.py's hand-off; [] when it found nothing)

Schedule (UTC): weekly fps fractions and the weekly report each Monday for the past ISO week;
memory growth, FP8 saturation and power (clocks, throttle reasons) hourly; regressions, step time within
sessions (session_age), change points, drift, variance and turn-latency
regressions daily; a cheap release watch every few minutes runs the regression detector as soon as a new release shows up; the fleet roll-up
(``queries.rollup``: closed days into ``fleet_daily`` for the dashboard) every 10 minutes. A failing job is logged,
recorded in ``job_runs`` (status 'failed', the error), retried with backoff up to
``MAX_ATTEMPTS`` and never raises out of the scheduler. Findings are written by
``analytics.findings.write_findings``: a re-run for the same window replaces its findings.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow as pa
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger

from analytics import (
    changepoints,
    drift,
    fps,
    memory,
    power,
    queries,
    regressions,
    saturation,
    session_age,
    variance,
)
from analytics.findings import write_findings

log = logging.getLogger("livestep.analytics")

MAX_ATTEMPTS = 3
RETRY_BASE_S = 60.0
MEMORY_WINDOW = timedelta(days=7)
REGRESSION_WINDOW = timedelta(days=28)
CHANGEPOINT_WINDOW = timedelta(days=42)
DRIFT_WINDOW = timedelta(days=28)
SESSION_AGE_WINDOW = timedelta(days=14)  # reads raw steps (a slope per session): two weeks, not four
# recent sessions only: a drift past the calibrated range is acted on within hours, and two days hold
# enough sampled sessions per release x GPU kind on a small fleet (saturation.MIN_SESSIONS)
SATURATION_WINDOW = timedelta(days=2)
RELEASE_POLL = timedelta(minutes=5)
# trailing-window detectors: each run is the whole current judgement (findings.write_findings current=True)
CURRENT_JOBS = frozenset({"memory", "fp8_saturation", "power", "regressions", "session_age", "changepoints", "drift",
                          "variance", "flips"})
FLIPS_WINDOW = timedelta(days=7)

_listeners: list[Callable[[list[dict]], None]] = []
_listeners_lock = threading.Lock()


class JobError(Exception):
    """An unknown job or a bad window; the message lists valid values."""


def add_findings_listener(fn: Callable[[list[dict]], None]) -> None:
    """Call ``fn(findings)`` after each detector run, with the open findings it wrote ([] when none: what it
    no longer finds was resolved). api/incidents.py's hand-off listens: findings go to the incident logic
    by a call in this process, never through the server's own webhook."""
    with _listeners_lock:
        if fn not in _listeners:
            _listeners.append(fn)


def remove_findings_listener(fn: Callable[[list[dict]], None]) -> None:
    with _listeners_lock:
        if fn in _listeners:
            _listeners.remove(fn)


def _notify(rows: list[dict]) -> None:
    with _listeners_lock:
        fns = list(_listeners)
    for fn in fns:
        try:
            fn(rows)
        except Exception:  # a listener never breaks a job
            log.exception("findings listener %r failed", fn)


def _utc(t: datetime | str | None) -> datetime | None:
    if t is None:
        return None
    if isinstance(t, str):
        try:
            t = datetime.fromisoformat(t)
        except ValueError as e:
            raise JobError(f"time {t!r} is not valid; valid form: ISO 8601, e.g. 2026-11-23 or 2026-11-23T08:00Z") from e
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)


def past_iso_week(now: datetime) -> str:
    """The last complete ISO week before ``now``."""
    return queries.iso_week_of(now - timedelta(days=7))


# The weekly report's writer and its default directory: registered by the api (api/report.py ``install``),
# whose HTML it is; the analytics never import the api.
_report_writer: tuple[Callable[..., Any], Callable[[], Path] | None] | None = None


def set_report_writer(fn: Callable[..., Any] | None, default_dir: Callable[[], Path] | None = None) -> None:
    """Register ``fn(store, iso_week, out_dir) -> paths`` as the weekly report (None: no report job)."""
    global _report_writer
    _report_writer = None if fn is None else (fn, default_dir)


def _report_dir() -> Path:
    env = os.environ.get("LIVESTEP_REPORTS_DIR")
    if env:
        return Path(env)
    if _report_writer is not None and _report_writer[1] is not None:
        try:
            return Path(_report_writer[1]())
        except Exception:
            log.exception("the report writer's directory is unavailable; reports go under <home>/reports")
    from collector.settings import data_home

    return data_home() / "reports"


# -- the jobs: (store, start, end, **extra) -> findings rows --------------------------------------------


def _detector(module, with_releases: bool = False):
    """The job of a detector module: its ``run(store, start, end)`` (``with_releases``: and ``releases=``, a
    partial run's) over the job's window, returning the findings rows. ``module``: the module, or its name
    under analytics/ to import at the job's first run."""

    def job(store, start, end, releases=None, **_):
        run = (importlib.import_module(f"analytics.{module}") if isinstance(module, str) else module).run
        return run(store, start, end, releases=releases) if with_releases else run(store, start, end)

    return job


def _memory(store, start, end, **_):
    return memory.analyze(store, start, end)[1]


def _rollup(store, start, end, **_):
    queries.rollup(store, now=end)
    # no findings of its own: returns None


def _weekly_report(store, start, end, week=None, out_dir=None, **_):
    if _report_writer is None:
        raise JobError("the weekly report is not available (no writer registered: the api's api/report.py "
                       f"install); valid jobs here: {', '.join(n for n in JOBS if n != 'weekly_report')}")
    paths = _report_writer[0](store, week or queries.iso_week_of(start), Path(out_dir or _report_dir()))
    log.info("weekly report written: %s", ", ".join(str(p) for p in paths))
    # no findings of its own: returns None


JOBS: dict[str, Callable[..., list[dict] | None]] = {
    "weekly_fps": _detector(fps),
    "memory": _memory,
    "fp8_saturation": _detector(saturation),
    "power": _detector(power),
    "regressions": _detector(regressions, with_releases=True),
    "session_age": _detector(session_age),
    "changepoints": _detector(changepoints),
    "drift": _detector(drift),
    "variance": _detector(variance, with_releases=True),
    "turn_regressions": _detector("turns", with_releases=True),  # conversational turns' latency
    "flips": _detector("flips"),  # switch flips that hurt sessions
    "weekly_report": _weekly_report,
    "rollup": _rollup,
}


def window(name: str, now: datetime | None = None, week: str | None = None, start=None, end=None):
    """The [start, end) a job reads by default: the past ISO week (weekly jobs), else a trailing window."""
    if name not in JOBS:
        raise JobError(f"unknown job {name!r}; valid jobs: {', '.join(JOBS)}")
    now = _utc(now) or datetime.now(UTC)
    start, end = _utc(start), _utc(end)
    if name in ("weekly_fps", "weekly_report") and start is None and end is None:
        return queries.iso_week_bounds(week or past_iso_week(now))
    end = end or now
    span = {"memory": MEMORY_WINDOW, "fp8_saturation": SATURATION_WINDOW, "power": power.WINDOW,
            "regressions": REGRESSION_WINDOW, "session_age": SESSION_AGE_WINDOW, "changepoints": CHANGEPOINT_WINDOW,
            "drift": DRIFT_WINDOW, "variance": REGRESSION_WINDOW, "rollup": timedelta(days=1),
            "turn_regressions": REGRESSION_WINDOW, "flips": FLIPS_WINDOW}
    start = start or end - span.get(name, timedelta(days=7))
    if start >= end:
        raise JobError(f"job window start {start} is not before end {end}; valid: start < end")
    return start, end


def run_job(name: str, store, *, trigger: str = "demand", attempt: int = 1, **win: Any) -> list[dict]:
    """Run one job now over its window (kwargs: start, end, week, now; regressions: releases; report:
    out_dir). Writes its findings (replacing the window's previous ones), records the run in
    ``job_runs``, calls the listeners, returns the findings written. Raises on failure (recorded)."""
    extra = {k: win.pop(k) for k in ("releases", "out_dir") if k in win}
    unknown = set(win) - {"start", "end", "week", "now"}
    if unknown:
        raise JobError(f"unknown window argument(s) {sorted(unknown)}; valid: start, end, week, now")
    start, end = window(name, **win)
    started = datetime.now(UTC)
    try:
        rows = JOBS[name](store, start, end, week=win.get("week"), **extra)
        current = name in CURRENT_JOBS and extra.get("releases") is None  # a partial run judges only its part
        written = [] if rows is None else write_findings(store, name, start, end, rows, current=current)
    except Exception as e:
        _record(store, name, started, "failed", attempt, trigger, start, end, 0, f"{type(e).__name__}: {e}")
        raise
    _record(store, name, started, "ok", attempt, trigger, start, end, len(written), "")
    if rows is not None:  # every detector run, even one that found nothing: what it no longer finds matters
        _notify(written)
    return written


def run_all(store, now: datetime | None = None, weeks: int = 4) -> list[dict]:
    """Every job once at ``now`` (the demo): fps fractions for each of the last ``weeks`` ISO weeks
    (the current one included), memory growth, FP8 saturation, regressions, change points, and the past week's
    report when a writer is registered (``set_report_writer``). Returns the findings written."""
    now = _utc(now) or datetime.now(UTC)
    out: list[dict] = []
    for k in range(weeks, -1, -1):
        out += run_job("weekly_fps", store, week=queries.iso_week_of(now - timedelta(days=7 * k)))
    run_job("rollup", store, now=now)
    for name in ("memory", "fp8_saturation", "power", "regressions", "session_age", "changepoints", "drift",
                 "variance"):
        out += run_job(name, store, now=now)
    if _report_available():
        try:
            run_job("weekly_report", store, now=now)
        except Exception:
            log.exception("weekly report failed")
    return out


def _report_available() -> bool:
    return _report_writer is not None


_RUNS_SCHEMA = pa.schema(
    [
        ("job", pa.string()), ("started_at", pa.timestamp("ms", tz="UTC")),
        ("finished_at", pa.timestamp("ms", tz="UTC")), ("status", pa.string()), ("attempt", pa.uint8()),
        ("trigger", pa.string()), ("window_start", pa.timestamp("ms", tz="UTC")),
        ("window_end", pa.timestamp("ms", tz="UTC")), ("findings", pa.uint32()), ("error", pa.string()),
    ]
)


def _record(store, job, started, status, attempt, trigger, start, end, n, error) -> None:
    row = {"job": job, "started_at": started, "finished_at": datetime.now(UTC), "status": status,
           "attempt": min(attempt, 255), "trigger": trigger, "window_start": start, "window_end": end,
           "findings": n, "error": error[:4000]}
    try:
        store.insert_arrow("job_runs", pa.Table.from_pylist([row], schema=_RUNS_SCHEMA))
    except Exception:  # the store may be the thing that failed
        log.exception("could not record the %s run (%s)", job, status)


def job_runs(store, job: str | None = None):
    """Recorded runs, newest first (polars)."""
    return queries.job_runs(store, job)


# -- the scheduler -------------------------------------------------------------------------------------


def scheduled(scheduler, name: str, store, attempt: int = 1, trigger: str = "schedule", **win) -> None:
    """Run a job from the scheduler: never raises; a failure is retried later with backoff."""
    try:
        run_job(name, store, trigger=trigger, attempt=attempt, **win)
    except Exception:
        log.exception("analytics job %s failed (attempt %d of %d)", name, attempt, MAX_ATTEMPTS)
        if attempt < MAX_ATTEMPTS and scheduler is not None and scheduler.running:
            when = datetime.now(UTC) + timedelta(seconds=RETRY_BASE_S * 2 ** (attempt - 1))
            try:
                scheduler.add_job(
                    scheduled, "date", run_date=when, args=[scheduler, name, store, attempt + 1, "retry"],
                    kwargs=win, id=f"{name}-retry", replace_existing=True,
                )
            except Exception:
                log.exception("could not schedule a retry of %s", name)


class ReleaseWatch:
    """Polls the releases seen (cheap: DISTINCT over the per-session view) and runs the regression
    detector for each new one. The first poll only learns what exists."""

    def __init__(self):
        self.known: set[str] | None = None

    def __call__(self, scheduler, store) -> list[str]:
        try:
            seen = set(queries.releases_seen(store))
        except Exception:
            log.exception("release watch could not read releases")
            return []
        new = [] if self.known is None else sorted(seen - self.known)
        self.known = seen
        if new:
            log.info("new release(s) seen: %s; running regressions", ", ".join(new))
            scheduled(scheduler, "regressions", store, trigger="release", releases=new)
        return new


def start_scheduler(store, *, timezone=UTC, reports_dir: Path | None = None,
                    report_writer: Callable[..., Any] | None = None) -> BackgroundScheduler:
    """A started BackgroundScheduler with the analytics schedule (the server's lifespan shuts it down).
    ``reports_dir``: where the weekly report goes (the server passes its settings'; default
    ``_report_dir()``); ``report_writer``: registered as the weekly report (``set_report_writer``);
    without one registered there is no weekly report job."""
    if report_writer is not None:
        set_report_writer(report_writer, None if _report_writer is None else _report_writer[1])
    s = BackgroundScheduler(
        timezone=timezone, job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": 3600}
    )
    add = s.add_job
    def hourly():
        return IntervalTrigger(hours=1, timezone=timezone)

    def nightly(minute: int):
        return CronTrigger(hour=2, minute=minute, timezone=timezone)

    schedule = {"weekly_fps": (CronTrigger(day_of_week="mon", hour=0, minute=30, timezone=timezone), {})}
    if _report_available():
        schedule["weekly_report"] = (CronTrigger(day_of_week="mon", hour=1, minute=0, timezone=timezone),
                                     {"out_dir": reports_dir} if reports_dir else {})
    schedule |= {"memory": (hourly(), {}), "fp8_saturation": (hourly(), {}), "power": (hourly(), {}),
                 "regressions": (nightly(0), {}), "session_age": (nightly(10), {}), "changepoints": (nightly(20), {}),
                 "drift": (nightly(30), {}), "variance": (nightly(40), {}), "turn_regressions": (nightly(50), {}),
                 "flips": (hourly(), {})}
    for name, (trigger, kwargs) in schedule.items():
        add(scheduled, trigger, args=[s, name, store], kwargs=kwargs, id=name, replace_existing=True)
    add(scheduled, IntervalTrigger(minutes=10, timezone=timezone), args=[s, "rollup", store], id="rollup",
        replace_existing=True, next_run_time=datetime.now(timezone))
    watch = ReleaseWatch()
    add(watch, IntervalTrigger(seconds=RELEASE_POLL.total_seconds(), timezone=timezone), args=[s, store],
        id="release_watch", replace_existing=True, next_run_time=datetime.now(timezone))
    s.start()
    return s
