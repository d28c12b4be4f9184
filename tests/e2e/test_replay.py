"""Record now, ship later: ``livestep worker run --telemetry-file`` then ``livestep replay`` (issue 21, item 4).

Real processes end to end: the worker CLI writes the file with no collector anywhere; a real
``livestep serve`` (uvicorn, spool, chDB) receives the replay, twice, with a restart between; the
rows are counted in its chDB directory after it exited.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import pytest

from collector.telemetry_file import read_file
from tests.e2e.test_records_delivered import stored
from tests.serving import REPO, Serve, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def livestep(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "api.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


@pytest.fixture
def serve(tmp_path):
    s = Serve(tmp_path, free_port())
    yield s
    s.stop()


def test_worker_file_replayed_twice_is_stored_once_with_exact_counts(serve, tmp_path):
    path = tmp_path / "run.arrows"
    run = livestep("worker", "run", "--preset", "tiny", "--steps", "20", "--sessions", "2", "--no-realtime",
                   "--json", "--worker-id", "w-file", "--release", "v-file", "--telemetry-file", str(path))
    assert run.returncode == 0, run.stderr
    sessions = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(sessions) == 2
    for s in sessions:  # no collector: every record filed, none lost
        assert s["telemetry_filed"] == sum(s["records"].values())
        assert (s["telemetry_sent"], s["telemetry_dropped"]) == (0, 0)

    scan = read_file(path)
    assert (scan.streams, scan.torn, scan.closed) == (2, False, True)  # one stream per session's client
    filed = Counter()
    for b in scan.batches:
        filed[b.kind] += b.rows
    assert filed == sum((Counter(s["records"]) for s in sessions), Counter())

    serve.start()
    first = livestep("replay", str(path), "--collector", serve.url, "--json")
    assert first.returncode == 0, first.stderr
    r1 = json.loads(first.stdout)
    assert (r1["batches"], r1["stored"], r1["duplicate"], r1["lost"]) == (len(scan.batches), len(scan.batches), 0, {})
    serve.wait_drained()
    serve.stop()
    serve.start()  # a collector restarted since still knows the keys
    second = livestep("replay", str(path), "--collector", serve.url)
    assert second.returncode == 0, second.stderr
    assert f"stored 0, already stored {len(scan.batches)}, not acked 0" in second.stdout
    serve.wait_drained()
    serve.stop()

    for s in sessions:
        got = stored(serve.workdir, s["session_id"])
        assert {t: got[t] for t in ("steps", "gpu_samples", "sessions", "events")} == {
            "steps": s["records"]["step"], "gpu_samples": s["records"]["gpu_sample"],
            "sessions": s["records"]["session"], "events": s["records"]["event"]}
        assert got["steps"] == 20 and got["sessions"] == 2 and got["dropped"] == []


def test_replay_reports_what_it_cannot_ship_and_exits_nonzero(serve, tmp_path):
    from collector.client import TelemetryClient, encode_arrow
    from tests.collector.helpers import step_rows

    path = tmp_path / "t.arrows"
    good = step_rows(4, session_id="s-replay-bad")
    bad = step_rows(2, session_id="s-replay-bad", start=4, diffusion_ms=-1.0)  # the collector refuses it
    c = TelemetryClient(None, telemetry_file=path)
    c._file.write("key-good", "step", 4, encode_arrow("step", good))
    c._file.write("key-bad", "step", 2, encode_arrow("step", bad))
    c.close()
    serve.start()
    r = livestep("replay", str(path), "--collector", serve.url)
    assert r.returncode == 1
    assert "stored 1, already stored 0, not acked 1 {'refused': 1}" in r.stdout
    assert "key-bad (2 step rows): HTTP 4" in r.stderr
    missing = livestep("replay", str(tmp_path / "nope.arrows"), "--collector", serve.url)
    assert missing.returncode == 2 and "no such telemetry file" in missing.stderr
