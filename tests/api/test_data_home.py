"""Where livestep keeps its data by default: ``$LIVESTEP_HOME``, else ``./var`` of the working directory
(collector/settings.py ``data_home``), never the installed package's folder; every command's --help
names the paths it will use; ``livestep analyze`` writes reports where the settings say, whatever --dsn."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from api.settings import Settings

REPO = Path(__file__).resolve().parents[2]
PATH_VARS = ("LIVESTEP_HOME", "LIVESTEP_CLICKHOUSE_DSN", "LIVESTEP_SPOOL_DIR", "LIVESTEP_REPORTS_DIR")


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in PATH_VARS}
    return {**env, "PYTHONPATH": str(REPO), **extra}


@pytest.fixture
def no_path_vars(monkeypatch):
    for k in PATH_VARS:
        monkeypatch.delenv(k, raising=False)


def test_defaults_are_under_the_working_directory(tmp_path, monkeypatch, no_path_vars):
    monkeypatch.chdir(tmp_path)
    s = Settings()
    assert s.clickhouse_dsn == f"chdb://{tmp_path / 'var' / 'chdb'}"
    assert s.spool_dir == tmp_path / "var" / "spool" and s.reports_dir == tmp_path / "var" / "reports"


def test_livestep_home_moves_every_default(tmp_path, monkeypatch, no_path_vars):
    monkeypatch.setenv("LIVESTEP_HOME", str(tmp_path / "home"))
    s = Settings()
    assert s.clickhouse_dsn == f"chdb://{tmp_path / 'home' / 'chdb'}"
    assert s.spool_dir == tmp_path / "home" / "spool" and s.reports_dir == tmp_path / "home" / "reports"


@pytest.mark.parametrize("command", [["serve"], ["migrate"], ["spool", "requeue"], ["analyze"], ["demo"]])
def test_help_names_the_paths_in_force(tmp_path, command):
    out = subprocess.run([sys.executable, "-m", "api.cli", *command, "--help"], cwd=tmp_path, env=clean_env(COLUMNS="2000"),
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())  # argparse wraps lines
    assert str(tmp_path / "var") in text and "LIVESTEP_HOME" in text, text
    assert "<repo>" not in text


def test_analyze_writes_reports_where_the_settings_say_with_another_dsn(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    repo_reports = REPO / "var" / "reports"
    before = set(repo_reports.rglob("*")) if repo_reports.exists() else set()
    out = subprocess.run([sys.executable, "-m", "api.cli", "analyze", "weekly_report", "--week", "2026-W47",
                          "--dsn", f"chdb://{tmp_path / 'elsewhere'}"], cwd=work, env=clean_env(),
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert list((work / "var" / "reports").rglob("*.html")), out.stdout
    assert str(work / "var" / "reports") in out.stdout
    after = set(repo_reports.rglob("*")) if repo_reports.exists() else set()
    assert after == before  # nothing in the source checkout's var/
