"""``livestep serve`` refuses a store it can never use, with one line and no traceback, before it
binds or starts anything (api/serve.py ``check_store``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def serve(tmp_path, dsn: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "api.cli", "serve", "--port", "0", "--dsn", dsn,
                           "--spool-dir", str(tmp_path / "spool")], check=False, cwd=tmp_path,
                          env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("dsn", "says"), [
    ("foo://bar", "unknown store engine 'foo'"),
    ("chdb://var/chdb", "absolute directory"),
    ("chdb:relative/dir", "absolute directory"),
])
def test_a_dsn_that_cannot_work_is_refused_in_one_line(tmp_path, dsn, says):
    out = serve(tmp_path, dsn)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("livestep serve: ") and says in lines[0], out.stderr
    assert not (tmp_path / "spool").exists()


def test_a_chdb_directory_held_by_another_process_is_refused_in_one_line(tmp_path, store, chdb_dir):
    out = serve(tmp_path, f"chdb://{chdb_dir}")  # this test process holds it (the store fixture)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "in use by another process" in lines[0] and f"PID: {os.getpid()}" in lines[0], out.stderr
