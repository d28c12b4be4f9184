"""The api role's /metrics: open findings, job runs, switch rules, webhook decisions, release rollouts and
the switches each release turned on, read from the store at scrape time."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pyarrow as pa
from fastapi.testclient import TestClient
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from analytics.findings import finding, write_findings
from analytics.jobs import _record
from api.metrics import suspects
from collector import records
from tests.api.conftest import ADMIN, real_app
from tests.api.test_alerts import am, post


def scrape(c) -> dict:
    r = c.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert r.status_code == 200, r.text
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def samples(fams, family) -> dict:
    return {tuple(sorted(s.labels.items())): s.value for s in fams[family].samples
            if not s.name.endswith("_created")}


def _sessions(store, release: str, switches: str, at: datetime, n: int = 2) -> None:
    rows = [{"worker_id": "w1", "session_id": f"{release}-{i}", "release": release, "gpu_kind": "cpu",
             "ts": at + timedelta(minutes=i), "phase": "start", "first_forward_tokens": 8, "streamed_s": 0.0,
             "frames": 0, "avg_fps": None, "late_chunks": 0, "stall_ms": 0.0, "tp_size": 1, "shape": "tiny",
             "switches": switches} for i in range(n)]
    store.insert_arrow("sessions", records.to_arrow("session", rows))


def test_store_families(store, settings):
    now = datetime.now(UTC)
    week = now - timedelta(days=7)
    write_findings(store, "memory", week, now, [
        finding("memory_growth", {"release": "v2", "gpu_kind": "h200"}, "bytes_per_shape", week, now, value=1e9,
                severity="critical", attribution="fused_allreduce"),
        finding("regression", {"release": "v2"}, "step_period_ms_p50", week, now, value=170.0, severity="warning"),
    ])
    _record(store, "memory", now, "ok", 1, "schedule", week, now, 1, "")
    _record(store, "memory", now, "failed", 1, "schedule", week, now, 0, "boom")
    _record(store, "regressions", now, "failed", 1, "schedule", week, now, 0, "boom")
    # v2 (rolled out after v1, though it sorts first the other way round by name) turned fused_allreduce on
    _sessions(store, "v10", "ring_cache,rope_at_write", now - timedelta(days=3))
    _sessions(store, "v2", "fused_allreduce,ring_cache,rope_at_write", now - timedelta(days=1))
    with TestClient(real_app(store, settings)) as c:
        r = c.put("/v1/switches/compile", json={"value": False, "scope": "release=v2", "who": "t", "why": "t"},
                  headers={"Authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 200, r.text
        assert post(c, am(switch="ring_cache", release="v2")).status_code == 200
        assert post(c, am(status="resolved", switch="ring_cache", release="v2", fingerprint="fp2")).status_code == 200
        fams = scrape(c)
    types = {n: fams[n].type for n in ("livestep_findings_open", "livestep_findings_open_critical",
                                       "livestep_job_runs", "livestep_job_failures", "livestep_switch_rules",
                                       "livestep_webhook_decisions", "livestep_release_rollout_timestamp_seconds",
                                       "livestep_release_new_switch", "livestep_store_up")}
    assert types == {"livestep_findings_open": "gauge", "livestep_findings_open_critical": "gauge",
                     "livestep_job_runs": "counter", "livestep_job_failures": "counter",
                     "livestep_switch_rules": "gauge", "livestep_webhook_decisions": "counter",
                     "livestep_release_rollout_timestamp_seconds": "gauge", "livestep_release_new_switch": "info",
                     "livestep_store_up": "gauge"}
    assert samples(fams, "livestep_findings_open") == {
        (("kind", "memory_growth"), ("severity", "critical")): 1, (("kind", "regression"), ("severity", "warning")): 1}
    assert samples(fams, "livestep_findings_open_critical") == {
        (("gpu_kind", "h200"), ("kind", "memory_growth"), ("release", "v2"), ("switch", "fused_allreduce"),
         ("worker_id", "")): 1}
    assert samples(fams, "livestep_job_runs") == {(("analytics_job", "memory"),): 2, (("analytics_job", "regressions"),): 1}
    assert samples(fams, "livestep_job_failures") == {(("analytics_job", "memory"),): 1, (("analytics_job", "regressions"),): 1}
    assert set(samples(fams, "livestep_job_last_success_timestamp_seconds")) == {(("analytics_job", "memory"),)}
    rules = samples(fams, "livestep_switch_rules")
    assert rules[(("switch", "compile"), ("value", "off"))] == 1
    assert rules[(("switch", "ring_cache"), ("value", "off"))] == 1  # the firing alert's rule
    decisions = samples(fams, "livestep_webhook_decisions")
    assert decisions[(("outcome", "set"),)] == 1 and decisions[(("outcome", "alert_resolved"),)] == 1
    assert samples(fams, "livestep_release_new_switch") == {
        (("gpu_kind", "cpu"), ("release", "v2"), ("switch", "fused_allreduce")): 1}
    roll = samples(fams, "livestep_release_rollout_timestamp_seconds")
    assert roll[(("release", "v2"),)] > roll[(("release", "v10"),)]


def test_suspects_by_rollout_time_not_name():
    got = suspects([("v10", 300.0, ["a,b"], ["h200"]), ("v2", 100.0, ["a"], ["h200"]), ("v3", 200.0, ["a", "a,c"], [])])
    assert got == {"v2": set(), "v3": {"c"}, "v10": {"b"}}


def test_store_down_reads_as_store_up_0(store, settings):
    with TestClient(real_app(store, settings)) as c:
        c.app.state.store = None  # the store went away (a server DSN that stopped answering)
        fams = scrape(c)
    assert fams["livestep_store_up"].samples[0].value == 0
    assert "livestep_findings_open" not in fams


def test_collector_families_only_on_the_collector_role(store, settings):
    with TestClient(real_app(store, settings)) as c:
        fams = scrape(c)
    assert "livestep_collector_spool_bytes" not in fams and "livestep_findings_open" in fams
    assert "process_cpu_seconds" in fams  # the process collector, on every role


def test_build_info_and_http_request_metrics_on_every_role(store, settings):
    """``livestep_build_info`` and the HTTP requests each role answered (prometheus-fastapi-instrumentator)."""
    from collector.version import __version__

    for role in ("api", "collector"):
        with TestClient(real_app(store, settings.model_copy(update={"role": role}))) as c:
            assert c.get("/v1/health").status_code in (200, 503)
            fams = scrape(c)
        assert samples(fams, "livestep_build") == {(("version", __version__),): 1}, role
        reqs = samples(fams, "livestep_http_requests")
        assert any(dict(k).get("handler") == "/v1/health" and dict(k).get("method") == "GET" for k in reqs), reqs


def test_exposition_passes_promtool_without_a_job_label(store, settings):
    """``promtool check metrics`` is clean, and no family has a label Prometheus would rename (``job``,
    ``instance``: they arrive as exported_job / exported_instance)."""
    import shutil
    import subprocess

    import pytest

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed: apt-get install prometheus")
    _record(store, "memory", datetime.now(UTC), "ok", 1, "schedule", datetime.now(UTC), datetime.now(UTC), 1, "")
    with TestClient(real_app(store, settings.model_copy(update={"role": "all"}))) as c:
        c.get("/v1/health")
        text = c.get("/metrics").text
    r = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30,
                       check=False)
    assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), r.stdout + r.stderr
    from prometheus_client.parser import text_string_to_metric_families as text_families

    fams = text_families(text)
    clashing = {(f.name, k) for f in fams for s in f.samples for k in s.labels if k in ("job", "instance")}
    assert not clashing


_ = pa  # (pyarrow is what records.to_arrow returns)


def incidents(store, now: datetime) -> None:
    """Three incidents as api/incidents.py stores them (sql/031): two open, one resolved."""
    rows = [["i1", "memory_growth", "release=v2", "v2", "", "fused_allreduce", "mitigated", "critical", "leak",
             now - timedelta(hours=3), None, 1],
            ["i2", "regression", "release=v2", "v2", "h200", "", "opened", "warning", "slower",
             now - timedelta(hours=2), None, 1],
            ["i3", "fps_fraction", "release=v1", "v1", "", "static_scales", "resolved", "critical", "fps",
             now - timedelta(days=2), now - timedelta(hours=1), 1]]
    store.client().insert("incidents", rows, column_names=["id", "kind", "scope", "release", "gpu_kind", "switch",
                                                          "state", "severity", "summary", "opened_at",
                                                          "resolved_at", "version"])


def test_incident_families(store, settings):
    incidents(store, datetime.now(UTC))
    with TestClient(real_app(store, settings)) as c:
        fams = scrape(c)
    assert fams["livestep_incidents_tracked"].samples[0].value == 1
    assert samples(fams, "livestep_incidents_open") == {
        (("kind", "memory_growth"), ("severity", "critical"), ("state", "mitigated")): 1,
        (("kind", "regression"), ("severity", "warning"), ("state", "opened")): 1}
    assert samples(fams, "livestep_incidents_open_critical") == {
        (("gpu_kind", ""), ("kind", "memory_growth"), ("release", "v2"), ("switch", "fused_allreduce")): 1}


def test_incident_annotations(store):
    from api.timeseries import annotations

    now = datetime.now(UTC)
    incidents(store, now)
    marks = [(m.kind, m.text) for m in annotations(store, now - timedelta(days=1), now + timedelta(minutes=1))]
    assert ("incident_open", "incident opened: memory_growth release=v2 (fused_allreduce)") in marks
    assert ("incident_open", "incident opened: regression release=v2") in marks
    assert ("incident_close", "incident closed: fps_fraction release=v1 (static_scales)") in marks
    assert not any(k == "incident_open" and "fps_fraction" in t for k, t in marks)  # opened before the range
