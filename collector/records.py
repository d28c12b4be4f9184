"""The wire contract: the only types that cross worker -> collector (DESIGN.md "Records").

Every field of every record kind is declared ONCE, in ``KINDS`` (collector/record_fields.py, standard
library only): its name, its type (one of ``TYPES``), its bounds (those of the ClickHouse column that
stores it), whether it may be null and since which migration. Everything else is derived from that
declaration, here, and every name of the declaration is imported from here too:

- the pydantic models (``StepRecord``, ..., ``MODELS``) and ``TelemetryBatch`` (the JSON body);
- the Arrow schemas (``ARROW_SCHEMAS``, one per kind, for the Arrow IPC body);
- the ingest checks (``CHECKS``, read by collector/ingest_checks.py);
- ``ADDED_COLUMNS`` (optional columns a body from an older worker may lack: stored as null).

The DDL (sql/) is the one other place a field is written, as a migration.

Adding a FIELD to a kind: append one ``Col`` to its ``columns`` (collector/record_fields.py) with
``since="NNN"`` (it must be ``nullable``, so older workers' bodies stay valid) and write migration
sql/NNN_*.sql that adds the column (its cluster form is generated). Adding a record KIND: append one ``Kind`` to ``KINDS``
(name, table, the TelemetryBatch list field, a docstring, its columns after ``COMMON``), write the
table's migration, and name its model ``<Name>Record`` at the bottom of this module.

Field names are stable: SQL, analytics and dashboards key on them. Bump ``SCHEMA_VERSION`` only
for a change that is not additive. An Arrow IPC stream body carries one kind; its schema metadata
names it (``livestep.kind`` and ``livestep.schema_version``). A JSON body is a ``TelemetryBatch``.

The shape a session ran with: typed columns of the session record, not a free ``shape`` map. Each
shape dimension the worker varies (first-forward tokens, conditioning tokens, decoder output
height x width, TP size, frames per chunk) is its own column with its own bounds, so a bad value
gets a 422 naming it, the store keeps it as a typed (sortable, aggregatable) column, and an unknown
key cannot grow the contract behind the detectors' backs. ``SHAPE_KEYS`` names them for the
detectors (analytics/memory.py judges memory growth against each): a new shape dimension is one
``Col`` plus one ``SHAPE_KEYS`` entry (both in collector/record_fields.py).
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Annotated, Any

import pyarrow as pa
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, create_model, field_validator

from collector.flip_fields import FLIP_COST_FIELDS, FLIP_COST_KIND  # noqa: F401 (re-exported: part of the contract)
from collector.gpu_kinds import canonical_gpu_kind
from collector.record_fields import (  # noqa: F401 (re-exported: imported from here)
    COMMON,
    EVALUATED,
    EVALUATION_METRICS,
    EVALUATION_VERDICTS,
    EVENT_KINDS,
    I31,
    KINDS,
    MAX_FUTURE_SKEW,
    PLAYOUT_POLICIES,
    SCHEMA_VERSION,
    SHAPE_KEYS,
    U32,
    U63,
    Col,
    Kind,
    decode_switches,
    encode_switches,
    integer,
    label,
    ms,
)
from collector.switch_names import FRAME_METRICS, NUMERIC_SWITCHES, SWITCH_NAMES  # noqa: F401 (re-exported: the contract)


def _finite(v: float | None) -> float | None:
    if v is not None and not math.isfinite(v):
        raise ValueError("must be a finite number (NaN and infinity are not valid)")
    return v


def _switch_state(v: str) -> str:
    encode_switches(list(decode_switches(v)))  # raises with the valid names
    return v


def _one_of(valid: tuple[str, ...], what: str):
    def check(v: str) -> str:
        if v not in valid:
            raise ValueError(f"unknown {what} {v!r}; valid {what.split()[-1]}s: {', '.join(valid)}")
        return v

    return check


def _annotation(c: Col) -> Any:
    """The pydantic type of a column (bounds included)."""
    d = {"description": c.description} if c.description else {}
    if c.type == "float":
        base = Annotated[float, Field(ge=c.lo, le=c.hi, **d), AfterValidator(_finite)]
    elif c.type == "int":
        base = Annotated[int, Field(ge=c.lo, le=c.hi, **d)]
    elif c.type == "label":
        base = Annotated[str, Field(min_length=c.lo, max_length=c.hi, **d)]
    elif c.type == "enum":
        base = Annotated[str, Field(**d), AfterValidator(_one_of(c.values, "event kind" if c.name == "kind" else c.name))]
    elif c.type == "switches":
        base = Annotated[str, Field(max_length=512, **d), AfterValidator(_switch_state)]
    elif c.type == "json":
        base = Annotated[dict[str, Any], Field(**d)]
    elif c.type == "bool":
        base = Annotated[bool, Field(**d)]
    else:  # ts
        base = Annotated[datetime, Field(**d)]
    return base | None if c.nullable else base


def _default(c: Col) -> Any:
    if c.nullable:
        return None
    if c.name == "simulated":
        return False
    if c.type == "json":
        return Field(default_factory=dict)
    return ...


# Arrow type and ingest-check tuple (collector/ingest_checks.py's format) per column type
_ARROW = {"float": pa.float64(), "int": pa.int64(), "label": pa.string(), "enum": pa.string(),
          "switches": pa.string(), "json": pa.string(), "bool": pa.bool_(), "ts": pa.timestamp("ms", tz="UTC")}
TYPES = tuple(_ARROW)


def _check(c: Col) -> tuple | None:
    if c.type == "float":
        return ("float", c.lo) if c.hi is None else ("float", c.lo, c.hi)
    if c.type in ("int", "label"):
        return (c.type, c.lo, c.hi)
    if c.type == "enum":
        return ("enum", c.values)
    if c.type == "json":
        return ("json_object", c.hi)
    if c.type in ("ts", "switches"):
        return (c.type,)
    return None  # bool: any value of the Arrow type is valid


# every column of type "ts" (the record's own ts, and e.g. a turn's generated_at / played_at)
_TS_COLUMNS: tuple[str, ...] = tuple(dict.fromkeys(c.name for k in KINDS for c in (*COMMON, *k.columns)
                                                   if c.type == "ts"))


class _Record(BaseModel):
    """Config and checks every record model shares (its fields come from ``KINDS``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator(*_TS_COLUMNS, check_fields=False)
    @classmethod
    def _ts_utc_not_future(cls, v: datetime) -> datetime:
        v = v.replace(tzinfo=UTC) if v.tzinfo is None else v.astimezone(UTC)
        if v > datetime.now(UTC) + MAX_FUTURE_SKEW:
            raise ValueError(f"timestamp {v.isoformat()} is more than {MAX_FUTURE_SKEW} in the future")
        if v.year < 2000:
            raise ValueError("timestamp before 2000-01-01 is not valid")
        return v

    @field_validator("gpu_kind", check_fields=False)
    @classmethod
    def _gpu_kind_canonical(cls, v: str) -> str:
        return canonical_gpu_kind(v)


def canonical_labels(table: pa.Table) -> pa.Table:
    """``table`` with its ``gpu_kind`` column canonical (collector/gpu_kinds.py); the same object when it
    already was (an Arrow body of a current worker is then spooled as sent)."""
    if "gpu_kind" not in table.schema.names or not table.num_rows:
        return table
    col = table.column("gpu_kind")
    seen = [v for v in col.unique().to_pylist() if v is not None]
    mapping = {v: canonical_gpu_kind(v) for v in seen}
    if all(k == v for k, v in mapping.items()):
        return table
    fixed = pa.array([None if v is None else mapping[v] for v in col.to_pylist()], type=col.type)
    return table.set_column(table.schema.get_field_index("gpu_kind"), table.schema.field("gpu_kind"), fixed)


def _model_name(kind: str) -> str:
    return "".join(p.title() for p in kind.split("_")) + "Record"


def columns(kind: str) -> tuple[Col, ...]:
    """All columns of a kind, in wire (and table) order."""
    return COMMON + _KIND[kind].columns


_KIND = {k.name: k for k in KINDS}
for _c in (c for k in KINDS for c in k.columns):
    assert _c.type in _ARROW, _c
    assert _c.since is None or _c.nullable, f"{_c.name}: a column added later must be nullable"
RECORD_KINDS: tuple[str, ...] = tuple(_KIND)
NOT_INGESTED: frozenset[str] = frozenset(k.name for k in KINDS if not k.ingested)  # kinds the ingest refuses
TABLES: dict[str, str] = {k.name: k.table for k in KINDS}
MODELS: dict[str, type[_Record]] = {
    k.name: create_model(_model_name(k.name), __base__=_Record, __doc__=k.doc,  # type: ignore[call-overload]
                         **{c.name: (_annotation(c), _default(c)) for c in columns(k.name)})
    for k in KINDS
}
ARROW_SCHEMAS: dict[str, pa.Schema] = {
    k.name: pa.schema([pa.field(c.name, _ARROW[c.type], nullable=c.nullable) for c in columns(k.name)],
                      metadata={b"livestep.kind": k.name.encode(), b"livestep.schema_version": str(SCHEMA_VERSION).encode()})
    for k in KINDS
}
CHECKS: dict[str, dict[str, tuple]] = {
    k.name: {c.name: ch for c in columns(k.name) if (ch := _check(c)) is not None} for k in KINDS
}
# Optional columns added after a kind's first schema (each with its migration): a body without them
# (an older worker, a batch spooled before the upgrade) is valid and reads them as null.
ADDED_COLUMNS: dict[str, tuple[str, ...]] = {
    k.name: tuple(c.name for c in k.columns if c.since) for k in KINDS if any(c.since for c in k.columns)
}
BATCH_FIELDS: dict[str, str] = {k.batch_field: k.name for k in KINDS}  # TelemetryBatch list -> kind
MAX_BATCH_ROWS = 100_000  # rows of one kind in one request: each JSON list, every Arrow body (decoded)


class _Batch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schema_version: Annotated[int, Field(ge=SCHEMA_VERSION, le=SCHEMA_VERSION)] = SCHEMA_VERSION

    def by_kind(self) -> dict[str, list[_Record]]:
        return {kind: getattr(self, f) for f, kind in BATCH_FIELDS.items()}


TelemetryBatch = create_model(  # type: ignore[call-overload]
    "TelemetryBatch", __base__=_Batch,
    __doc__="The JSON body of ``POST /v1/telemetry``: any mix of kinds, at most a few thousand rows.",
    **{f: (list[MODELS[kind]], Field(default_factory=list, max_length=MAX_BATCH_ROWS)) for f, kind in BATCH_FIELDS.items()},
)
# The models by name, for imports and type hints (one line per kind)
StepRecord = MODELS["step"]
GpuSampleRecord = MODELS["gpu_sample"]
SessionRecord = MODELS["session"]
EventRecord = MODELS["event"]
EvaluationRecord = MODELS["evaluation"]
TurnRecord = MODELS["turn"]


def conform(kind: str, table: pa.Table) -> pa.Table:
    """``table`` with the ``ADDED_COLUMNS`` it lacks appended as nulls, in the kind's column order.

    Only those columns may be missing (anything else is returned as is, for the caller's check).
    """
    schema = ARROW_SCHEMAS[kind]
    missing = [n for n in ADDED_COLUMNS.get(kind, ()) if n not in table.schema.names]
    names = table.schema.names
    if not missing or len(set(names)) != len(names) or set(schema.names) - set(names) != set(missing):
        return table
    for n in missing:
        table = table.append_column(schema.field(n), pa.nulls(table.num_rows, schema.field(n).type))
    return table.select(schema.names)


def to_arrow(kind: str, rows: list[dict[str, Any]]) -> pa.Table:
    """Rows (dicts with the model's field names) -> an Arrow table of that kind's schema.

    Used by the shipping client; no validation here (the collector validates). A field a row lacks
    is null (``simulated``: false; a JSON field: ``{}``).
    """
    import orjson

    cols: dict[str, list[Any]] = {}
    for c in columns(kind):
        v = [r.get(c.name) for r in rows]
        if c.type == "json":
            v = [x if isinstance(x, str) else orjson.dumps(x or {}).decode() for x in v]
        elif c.name == "simulated":
            v = [bool(x) for x in v]
        cols[c.name] = v
    return pa.Table.from_pydict(cols, schema=ARROW_SCHEMAS[kind])
