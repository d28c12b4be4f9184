"""``livestep demo`` (api/demo.py): its synthetic session is valid, and the main job runs end to end."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from api.demo import SessionSpec, session_records
from collector import records

REPO = Path(__file__).resolve().parents[2]


def test_demo_session_is_valid_and_close_to_24_fps():
    spec = SessionSpec(steps=200, seed=1)
    kinds = Counter()
    for kind, row in session_records(spec):
        records.MODELS[kind].model_validate(row)  # raises on any invalid record
        kinds[kind] += 1
        if kind == "session" and row["phase"] == "end":
            end = row
    assert kinds["step"] == 200 and kinds["session"] == 2
    assert kinds["gpu_sample"] > 0 and kinds["event"] >= 2
    assert end["frames"] == 800
    assert 23.5 < end["avg_fps"] < 26.0


@pytest.mark.e2e
@pytest.mark.slow
def test_demo_command_streams_stores_and_exits(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "api.cli", "demo", "--quick", "--port", "0", "--steps", "120",
           "--dsn", f"chdb://{tmp_path / 'chdb'}", "--spool-dir", str(tmp_path / "spool")]  # fmt: skip
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    stored = re.search(r"stored\s+(.*)", out.stdout).group(1)
    pairs = re.findall(r"(\w+) (\d+)/(\d+)", stored)
    assert {t for t, _, _ in pairs} == {"steps", "gpu_samples", "sessions", "events"}
    assert all(a == b for _, a, b in pairs), stored
    assert "steps 120/120" in stored
    assert re.search(r"session\s+2\d\.\d\d fps", out.stdout)
    assert "/v1/health" in out.stdout and "/docs" in out.stdout


@pytest.mark.e2e
@pytest.mark.slow
def test_demo_tells_the_whole_story(tmp_path):
    """History with the August incident -> finding -> webhook -> switch off -> the live worker applies it."""
    env = dict(os.environ, PYTHONPATH=str(REPO), LIVESTEP_REPORTS_DIR=str(tmp_path / "reports"))
    cmd = [sys.executable, "-m", "api.cli", "demo", "--port", "0", "--steps", "60", "--weeks", "1",
           "--live-seconds", "8", "--dsn", f"chdb://{tmp_path / 'chdb'}?database=demo",
           "--spool-dir", str(tmp_path / "spool")]  # fmt: skip
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"critical memory_growth .* -> fused_allreduce", out.stdout), out.stdout
    assert re.search(r"fused_allreduce off for release=v1\.\d", out.stdout), out.stdout
    assert "live-demo applied {'fused_allreduce': False}" in out.stdout, out.stdout
    report = re.search(r"(\S+livestep-report-\d{4}-W\d\d\.json)", out.stdout).group(1)
    assert (tmp_path / "reports") in Path(report).parents and Path(report).exists()
    assert "/dashboard/" in out.stdout
