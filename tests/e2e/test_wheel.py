"""The wheel as a user installs it: built from this tree, installed into a fresh venv with the server
extra only (no torch), then ``livestep migrate``, ``livestep serve``, a batch shipped by the installed
client and read back through the API -- all from the venv's site-packages, none from the repo.

The venv is made by uv from its local cache (``uv pip install --offline``), falling back to the
index on a cold cache; the first run on a machine downloads the server's dependencies once.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import httpx
import pytest

from collector.migrations import schema_files
from collector.version import __version__

REPO = Path(__file__).resolve().parents[2]
UV = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")

pytestmark = [pytest.mark.e2e, pytest.mark.slow,
              pytest.mark.skipif(UV is None, reason="uv is not installed (it is in livestep[dev])")]

_SKIP = shutil.ignore_patterns(".git", ".venv", "var", "build", "dist", "*.egg-info", "__pycache__", ".hypothesis",
                               ".pytest_cache", "reports")


def _clean_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LIVESTEP_", "PYTHON", "VIRTUAL_ENV"))}
    return env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src") / "livestep"
    shutil.copytree(REPO, src, ignore=_SKIP)
    dist = src.parent / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
                    str(src)], check=True, capture_output=True, timeout=300)
    (whl,) = dist.glob("livestep-*.whl")
    return whl


def test_the_wheel_ships_the_schema_and_declares_roles(wheel):
    assert wheel.name.startswith(f"livestep-{__version__}-")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta = z.read(f"livestep-{__version__}.dist-info/METADATA").decode()
    for cluster in (False, True):
        for f in schema_files(cluster):
            assert f"collector/sql/{'cluster/' if cluster else ''}{f.name}" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    requires = re.findall(r"^Requires-Dist: (.+)$", meta, re.MULTILINE)
    torch = [r for r in requires if r.startswith("torch")]
    assert torch and all('extra == "worker"' in r for r in torch), torch
    assert all("extra ==" in r for r in requires if r.startswith(("chdb", "fastapi", "polars")))
    assert 'livestep[server,worker]; extra == "dev"' in requires  # ./dev installs .[dev]: every role
    assert not any(n.startswith(("tests/", "bench/", "sql/")) for n in names)
    for rel in ("prometheus/prometheus.yml", "prometheus/rules.yml", "alertmanager/alertmanager.yml",
                "grafana/livestep.json", "DEPLOY.md"):  # what `livestep init` writes (api/init.py)
        assert f"api/deploy/{rel}" in names, rel


def _uv_install(venv: Path, spec: str) -> None:
    base = [UV, "pip", "install", "--python", str(venv / "bin" / "python"), spec]
    env = dict(_clean_env(), UV_NO_PROGRESS="1")
    offline = subprocess.run([*base, "--offline"], capture_output=True, text=True, env=env, timeout=300)
    if offline.returncode != 0:  # a cold cache: fetch once
        online = subprocess.run(base, capture_output=True, text=True, env=env, timeout=900)
        assert online.returncode == 0, online.stderr[-3000:]


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    venv = tmp_path_factory.mktemp("venv") / "v"
    subprocess.run([UV, "venv", "-q", "--python", sys.executable, str(venv)], check=True, env=_clean_env(),
                   capture_output=True, timeout=120)
    _uv_install(venv, f"livestep[server] @ {wheel.as_uri()}")
    return venv


def _run(venv: Path, *args: str, cwd: Path, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(venv / "bin" / "livestep"), *args], cwd=cwd, env=_clean_env(), capture_output=True,
                          text=True, timeout=180, **kw)


def test_server_extra_installs_without_torch(venv, tmp_path):
    py = str(venv / "bin" / "python")
    probe = subprocess.run([py, "-c", "import importlib.util as u, collector, sys; "
                            "print(u.find_spec('torch') is None, u.find_spec('triton') is None, collector.__file__)"],
                           cwd=tmp_path, env=_clean_env(), capture_output=True, text=True, timeout=60, check=False)
    no_torch, no_triton, where = probe.stdout.split()
    assert (no_torch, no_triton) == ("True", "True")
    assert where.startswith(str(venv)), where  # the installed package, not the repo
    assert _run(venv, "--version", cwd=tmp_path).stdout.strip() == f"livestep {__version__}"
    worker = _run(venv, "worker", "run", "--steps", "1", cwd=tmp_path)
    assert worker.returncode == 2 and worker.stderr.strip() == (
        "livestep worker: torch is not installed, and this command needs it: pip install 'livestep[worker]'")


CLIENT = """
import sys
from datetime import UTC, datetime, timedelta
from collector.client import TelemetryClient
c = TelemetryClient(sys.argv[1])
t0 = datetime.now(UTC) - timedelta(minutes=5)
for i in range(50):
    c.put("step", {"worker_id": "wheel-w", "session_id": "wheel-s", "release": "wheel", "gpu_kind": "cpu",
                   "ts": t0 + timedelta(milliseconds=166 * i), "step": i, "diffusion_ms": 150.0,
                   "step_period_ms": 166.5, "late": False, "playout_depth": 2, "reset_step": False,
                   "mem_allocated_bytes": 1, "mem_reserved_bytes": 2, "buffers_registered": 1, "switches": ""})
ok = c.close(timeout_s=30)
print(ok, c.dropped)
"""


def test_migrate_serve_ingest_read_back(venv, tmp_path):
    dsn = f"chdb://{tmp_path / 'db'}"
    out = _run(venv, "migrate", "--dsn", dsn, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith(f"{len(schema_files())} migration(s) applied; schema current")
    env = dict(_clean_env(), LIVESTEP_MIGRATE_ON_START="false")  # serve checks the schema migrate applied
    proc = subprocess.Popen([str(venv / "bin" / "livestep"), "serve", "--port", "0", "--dsn", dsn, "--spool-dir",
                             str(tmp_path / "spool"), "--log-level", "warning"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        m = re.match(r"livestep serve: (http://127\.0\.0\.1:\d+) role=all", line)
        assert m, (line, proc.stderr.read() if proc.poll() is not None else "")
        base = m.group(1)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/v1/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "server did not come up"
            time.sleep(0.2)
        ship = subprocess.run([str(venv / "bin" / "python"), "-c", CLIENT, base], cwd=tmp_path, env=_clean_env(),
                              capture_output=True, text=True, timeout=120, check=False)
        assert ship.stdout.split() == ["True", "0"], ship.stderr
        deadline = time.monotonic() + 30
        while True:
            r = httpx.get(f"{base}/v1/sessions/wheel-s/steps", params={"limit": 100}, timeout=10)
            if r.status_code == 200 and r.json()["total"] == 50:
                break
            assert time.monotonic() < deadline, r.text[:500]
            time.sleep(0.3)
        assert sorted(row["step"] for row in r.json()["steps"]) == list(range(50))
        assert httpx.get(f"{base}/v1/health", timeout=10).json()["version"] == __version__
    finally:
        proc.terminate()
        proc.wait(30)
