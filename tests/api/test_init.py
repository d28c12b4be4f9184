"""``livestep init [DIR]`` writes the deployment files (Prometheus, Alertmanager, Grafana, DEPLOY.md)
from what the install ships; the sdist carries deploy/, docs/ and bench/ (the wheel: tests/e2e/test_wheel.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from api import cli

REPO = Path(__file__).resolve().parents[2]
SHIPPED = ("prometheus/prometheus.yml", "prometheus/rules.yml", "prometheus/tests/rules_test.yml",
           "alertmanager/alertmanager.yml", "grafana/livestep.json", "DEPLOY.md")


def test_init_writes_the_deployment_files_and_never_overwrites_unasked(tmp_path, capsys):
    assert cli.main(["init", str(tmp_path)]) == 0
    for rel in SHIPPED:
        written = tmp_path / "deploy" / rel
        source = REPO / ("docs/DEPLOY.md" if rel == "DEPLOY.md" else f"deploy/{rel}")
        assert written.read_bytes() == source.read_bytes(), rel
    capsys.readouterr()
    (tmp_path / "deploy" / "prometheus" / "rules.yml").write_text("# mine\n")
    assert cli.main(["init", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "exists" in err[0] and "--force" in err[0]
    assert (tmp_path / "deploy" / "prometheus" / "rules.yml").read_text() == "# mine\n"
    assert cli.main(["init", str(tmp_path), "--force"]) == 0
    assert (tmp_path / "deploy" / "prometheus" / "rules.yml").read_bytes() == (REPO / "deploy/prometheus/rules.yml").read_bytes()


def test_the_sdist_carries_deploy_docs_and_bench(tmp_path):
    src = tmp_path / "livestep"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", ".venv", "var", "build", "dist", "*.egg-info",
                                                             "__pycache__", ".hypothesis", ".pytest_cache"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    out = subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path / "dist")], cwd=src, env=env,
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    (sdist,) = (tmp_path / "dist").glob("livestep-*.tar.gz")
    with tarfile.open(sdist) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    for rel in SHIPPED[:-1]:
        assert f"deploy/{rel}" in names, rel
    assert {"docs/DEPLOY.md", "docs/METRICS.md", "bench/worker_step.py"} <= names
