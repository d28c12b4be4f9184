"""The loop with the real programs: livestep (real uvicorn, collector + api + scheduler on chDB), a real
Prometheus scraping its /metrics with the shipped rules, and a real Alertmanager with the shipped routing,
all on loopback ports, with short scrape / evaluation / group intervals.

Telemetry with a late-chunk burst for one release goes in -> LivestepLateChunks fires for that release,
naming the switch the release turned on -> Alertmanager posts it (bearer token) to /v1/alerts -> the
switch is off for that release only; once the burst stops the alert resolves, Alertmanager posts the
resolved notification, and it flips nothing.
"""

from __future__ import annotations

import re
import threading
import uuid
from datetime import UTC, datetime, timedelta

import httpx
import pytest
import yaml

from tests.api.live import bound_socket, serve
from tests.collector.helpers import ARROW, arrow_body, step_rows, wait_for
from tests.deploy.peers import DEPLOY, alertmanager, alertmanager_config, binary, prometheus

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

READ = "e2e-read-token-0123456789"
AM_TOKEN = "e2e-alertmanager-token-0123456789"
SWITCHES = "ring_cache,rope_at_write"


def fast_rules(text: str) -> str:
    """The shipped rules with windows of seconds, for a test that runs in seconds (the expressions,
    labels and routing are the shipped ones)."""
    text = re.sub(r"\[(5m|10m|1h)\]", "[8s]", text)
    return re.sub(r"for: \S+", "for: 0s", text)


class Fleet(threading.Thread):
    """Two releases streaming: v1 on time, v2 late on every other chunk while ``burst`` is set."""

    def __init__(self, base: str):
        super().__init__(daemon=True)
        self.base, self.burst, self.stop = base, threading.Event(), threading.Event()
        self.step = 0

    def post(self, kind: str, rows: list[dict]) -> None:
        r = httpx.post(f"{self.base}/v1/telemetry", content=arrow_body(kind, rows),
                       headers={"Content-Type": ARROW}, timeout=10)
        assert r.status_code == 200, r.text

    def run(self) -> None:
        while not self.stop.is_set():
            now = datetime.now(UTC) - timedelta(seconds=1)
            for release, sw in (("v1", SWITCHES), ("v2", "fused_allreduce," + SWITCHES)):
                rows = step_rows(20, session_id=f"{release}-s", release=release, start=self.step, ts=now,
                                 late=False, switches=sw)
                if release == "v2" and self.burst.is_set():
                    for r in rows[::2]:
                        r["late"] = True
                for r in rows:  # step_rows spaces them 166 ms from ts: keep them in the past
                    r["ts"] = now
                self.post("step", rows)
            self.step += 20
            self.stop.wait(0.25)


def _session_start(release: str, at: datetime, switches: str) -> dict:
    return {"worker_id": "w1", "session_id": f"{release}-s", "release": release, "gpu_kind": "cpu", "ts": at,
            "phase": "start", "first_forward_tokens": 8, "streamed_s": 0.0, "frames": 0, "avg_fps": None,
            "late_chunks": 0, "stall_ms": 0.0, "tp_size": 1, "shape": "tiny", "switches": switches}


def test_late_chunk_burst_fires_alertmanager_turns_the_switch_off_for_that_release_only(tmp_path, chdb_dir):
    binary("prometheus")
    binary("alertmanager")
    from api.app import create_app
    from api.settings import Settings

    sock = bound_socket()
    port = sock.getsockname()[1]
    settings = Settings(clickhouse_dsn=f"chdb://{chdb_dir}?database=t_{uuid.uuid4().hex[:12]}", role="all",
                        host="127.0.0.1", port=port, spool_dir=tmp_path / "spool", reports_dir=tmp_path / "reports",
                        flush_interval_s=0.05, switch_cache_s=0, read_tokens=[READ],
                        webhook_bearer_tokens={"alertmanager": AM_TOKEN})
    app = create_app(settings)
    (tmp_path / "read-token").write_text(READ)
    (tmp_path / "am-token").write_text(AM_TOKEN)
    (tmp_path / "rules.yml").write_text(fast_rules((DEPLOY / "prometheus" / "rules.yml").read_text()))
    am_cfg = alertmanager_config(port, tmp_path / "am-token")
    auth = {"Authorization": f"Bearer {READ}"}

    with serve(app, sock=sock, lifespan="on") as base, \
            alertmanager(am_cfg, tmp_path) as am_url:
        prom_cfg = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(tmp_path / "rules.yml")],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [am_url.removeprefix("http://")]}]}]},
            "scrape_configs": [{"job_name": "livestep", "authorization": {"credentials_file": str(tmp_path / "read-token")},
                                "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}],
        }
        # v1 rolled out first, then v2, which turned fused_allreduce on
        t0 = datetime.now(UTC)
        fleet = Fleet(base)
        fleet.post("session", [_session_start("v1", t0 - timedelta(hours=2), SWITCHES),
                               _session_start("v2", t0 - timedelta(hours=1), "fused_allreduce," + SWITCHES)])
        fleet.start()
        try:
            with prometheus(yaml.safe_dump(prom_cfg), tmp_path) as prom_url:
                def up():
                    r = httpx.get(f"{prom_url}/api/v1/query", params={"query": "livestep_fleet_chunks_total"}).json()
                    return len(r["data"]["result"]) == 2
                wait_for(up, 20, "Prometheus scraping livestep's fleet counters", every_s=0.2)
                fleet.burst.set()

                def switch(release: str):
                    r = httpx.get(f"{base}/v1/switches", params={"release": release, "gpu_kind": "cpu",
                                                                  "worker_id": "w1"}, headers=auth)
                    return r.json()["switches"].get("fused_allreduce")
                wait_for(lambda: switch("v2") is False, 40, "the alert to turn fused_allreduce off for v2", every_s=0.2)
                assert switch("v1") is None  # no rule for the other release: its workers keep their value
                fleet.burst.clear()

                def decisions():
                    r = httpx.get(f"{base}/v1/switches/history", params={"source": "alert"}, headers=auth)
                    assert r.status_code == 200, r.text
                    return r.json()
                wait_for(lambda: any(d["action"] == "alert_resolved" for d in _rows(decisions())), 40,
                         "Alertmanager's resolved notification", every_s=0.2)
        finally:
            fleet.stop.set()
            fleet.join(10)
        rows = _rows(decisions())
        flips = [d for d in rows if d["changed"]]
        assert len(flips) == 1, rows
        assert flips[0]["name"] == "fused_allreduce" and flips[0]["scope"] == "gpu_kind=cpu,release=v2"
        assert flips[0]["new_value"] is False
        assert switch("v2") is False and switch("v1") is None  # the resolved alert flipped nothing back
        alerts = {d.get("actor", "") for d in rows}
        assert any("alertmanager" in a for a in alerts), alerts


def _rows(body) -> list[dict]:
    return body["decisions"]
