"""POST /v1/telemetry through TestClient: round trip, duplicates, every bad input, 429, outage."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pyarrow as pa
import pytest

from collector import records
from tests.collector.helpers import ARROW, arrow_body, drained, event_row, json_rows, step_rows, wait_for


def _post_arrow(c, body, key=None, **headers):
    h = {"content-type": ARROW, **headers}
    if key:
        h["idempotency-key"] = key
    return c.post("/v1/telemetry", content=body, headers=h)


def _stored(c) -> tuple[int, int]:
    wait_for(lambda: drained(c.app), what="spool drained")
    s = c.app.state.store
    return (s.query_rows("SELECT count() FROM steps")[0][0], s.query_rows("SELECT count() FROM events")[0][0])


def test_arrow_and_json_round_trip_exact_values(collector):
    c = collector()
    rows = step_rows(7, session_id="sa")
    r = _post_arrow(c, arrow_body("step", rows), key="k-arrow")
    assert r.status_code == 200, r.text
    assert r.json() == {"batch_id": "k-arrow", "rows": {"step": 7}, "duplicate": False}
    jrows = step_rows(3, session_id="sj")
    r = c.post("/v1/telemetry", json={"steps": json_rows(jrows), "events": json_rows([event_row(session_id="sj")])})
    assert r.status_code == 200, r.text
    assert r.json()["rows"] == {"step": 3, "event": 1} and r.json()["batch_id"].startswith("sha256:")
    assert _stored(c) == (10, 1)
    got = c.app.state.store.query_rows(
        "SELECT session_id, step, diffusion_ms, step_period_ms, cache_upkeep_ms, decode_ms, late, "
        "mem_allocated_bytes, switches, ts FROM steps ORDER BY session_id, step")
    want = [(r["session_id"], r["step"], r["diffusion_ms"], r["step_period_ms"], r["cache_upkeep_ms"], None,
             r["late"], r["mem_allocated_bytes"], r["switches"], r["ts"]) for r in rows + jrows]
    assert [g[:9] for g in got] == [w[:9] for w in want]
    assert [g[9].replace(tzinfo=UTC) for g in got] == [w[9] for w in want]
    ev = c.app.state.store.query_rows("SELECT kind, detail FROM events")
    assert ev == [("reset", '{"why":"test"}')]


@pytest.mark.parametrize("mode", ["key", "body-hash"])
def test_same_batch_sent_ten_times_is_stored_once(collector, mode):
    c = collector()
    body = arrow_body("step", step_rows(20))
    answers = [_post_arrow(c, body, key="batch-1" if mode == "key" else None).json() for _ in range(10)]
    assert [a["duplicate"] for a in answers] == [False] + [True] * 9
    assert all(a["rows"] == {"step": 20} for a in answers)
    assert _stored(c) == (20, 0)
    assert c.app.state.store.query_rows("SELECT countMerge(steps) FROM session_stats") == [(20,)]


# ---- every bad input: a 4xx that says what is wrong and what is valid, nothing stored -----------------

def _with(field, value, kind="step"):
    rows = step_rows(3) if kind == "step" else [event_row()]
    rows[1 if kind == "step" else 0][field] = value
    return rows


def _json(steps=None, **extra):
    body = {"steps": json_rows(steps if steps is not None else step_rows(3)), **extra}
    return json.dumps(body).encode()


def _future():
    return datetime.now(UTC) + timedelta(days=2)


def _arrow_with(field, value):
    return arrow_body("step", _with(field, value))


def _retyped(col, typ):
    t = records.to_arrow("step", step_rows(3))
    i = t.schema.get_field_index(col)
    return arrow_body("step", [], t.set_column(i, pa.field(col, typ), t.column(col).cast(typ)))


def _without(col):
    t = records.to_arrow("step", step_rows(3))
    return arrow_body("step", [], t.drop_columns([col]))


def _kind_meta(kind):
    t = records.to_arrow("step", step_rows(2))
    return arrow_body("step", [], t.replace_schema_metadata({b"livestep.kind": kind}))


def _nulls(col):
    t = records.to_arrow("step", step_rows(2))
    i = t.schema.get_field_index(col)
    return arrow_body("step", [], t.set_column(i, pa.field(col, pa.float64()), pa.array([1.0, None])))


def _missing_json_field():
    rows = json_rows(step_rows(2))
    del rows[0]["diffusion_ms"]
    return json.dumps({"steps": rows}).encode()


GOOD = arrow_body("step", step_rows(3))
BAD = [
    # name, content-type, body, extra headers, status, words the message must contain
    ("json missing field", "application/json", _missing_json_field(), {}, 422, ["diffusion_ms", "Field required", "valid step fields"]),
    ("json extra field", "application/json", _json(json_rows(_with("color", "blue"))), {}, 422, ["color", "valid step fields"]),
    ("json extra top-level", "application/json", _json(frames=[]), {}, 422, ["frames", "valid top-level fields"]),
    ("json wrong type", "application/json", _json(_with("step", "three")), {}, 422, ["steps[1].step", "integer"]),
    ("json nan", "application/json", _json(_with("diffusion_ms", float("nan"))), {}, 422, ["diffusion_ms", "got nan"]),
    ("json inf", "application/json", _json(_with("step_period_ms", float("inf"))), {}, 422, ["step_period_ms", "got inf"]),
    ("json negative duration", "application/json", _json(_with("diffusion_ms", -3.0)), {}, 422, ["diffusion_ms", "greater than or equal to 0"]),
    ("json future ts", "application/json", _json(_with("ts", _future())), {}, 422, ["ts", "in the future"]),
    ("json unknown switch", "application/json", _json(_with("switches", "ring_cache,warp_drive")), {}, 422, ["warp_drive", "valid switches: ring_cache"]),
    ("json unknown event kind", "application/json", json.dumps({"events": json_rows(_with("kind", "party", "event"))}).encode(), {}, 422, ["party", "valid kinds"]),
    ("json step beyond store", "application/json", _json(_with("step", 2**40)), {}, 422, ["steps[1].step", "less than or equal to 4294967295"]),
    ("json one bad kind spoils batch", "application/json", json.dumps({"steps": json_rows(step_rows(2)), "events": json_rows(_with("kind", "x", "event"))}).encode(), {}, 422, ["events[0].kind"]),
    ("json syntax", "application/json", b'{"steps": [', {}, 400, ["not valid JSON", "TelemetryBatch"]),
    ("json not an object", "application/json", b"[1, 2]", {}, 422, ["TelemetryBatch"]),
    ("unknown content type", "text/csv", b"a,b\n1,2\n", {}, 415, ["text/csv", "application/json", ARROW]),
    ("no content type", "", GOOD, {}, 415, ["(none)", ARROW]),
    ("arrow truncated", ARROW, GOOD[: len(GOOD) // 2], {}, 400, ["truncated"]),
    ("arrow missing end marker", ARROW, GOOD[:-8], {}, 400, ["end-of-stream"]),
    ("arrow garbage", ARROW, b"\x00" * 64 + b"\xff\xff\xff\xff\x00\x00\x00\x00", {}, 400, ["Arrow IPC stream"]),
    ("arrow trailing bytes", ARROW, GOOD + GOOD, {}, 400, ["follow the Arrow stream"]),
    ("arrow json body", ARROW, _json(), {}, 400, ["truncated"]),
    ("arrow missing column", ARROW, _without("late"), {}, 422, ["missing ['late']", "valid columns"]),
    ("arrow wrong type", ARROW, _retyped("step", pa.int32()), {}, 422, ["step is int32, expected int64"]),
    ("arrow ts unit", ARROW, _retyped("ts", pa.timestamp("us", tz="UTC")), {}, 422, ["ts is timestamp[us, tz=UTC]"]),
    ("arrow unknown kind", ARROW, _kind_meta(b"frame"), {}, 422, ["'frame'", "valid kinds: step"]),
    ("arrow kind mismatch", ARROW, _kind_meta(b"event"), {}, 422, ["event columns do not match"]),
    ("arrow nan", ARROW, _arrow_with("diffusion_ms", float("nan")), {}, 422, ["row 1", "diffusion_ms", "finite"]),
    ("arrow inf", ARROW, _arrow_with("energy_mj", float("-inf")), {}, 422, ["energy_mj", "finite"]),
    ("arrow negative duration", ARROW, _arrow_with("step_period_ms", -1.0), {}, 422, ["step_period_ms", ">= 0"]),
    ("arrow negative count", ARROW, _arrow_with("playout_depth", -1), {}, 422, ["playout_depth", "[0, 65535]"]),
    ("arrow future ts", ARROW, _arrow_with("ts", _future()), {}, 422, ["ts", "in the future"]),
    ("arrow ancient ts", ARROW, _arrow_with("ts", datetime(1990, 1, 1, tzinfo=UTC)), {}, 422, ["steps table keeps 180 days"]),
    ("arrow unknown switch", ARROW, _arrow_with("switches", "warp_drive"), {}, 422, ["warp_drive", "valid switches"]),
    ("arrow empty label", ARROW, _arrow_with("worker_id", ""), {}, 422, ["worker_id", "1 to 128 characters"]),
    ("arrow null required", ARROW, _nulls("diffusion_ms"), {}, 422, ["diffusion_ms", "required"]),
    ("oversize body", ARROW, b"\x00" * (70 * 1024), {}, 413, ["over the limit of 65536 bytes"]),
    ("missing token", ARROW, GOOD, {"authorization": ""}, 401, ["missing bearer token"]),
    ("wrong token", ARROW, GOOD, {"authorization": "Bearer nope"}, 403, ["not allowed", "ingest token"]),
    ("bad idempotency key", ARROW, GOOD, {"idempotency-key": "x" * 300}, 400, ["Idempotency-Key", "printable"]),
]


@pytest.fixture(scope="module")
def bad_client(tmp_path_factory, chdb_dir):
    from fastapi.testclient import TestClient

    from api.app import create_app
    from tests.collector.conftest import TOKEN
    from tests.collector.helpers import chdb_dsn, make_settings

    settings = make_settings(chdb_dsn(chdb_dir), tmp_path_factory.mktemp("bad"), ingest_tokens=[TOKEN],
                             max_body_bytes=64 * 1024)
    with TestClient(create_app(settings), headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        yield c


@pytest.mark.parametrize("name,ctype,body,headers,status,words", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_refused_with_a_helpful_4xx_and_nothing_stored(bad_client, name, ctype, body, headers,
                                                                     status, words):
    c = bad_client
    before = c.app.state.spool.stats()["last_seq"]
    h = {"content-type": ctype, **headers} if ctype else {**headers}
    r = c.post("/v1/telemetry", content=body, headers=h)
    assert r.status_code == status, r.text
    detail = r.json()["detail"]
    assert isinstance(detail, str)
    for w in words:
        assert w in detail, (w, detail)
    if status == 401:
        assert r.headers["www-authenticate"] == "Bearer"
    assert c.app.state.spool.stats()["last_seq"] == before  # nothing of the batch reached the spool
    wait_for(lambda: drained(c.app), what="spool drained")
    assert c.app.state.store.query_rows("SELECT count() FROM steps") == [(0,)]


def test_empty_batch_is_acked_and_stores_nothing(collector):
    c = collector()
    assert c.post("/v1/telemetry", json={}).json()["rows"] == {}
    assert _post_arrow(c, arrow_body("step", [])).json()["rows"] == {}
    assert c.app.state.spool.stats()["last_seq"] == 0


def test_spool_over_bound_answers_429_then_recovers(collector, tmp_path):
    down = tmp_path / "down"
    down.touch()
    c = collector(spool_max_bytes=1 << 20, fault_store_down_file=down)
    acked, refused = [], None
    for i in range(400):  # ~10 KB a batch against a 1 MiB bound
        r = _post_arrow(c, arrow_body("step", step_rows(100, start=100 * i)), key=f"b{i}")
        if r.status_code == 429:
            refused = (i, r)
            break
        assert r.status_code == 200
        acked.append(i)
    assert refused is not None, "the bound was never reached"
    i, r = refused
    assert int(r.headers["retry-after"]) >= 1 and "retry after" in r.json()["detail"]
    down.unlink()  # the store comes back: the spool drains, the refused batch is accepted on retry
    wait_for(lambda: drained(c.app), what="spool drained")
    assert _post_arrow(c, arrow_body("step", step_rows(100, start=100 * i)), key=f"b{i}").status_code == 200
    assert _stored(c) == (100 * (len(acked) + 1), 0)


def test_store_outage_mid_stream_every_acked_row_stored_once(collector, tmp_path):
    down = tmp_path / "down"
    c = collector(fault_store_down_file=down)
    sent = 0
    for i in range(30):
        if i == 10:
            down.touch()  # the store goes away mid-stream
        if i == 20:
            wait_for(lambda: c.app.state.writer.failures > 0, what="the writer meeting the outage")
            h = c.get("/v1/health").json()
            assert h["status"] == "degraded" and "fault hook" in h["writer"]["last_error"]
            assert h["spool"]["batches"] >= 1
            down.unlink()  # ... and comes back
        body = arrow_body("step", step_rows(50, session_id=f"s{i % 3}", start=50 * i))
        for _ in range(2 if i % 7 == 0 else 1):  # some batches retried by the client
            r = _post_arrow(c, body, key=f"batch-{i}")
            assert r.status_code == 200
        sent += 50
    assert _stored(c) == (sent, 0)
    s = c.app.state.store
    assert s.query_rows("SELECT count() FROM (SELECT session_id, step FROM steps GROUP BY 1, 2 HAVING count() > 1)") == [(0,)]
    assert s.query_rows("SELECT countMerge(steps) FROM session_stats") == [(sent,)]
    assert c.get("/v1/health").json()["status"] == "ok"


def test_values_at_every_bound_are_accepted_and_stored(collector):
    """What validation lets through, the store can hold: nothing accepted can wedge the writer."""
    c = collector()
    now = datetime.now(UTC) - timedelta(seconds=1)
    step = step_rows(1, step=2**32 - 1, diffusion_ms=1e308, step_period_ms=0.0, playout_depth=65535,
                     mem_allocated_bytes=2**63 - 1, mem_reserved_bytes=0, buffers_registered=2**32 - 1,
                     energy_mj=0.0, switches=",".join(records.SWITCH_NAMES), worker_id="w" * 128, ts=now)
    gpu = {"worker_id": "w", "session_id": "s", "release": "r", "gpu_kind": "g", "ts": now, "gpu_index": 1023,
           "power_w": 1e308, "energy_mj": 1e308, "sm_clock_mhz": 2**32 - 1, "mem_used_bytes": 2**63 - 1,
           "temp_c": -1e308, "throttle_reasons": 2**63 - 1}
    sess = {"worker_id": "w", "session_id": "s", "release": "r", "gpu_kind": "g", "ts": now, "phase": "end",
            "first_forward_tokens": 2**31 - 1, "streamed_s": 1e308, "frames": 2**63 - 1, "avg_fps": None,
            "late_chunks": 2**63 - 1, "stall_ms": 0.0, "tp_size": 1024, "shape": "x" * 128, "switches": ""}
    ev = event_row(detail={"k": "v" * 60000})
    for kind, rows in (("step", step), ("gpu_sample", [gpu]), ("session", [sess]), ("event", [ev])):
        r = _post_arrow(c, arrow_body(kind, rows))
        assert r.status_code == 200, r.text
    wait_for(lambda: drained(c.app), what="spool drained")
    assert c.app.state.writer.last_error is None
    s = c.app.state.store
    assert s.query_rows("SELECT step, playout_depth, mem_allocated_bytes, buffers_registered FROM steps") == \
        [(2**32 - 1, 65535, 2**63 - 1, 2**32 - 1)]
    assert s.query_rows("SELECT gpu_index, sm_clock_mhz FROM gpu_samples") == [(1023, 2**32 - 1)]
    assert s.query_rows("SELECT first_forward_tokens, tp_size, frames FROM sessions") == [(2**31 - 1, 1024, 2**63 - 1)]
    assert s.query_rows("SELECT length(detail) FROM events") == [(len('{"k":""}') + 60000,)]


def test_a_stream_of_several_record_batches_is_stored_whole(collector):
    c = collector()
    t = records.to_arrow("step", step_rows(10, session_id="multi"))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, t.schema) as w:
        for batch in t.to_batches(max_chunksize=3):  # 4 record batches after one schema message
            w.write_batch(batch)
    r = _post_arrow(c, sink.getvalue().to_pybytes(), key="multi")
    assert r.status_code == 200, r.text
    assert r.json()["rows"] == {"step": 10}
    assert _stored(c) == (10, 0)
    got = c.app.state.store.query_rows("SELECT step FROM steps ORDER BY step")
    assert [g[0] for g in got] == list(range(10))


def test_other_methods_on_the_ingest_path_get_405_with_allow(collector):
    c = collector()
    r = c.get("/v1/telemetry")
    assert r.status_code == 405
    assert r.headers["allow"] == "POST"


def test_rows_older_than_the_tables_retention_are_refused_with_422_naming_the_window(collector):
    """200-day-old steps would be dropped by the steps table's 180-day TTL: refused, nothing stored
    (the window is read from the store's own TTL); 29-day-old GPU samples are outside their 30 - 1 days."""
    from datetime import UTC, datetime, timedelta

    c = collector()
    old = datetime.now(UTC) - timedelta(days=200)
    r = _post_arrow(c, arrow_body("step", step_rows(100, ts=old)), key="old")
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert "'ts'" in detail and "steps table keeps 180 days" in detail and "179 days old" in detail, detail
    r = c.post("/v1/telemetry", json={"steps": json_rows(step_rows(3, ts=old))})
    assert r.status_code == 422 and "180 days" in r.json()["detail"]
    assert _post_arrow(c, arrow_body("step", step_rows(10, ts=datetime.now(UTC) - timedelta(days=170))),
                       key="recent").status_code == 200
    assert _stored(c) == (10, 0)
    c.app.state.store.command("ALTER TABLE steps MODIFY TTL toDateTime(ts) + INTERVAL 100 DAY")
    c.app.state.writer._limits = None  # re-read on the writer's next round (after its next block)
    assert _post_arrow(c, arrow_body("step", step_rows(1, session_id="wake")), key="wake").status_code == 200
    wait_for(lambda: c.app.state.writer.limits.retention["step"].days == 100, what="limits re-read")
    r = _post_arrow(c, arrow_body("step", step_rows(10, ts=datetime.now(UTC) - timedelta(days=150))), key="r2")
    assert r.status_code == 422 and "keeps 100 days" in r.json()["detail"]


def test_a_key_reused_with_a_different_body_is_409_and_stores_nothing(collector):
    c = collector()
    first, other = arrow_body("step", step_rows(5)), arrow_body("step", step_rows(7, start=5))
    r = _post_arrow(c, first, key="batch-1")
    assert r.status_code == 200 and r.json() == {"batch_id": "batch-1", "rows": {"step": 5}, "duplicate": False}
    r = _post_arrow(c, other, key="batch-1")
    assert r.status_code == 409, r.text
    assert "batch-1" in r.json()["detail"] and "different" in r.json()["detail"]
    assert _post_arrow(c, first, key="batch-1").json()["duplicate"] is True  # a true retry is still a duplicate
    r = c.post("/v1/telemetry", json={"steps": json_rows(step_rows(2, start=50))}, headers={"idempotency-key": "batch-1"})
    assert r.status_code == 409
    assert _stored(c) == (5, 0)


def test_keys_are_scoped_per_ingest_token(collector):
    from tests.collector.conftest import TOKEN

    c = collector(ingest_tokens=[TOKEN, "second-ingest-token"])
    a, b = arrow_body("step", step_rows(5, worker_id="wa")), arrow_body("step", step_rows(3, worker_id="wb"))
    assert _post_arrow(c, a, key="batch-1").json()["duplicate"] is False
    r = _post_arrow(c, b, key="batch-1", authorization="Bearer second-ingest-token")
    assert r.status_code == 200 and r.json()["duplicate"] is False, r.text  # another client's batch-1
    r = _post_arrow(c, b, key="batch-1", authorization="Bearer second-ingest-token")
    assert r.json()["duplicate"] is True
    assert _stored(c) == (8, 0)
