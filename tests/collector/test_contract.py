"""One contract, one place (``KINDS``, collector/record_fields.py, derived in collector/records.py): the
pydantic models, the Arrow schemas, the ingest checks and the store's columns all agree with the
declaration; the session record carries every shape dimension (sql/040), optional, so an older worker's JSON or Arrow body stays valid and stores NULL."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pyarrow as pa
import pytest
from pydantic import ValidationError

from collector import records
from tests.collector.helpers import ARROW, arrow_body, drained, json_rows, wait_for
from tests.collector.test_ingest_checks import CASES, ROWS

NEW_SHAPE = ("cond_tokens", "decoder_height", "decoder_width", "chunk_frames")


@pytest.mark.parametrize("kind,col,value", CASES, ids=[f"{k}.{c}={v!r:.20}" for k, c, v in CASES])
def test_the_model_refuses_every_value_the_ingest_check_refuses(kind, col, value):
    """The JSON path (models) and the Arrow path (checks) share one set of bounds: what one refuses the
    other refuses too (before the declaration, a step of 2**40 passed the model and failed the store)."""
    row = {**ROWS[kind][0], col: value}  # event detail: a text is not a JSON object in a model either
    with pytest.raises(ValidationError):
        records.MODELS[kind](**row)


@pytest.mark.parametrize("kind", records.RECORD_KINDS)
def test_models_schemas_and_checks_are_derived_from_one_declaration(kind):
    cols = records.columns(kind)
    assert list(records.MODELS[kind].model_fields) == [c.name for c in cols]
    assert records.ARROW_SCHEMAS[kind].names == [c.name for c in cols]
    assert [f.nullable for f in records.ARROW_SCHEMAS[kind]] == [c.nullable for c in cols]
    assert set(records.CHECKS[kind]) == {c.name for c in cols if c.type != "bool"}
    for c in cols:
        if c.since:
            assert c.name in records.ADDED_COLUMNS[kind]
    assert records.TelemetryBatch.model_fields[next(f for f, k in records.BATCH_FIELDS.items() if k == kind)]


def test_every_declared_column_is_a_store_column_and_nothing_else(store):
    for kind, table in records.TABLES.items():
        stored = [r[0] for r in store.query_rows(f"SELECT name FROM system.columns WHERE database = currentDatabase() "
                                                 f"AND table = '{table}' ORDER BY position")]
        assert stored == records.ARROW_SCHEMAS[kind].names, kind


def test_the_shape_keys_name_session_columns():
    names = set(records.ARROW_SCHEMAS["session"].names)
    for key, cols in records.SHAPE_KEYS.items():
        assert set(cols) <= names, key
    assert {"first_forward_tokens", "cond_tokens", "decoder_resolution", "tp_size", "chunk_frames"} <= set(
        records.SHAPE_KEYS)


def _session(**over) -> dict:
    r = {**ROWS["session"][0], "session_id": "s-new", "cond_tokens": 300, "decoder_height": 704,
         "decoder_width": 1088, "chunk_frames": 4, "ts": datetime.now(UTC) - timedelta(minutes=2)}
    r.update(over)
    return r


@pytest.mark.parametrize("col,bad", [("cond_tokens", 0), ("decoder_height", 65536), ("decoder_width", -1),
                                     ("chunk_frames", 0)])
def test_a_shape_value_out_of_bounds_is_a_422_naming_it(collector, col, bad):
    c = collector()
    for ctype, body in ((ARROW, arrow_body("session", [_session(**{col: bad})])),
                        ("application/json", json.dumps({"sessions": json_rows([_session(**{col: bad})])}).encode())):
        r = c.post("/v1/telemetry", content=body, headers={"content-type": ctype})
        assert r.status_code == 422, r.text
        assert col in r.json()["detail"]


def test_old_workers_without_the_shape_fields_are_stored_with_nulls(collector):
    c = collector()
    new = _session()
    old_json = {k: v for k, v in _session(session_id="s-old-json").items() if k not in NEW_SHAPE}
    t = records.to_arrow("session", [_session(session_id="s-old-arrow")])
    old_schema = pa.schema([f for f in t.schema if f.name not in NEW_SHAPE], metadata=t.schema.metadata)
    old_arrow = pa.Table.from_arrays([t.column(n) for n in old_schema.names], schema=old_schema)
    for ctype, body in ((ARROW, arrow_body("session", [new])),
                        ("application/json", json.dumps({"sessions": json_rows([old_json])}).encode()),
                        (ARROW, arrow_body("session", [], table=old_arrow))):
        r = c.post("/v1/telemetry", content=body, headers={"content-type": ctype})
        assert r.status_code == 200, r.text
    wait_for(lambda: drained(c.app), what="spool drained")
    got = c.app.state.store.query_rows(
        "SELECT session_id, first_forward_tokens, cond_tokens, decoder_height, decoder_width, chunk_frames "
        "FROM sessions ORDER BY session_id")
    assert got == [("s-new", 1, 300, 704, 1088, 4), ("s-old-arrow", 1, None, None, None, None),
                   ("s-old-json", 1, None, None, None, None)]
