"""collector.routes.check_table: every column's bounds, one bad value at a time, for every kind.

The check has a quick path over whole groups of columns; these tests pin that it lets no invalid
value through and that the 422 still names the row and the column.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pyarrow as pa
import pytest

from collector import records
from collector.routes import CHECKS, BadBatchError, check_table
from tests.collector.helpers import event_row, step_rows, turn_rows

NOW = datetime.now(UTC) - timedelta(minutes=1)
_COMMON = {"worker_id": "w", "session_id": "s", "release": "r", "gpu_kind": "g", "ts": NOW}
ROWS = {
    "step": step_rows(3),
    "gpu_sample": [{**_COMMON, "gpu_index": 0, "power_w": 300.0, "energy_mj": 1.0, "sm_clock_mhz": 1980,
                    "mem_used_bytes": 1 << 30, "temp_c": 50.0, "throttle_reasons": 0}] * 3,
    "session": [{**_COMMON, "phase": "end", "first_forward_tokens": 1, "streamed_s": 1.0, "frames": 10,
                 "avg_fps": 16.0, "late_chunks": 0, "stall_ms": 0.0, "tp_size": 1, "shape": "1x1",
                 "switches": "ring_cache"}] * 3,
    "event": [event_row(), event_row(), event_row()],
    "evaluation": [{**_COMMON, "configuration": "fp8_cache,rope_at_write", "switch": "fp8_cache", "preset": "tiny",
                    "metric": "divergence", "value": 0.02, "band_lo": 0.01, "band_hi": 0.03, "verdict": "pass",
                    "n": 4, "step": 10}] * 3,
    "turn": turn_rows(3),
}


def _bad_values(check: tuple) -> list:
    what = check[0]
    if what == "float":
        bad = [float("nan"), float("inf"), float("-inf")]
        bad += [check[1] - 1.0] if check[1] is not None else []
        return bad + ([check[2] + 1.0] if len(check) > 2 else [])
    if what == "int":
        return [check[1] - 1] + ([check[2] + 1] if check[2] < 2**63 - 1 else [])
    if what == "label":
        return ["", "x" * (check[2] + 1)]
    if what == "ts":
        return [datetime(1999, 12, 31, tzinfo=UTC), datetime.now(UTC) + timedelta(hours=1)]
    if what == "enum":
        return ["not-a-" + check[1][0]]
    if what == "switches":
        return ["warp_drive", "ring_cache,warp_drive", ",".join(records.SWITCH_NAMES) + "," + "x" * 512]
    return ["[1, 2]", "{not json", "{}" + " " * check[1]]  # json_object


def _table(kind: str, col: str, value) -> pa.Table:
    t = records.to_arrow(kind, ROWS[kind])
    i = t.schema.get_field_index(col)
    values = t.column(col).to_pylist()
    values[1] = value
    return t.set_column(i, t.schema.field(i), pa.array(values, t.schema.field(i).type))


CASES = [(kind, col, v) for kind, checks in CHECKS.items() for col, check in checks.items()
         for v in _bad_values(check)]


@pytest.mark.parametrize("kind,col,value", CASES, ids=[f"{k}.{c}={v!r:.20}" for k, c, v in CASES])
def test_every_out_of_bounds_value_is_refused_naming_row_and_column(kind, col, value):
    table = _table(kind, col, value)
    with pytest.raises(BadBatchError) as e:
        check_table(kind, table)
    assert e.value.status == 422
    assert f"{kind} row 1 column '{col}'" in str(e.value)


@pytest.mark.parametrize("kind", list(CHECKS))
def test_valid_tables_pass_with_and_without_nulls_in_optional_columns(kind):
    t = records.to_arrow(kind, ROWS[kind])
    check_table(kind, t)
    for i, f in enumerate(t.schema):
        if f.nullable:  # one null, then all nulls: both valid
            values = t.column(i).to_pylist()
            check_table(kind, t.set_column(i, f, pa.array([values[0], None, values[2]], f.type)))
            check_table(kind, t.set_column(i, f, pa.nulls(t.num_rows, f.type)))
    check_table(kind, t.slice(0, 0))


REQUIRED = [(k, f.name) for k in CHECKS for f in records.ARROW_SCHEMAS[k] if not f.nullable]


@pytest.mark.parametrize("kind,col", REQUIRED, ids=[f"{k}.{c}" for k, c in REQUIRED])
def test_a_null_in_a_required_column_is_refused(kind, col):
    t = records.to_arrow(kind, ROWS[kind])
    i = t.schema.get_field_index(col)
    f = t.schema.field(i)
    values = t.column(i).to_pylist()
    nulled = t.set_column(i, f, pa.array([values[0], None, values[2]], f.type))  # schema still says required
    with pytest.raises(BadBatchError, match=f"row 1 column '{col}'.*required"):
        check_table(kind, nulled)


def test_a_table_in_several_chunks_is_checked_whole():
    good = records.to_arrow("step", step_rows(3))
    bad = _table("step", "diffusion_ms", -5.0)
    with pytest.raises(BadBatchError, match="row 4 column 'diffusion_ms'"):
        check_table("step", pa.concat_tables([good, bad]))
    check_table("step", pa.concat_tables([good, good]))
