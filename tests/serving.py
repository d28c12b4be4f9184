"""``livestep serve`` as a subprocess for tests, and what it stored, read once it has exited.

    serve = Serve(tmp_path, free_port(), LIVESTEP_INGEST_TOKENS="t").start()   # own chdb/ and spool/
    ...; serve.stop()
    read_store(tmp_path, session_id, **counted("steps", "events"), fps="<a Python expression>")

Each server process gets its own chDB and spool directories and an ephemeral loopback port; its store
is read by a separate process after it exited (chDB: one process per directory).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
COUNT = "s.query_rows('SELECT count() FROM {table} WHERE session_id = {{s:String}}', q)[0][0]"


def counted(*tables: str) -> dict[str, str]:
    """``read_store`` expressions: the session's rows in each table."""
    return {t: COUNT.format(table=t) for t in tables}


def read_store(workdir: Path, session_id: str, **exprs: str) -> dict[str, Any]:
    """Each Python expression of ``exprs`` evaluated against the store in ``workdir/chdb`` (``s``; ``q``:
    ``{'s': session_id}`` for ``{s:String}``) in a separate process, after the server exited; by name."""
    body = ", ".join(f"{name!r}: {expr}" for name, expr in exprs.items())
    code = ("import json; from collector.store import open_store; "
            f"s = open_store('chdb://{workdir / 'chdb'}'); q = {{'s': {session_id!r}}}; "
            f"print(json.dumps({{{body}}}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Serve:
    """``livestep serve`` on ``workdir`` (chdb/, spool/) and ``port``; restartable on the same both."""

    def __init__(self, workdir: Path, port: int, **env: str):
        self.workdir, self.port, self.env = workdir, port, env
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self, timeout_s: float = 60.0) -> Serve:
        self.starts += 1
        env = dict(
            os.environ,
            LIVESTEP_CLICKHOUSE_DSN=f"chdb://{self.workdir / 'chdb'}",
            LIVESTEP_SPOOL_DIR=str(self.workdir / "spool"),
            LIVESTEP_FLUSH_INTERVAL_S="0.1",
            PYTHONPATH=str(REPO),
            **self.env,
        )
        log = open(self.workdir / f"serve-{self.starts}.log", "wb")  # noqa: SIM115 - the child owns it
        cmd = [sys.executable, "-m", "api.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            assert self.proc.poll() is None, f"livestep serve exited: {self.log_tail()}"
            try:
                if httpx.get(self.url + "/v1/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"livestep serve not ready in {timeout_s} s: {self.log_tail()}")

    def log_tail(self) -> str:
        return (self.workdir / f"serve-{self.starts}.log").read_bytes()[-3000:].decode(errors="replace")

    def kill(self) -> None:
        """SIGKILL: no shutdown code runs; what was acked must survive in the spool."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)

    def wait_drained(self, timeout_s: float = 30.0) -> dict:
        """Until the spool holds no unstored batch (everything acked is in ClickHouse)."""
        end = time.monotonic() + timeout_s
        while True:
            h = httpx.get(self.url + "/v1/health", timeout=5.0).json()
            if h["spool"]["batches"] == 0 or time.monotonic() > end:
                return h
            time.sleep(0.1)

    def steps(self, session_id: str) -> list[dict]:
        out: list[dict] = []
        while True:
            r = httpx.get(
                f"{self.url}/v1/sessions/{session_id}/steps",
                params={"limit": 1000, "offset": len(out)},
                timeout=10,
            )
            assert r.status_code == 200, r.text
            page = r.json()
            out += page["steps"]
            if not page["steps"] or len(out) >= page["total"]:
                return out

    def count_stored(self, session_id: str) -> dict[str, int]:
        """Rows per table for the session, counted in the chDB directory after the server exited."""
        assert self.proc.poll() is not None, "stop the server first (chDB: one process per directory)"
        return read_store(self.workdir, session_id, **counted("steps", "gpu_samples", "sessions", "events"))
