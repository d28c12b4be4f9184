"""The app factory's roles: any role that runs the analytics scheduler also runs the canary
evaluation job and the findings notifier, exactly once (role all too); the others run neither."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from fastapi.testclient import TestClient

from api import canary, notify
from api.notify import Notifier
from tests.api.conftest import SECRET


def app_for(store, tmp_path, role: str, **kw):
    from api.app import create_app
    from api.settings import Settings

    return create_app(Settings(clickhouse_dsn=store.dsn.redacted(), role=role, host="127.0.0.1",
                               spool_dir=tmp_path / "spool", reports_dir=tmp_path / "reports",
                               webhook_secret=SECRET, **kw))


def notifiers() -> list[Notifier]:
    from analytics import jobs

    return [fn for fn in jobs._listeners if isinstance(fn, Notifier)]  # read only: who listens now


def critical_finding(scope: str) -> dict:
    now = datetime.now(UTC)
    return {"kind": "memory_growth", "scope": scope, "metric": "reserved_bytes_per_shape", "window_start": now,
            "window_end": now, "value": 1.0, "severity": "critical", "status": "open",
            "attribution": "fused_allreduce", "evidence": "{}"}


def test_scheduler_role_runs_the_canary_job_and_the_notifier(store, tmp_path):
    app = app_for(store, tmp_path, "scheduler")
    with TestClient(app) as c:
        assert c.post("/v1/alerts", content=b"{}").status_code == 404  # the webhook is not served here
        job = app.state.scheduler.get_job(canary.JOB_ID)
        assert job is not None and job.func is canary.evaluate_running and job.args == (app.state.store,)
        n = app.state.notifier
        assert n is not None and notifiers() == [n]
        # no URL configured and no webhook served here: a critical finding goes to the webhook's own
        # handler in this process, signed, and the switch goes off in the shared store
        assert n.local is not None
        n([critical_finding("release=v7")])
        assert n.sent == [{"url": "local", "ok": True, "status": 200, "flipped": 1}]
        rows = store.query_rows("SELECT name, scope, new_value FROM switch_audit WHERE source = 'alert' AND changed")
        assert rows == [("fused_allreduce", "release=v7", False)]
    assert notifiers() == []  # uninstalled at shutdown


def test_collector_role_runs_neither(store, tmp_path):
    app = app_for(store, tmp_path, "collector")
    with TestClient(app):
        assert app.state.scheduler is None and app.state.notifier is None
        assert notifiers() == []


def test_api_role_serves_the_webhook_but_runs_neither(store, tmp_path):
    app = app_for(store, tmp_path, "api")
    with TestClient(app) as c:
        assert app.state.scheduler is None and app.state.notifier is None and notifiers() == []
        assert c.get("/v1/canaries").status_code == 200


@pytest.mark.parametrize("port", [0, 8000])
def test_role_all_wires_each_once(store, tmp_path, port):
    app = app_for(store, tmp_path, "all", port=port)
    with TestClient(app):
        jobs = [j for j in app.state.scheduler.get_jobs() if j.func is canary.evaluate_running]
        assert len(jobs) == 1
        assert notifiers() == [app.state.notifier]
        # the webhook is served here: HTTP to our own /v1/alerts unless the port is unknown (0)
        assert (app.state.notifier.local is not None) == (port == 0)
        if port == 0:
            app.state.notifier([critical_finding("release=v8")])
            n = store.query_rows("SELECT count() FROM switch_audit WHERE source = 'alert' AND scope = 'release=v8'")
            assert n == [(1,)]  # one delivery: a second notifier would have recorded a duplicate
    assert notifiers() == []


@pytest.fixture
def webhook_url_env(monkeypatch):
    monkeypatch.setenv("LIVESTEP_WEBHOOK_URLS", "http://127.0.0.1:9/v1/alerts")  # read by the Settings built next


def test_a_configured_webhook_url_is_posted_to_whatever_the_role(store, tmp_path, webhook_url_env):
    from api.settings import Settings

    s = Settings(clickhouse_dsn=store.dsn.redacted(), role="scheduler", host="127.0.0.1",
                 spool_dir=tmp_path / "spool", webhook_secret=SECRET)
    n = notify.install_for_server(s, store)
    try:
        assert n is not None and n.local is None and n.urls == ["http://127.0.0.1:9/v1/alerts"]
    finally:
        notify.uninstall(n)
