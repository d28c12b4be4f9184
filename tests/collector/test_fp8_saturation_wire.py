"""StepRecord.fp8_saturated end to end on the wire and in the store (sql/022): optional (an older
worker's JSON or Arrow body without it stays valid and stores NULL), a fraction in [0, 1] (anything
else a 422 that says what is valid), rows stored before the migration read NULL, and session_stats
keeps the per-session figures (max, mean, sampled / saturating / static-scales steps)."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pyarrow as pa
import pytest
from pydantic import ValidationError

from collector import records
from collector.migrations import SQL_DIR, statements
from collector.routes import BadBatchError, check_table
from tests.collector.helpers import ARROW, arrow_body, drained, json_rows, step_rows, store_before, wait_for

T0 = datetime(2026, 11, 2, 8, tzinfo=UTC)
MIGRATION = "022_fp8_saturation.sql"
SAT = [None, 0.0, None, 2.5e-4, None, 0.0]  # sampled every other step


def _old_schema_table(rows: list[dict]) -> pa.Table:
    """What a worker built before fp8_saturated existed sends: the step schema without the column."""
    t = records.to_arrow("step", rows)
    old = pa.schema([f for f in records.ARROW_SCHEMAS["step"] if f.name != "fp8_saturated"],
                    metadata=records.ARROW_SCHEMAS["step"].metadata)
    return pa.Table.from_arrays([t.column(n) for n in old.names], schema=old)


def _stats(store) -> list[tuple]:
    return store.query_rows(
        "SELECT session_id, max(fp8_sat_max), avgMerge(fp8_sat_avg), countIfMerge(fp8_sampled), "
        "countIfMerge(fp8_sat_steps), countIfMerge(fp8_static_steps), countMerge(steps) "
        "FROM session_stats GROUP BY session_id ORDER BY session_id")


def test_the_record_takes_a_fraction_or_nothing():
    row = step_rows(1)[0]
    assert records.StepRecord(**row).fp8_saturated is None  # an older worker: the field absent
    for v in (0.0, 1e-6, 1.0):
        assert records.StepRecord(**row, fp8_saturated=v).fp8_saturated == v
    for v in (-1e-9, 1.0001, float("nan"), float("inf")):
        with pytest.raises(ValidationError):
            records.StepRecord(**row, fp8_saturated=v)
    assert records.ARROW_SCHEMAS["step"].field("fp8_saturated").nullable


@pytest.mark.parametrize("value", [-0.01, 1.5, float("nan"), float("inf")])
def test_the_arrow_check_refuses_a_value_outside_zero_one(value):
    rows = step_rows(3)
    rows[2]["fp8_saturated"] = value
    with pytest.raises(BadBatchError) as e:
        check_table("step", records.to_arrow("step", rows))
    assert e.value.status == 422 and "step row 2 column 'fp8_saturated'" in str(e.value)
    assert "[0, 1]" in str(e.value) or "finite" in str(e.value)


def test_conform_adds_only_the_added_columns_as_nulls():
    rows = step_rows(2)
    t = records.conform("step", _old_schema_table(rows))
    assert t.schema.names == records.ARROW_SCHEMAS["step"].names
    assert t.column("fp8_saturated").null_count == 2
    assert pa.concat_tables([t, records.to_arrow("step", rows)]).num_rows == 4  # a spooled old batch + a new one
    other = _old_schema_table(rows).drop_columns(["late"])  # anything else missing: left to the caller's check
    assert records.conform("step", other).schema.names == other.schema.names


def _post(c, body: bytes, ctype: str):
    return c.post("/v1/telemetry", content=body, headers={"content-type": ctype})


def test_ingest_stores_the_value_and_null_for_older_workers(collector):
    c = collector()
    new = step_rows(6, session_id="new", switches="static_scales")
    for r, v in zip(new, SAT, strict=True):
        r["fp8_saturated"] = v
    assert _post(c, arrow_body("step", new), ARROW).status_code == 200
    old_arrow = step_rows(3, session_id="old-arrow")
    r = _post(c, arrow_body("step", [], table=_old_schema_table(old_arrow)), ARROW)
    assert r.status_code == 200, r.text
    old_json = json_rows(step_rows(2, session_id="old-json"))  # no fp8_saturated key at all
    r = _post(c, json.dumps({"steps": old_json}).encode(), "application/json")
    assert r.status_code == 200, r.text
    new_json = json_rows(step_rows(2, session_id="new-json", fp8_saturated=1.0))
    assert _post(c, json.dumps({"steps": new_json}).encode(), "application/json").status_code == 200
    wait_for(lambda: drained(c.app), what="spool drained")
    got = c.app.state.store.query_rows("SELECT session_id, step, fp8_saturated FROM steps ORDER BY session_id, step")
    want = ([("new", i, v) for i, v in enumerate(SAT)] + [("new-json", i, 1.0) for i in range(2)]
            + [("old-arrow", i, None) for i in range(3)] + [("old-json", i, None) for i in range(2)])
    assert [(s, i, None if v is None else pytest.approx(v, rel=1e-6)) for s, i, v in want] == got
    stats = {r[0]: r[1:] for r in _stats(c.app.state.store)}
    assert stats["new"][0] == pytest.approx(2.5e-4, rel=1e-6) and stats["new"][1] == pytest.approx(2.5e-4 / 3, rel=1e-6)
    assert stats["new"][2:] == (3, 1, 3, 6)
    assert stats["new-json"][2:] == (2, 2, 0, 2)  # saturating, but not with static_scales in its state
    assert stats["old-arrow"] == (None, None, 0, 0, 0, 3)


@pytest.mark.parametrize("value", [-0.5, 1.01, "NaN"])
@pytest.mark.parametrize("ctype", [ARROW, "application/json"])
def test_ingest_refuses_a_bad_fraction_listing_what_is_valid(collector, ctype, value):
    c = collector()
    rows = step_rows(3)
    rows[1]["fp8_saturated"] = float(value)
    if ctype == ARROW:
        body = arrow_body("step", rows)
    else:
        body = json.dumps({"steps": json_rows(rows)}).encode()  # NaN goes out as the JSON token NaN
    r = _post(c, body, ctype)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert "fp8_saturated" in detail
    assert any(s in detail for s in ("[0, 1]", "less than or equal to 1", "greater than or equal to 0", "finite"))
    wait_for(lambda: drained(c.app), what="spool drained")
    assert c.app.state.store.query_rows("SELECT count() FROM steps") == [(0,)]


def _insert(store, token, session_id, **over):
    rows = step_rows(4, session_id=session_id, ts=T0, **over)
    table = records.to_arrow("step", rows)
    if "fp8_saturated" not in over:
        table = _old_schema_table(rows)
    store.insert_arrow("steps", table, dedup_token=token)


def test_rows_stored_before_the_migration_read_null(store):
    with store_before(store, MIGRATION) as old:
        _insert(old, "a", "before")
        assert old.migrate()[0] == MIGRATION
        for stmt in statements(SQL_DIR / MIGRATION):  # idempotent (a crash mid-file)
            old.command(stmt)
        _insert(old, "b", "after", fp8_saturated=0.5, switches="static_scales")
        _insert(old, "c", "before", start=10, fp8_saturated=0.0, switches="static_scales")  # it goes on
        got = old.query_rows("SELECT session_id, fp8_saturated FROM steps ORDER BY session_id, ts")
        assert got == [("after", 0.5)] * 4 + [("before", None)] * 4 + [("before", 0.0)] * 4
        for _ in range(2):  # partial rows, then merged
            assert _stats(old) == [("after", 0.5, 0.5, 4, 4, 4, 4), ("before", 0.0, 0.0, 4, 0, 4, 8)]
            old.command("OPTIMIZE TABLE session_stats FINAL")


def test_rows_without_samples_keep_the_aggregate_empty(store):
    _insert(store, "a", "s1")
    assert _stats(store) == [("s1", None, None, 0, 0, 0, 4)]
