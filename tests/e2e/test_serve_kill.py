"""``livestep serve`` as a real process: SIGKILL with a non-empty spool, restart, exact counts; and
the refusal to bind beyond loopback without tokens.

Each server gets its own chDB and spool directories (tmp_path) and an ephemeral loopback port. The
store is held down through the writer's fault hook file (LIVESTEP_FAULT_STORE_DOWN_FILE) so acked
rows are still only in the spool when the process is killed.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from tests.collector.helpers import ARROW, arrow_body, json_rows, step_rows, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
TOKEN = "kill-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, tmp: Path):
        self.tmp, self.port = tmp, _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.down = tmp / "store-down"
        self.proc: subprocess.Popen | None = None

    def start(self) -> Server:
        env = {**os.environ, "LIVESTEP_INGEST_TOKENS": TOKEN, "LIVESTEP_FAULT_STORE_DOWN_FILE": str(self.down),
               "LIVESTEP_FLUSH_INTERVAL_S": "0.05", "LIVESTEP_RETRY_MAX_S": "0.2"}
        cmd = [sys.executable, "-m", "api.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--dsn", f"chdb://{self.tmp / 'chdb'}", "--spool-dir", str(self.tmp / "spool"), "--log-level", "info",
               "--role", "collector"]
        log = open(self.tmp / "serve.log", "ab")  # noqa: SIM115 (the child writes it)
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        wait_for(lambda: self._up() or self.proc.poll() is not None, what="server up")
        assert self.proc.poll() is None, (self.tmp / "serve.log").read_text()
        return self

    def _up(self) -> bool:
        try:
            return httpx.get(f"{self.url}/v1/health", timeout=1).status_code in (200, 503)
        except httpx.HTTPError:
            return False

    def health(self) -> dict:
        return httpx.get(f"{self.url}/v1/health", timeout=5).json()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        assert self.proc.wait(30) == -signal.SIGKILL

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)


_T0 = step_rows(1)[0]["ts"]  # one start for every batch: a re-sent batch is the same body (same key)


def _batch(i: int) -> dict:
    rows = step_rows(40, session_id=f"k{i % 4}", start=40 * (i // 4), ts=_T0)
    if i % 5 == 0:
        return {"json": {"steps": json_rows(rows)}, "headers": {**AUTH, "idempotency-key": f"b{i}"}}
    return {"content": arrow_body("step", rows), "headers": {**AUTH, "content-type": ARROW, "idempotency-key": f"b{i}"}}


def _count_in_store(tmp: Path) -> list[tuple]:
    code = ("import sys, chdb; r = chdb.query(\"SELECT session_id, count(), uniqExact(step) FROM livestep.steps "
            "GROUP BY 1 ORDER BY 1\", 'CSV', path=sys.argv[1]); print(r)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp / "chdb")], capture_output=True, text=True, check=True)
    rows = [ln.split(",") for ln in out.stdout.strip().splitlines() if ln.strip()]
    return [(r[0].strip('"'), int(r[1]), int(r[2])) for r in rows]


def test_sigkill_with_full_spool_then_restart_stores_every_acked_row_once(tmp_path):
    srv = Server(tmp_path)
    srv.down.touch()  # the store is unavailable: acked rows stay in the spool
    srv.start()
    with httpx.Client(base_url=srv.url, timeout=30) as h:
        for i in range(24):
            r = h.post("/v1/telemetry", **_batch(i))
            assert r.status_code == 200 and not r.json()["duplicate"], r.text
    wait_for(lambda: srv.health()["writer"]["failures"] >= 1, what="writer failing on the held-down store")
    assert srv.health()["spool"]["batches"] == 24
    srv.kill()
    seg = max((tmp_path / "spool").glob("seg-*.log"))
    with open(seg, "ab") as f:  # and a torn half-written record at the tail, never acked
        f.write(b"LSP1\x10\x00\x00")

    srv.down.unlink()
    srv.start()
    wait_for(lambda: srv.health()["spool"]["batches"] == 0, what="spool replayed")
    with httpx.Client(base_url=srv.url, timeout=30) as h:
        for i in range(0, 24, 5):  # late retries of batches acked before the kill
            r = h.post("/v1/telemetry", **_batch(i))
            assert r.status_code == 200 and r.json()["duplicate"], r.text

    # phase 2: kill while traffic flows and the writer inserts (the kill may land between an insert
    # and its commit); afterwards every batch is re-sent under its key, as a client would
    sent = threading.Event()

    def traffic():
        with httpx.Client(base_url=srv.url, timeout=5) as h:
            for i in range(24, 64):
                try:
                    h.post("/v1/telemetry", **_batch(i))
                except httpx.HTTPError:
                    return
                if i == 40:
                    sent.set()

    t = threading.Thread(target=traffic)
    t.start()
    sent.wait(60)
    srv.kill()
    t.join(60)
    srv.start()
    with httpx.Client(base_url=srv.url, timeout=30) as h:
        for i in range(64):
            assert h.post("/v1/telemetry", **_batch(i)).status_code == 200
    wait_for(lambda: srv.health()["spool"]["batches"] == 0, what="spool drained")
    assert srv.stop() in (0, -signal.SIGTERM)  # uvicorn re-raises SIGTERM after its graceful shutdown
    assert "stopped cleanly" in (tmp_path / "serve.log").read_text()

    per_session = 16 * 40  # 64 batches over 4 sessions, 40 rows each
    assert _count_in_store(tmp_path) == [(f"k{j}", per_session, per_session) for j in range(4)]


def test_refuses_non_loopback_bind_without_tokens(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIVESTEP_")}
    r = subprocess.run([sys.executable, "-m", "api.cli", "serve", "--host", "0.0.0.0", "--port", "0",
                        "--dsn", f"chdb://{tmp_path / 'chdb'}", "--spool-dir", str(tmp_path / "spool")],
                       check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "refusing to bind 0.0.0.0" in r.stderr and "LIVESTEP_INGEST_TOKENS" in r.stderr
    assert "LIVESTEP_WEBHOOK_SECRET" in r.stderr
