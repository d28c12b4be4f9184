"""``livestep serve`` answers ``POST /v1/telemetry`` through its fast lane exactly as the app's route does.

One real ``livestep serve --role collector`` process (own chDB and spool directories, ephemeral
loopback port) and, in this process, the same app behind TestClient (FastAPI's middleware and
routing): every bad input of the collector tests, a good batch and its retry get the same status,
``detail`` and headers from both; the served rows are stored exactly once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from tests.collector.helpers import ARROW, arrow_body, chdb_dsn, make_settings, step_rows, wait_for
from tests.collector.test_ingest_routes import BAD
from tests.e2e.test_serve_kill import _count_in_store, _free_port

pytestmark = [pytest.mark.e2e]
REPO = Path(__file__).resolve().parents[2]
TOKEN = "test-ingest-token"  # the token the BAD cases were written for (tests/collector/conftest.py)
MAX_BODY = 64 * 1024


@pytest.fixture
def served(tmp_path):
    port = _free_port()
    env = {**os.environ, "LIVESTEP_INGEST_TOKENS": TOKEN, "LIVESTEP_MAX_BODY_BYTES": str(MAX_BODY),
           "LIVESTEP_FLUSH_INTERVAL_S": "0.05"}
    cmd = [sys.executable, "-m", "api.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--dsn", f"chdb://{tmp_path / 'chdb'}", "--spool-dir", str(tmp_path / "spool"), "--role", "collector"]
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115 (the child writes it)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(f"{url}/v1/health", timeout=1).status_code in (200, 503)
        except httpx.HTTPError:
            return proc.poll() is not None

    wait_for(up, what="livestep serve up")
    assert proc.poll() is None, (tmp_path / "serve.log").read_text()
    with httpx.Client(base_url=url, timeout=30, headers={"Authorization": f"Bearer {TOKEN}"}) as h:
        yield h, proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    log.close()


@pytest.fixture
def in_app(tmp_path, chdb_dir):
    from api.app import create_app

    settings = make_settings(chdb_dsn(chdb_dir), tmp_path / "app", ingest_tokens=[TOKEN], max_body_bytes=MAX_BODY)
    with TestClient(create_app(settings), headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        yield c
        c.app.state.store.command(f"DROP DATABASE IF EXISTS {c.app.state.store.database}")


def _answer(r: httpx.Response) -> tuple:
    return (r.status_code, r.json(), r.headers.get("content-type"), r.headers.get("www-authenticate"),
            r.headers.get("retry-after"))


def test_fast_lane_answers_like_the_apps_route_and_stores_once(served, in_app, tmp_path):
    h, proc = served
    for name, ctype, body, headers, status, _ in BAD:
        hdrs = {"content-type": ctype, **headers} if ctype else {**headers}
        got, want = h.post("/v1/telemetry", content=body, headers=hdrs), in_app.post(
            "/v1/telemetry", content=body, headers=hdrs)
        assert _answer(got) == _answer(want), name
        assert got.status_code == status, (name, got.text)

    body = arrow_body("step", step_rows(25, session_id="lane"))
    for dup in (False, True):
        hdrs = {"content-type": ARROW, "idempotency-key": "lane-1"}
        got, want = h.post("/v1/telemetry", content=body, headers=hdrs), in_app.post(
            "/v1/telemetry", content=body, headers=hdrs)
        assert _answer(got) == _answer(want)
        assert got.json() == {"batch_id": "lane-1", "rows": {"step": 25}, "duplicate": dup}

    assert h.get("/v1/telemetry").status_code == 405  # other methods still reach the app
    assert "post" in h.get("/openapi.json").json()["paths"]["/v1/telemetry"]
    wait_for(lambda: h.get("/v1/health").json()["spool"]["batches"] == 0, what="spool drained")
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)
    assert _count_in_store(tmp_path) == [("lane", 25, 25)]
