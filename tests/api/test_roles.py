"""The app factory's roles: any role that runs the analytics scheduler also runs the canary
evaluation job and the incident hand-off, exactly once (role all too); the others run neither. The
hand-off is a function call: nothing is posted to the server's own /v1/alerts."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from fastapi.testclient import TestClient

from analytics.findings import finding, write_findings
from api import canary
from api.incidents import Handoff
from tests.api.conftest import SECRET


def app_for(store, tmp_path, role: str, **kw):
    from api.app import create_app
    from api.settings import Settings

    return create_app(Settings(clickhouse_dsn=store.dsn.redacted(), role=role, host="127.0.0.1",
                               spool_dir=tmp_path / "spool", reports_dir=tmp_path / "reports",
                               webhook_secret=SECRET, **kw))


def handoffs() -> list[Handoff]:
    from analytics import jobs

    return [fn for fn in jobs._listeners if isinstance(fn, Handoff)]  # read only: who listens now


def critical_finding(store, scope: str) -> list[dict]:
    now = datetime.now(UTC)
    f = finding("memory_growth", scope, "processes_growing_per_shape", now - timedelta(days=1), now, value=3.0,
                severity="critical", attribution="fused_allreduce")
    return write_findings(store, "memory", now - timedelta(days=7), now, [f])


def test_scheduler_role_runs_the_canary_job_and_the_handoff(store, tmp_path):
    app = app_for(store, tmp_path, "scheduler")
    with TestClient(app) as c:
        assert c.post("/v1/alerts", content=b"{}").status_code == 404  # the webhook is not served here
        job = app.state.scheduler.get_job(canary.JOB_ID)
        assert job is not None and job.func is canary.evaluate_running and job.args == (app.state.store,)
        h = app.state.incidents
        assert h is not None and handoffs() == [h] and h.notifier is None  # no receiver configured
        h(critical_finding(store, "release=v7"))  # what the scheduler does after a job
        rows = store.query_rows("SELECT name, scope, new_value, source FROM switch_audit WHERE changed")
        assert rows == [("fused_allreduce", "release=v7", False, "incident")]
    assert handoffs() == []  # uninstalled at shutdown


def test_collector_role_runs_neither(store, tmp_path):
    app = app_for(store, tmp_path, "collector")
    with TestClient(app):
        assert app.state.scheduler is None and app.state.incidents is None
        assert handoffs() == []


def test_api_role_serves_the_webhook_but_runs_neither(store, tmp_path):
    app = app_for(store, tmp_path, "api")
    with TestClient(app) as c:
        assert app.state.scheduler is None and app.state.incidents is None and handoffs() == []
        assert c.get("/v1/canaries").status_code == 200


def test_role_all_wires_each_once(store, tmp_path):
    app = app_for(store, tmp_path, "all", port=8000)
    with TestClient(app):
        jobs = [j for j in app.state.scheduler.get_jobs() if j.func is canary.evaluate_running]
        assert len(jobs) == 1
        assert handoffs() == [app.state.incidents]
        app.state.incidents(critical_finding(store, "release=v8"))
        n = store.query_rows("SELECT count() FROM switch_audit WHERE scope = 'release=v8'")
        assert n == [(1,)]  # one flip, and no alert delivery: nothing went through /v1/alerts
        assert store.query_rows("SELECT count() FROM alert_deliveries") == [(0,)]
    assert handoffs() == []


@pytest.fixture
def webhook_url_env(monkeypatch):
    monkeypatch.setenv("LIVESTEP_WEBHOOK_URLS", "http://127.0.0.1:9/hook")  # read by the Settings built next


def test_a_configured_receiver_gets_the_notifications_whatever_the_role(store, tmp_path, webhook_url_env):
    from api import incidents
    from api.settings import Settings

    s = Settings(clickhouse_dsn=store.dsn.redacted(), role="scheduler", host="127.0.0.1",
                 spool_dir=tmp_path / "spool", webhook_secret=SECRET)
    h = incidents.install(s, store)
    try:
        assert h is not None and h.notifier.urls == ["http://127.0.0.1:9/hook"] and h.notifier.secret == SECRET
    finally:
        incidents.uninstall(h)
