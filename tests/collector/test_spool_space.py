"""A spool out of space recovers once the store has its data (issue 30 item 2).

Two ways to run out: the spool's own bound (``max_bytes``: 429) and the filesystem under it (a full
disk: the append fails, 503). Either way health says ``degraded`` with the reason while ingest is
refused, and ingest is taken again once the writer has stored what was waiting: for a full disk that
needs the stored part of the active segment given back (before, only whole non-active segments were,
and a disk filled by the active one stayed full until it was grown).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import uuid

import pytest

from collector import records
from collector.spool import Spool, SpoolError, SpoolFullError
from collector.state import collector_state
from collector.writer import BlockWriter
from tests.collector.helpers import step_rows, wait_for


def _batch(i: int) -> dict:
    return {"step": records.to_arrow("step", step_rows(50, session_id=f"s{i}"))}


def _fill(sp: Spool, error: type[Exception]) -> int:
    """Submit batches until the spool refuses one with ``error``; the number taken."""
    for i in range(100_000):
        try:
            sp.submit(f"b{i}", _batch(i)).result()
        except error:
            return i
    raise AssertionError("the spool never refused")


def _reasons(sp: Spool, w: BlockWriter) -> list[str]:
    return collector_state(True, sp, w)["reasons"]


def _recovers(sp: Spool, w: BlockWriter, down, taken: int) -> None:
    assert any("refused for space" in r for r in _reasons(sp, w)), _reasons(sp, w)
    down.unlink()  # the store is back
    wait_for(lambda: sp.stats()["batches"] == 0, what="spool drained")
    # the writer forgets the stored batches first, then gives their space back (Spool.mark_committed): the
    # reason clears a moment after the drain, and must clear
    wait_for(lambda: not any("refused for space" in r for r in _reasons(sp, w)), timeout_s=10,
             what="the space given back: no 'refused for space' reason")
    sp.submit("after", _batch(taken + 1)).result()  # ingest is taken again
    wait_for(lambda: sp.stats()["batches"] == 0, what="the new batch stored")


@contextlib.contextmanager
def _store_down(store, tmp_path, sp: Spool):
    """``sp`` and its writer into ``store``, which is down (the fault file) until the test removes the file;
    the writer is stopped and the spool closed at the end."""
    down = tmp_path / "store-down"
    down.touch()
    w = BlockWriter(sp, lambda: store, flush_interval_s=0.01, retry_max_s=0.05, fault_store_down_file=down)
    w.start()
    try:
        yield sp, w, down
    finally:
        w.stop()
        sp.close()


def test_a_spool_over_its_bound_is_degraded_then_takes_ingest_once_drained(store, tmp_path):
    with _store_down(store, tmp_path, Spool(tmp_path / "spool", max_bytes=256 << 10)) as (sp, w, down):
        taken = _fill(sp, SpoolFullError)
        assert "spool full" in sp.stats()["refusing"]
        _recovers(sp, w, down, taken)
    assert store.query_rows("SELECT count() FROM steps")[0][0] == 50 * (taken + 1)


@pytest.fixture
def tiny_disk(tmp_path):
    """A 1 MiB tmpfs (needs root to mount; skipped otherwise)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / f"disk-{uuid.uuid4().hex[:8]}"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, check=False)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode()[:200]}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_disk_gets_its_space_back_once_the_store_has_the_data(store, tmp_path, tiny_disk):
    sp = Spool(tiny_disk, max_bytes=1 << 30, segment_bytes=64 << 20)  # the disk, not the bound, runs out
    with _store_down(store, tmp_path, sp) as (sp, w, down):
        taken = _fill(sp, SpoolError)
        assert "cannot write" in sp.stats()["refusing"]
        _recovers(sp, w, down, taken)
    used = sum(p.stat().st_size for p in tiny_disk.glob("seg-*.log"))
    assert used < 64 << 10  # the stored batches' space is free again
    assert store.query_rows("SELECT count() FROM steps")[0][0] == 50 * (taken + 1)


def test_health_names_the_refusal_for_space_while_ingest_is_refused(collector, tmp_path):
    """Through the app: 429 while the spool is over its bound and the store is down, ``/v1/health``
    degraded and saying why; once the store is back and the spool drained, ingest is taken and health is ok."""
    from tests.collector.helpers import ARROW, arrow_body, drained

    down = tmp_path / "down"
    down.touch()
    c = collector(fault_store_down_file=down, spool_max_bytes=1 << 20)
    i = 0
    while True:
        r = c.post("/v1/telemetry", content=arrow_body("step", step_rows(500, session_id=f"h{i}")),
                   headers={"content-type": ARROW, "idempotency-key": f"h{i}"})
        if r.status_code != 200:
            break
        i += 1
    assert r.status_code == 429 and "Retry-After" in r.headers
    h = c.get("/v1/health").json()
    assert h["status"] == "degraded" and any("refused for space" in x for x in h["reasons"]), h["reasons"]
    down.unlink()
    wait_for(lambda: drained(c.app), what="spool drained")
    r = c.post("/v1/telemetry", content=arrow_body("step", step_rows(500, session_id="after")),
               headers={"content-type": ARROW, "idempotency-key": "after"})
    assert r.status_code == 200, r.text
    assert c.get("/v1/health").json()["status"] == "ok"
