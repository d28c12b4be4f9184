"""The schedule: jobs re-run idempotently, a failing job is recorded and retried without raising,
listeners hear about findings, the scheduler starts with every job."""

from datetime import timedelta

import pytest

from analytics import jobs
from analytics.findings import read_findings
from analytics.simulate import simulate_fleet


def test_rerun_replaces_never_duplicates(store, small, tmp_path, monkeypatch):
    monkeypatch.setenv("LIVESTEP_REPORTS_DIR", str(tmp_path))  # where a report would go (none: no writer here)
    sim = simulate_fleet(store, weeks=2, incidents=[("august", 5), ("sync", 10)], seed=31, **small)
    first = jobs.run_all(store, now=sim.end, weeks=2)
    n1 = len(read_findings(store))
    second = jobs.run_all(store, now=sim.end, weeks=2)
    assert len(first) == len(second) > 0
    assert len(read_findings(store)) == n1
    kinds = set(read_findings(store, status="open")["kind"])
    assert {"fps_fraction", "memory_growth", "regression", "changepoint"} <= kinds
    runs = jobs.job_runs(store)
    assert set(runs["status"]) == {"ok"} and len(runs) >= 2 * 6


def test_a_finding_that_goes_away_is_resolved(store, small):
    sim = simulate_fleet(store, weeks=1, incidents=[("sync", 3)], seed=32, **small)
    rows = jobs.run_job("regressions", store, now=sim.end)
    assert rows
    store.command("TRUNCATE TABLE session_stats")  # the evidence is gone: the re-run finds nothing
    assert jobs.run_job("regressions", store, now=sim.end) == []
    assert len(read_findings(store, kind="regression", status="open")) == 0
    assert len(read_findings(store, kind="regression", status="resolved")) == len(rows)


def test_listeners_hear_findings(store, small):
    sim = simulate_fleet(store, weeks=1, incidents=[("sync", 3)], seed=33, **small)
    heard = []
    jobs.add_findings_listener(heard.append)
    jobs.add_findings_listener(lambda rows: 1 / 0)  # a broken listener never breaks the job
    try:
        rows = jobs.run_job("regressions", store, now=sim.end)
    finally:
        jobs._listeners.clear()
    assert heard == [rows]


def test_failing_job_is_recorded_retried_and_never_raises(store):
    store.command("DROP TABLE session_stats_mv")
    store.command("DROP TABLE session_stats")  # every detector now fails on its query
    with pytest.raises(Exception, match="session_stats"):
        jobs.run_job("memory", store)
    sched = jobs.start_scheduler(store)
    try:
        jobs.scheduled(sched, "regressions", store)  # what the scheduler calls: must not raise
        retry = sched.get_job("regressions-retry")
        assert retry is not None and retry.args[3] == 2  # attempt 2, later
    finally:
        sched.shutdown(wait=True)
    runs = jobs.job_runs(store)
    assert {(r["job"], r["status"]) for r in runs.iter_rows(named=True)} >= {("memory", "failed"),
                                                                             ("regressions", "failed")}
    failed = runs.filter(runs["status"] == "failed")
    assert len(failed) >= 2 and all("session_stats" in e for e in failed["error"])


def test_scheduler_has_the_schedule_and_watches_releases(store, small, tmp_path):
    sched = jobs.start_scheduler(store, reports_dir=tmp_path / "reports", report_writer=lambda *a: ())
    try:
        ids = {j.id for j in sched.get_jobs()}
        assert {"weekly_fps", "memory", "regressions", "changepoints", "release_watch"} <= ids
        assert "day_of_week='mon'" in str(sched.get_job("weekly_fps").trigger)
        report = sched.get_job("weekly_report")  # the server's reports directory, not the environment's
        assert report is not None and report.kwargs == {"out_dir": tmp_path / "reports"}
    finally:
        sched.shutdown(wait=True)
        jobs.set_report_writer(None)
    watch = jobs.ReleaseWatch()
    sim = simulate_fleet(store, weeks=1, incidents=[("sync", 3)], seed=34, **(small | {"end": None}))
    assert watch(None, store) == []  # the first poll learns what exists
    simulate_fleet(store, weeks=1, incidents=[("sync", 3), ("benign", 5)], seed=35, **(small | {"end": sim.end}))
    assert watch(None, store) == ["v1.2"]
    assert jobs.job_runs(store, "regressions")["trigger"][0] == "release"


def test_unknown_job_and_bad_window_list_valid_values(store):
    with pytest.raises(jobs.JobError, match="valid jobs: weekly_fps"):
        jobs.run_job("nope", store)
    with pytest.raises(jobs.JobError, match="start < end"):
        jobs.run_job("memory", store, start="2026-11-20", end="2026-11-10")
    with pytest.raises(Exception, match="YYYY-Www"):
        jobs.run_job("weekly_fps", store, week="last")
    start, end = jobs.window("weekly_fps", week="2026-W47")
    assert (start.isoformat(), end - start) == ("2026-11-16T00:00:00+00:00", timedelta(days=7))
