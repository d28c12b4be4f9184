"""``livestep spool requeue`` as a command: a quarantined batch stored after the fix, the files gone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from collector import records
from collector.spool import Spool
from tests.collector.helpers import step_rows

REPO = Path(__file__).resolve().parents[2]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "api.cli", "spool", "requeue", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=False)


def test_requeue_stores_a_quarantined_batch_once_and_says_so(tmp_path):
    spool_dir, dsn = tmp_path / "spool", f"chdb://{tmp_path / 'chdb'}"
    sp = Spool(spool_dir, max_bytes=1 << 20)
    sp.submit("b1", {"step": records.to_arrow("step", step_rows(10))}).result()
    [entry] = sp.take(100)
    sp.quarantine(entry, "step", sp.read([entry])["step"][0], "Code: 469. DB::Exception: (VIOLATED_CONSTRAINT)")
    sp.mark_committed(entry.seq)
    sp.close()
    first = _cli("--spool-dir", str(spool_dir), "--dsn", dsn)
    assert first.returncode == 0, first.stderr
    assert "batch 1 (step, 10 rows): stored 10 of 10 rows" in first.stdout and "1 requeued, 0 still" in first.stdout
    again = _cli("--spool-dir", str(spool_dir), "--dsn", dsn)
    assert again.returncode == 0 and "no quarantined batches" in again.stdout
    code = ("import sys, chdb; print(chdb.query('SELECT count() FROM livestep.steps', 'CSV', path=sys.argv[1]))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "chdb")], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "10"


def test_requeue_without_a_spool_says_what_it_expected(tmp_path):
    r = _cli("--spool-dir", str(tmp_path / "nowhere"), "--dsn", f"chdb://{tmp_path / 'chdb'}")
    assert r.returncode == 2 and "not a spool directory" in r.stderr and "--spool-dir" in r.stderr
