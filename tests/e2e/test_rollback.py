"""The loop closed, end to end on a real uvicorn (collector + api + scheduler, chDB):

simulated history with the August incident -> the memory job's findings, handed to the incident logic
in process -> one incident, one signed notification to an external receiver (a second real uvicorn),
one flip: fused_allreduce off for the leaking release -> a live tiny worker polling /v1/switches
applies it at a step boundary once its poller sees the new version -> its switch_applied event (after
the flip's audit row; every step from it on without the switch) is stored through the collector ->
the fix: an operator re-enables the switch for the release, which reaches every worker of it -> the
evidence goes away, the incident resolves (a second notification) -> the week's report shows it all.
"""

from __future__ import annotations

import threading
import uuid
from datetime import UTC, datetime, timedelta

import orjson
import pytest

from tests.api.live import bound_socket, serve
from tests.api.test_incidents import Receiver
from tests.collector.helpers import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

POLL_S = 0.5


def test_incident_notification_flip_worker_applies_fix_re_enable_resolved(tmp_path, chdb_dir):
    from api.app import create_app
    from api.settings import Settings
    from tests.api.conftest import SECRET

    receiver = Receiver()
    sock = bound_socket()
    port = sock.getsockname()[1]
    with serve(receiver.app) as hook_base:
        settings = Settings(clickhouse_dsn=f"chdb://{chdb_dir}?database=t_{uuid.uuid4().hex[:12]}", role="all",
                            host="127.0.0.1", port=port, spool_dir=tmp_path / "spool",
                            reports_dir=tmp_path / "reports", webhook_secret=SECRET, flush_interval_s=0.2,
                            webhook_urls=f"{hook_base}/hook",
                            incident_resolve_after_s=0)  # the story's evidence goes at once: resolve without the hold
        _story(create_app(settings), sock, receiver, tmp_path)


def _story(app, sock, receiver, tmp_path):
    from analytics.jobs import run_job
    from analytics.queries import iso_week_of
    from analytics.simulate import simulate_fleet
    from api.report import build_weekly_report
    from worker.config import Switches
    from worker.session import run_session
    from worker.switches import HttpSource

    with serve(app, sock=sock, lifespan="on") as base:
        store = app.state.store
        assert app.state.incidents is not None, "the incident hand-off was not installed"
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
        wait_for(lambda: source.version is not None, 30, "the worker's first switch poll", every_s=0.1)
        wait_for(lambda: store.query_rows("SELECT count() FROM steps WHERE worker_id = 'live-1'")[0][0] > 3, 30,
                 "the live worker's first steps", every_s=0.1)

        findings = run_job("memory", store)  # the scheduler's hand-off: the incident logic, in process
        assert any(f["severity"] == "critical" and f["attribution"] == "fused_allreduce" for f in findings)
        assert len(receiver.got) == 1 and receiver.got[0]["signed"], receiver.got  # one signed notification
        assert receiver.got[0]["incident"]["state"] == "mitigated"
        decision = store.query_rows("SELECT ts, version, source, scope FROM switch_audit WHERE changed")
        assert len(decision) == 1 and decision[0][2:] == ("incident", f"release={leaking}")  # one flip
        flipped_at, flip_version = decision[0][:2]
        assert store.query_rows("SELECT count() FROM alert_deliveries") == [(0,)]  # not through /v1/alerts

        worker.join(60)
        assert not worker.is_alive()
        applied = [e for e in summary["s"].switch_events if "fused_allreduce" in e["changed"]]
        assert len(applied) == 1 and applied[0]["changed"] == {"fused_allreduce": False}

        ev = wait_for(lambda: store.query_rows(
            "SELECT ts, detail FROM events WHERE kind = 'switch_applied' AND worker_id = 'live-1'"), 20,
            "the switch_applied event in the store", every_s=0.1)
        applied_at, detail = ev[0][0], orjson.loads(ev[0][1])
        assert detail["changed"] == {"fused_allreduce": False}
        # the worker's poller saw the flip's version, and applied it after the decision was recorded
        assert source.version is not None and source.version >= flip_version, (source.version, flip_version)
        assert flipped_at <= applied_at, (flipped_at, applied_at)
        print(f"switch applied {(applied_at - flipped_at).total_seconds():.3f} s after the flip (information)")
        # ... at a step boundary: every stored step before it ran the switch, every one from it on did not
        n_steps = summary["s"].steps
        wait_for(lambda: store.query_rows("SELECT count() FROM steps WHERE worker_id = 'live-1'")[0][0] >= n_steps,
                 20, "every step of the live worker in the store", every_s=0.1)
        rows = store.query_rows("SELECT step, switches FROM steps WHERE worker_id = 'live-1' ORDER BY step")
        before = [sw for step, sw in rows if step < detail["step"]]
        after = [sw for step, sw in rows if step >= detail["step"]]
        assert before and after, (detail["step"], len(rows))
        assert all("fused_allreduce" in sw.split(",") for sw in before)
        assert all("fused_allreduce" not in sw.split(",") for sw in after)
        # no rule names the switch for the other release: its workers keep their own value
        assert "fused_allreduce" not in httpx_get(base, {"release": sim.releases[0].name})["switches"]

        # the fix: an operator re-enables the switch for the release; it reaches every worker of it
        import httpx

        from tests.api.evaluations import evaluate_release

        evaluate_release(store, "fused_allreduce", leaking)  # a numeric switch: on only with its evidence
        r = httpx.put(f"{base}/v1/switches/fused_allreduce", json={"value": True, "scope": f"release={leaking}",
                                                                   "who": "op", "why": "fixed in place"})
        assert r.status_code == 200 and r.json()["changed"], r.text
        workers = [(w.worker_id, w.gpu_kind) for w in sim.workers] + [("live-1", "cpu")]  # each polls with its kind
        assert {httpx_get(base, {"worker_id": w, "release": leaking, "gpu_kind": k})["switches"]["fused_allreduce"]
                for w, k in workers} == {True}
        # the evidence goes away (the memory job over a window after the leak): the incident resolves
        run_job("memory", store, start=sim.end + timedelta(days=1), end=sim.end + timedelta(days=2))
        [incident] = httpx.get(f"{base}/v1/incidents").json()["incidents"]
        assert incident["state"] == "resolved" and incident["flips"] == 1, incident
        assert [n["status"] for n in receiver.got] == ["firing", "resolved"]
        assert store.query_rows("SELECT count() FROM switch_audit WHERE changed AND source = 'incident'") == [(1,)]

        week = iso_week_of(datetime.now(UTC))
        _, json_path = build_weekly_report(store, week, tmp_path / "reports")
        report = orjson.loads(json_path.read_bytes())
        assert any(c["name"] == "fused_allreduce" and c["source"] == "incident" and c["scope"] == f"release={leaking}"
                   for c in report["switch_changes"])
        assert [i["id"] for i in report["incidents"]] == [incident["id"]]
        assert any(e["kind"] == "switch_applied" and e["worker_id"] == "live-1" for e in report["switch_events"])
        assert any(e["kind"] == "rollback" and e["worker_id"] == "control-plane" and e["release"] == leaking
                   for e in report["switch_events"])


def httpx_get(base: str, params: dict) -> dict:
    import httpx

    return httpx.get(f"{base}/v1/switches", params=params).json()
