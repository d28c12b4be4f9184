"""Idempotency-Keys live in a namespace of their own (issue 30 item 4).

A key names a batch of its sender (scoped per ingest token) and nothing else: a key spelled like
another batch's spool id (an unkeyed batch's ``sha256:<digest>``, another token's scoped id) is just
a key, and a batch a previous release spooled under the bare key is a duplicate only for the same
rows. Each case: a different body under such a key is stored (``duplicate: false``), never dropped.
"""

from __future__ import annotations

from collector import records
from collector.spool import Spool
from tests.collector.conftest import TOKEN
from tests.collector.helpers import ARROW, arrow_body, drained, step_rows, wait_for


def _post(c, body, key=None, token=TOKEN):
    h = {"content-type": ARROW, "authorization": f"Bearer {token}"}
    if key is not None:
        h["idempotency-key"] = key
    return c.post("/v1/telemetry", content=body, headers=h)


def _steps(c) -> int:
    wait_for(lambda: drained(c.app), what="spool drained")
    return c.app.state.store.query_rows("SELECT count() FROM steps")[0][0]


def test_a_key_spelled_like_an_unkeyed_batch_id_is_not_that_batch(collector):
    c = collector()
    r = _post(c, arrow_body("step", step_rows(5)))
    unkeyed_id = r.json()["batch_id"]
    assert unkeyed_id.startswith("sha256:")
    r = _post(c, arrow_body("step", step_rows(7, session_id="other")), key=unkeyed_id)
    assert r.status_code == 200 and r.json()["duplicate"] is False, r.text
    assert _steps(c) == 12


def test_a_key_spelled_like_another_tokens_scoped_id_is_not_that_batch(collector):
    c = collector(ingest_tokens=[TOKEN, "second-ingest-token"])
    first = arrow_body("step", step_rows(5))
    assert _post(c, first, key="batch-1").json()["duplicate"] is False
    scoped = _scoped_id(first, "batch-1")
    r = _post(c, arrow_body("step", step_rows(3, session_id="b")), key=scoped, token="second-ingest-token")
    assert r.status_code == 200 and r.json()["duplicate"] is False, r.text
    assert _steps(c) == 8


def _scoped_id(body: bytes, key: str) -> str:
    """The spool id the first token's batch got."""
    from collector.routes import _batch_id

    return _batch_id(key, body, f"Bearer {TOKEN}")


def _previous_release_spool(directory, key: str, rows: list[dict]) -> None:
    """A spool as the release before scoped keys left it: the batch spooled under the bare key."""
    sp = Spool(directory, max_bytes=1 << 26)
    sp.submit(key, {"step": records.to_arrow("step", rows)}).result()
    sp.close()


def test_a_previous_releases_bare_key_is_a_duplicate_only_for_the_same_rows(collector, tmp_path):
    spool_dir = tmp_path / "old-spool"
    rows = step_rows(4, session_id="legacy")
    _previous_release_spool(spool_dir, "batch-7", rows)
    c = collector(spool_dir=spool_dir)  # the new release starts on it and stores the old batch
    assert _steps(c) == 4
    r = _post(c, arrow_body("step", step_rows(6, session_id="new")), key="batch-7")
    assert r.status_code == 200 and r.json()["duplicate"] is False, r.text  # another body: stored
    r = _post(c, arrow_body("step", rows), key="batch-7")
    assert r.status_code == 200 and r.json()["duplicate"] is True, r.text  # the old batch retried
    assert _steps(c) == 10


def test_a_previous_releases_key_is_recognised_after_its_segment_is_gone(collector, tmp_path):
    spool_dir = tmp_path / "old-spool"
    rows = step_rows(4, session_id="legacy")
    _previous_release_spool(spool_dir, "batch-7", rows)
    c = collector(spool_dir=spool_dir)
    assert _steps(c) == 4
    c.__exit__(None, None, None)  # a restart: the old segment was stored and deleted, its id is in keys.log
    assert not list(spool_dir.glob("seg-*.log")) or all(p.stat().st_size == 0 for p in spool_dir.glob("seg-*.log"))
    c = collector(spool_dir=spool_dir)
    assert _post(c, arrow_body("step", rows), key="batch-7").json()["duplicate"] is True
    assert _post(c, arrow_body("step", step_rows(2, session_id="x")), key="batch-7").json()["duplicate"] is False
    assert _steps(c) == 2  # (a fresh database: only the new batch went in)
