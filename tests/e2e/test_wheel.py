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
    for f in schema_files():  # (the cluster form is generated from the same files: collector/migrations.py)
        assert f"collector/sql/{f.name}" in names
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


def _uv_install(venv: Path, spec: str, *extra: str) -> None:
    base = [UV, "pip", "install", "--python", str(venv / "bin" / "python"), spec, *extra]
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


# -- DEPLOY.md's monitoring steps, from a fresh venv of the wheel with the server and worker extras --------

def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def full_venv(wheel, tmp_path_factory) -> Path:
    """server + worker extras (torch's CPU build from the machine's wheel folder when it has one), and
    Apache Otava --no-deps as DEPLOY.md says."""
    venv = tmp_path_factory.mktemp("fullvenv") / "v"
    subprocess.run([UV, "venv", "-q", "--python", sys.executable, str(venv)], check=True, env=_clean_env(),
                   capture_output=True, timeout=120)
    cpu_torch = [str(w) for d in os.environ.get("PIP_FIND_LINKS", "").split() if Path(d).is_dir()
                 for w in Path(d).glob("torch-*+cpu-*.whl")][:1]  # else the index's (a CUDA build: GBs)
    _uv_install(venv, f"livestep[server,worker] @ {wheel.as_uri()}", *cpu_torch)
    _uv_install(venv, "apache-otava>=0.8,<0.9", "--no-deps")
    return venv


def _wait(fn, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            v = fn()
        except httpx.HTTPError:
            v = None
        if v:
            return v
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def test_init_and_deploy_md_bring_up_serve_a_worker_prometheus_and_alertmanager(full_venv, tmp_path):
    import yaml

    from tests.deploy.peers import alertmanager, binary, prometheus

    binary("prometheus")
    binary("alertmanager")
    bin_ = full_venv / "bin"
    # 1. files and tokens
    out = _run(full_venv, "init", str(tmp_path / "etc"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    deploy = tmp_path / "etc" / "deploy"
    assert (deploy / "DEPLOY.md").is_file()
    tokens = {name: f"{name}-token-0123456789abcdef" for name in ("read", "ingest", "am")}
    for name, tok in tokens.items():
        (tmp_path / f"{name}-token").write_text(tok + "\n")
    rules = subprocess.run([binary("promtool"), "test", "rules", str(deploy / "prometheus/tests/rules_test.yml")],
                           capture_output=True, text=True, timeout=120, check=False)
    assert rules.returncode == 0, rules.stdout + rules.stderr
    port, worker_port = _free_port(), _free_port()
    base = f"http://127.0.0.1:{port}"
    # 5. Alertmanager (first: livestep is told its address)
    am_cfg = yaml.safe_load((deploy / "alertmanager" / "alertmanager.yml").read_text())
    hook = next(r for r in am_cfg["receivers"] if r["name"] == "livestep")["webhook_configs"][0]
    hook["url"] = f"{base}/v1/alerts"
    hook["http_config"]["authorization"]["credentials_file"] = str(tmp_path / "am-token")
    with alertmanager(yaml.safe_dump(am_cfg), deploy / "alertmanager") as am_url:
        # 2. livestep
        env = dict(_clean_env(), LIVESTEP_HOME=str(tmp_path / "home"), LIVESTEP_READ_TOKENS=tokens["read"],
                   LIVESTEP_INGEST_TOKENS=tokens["ingest"], LIVESTEP_WEBHOOK_BEARER_TOKENS=f"alertmanager={tokens['am']}",
                   LIVESTEP_ALERTMANAGER_URL=am_url)
        serve = subprocess.Popen([str(bin_ / "livestep"), "serve", "--port", str(port), "--log-level", "warning"],
                                 cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        worker = None
        try:
            _wait(lambda: httpx.get(f"{base}/v1/health", timeout=2).status_code == 200, 120, "livestep serve")
            assert (tmp_path / "home" / "chdb").is_dir()  # LIVESTEP_HOME, not site-packages
            # 3. a worker: token from the environment, base URL of the switch source, metrics served
            wenv = dict(_clean_env(), LIVESTEP_INGEST_TOKEN=tokens["ingest"])
            worker = subprocess.Popen([str(bin_ / "livestep"), "worker", "run", "--preset", "tiny", "--device", "cpu",
                                       "--seconds", "3", "--sessions", "1000", "--collector", base,
                                       "--switch-source", base, "--metrics-port", str(worker_port),
                                       "--release", "wheel-e2e"], cwd=tmp_path, env=wenv,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            # 4. Prometheus with the shipped config, its targets and files set as DEPLOY.md says
            prom_cfg = yaml.safe_load((deploy / "prometheus" / "prometheus.yml").read_text())
            prom_cfg["global"].update(scrape_interval="1s", evaluation_interval="1s")
            prom_cfg["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] = [am_url.removeprefix("http://")]
            jobs = {j["job_name"]: j for j in prom_cfg["scrape_configs"]}
            jobs["livestep"]["static_configs"][0]["targets"] = [f"127.0.0.1:{port}"]
            jobs["livestep"]["authorization"]["credentials_file"] = str(tmp_path / "read-token")
            jobs["livestep-worker"]["static_configs"][0]["targets"] = [f"127.0.0.1:{worker_port}"]
            del jobs["livestep-worker"]["authorization"]  # a loopback worker's metrics need no token
            with prometheus(yaml.safe_dump(prom_cfg), deploy / "prometheus") as prom_url:
                def query(q):
                    return httpx.get(f"{prom_url}/api/v1/query", params={"query": q}, timeout=5).json()["data"]["result"]

                ups = _wait(lambda: (r := query("up")) and len(r) == 2 and all(x["value"][1] == "1" for x in r) and r,
                            180, "both targets up")
                assert {x["metric"]["job"] for x in ups} == {"livestep", "livestep-worker"}
                builds = _wait(lambda: len(query("livestep_build_info")) == 2 and query("livestep_build_info"), 30,
                               "livestep_build_info of serve and the worker")
                assert {b["metric"]["version"] for b in builds} == {__version__}
                _wait(lambda: query('sum(livestep_fleet_chunks_total{release="wheel-e2e"}) > 0'), 120,
                      "the worker's chunks stored and counted")
                ams = httpx.get(f"{prom_url}/api/v1/alertmanagers", timeout=5).json()["data"]["activeAlertmanagers"]
                assert [a["url"].split("/api")[0] for a in ams] == [am_url]
                assert query("livestep_worker_switch_source_up") and query("livestep_worker_switch_source_up")[0][
                    "value"][1] == "1"
        finally:
            for p in (worker, serve):
                if p is not None:
                    p.terminate()
                    p.wait(30)
    assert "Traceback" not in (worker.stdout.read() if worker else "")


def test_change_points_run_on_the_light_otava_install(full_venv, tmp_path):
    """Apache Otava --no-deps (DEPLOY.md): otava.analysis imports and the change-point job runs, and none of
    the clients its metadata declares (BigQuery, Slack, PostgreSQL) is installed."""
    py = str(full_venv / "bin" / "python")
    code = ("import importlib.util as u, otava.analysis; "
            "print([m for m in ('google.cloud.bigquery', 'slack_sdk', 'pg8000') if u.find_spec(m.split('.')[0])])")
    probe = subprocess.run([py, "-c", code],
                           cwd=tmp_path, env=_clean_env(), capture_output=True, text=True, timeout=120, check=False)
    assert probe.returncode == 0 and probe.stdout.strip() == "[]", probe.stdout + probe.stderr
    out = _run(full_venv, "analyze", "changepoints", "--dsn", f"chdb://{tmp_path / 'db'}", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
