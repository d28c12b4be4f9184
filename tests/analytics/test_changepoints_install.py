"""The change-point library installs light: Apache Otava without its declared dependencies (BigQuery,
gRPC, Slack, PostgreSQL clients and a numpy pin for one function), from requirements-nodeps.txt; a
server without it runs every other job and this one says what to install."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from analytics.changepoints import OTAVA, ChangepointError, change_points

REPO = Path(__file__).resolve().parents[2]


def test_otava_is_installed_without_its_dependencies():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert not any(r.startswith("apache-otava") for reqs in extras.values() for r in reqs)
    lines = [ln.split("#")[0].strip() for ln in (REPO / "requirements-nodeps.txt").read_text().splitlines()]
    assert [ln for ln in lines if ln] == [OTAVA]
    assert "--no-deps -r requirements-nodeps.txt" in (REPO / "dev").read_text()


def test_without_otava_the_analytics_load_and_change_points_say_what_to_install(monkeypatch):
    code = ("import sys; sys.modules['otava'] = None; sys.modules['otava.analysis'] = None; "
            "import analytics.jobs, analytics.changepoints; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]
    monkeypatch.setitem(sys.modules, "otava.analysis", None)
    with pytest.raises(ChangepointError, match=r"pip install --no-deps 'apache-otava>=0\.8,<0\.9'"):
        change_points([1.0] * 10 + [2.0] * 10)
