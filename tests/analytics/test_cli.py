"""``livestep simulate --direct`` and ``livestep analyze`` as commands (own process, own chDB directory)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def livestep(*args: str, cwd=REPO) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "api.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=180, check=False)


@pytest.mark.e2e
def test_simulate_then_analyze(tmp_path):
    dsn = f"chdb://{tmp_path / 'chdb'}"
    out = livestep("simulate", "--direct", "--dsn", dsn, "--weeks", "1", "--incident", "sync@3", "--workers", "6",
                   "--sessions-per-day", "48", "--session-median-s", "6", "--no-progress")
    assert out.returncode == 0, out.stderr
    assert "release v1.1 (sync)" in out.stdout
    out = livestep("analyze", "regressions", "--dsn", dsn)
    assert out.returncode == 0, out.stderr
    assert "regression" in out.stdout and "step_period_ms" in out.stdout and "release=v1.1" in out.stdout
    bad = livestep("analyze", "weekly_fps", "--week", "last", "--dsn", dsn)
    assert bad.returncode == 2 and "YYYY-Www" in bad.stderr
    bad = livestep("simulate", "--direct", "--dsn", dsn, "--incident", "meteor")
    assert bad.returncode == 2 and "valid: august, sync, benign, fix" in bad.stderr
