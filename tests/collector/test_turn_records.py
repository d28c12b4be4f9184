"""Turn records through the collector: a real tiny worker's turns (Arrow and JSON bodies) stored as sent
in ``turns`` and aggregated per session in ``turn_stats``; a bad turn is a 422 naming the column."""

from __future__ import annotations

from datetime import UTC

import pytest

from collector import records
from tests.collector.helpers import ARROW, arrow_body, drained, json_rows, turn_rows, wait_for
from worker.session import Session, Worker
from worker.telemetry import ListSink
from worker.turns import TurnSchedule

COLS = ("turn", "step", "speaking", "cond_tokens", "policy", "queue_depth", "dropped_chunks", "superseded",
        "wait_ms", "recompute_ms", "generation_ms", "queue_ms", "latency_ms", "stall_ms")


@pytest.fixture(scope="module")
def worker_turns() -> list[dict]:
    """The turn records of a real tiny session (real time, the trim policy, three turns)."""
    sink = ListSink()
    Session(Worker("tiny"), seconds=6.0, sink=sink, seed=2, turns=TurnSchedule([(0.5, 6, True), (1.3, 14, False),
                                                                               (2.1, 9, True)]),
            playout_policy="trim").run()
    rows = sink.rows["turn"]
    assert len(rows) == 3
    for r in rows:
        records.TurnRecord.model_validate(r)  # the worker's rows are the contract's
    return rows


def _ms(t):
    return t.replace(microsecond=t.microsecond // 1000 * 1000)


def test_worker_turns_round_trip_through_arrow_and_json(collector, worker_turns):
    c = collector()
    r = c.post("/v1/telemetry", content=arrow_body("turn", worker_turns), headers={"content-type": ARROW})
    assert r.status_code == 200 and r.json()["rows"] == {"turn": 3}, r.text
    again = [{**x, "session_id": "json-copy"} for x in worker_turns]
    r = c.post("/v1/telemetry", json={"turns": json_rows(again)})
    assert r.status_code == 200 and r.json()["rows"] == {"turn": 3}, r.text
    wait_for(lambda: drained(c.app), what="spool drained")
    store = c.app.state.store
    for sid in (worker_turns[0]["session_id"], "json-copy"):
        got = store.query_rows(f"SELECT {', '.join(COLS)}, ts, generated_at, played_at FROM turns "
                               "WHERE session_id = {s:String} ORDER BY turn", {"s": sid})
        assert len(got) == 3
        for g, w in zip(got, worker_turns, strict=True):
            assert g[:8] == tuple(w[k] for k in COLS[:8])
            assert g[8:14] == pytest.approx([w[k] for k in COLS[8:]], rel=1e-6, abs=1e-6)  # Float32
            assert [t.replace(tzinfo=UTC) for t in g[14:]] == [_ms(w[k]) for k in ("ts", "generated_at", "played_at")]
    (n, stalled, p50), = store.query_rows(
        "SELECT countMerge(turns), countIfMerge(stalled_turns), "
        "arrayElement(quantilesTDigestMerge(0.5, 0.95, 0.99)(latency_q), 1) FROM turn_stats "
        "WHERE session_id = {s:String}", {"s": "json-copy"})
    lat = sorted(w["latency_ms"] for w in worker_turns)
    assert n == 3 and stalled == sum(w["stall_ms"] > 0 for w in worker_turns)
    assert lat[0] <= p50 <= lat[-1]


@pytest.mark.parametrize(("col", "value", "words"), [
    ("policy", "skip", ["policy", "keep, drop_unplayed, trim"]),
    ("cond_tokens", 0, ["cond_tokens", "1"]),
    ("latency_ms", -1.0, ["latency_ms"]),
])
def test_a_bad_turn_is_a_422_naming_the_column_and_nothing_is_stored(collector, col, value, words):
    c = collector()
    rows = turn_rows(3)
    rows[1][col] = value
    for r in (c.post("/v1/telemetry", content=arrow_body("turn", rows), headers={"content-type": ARROW}),
              c.post("/v1/telemetry", json={"turns": json_rows(rows)})):
        assert r.status_code == 422, r.text
        assert all(w in r.text for w in words), r.text
    wait_for(lambda: drained(c.app), what="spool drained")
    assert c.app.state.store.query_rows("SELECT count() FROM turns") == [(0,)]
