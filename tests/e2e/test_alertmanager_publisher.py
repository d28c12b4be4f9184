"""With ``LIVESTEP_ALERTMANAGER_URL`` set, findings are published to a real Alertmanager (Debian's
prometheus-alertmanager, the shipped routing) as alerts: its silences hold, the critical finding with a
switch comes back to ``/v1/alerts`` and livestep flips it, a closed finding resolves the alert and flips
nothing back. Without the URL the embedded incident logic is the hand-off (api/app.py)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from analytics.findings import finding, write_findings
from api.alertmanager_publisher import ALERTNAME, Publisher
from tests.api.live import bound_socket, serve
from tests.collector.helpers import wait_for
from tests.deploy.peers import alertmanager, alertmanager_config, binary

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

READ = "e2e-read-token-0123456789"
AM_TOKEN = "e2e-alertmanager-token-0123456789"


def _settings(tmp_path, chdb_dir, port, **kw):
    from api.settings import Settings

    return Settings(clickhouse_dsn=f"chdb://{chdb_dir}?database=t_{uuid.uuid4().hex[:12]}", role="all",
                    host="127.0.0.1", port=port, spool_dir=tmp_path / "spool", reports_dir=tmp_path / "reports",
                    switch_cache_s=0, read_tokens=[READ], webhook_bearer_tokens={"alertmanager": AM_TOKEN}, **kw)


def test_without_an_alertmanager_the_incidents_keep_the_findings(tmp_path, chdb_dir):
    from fastapi.testclient import TestClient

    from api.app import create_app
    from api.incidents import Handoff

    with TestClient(create_app(_settings(tmp_path, chdb_dir, 0))) as c:
        assert isinstance(c.app.state.incidents, Handoff)


def test_findings_become_alertmanager_alerts_and_its_webhook_flips_the_switch(tmp_path, chdb_dir):
    binary("alertmanager")
    from api.app import create_app

    sock = bound_socket()
    port = sock.getsockname()[1]
    (tmp_path / "am-token").write_text(AM_TOKEN)
    am_cfg = alertmanager_config(port, tmp_path / "am-token")
    auth = {"Authorization": f"Bearer {READ}"}
    with alertmanager(am_cfg, tmp_path) as am_url:
        app = create_app(_settings(tmp_path, chdb_dir, port, alertmanager_url=am_url))
        with serve(app, sock=sock, lifespan="on") as base:
            publisher = app.state.incidents
            assert isinstance(publisher, Publisher)  # instead of the incident logic
            store = app.state.store
            now = datetime.now(UTC)
            week = now - timedelta(days=7)
            # a silence on v8's alert, made in Alertmanager before it fires
            r = httpx.post(f"{am_url}/api/v2/silences", json={
                "matchers": [{"name": "release", "value": "v8", "isRegex": False, "isEqual": True}],
                "startsAt": (now - timedelta(minutes=1)).isoformat(), "endsAt": (now + timedelta(hours=1)).isoformat(),
                "createdBy": "test", "comment": "maintenance"})
            assert r.status_code == 200, r.text
            leak = finding("memory_growth", {"release": "v9", "gpu_kind": "cpu"}, "bytes_per_shape", week, now,
                           value=1e9, severity="critical", attribution="fused_allreduce")
            silenced = finding("memory_growth", {"release": "v8", "gpu_kind": "cpu"}, "bytes_per_shape", week, now,
                               value=1e9, severity="critical", attribution="compile")
            warn = finding("regression", {"release": "v9"}, "step_period_ms_p50", week, now, value=170.0,
                           severity="warning", attribution="ring_cache")
            write_findings(store, "memory", week, now, [leak, silenced])
            write_findings(store, "regressions", week, now, [warn])
            publisher([])  # what analytics.jobs calls after a detector run
            assert publisher.last_error is None

            def am_alerts():
                return {a["labels"]["release"]: a for a in httpx.get(f"{am_url}/api/v2/alerts").json()
                        if a["labels"].get("alertname") == ALERTNAME and a["labels"]["kind"] == "memory_growth"}
            alerts = wait_for(lambda: len(am_alerts()) == 2 and am_alerts(), 20, "both alerts in Alertmanager", every_s=0.2)
            assert alerts["v9"]["labels"]["switch"] == "fused_allreduce"
            assert alerts["v9"]["labels"]["incident"] == "memory_growth/v9/cpu"
            assert alerts["v8"]["status"]["state"] == "suppressed"  # Alertmanager's silence

            def switches(release):
                r = httpx.get(f"{base}/v1/switches", params={"release": release, "gpu_kind": "cpu",
                                                              "worker_id": "w1"}, headers=auth)
                return r.json()["switches"]
            wait_for(lambda: switches("v9").get("fused_allreduce") is False, 30, "the webhook's flip for v9", every_s=0.2)
            assert "compile" not in switches("v8")  # silenced: nothing reached livestep
            assert "ring_cache" not in switches("v9")  # a warning names no switch: it flips nothing

            def decisions():
                return httpx.get(f"{base}/v1/switches/history", params={"source": "alert"}, headers=auth).json()[
                    "decisions"]

            write_findings(store, "memory", week, now, [silenced], current=True)  # v9's leak is no longer found
            publisher([])
            wait_for(lambda: any(d["action"] == "alert_resolved" for d in decisions()), 30,
                     "Alertmanager's resolved notification", every_s=0.2)
            flips = [d for d in decisions() if d["changed"]]
            assert [(d["name"], d["scope"]) for d in flips] == [("fused_allreduce", "gpu_kind=cpu,release=v9")]
            assert switches("v9").get("fused_allreduce") is False  # resolved flips nothing back
