"""Mangled Arrow bodies against a real ``livestep serve``: no 5xx, no hang, and the server still answers.

A smaller run of tests/collector/fuzz_bodies.py's corpus (the crafted invalid-offsets body first)
through uvicorn into a separate server process; then ``/v1/health`` must answer 200, the writer must
have stored every acked row (0 failures) and the store must hold exactly the rows acked.
"""

from __future__ import annotations

import random
import subprocess
import sys

import httpx
import pytest

from tests.collector.fuzz_bodies import crafted_invalid_offsets, mangle, seeds
from tests.collector.helpers import ARROW, wait_for
from tests.e2e.test_serve_kill import AUTH, Server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _rows_in_store(srv: Server) -> int:
    code = ("import sys, chdb; print(sum(int(chdb.query(f'SELECT count() FROM livestep.{t}', 'CSV', "
            "path=sys.argv[1]).bytes().decode()) for t in ('steps', 'gpu_samples', 'sessions', 'events')))")
    out = subprocess.run([sys.executable, "-c", code, str(srv.tmp / "chdb")], capture_output=True, text=True,
                         check=True)
    return int(out.stdout.strip())


@pytest.fixture
def srv(tmp_path):
    s = Server(tmp_path)
    yield s
    if s.proc is not None and s.proc.poll() is None:  # a server hung by a body ignores SIGTERM
        s.kill()


def test_mangled_bodies_never_hang_or_5xx_a_real_server(srv):
    srv.start()
    rng = random.Random(29)
    corpus = seeds()
    bodies = [crafted_invalid_offsets()] + [mangle(corpus[i % len(corpus)], rng) for i in range(400)]
    statuses: dict[int, int] = {}
    acked = 0
    with httpx.Client(base_url=srv.url, timeout=10, headers={**AUTH, "content-type": ARROW}) as h:
        for i, body in enumerate(bodies):
            r = h.post("/v1/telemetry", content=body, headers={"idempotency-key": f"fuzz-{i}"})
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code < 500, (i, r.status_code, r.text[:300])
            if r.status_code == 200:
                acked += sum(r.json()["rows"].values())
            if i == 0:
                assert r.status_code == 400 and "session_id" in r.json()["detail"], r.text
        assert h.get("/v1/health").status_code == 200
    assert statuses.get(200) and statuses.get(400)
    wait_for(lambda: srv.health()["spool"]["batches"] == 0, what="spool drained")
    assert srv.health()["writer"]["failures"] == 0
    assert srv.stop() in (0, -15)
    assert _rows_in_store(srv) == acked
