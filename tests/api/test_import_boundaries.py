"""What each role may import, checked in a process where the other side's packages cannot be imported:
the server roles (app, scheduler, every server command) run with torch and triton unimportable, and
the worker runs a session and its shipping client with no server package (fastapi, chDB, polars, ...)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# None in sys.modules: ``import x`` raises ModuleNotFoundError and find_spec("x") is None, as when
# x is not installed (libraries probing for optional packages, polars for torch, see it so too)
BLOCK = """
import sys


class _Blocked:  # an import of these fails as if they were not installed (a None in sys.modules would be seen by
    # libraries that look for them there, such as scipy's array-API checks, and crash them instead)
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {names!r}:
            raise ModuleNotFoundError(f"blocked in this test: {{name}}", name=name)
        return None


sys.meta_path.insert(0, _Blocked())
"""


def run_blocked(names: set[str], body: str, tmp_path) -> subprocess.CompletedProcess:
    code = BLOCK.format(names=sorted(names)) + textwrap.dedent(body)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=240, check=False,
                         env=dict(os.environ, PYTHONPATH=str(REPO), LIVESTEP_REPORTS_DIR=str(tmp_path / "reports")))
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_server_roles_never_import_torch(tmp_path):
    out = run_blocked({"torch", "triton", "pynvml"}, f"""
        from fastapi.testclient import TestClient
        from api import cli
        from api.app import create_app
        from api.settings import Settings
        from analytics import jobs
        cli.build_parser()  # every subcommand registers (the worker's lazily)
        for cmd in ("serve", "migrate", "analyze", "simulate"):
            try:
                cli.main([cmd, "--help"])
            except SystemExit:
                pass
        app = create_app(Settings(clickhouse_dsn="chdb://{tmp_path}/db", role="all", spool_dir="{tmp_path}/spool"))
        with TestClient(app) as c:
            assert c.get("/v1/health").status_code == 200
            assert c.get("/dashboard/").status_code == 200
            assert app.state.scheduler is not None
            jobs.run_all(app.state.store)
        print(sorted(m for m, mod in sys.modules.items() if mod is not None
                     and (m.split(".")[0] in ("torch", "triton", "kernels") or m in ("worker.session", "worker.model"))))
        assert cli.main(["worker", "run", "--steps", "1"]) == 2  # a server box asked for the worker: one line
    """, tmp_path)
    assert out.stdout.strip().splitlines()[-1] == "[]"
    assert out.stderr.strip().splitlines()[-1] == ("livestep worker: torch is not installed, and this command "
                                                   "needs it: pip install 'livestep[worker]'")


SERVER_PACKAGES = {"fastapi", "starlette", "uvicorn", "chdb", "clickhouse_connect", "polars", "apscheduler",
                   "pydantic_settings", "plotly", "scipy", "statsmodels", "otava"}


def test_the_worker_and_its_client_import_no_server_code(tmp_path):
    out = run_blocked(SERVER_PACKAGES, """
        from worker.session import Worker
        from worker import cli
        from collector.client import TelemetryClient
        s = Worker("tiny", device="cpu").run_session(steps=3, realtime=False, collector_url=None)
        assert s.steps == 3
        c = TelemetryClient("http://127.0.0.1:9")  # nothing listens: the client never raises
        c.put("event", {"worker_id": "w", "session_id": "s", "release": "r", "gpu_kind": "cpu", "kind": "x"})
        c.close(timeout_s=0.1)
        print(sorted(m for m, mod in sys.modules.items() if mod is not None and (m.split(".")[0] in ("api", "analytics")
                     or m in ("collector.store", "collector.routes", "collector.writer", "collector.spool"))))
    """, tmp_path)
    assert out.stdout.strip().splitlines()[-1] == "[]"
