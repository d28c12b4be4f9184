"""The loop closed, end to end on a real uvicorn (collector + api + scheduler, chDB):

simulated history with the August incident -> the memory job's critical finding -> notify posts it,
signed, to /v1/alerts -> fused_allreduce off for the leaking release -> a live tiny worker polling
/v1/switches applies it at a step boundary once its poller sees the new version -> its switch_applied
event (after the flip's audit row; every step from it on without the switch) is stored through the collector -> the report of this week shows the change and the event.
"""

from __future__ import annotations

import threading
import time
import uuid
from datetime import UTC, datetime

import orjson
import pytest

from tests.api.live import bound_socket, serve

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

POLL_S = 0.5


def wait_for(fn, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = fn()
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_incident_finding_webhook_switch_off_worker_applies_report_shows(tmp_path, chdb_dir):
    from analytics.jobs import run_job
    from analytics.queries import iso_week_of
    from analytics.report import build_weekly_report
    from analytics.simulate import simulate_fleet
    from api.app import create_app
    from api.settings import Settings
    from worker.config import Switches
    from worker.session import run_session
    from worker.switches import HttpSource

    sock = bound_socket()
    port = sock.getsockname()[1]
    settings = Settings(clickhouse_dsn=f"chdb://{chdb_dir}?database=t_{uuid.uuid4().hex[:12]}", role="all", host="127.0.0.1", port=port,
                        spool_dir=tmp_path / "spool", reports_dir=tmp_path / "reports",
                        webhook_secret="e2e-webhook-secret-0123456789", flush_interval_s=0.2)
    app = create_app(settings)
    with serve(app, sock=sock, lifespan="on") as base:
        store = app.state.store
        assert app.state.notifier is not None, "the webhook notifier was not installed"
        assert app.state.scheduler.get_job("canaries") is not None, "the canary job was not scheduled"
        sim = simulate_fleet(store, weeks=1, incidents=[("august", 2)], workers=6, sessions_per_day=24,
                             session_median_s=20, seed=1)
        leaking = sim.releases[-1].name

        # a live tiny worker of the leaking release in its production configuration (every optimization
        # on: what the release's workers run), polling the control plane
        source = HttpSource(base, "live-1", leaking, "cpu", interval_s=POLL_S)
        summary: dict = {}
        worker = threading.Thread(target=lambda: summary.update(s=run_session(
            "tiny", seconds=8, collector_url=base, switches=Switches.all_on(), switch_source=source,
            release=leaking, worker_id="live-1")), daemon=True)
        worker.start()
        wait_for(lambda: source.version is not None, 30, "the worker's first switch poll")
        wait_for(lambda: store.query_rows("SELECT count() FROM steps WHERE worker_id = 'live-1'")[0][0] > 3, 30,
                 "the live worker's first steps")

        findings = run_job("memory", store)  # the listener posts the critical ones to /v1/alerts
        assert any(f["severity"] == "critical" and f["attribution"] == "fused_allreduce" for f in findings)
        flips = [d for d in app.state.notifier.sent]
        assert flips and all(r["ok"] for r in flips), flips
        decision = wait_for(lambda: store.query_rows(
            "SELECT ts, version FROM switch_audit WHERE source = 'alert' AND changed AND name = 'fused_allreduce' "
            "AND scope = {s:String}", {"s": f"release={leaking}"}), 10, "the switch decision")
        flipped_at, flip_version = decision[0]

        worker.join(60)
        assert not worker.is_alive()
        applied = [e for e in summary["s"].switch_events if "fused_allreduce" in e["changed"]]
        assert len(applied) == 1 and applied[0]["changed"] == {"fused_allreduce": False}

        ev = wait_for(lambda: store.query_rows(
            "SELECT ts, detail FROM events WHERE kind = 'switch_applied' AND worker_id = 'live-1'"), 20,
            "the switch_applied event in the store")
        applied_at, detail = ev[0][0], orjson.loads(ev[0][1])
        assert detail["changed"] == {"fused_allreduce": False}
        # the worker's poller saw the flip's version, and applied it after the decision was recorded
        assert source.version is not None and source.version >= flip_version, (source.version, flip_version)
        assert flipped_at <= applied_at, (flipped_at, applied_at)
        print(f"switch applied {(applied_at - flipped_at).total_seconds():.3f} s after the flip (information)")
        # ... at a step boundary: every stored step before it ran the switch, every one from it on did not
        n_steps = summary["s"].steps
        wait_for(lambda: store.query_rows("SELECT count() FROM steps WHERE worker_id = 'live-1'")[0][0] >= n_steps,
                 20, "every step of the live worker in the store")
        rows = store.query_rows("SELECT step, switches FROM steps WHERE worker_id = 'live-1' ORDER BY step")
        before = [sw for step, sw in rows if step < detail["step"]]
        after = [sw for step, sw in rows if step >= detail["step"]]
        assert before and after, (detail["step"], len(rows))
        assert all("fused_allreduce" in sw.split(",") for sw in before)
        assert all("fused_allreduce" not in sw.split(",") for sw in after)
        # no rule names the switch for the other release: its workers keep their own value
        assert "fused_allreduce" not in httpx_get(base, {"release": sim.releases[0].name})["switches"]

        week = iso_week_of(datetime.now(UTC))
        _, json_path = build_weekly_report(store, week, tmp_path / "reports")
        report = orjson.loads(json_path.read_bytes())
        assert any(c["name"] == "fused_allreduce" and c["source"] == "alert" and c["scope"] == f"release={leaking}"
                   for c in report["switch_changes"])
        assert any(e["kind"] == "switch_applied" and e["worker_id"] == "live-1" for e in report["switch_events"])
        assert any(e["kind"] == "rollback" and e["worker_id"] == "control-plane" and e["release"] == leaking
                   for e in report["switch_events"])


def httpx_get(base: str, params: dict) -> dict:
    import httpx

    return httpx.get(f"{base}/v1/switches", params=params).json()
