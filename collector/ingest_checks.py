"""The ingest checks: every value of a decoded batch within the bounds its column can hold, else a 422.

    check_table("step", table, limits)    # raises BadBatchError(422, "step row 3 column 'x' = ... is not valid: ...")

The bounds are collector/records.py's (``records.CHECKS``: those of the store's column types) and the
store's retention (collector/limits.py) for ``ts``. A quick pass over whole groups of columns accepts a
valid batch; anything it doubts is explained column by column, naming the first invalid value.
The route is collector/routes.py; reading a body into tables, collector/ingest_bodies.py.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any, NamedTuple

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc

from collector import records
from collector.limits import DEFAULT as DEFAULT_LIMITS
from collector.limits import Limits


class BadBatchError(Exception):
    """A batch that cannot be stored; ``status`` is the 4xx to answer, the message says what is valid."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.rows: dict[str, int] = {}  # the rows of a batch read before it was refused, by kind (metrics)


# ---------------------------------------------------------------------------------------------
# Column checks: the bounds collector/records.py declares (those the store's column types can hold),
# in the format ``records.CHECKS`` derives: (type, lo, hi) per column.

CHECKS: dict[str, dict[str, tuple]] = records.CHECKS


def _np(col: pa.ChunkedArray, fill) -> np.ndarray:
    """A numeric column as numpy (nulls, allowed where the schema allows them, replaced by ``fill``)."""
    if col.null_count:
        col = col.fill_null(fill)
    return col.to_numpy()


def _first(mask: np.ndarray) -> int | None:
    return int(np.argmax(mask)) if mask.any() else None


def _bad(kind: str, col: str, row: int, value: Any, valid: str) -> BadBatchError:
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return BadBatchError(422, f"{kind} row {row} column '{col}' = {shown} is not valid: {valid}")


def _first_of(col: pa.ChunkedArray, value) -> int:
    return _first(np.asarray(pc.equal(col, value).fill_null(False).to_numpy(zero_copy_only=False)))


class _Plan(NamedTuple):
    """A kind's checks grouped by type, as column indices: one numpy reduction per group, not per column."""

    floats: dict[tuple[float | None, float | None], tuple[int, ...]]  # (lo, hi), None: unbounded -> columns
    ints: dict[tuple[int, int], tuple[int, ...]]  # (lo, hi) -> columns
    labels: dict[tuple[int, int], tuple[int, ...]]  # (min chars, max chars) -> columns
    ts: tuple[int, ...]
    enums: tuple[tuple[int, frozenset[str]], ...]
    switches: tuple[int, ...]
    json: tuple[str, ...]  # names: checked row by row by ``_explain``'s rule
    required: tuple[bool, ...]  # per column: nulls not allowed


def _plan(kind: str) -> _Plan:
    schema = records.ARROW_SCHEMAS[kind]
    floats: dict = {}
    ints: dict = {}
    labels: dict = {}
    ts, enums, switches, js = [], [], [], []
    for name, check in CHECKS[kind].items():
        i, what = schema.get_field_index(name), check[0]
        if what == "float":
            floats.setdefault((check[1], check[2] if len(check) > 2 else None), []).append(i)
        elif what == "int":
            ints.setdefault((check[1], check[2]), []).append(i)
        elif what == "label":
            labels.setdefault((check[1], check[2]), []).append(i)
        elif what == "ts":
            ts.append(i)
        elif what == "enum":
            enums.append((i, frozenset(check[1])))
        elif what == "switches":
            switches.append(i)
        else:
            js.append(name)
    return _Plan({k: tuple(v) for k, v in floats.items()}, {k: tuple(v) for k, v in ints.items()},
                 {k: tuple(v) for k, v in labels.items()},
                 tuple(ts), tuple(enums), tuple(switches), tuple(js), tuple(not f.nullable for f in schema))


_PLANS = {kind: _plan(kind) for kind in CHECKS}
_GOOD_SWITCHES: set[str] = set()  # switch-state strings already found valid (bounded)


def _switches_ok(v: str | None) -> bool:
    if v in _GOOD_SWITCHES:
        return True
    if v is None or len(v) > 512 or not records.decode_switches(v) <= set(records.SWITCH_NAMES):
        return False
    if len(_GOOD_SWITCHES) < 4096:
        _GOOD_SWITCHES.add(v)
    return True


def _all_valid(kind: str, table: pa.Table, limits: Limits) -> bool:
    """True only if every check of ``_explain`` passes (a False is settled by ``_explain``).

    Whole groups of columns at once: all bounded-below floats in one ``min``/``max``, NaN failing
    every comparison; integers grouped by bounds; labels, enums and switch states over their
    distinct values.
    """
    plan = _PLANS[kind]
    cols = table.columns
    nulls = [c.null_count for c in cols]
    n = table.num_rows
    for required, k in zip(plan.required, nulls, strict=True):
        if k and required:
            return False

    def numeric(idx: tuple[int, ...], fill) -> np.ndarray | None:
        parts = [cols[i].fill_null(fill).to_numpy() if nulls[i] else cols[i].to_numpy()
                 for i in idx if nulls[i] != n]  # an all-null optional column: nothing to check
        return (parts[0] if len(parts) == 1 else np.concatenate(parts)) if parts else None

    for (lo, hi), idx in plan.floats.items():
        a = numeric(idx, 0.0)
        if a is not None and not ((a.min() > -np.inf if lo is None else a.min() >= lo)
                                  and (a.max() < np.inf if hi is None else a.max() <= hi)):
            return False
    for (lo, hi), idx in plan.ints.items():
        a = numeric(idx, lo)
        if a is not None and not (a.min() >= lo and a.max() <= hi):
            return False
    if plan.ts:
        now_ms = int(time.time() * 1000)
        oldest, newest = limits.oldest_ms(kind, now_ms), now_ms + int(records.MAX_FUTURE_SKEW.total_seconds() * 1000)
        for i in plan.ts:
            a = cols[i].to_numpy().view("int64")
            if not (a.min() >= oldest and a.max() <= newest):
                return False
    for (lo, hi), idx in plan.labels.items():  # the distinct values of all these columns at once
        distinct = pa.chunked_array([ch for i in idx for ch in cols[i].chunks], pa.string()).unique()
        if not all(v is not None and lo <= len(v) <= hi for v in distinct.to_pylist()):
            return False
    for i, valid in plan.enums:
        if not all(v is None or v in valid for v in cols[i].unique().to_pylist()):
            return False
    for i in plan.switches:
        if not all(v is None or _switches_ok(v) for v in cols[i].unique().to_pylist()):
            return False
    return not plan.json  # JSON text columns are checked row by row, by ``_explain``


def check_table(kind: str, table: pa.Table, limits: Limits = DEFAULT_LIMITS) -> None:
    """Every value of ``table`` (already of ``records.ARROW_SCHEMAS[kind]``) within bounds, else 422;
    ``ts`` within what the store keeps (``limits``: its retention, collector/limits.py).

    A quick pass over whole groups of columns (~30 us per 100-row step batch) accepts valid batches;
    anything it doubts goes through ``_explain``, which finds the first invalid value and names it.
    """
    if table.num_rows and not _all_valid(kind, table, limits):
        _explain(kind, table, limits)


def check_counted(kind: str, table: pa.Table, limits: Limits) -> None:
    """``check_table``; a refusal carries the batch's row count of ``kind`` (collector/metrics.py counts it)."""
    try:
        check_table(kind, table, limits)
    except BadBatchError as e:
        e.rows = {kind: table.num_rows}
        raise


def _explain(kind: str, table: pa.Table, limits: Limits) -> None:
    """Column by column, in schema order: raise the 422 that names the first invalid value (if any)."""
    schema = records.ARROW_SCHEMAS[kind]
    for f in schema:
        col = table.column(f.name)
        if not f.nullable and col.null_count:
            row = _first(np.asarray(col.is_null().to_numpy(zero_copy_only=False)))
            raise _bad(kind, f.name, row, None, "this column is required (no nulls)")
    now_ms = int(datetime.now(UTC).timestamp() * 1000)
    oldest, newest = limits.oldest_ms(kind, now_ms), now_ms + int(records.MAX_FUTURE_SKEW.total_seconds() * 1000)
    n = table.num_rows
    for name, check in CHECKS[kind].items():
        col = table.column(name)
        if col.null_count == n:  # all null (an optional field not measured here): nothing to check
            continue
        what = check[0]
        if what == "float":
            a = _np(col, 0.0)
            if not np.isfinite(a).all():
                row = _first(~np.isfinite(a))
                raise _bad(kind, name, row, col[row].as_py(), "a finite number (NaN and infinity are not valid)")
            hi = check[2] if len(check) > 2 else None
            if hi is not None and len(a) and (a.min() < check[1] or a.max() > hi):
                row = _first((a < check[1]) | (a > hi))
                raise _bad(kind, name, row, col[row].as_py(), f"a number in [{check[1]:g}, {hi:g}] (a fraction)")
            if check[1] is not None and len(a) and a.min() < check[1]:
                row = _first(a < check[1])
                raise _bad(kind, name, row, col[row].as_py(), f"a number >= {check[1]:g} (a duration or amount)")
        elif what == "int":
            lo, hi = check[1], check[2]
            a = _np(col, lo)
            if len(a) and (a.min() < lo or a.max() > hi):
                row = _first((a < lo) | (a > hi))
                raise _bad(kind, name, row, col[row].as_py(), f"an integer in [{lo}, {hi}]")
        elif what == "label":
            for v in pc.unique(col).to_pylist():
                if v is not None and not check[1] <= len(v) <= check[2]:  # a null: the required check's
                    raise _bad(kind, name, _first_of(col, v), v, f"a string of {check[1]} to {check[2]} characters")
        elif what == "ts":
            a = col.to_numpy().view("int64") if col.num_chunks == 1 else pc.cast(col, pa.int64()).to_numpy()
            row = _first((a < oldest) | (a > newest))
            if row is not None:
                first = datetime.fromtimestamp(oldest / 1000, UTC).isoformat(timespec="seconds")
                raise _bad(kind, name, row, str(col[row].as_py()),
                           f"a UTC time from {first} (retention: {limits.window_text(kind)}) to at most "
                           f"{records.MAX_FUTURE_SKEW} in the future")
        elif what == "enum":
            for v in pc.unique(col).to_pylist():
                if v is not None and v not in check[1]:
                    raise _bad(kind, name, _first_of(col, v), v, f"one of {', '.join(check[1])}")
        elif what == "switches":
            for v in pc.unique(col).to_pylist():
                if v is None:
                    continue
                unknown = sorted(records.decode_switches(v) - set(records.SWITCH_NAMES))
                if unknown or len(v) > 512:
                    raise _bad(kind, name, _first_of(col, v), v,
                               f"comma-separated switch names, unknown {unknown}; valid switches: "
                               f"{', '.join(records.SWITCH_NAMES)}")
        elif what == "json_object":
            for row, v in enumerate(col.to_pylist()):
                try:
                    ok = len(v) <= check[1] and isinstance(orjson.loads(v), dict)
                except orjson.JSONDecodeError:
                    ok = False
                if not ok:
                    raise _bad(kind, name, row, v, f"a JSON object as text, at most {check[1]} bytes")
