"""The wire contract: the only types that cross worker -> collector (DESIGN.md "Records").

One module over ~450 lines on purpose: it is one thing, the declaration of every field (``KINDS``) and
what derives from it (models, Arrow schemas, ingest checks); split, a field's name, type and bounds
would be read in one file and turned into a model or a schema in another.

Every field of every record kind is declared ONCE, in ``KINDS`` below: its name, its type (one of
``TYPES``), its bounds (those of the ClickHouse column that stores it), whether it may be null and
since which migration. Everything else is derived from that declaration:

- the pydantic models (``StepRecord``, ..., ``MODELS``) and ``TelemetryBatch`` (the JSON body);
- the Arrow schemas (``ARROW_SCHEMAS``, one per kind, for the Arrow IPC body);
- the ingest checks (``CHECKS``, read by collector/ingest_checks.py);
- ``ADDED_COLUMNS`` (optional columns a body from an older worker may lack: stored as null).

The DDL (sql/) is the one other place a field is written, as a migration.

Adding a FIELD to a kind: append one ``Col`` to its ``columns`` with ``since="NNN"`` (it must be
``nullable``, so older workers' bodies stay valid) and write migration sql/NNN_*.sql that adds
the column (its cluster form is generated). Adding a record KIND: append one ``Kind`` to ``KINDS``
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
``Col`` here plus one ``SHAPE_KEYS`` entry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

import pyarrow as pa
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, create_model, field_validator

from collector.flip_fields import FLIP_COST_FIELDS, FLIP_COST_KIND  # noqa: F401 (re-exported: part of the contract)
from collector.gpu_kinds import canonical_gpu_kind
from collector.switch_names import FRAME_METRICS, NUMERIC_SWITCHES, SWITCH_NAMES  # re-exported: the contract

SCHEMA_VERSION = 1

EVENT_KINDS: tuple[str, ...] = (
    "session_start",
    "session_end",
    "switch_applied",
    "rollback",
    "canary_start",
    "canary_promote",
    "canary_rollback",
    "reset",
    "oom",
    "error",
    "telemetry_dropped",
    "batch_quarantined",  # the collector's writer: a spooled batch the store refused for its content
    FLIP_COST_KIND,  # what a switch flip cost the live session: collector/flip_fields.py
)

# ``livestep evaluate``'s judges (worker/evaluate.py): summaries, curve points, and each configuration's
# overall verdict (the one the control plane's gate on numeric switch defaults reads)
EVALUATION_METRICS: tuple[str, ...] = (
    "teacher_forced_ratio",  # mean error against the truth / the plain path's own, same state and inputs
    "divergence_ratio",  # free-running: the largest bin's distance to the truth / the plain path's
    "divergence",  # a curve point of it: one bin of steps (band: the correct implementations' ratios)
    *FRAME_METRICS,  # the decoded frames against the truth's: shown beside the verdict, never part of it
    "drift_tau",  # Kendall's tau of the error ratio vs session age
    "drift_error_tau",  # the same for the error itself
    "drift_ratio",  # a curve point: mean error ratio over one position-reset interval
    "overall",  # value: judges failed; verdict: the configuration's
)
EVALUATION_VERDICTS: tuple[str, ...] = ("pass", "fail", "no_effect", "incomplete")
EVALUATED: tuple[str, ...] = (*NUMERIC_SWITCHES, "production")  # what an evaluation judges
# What the player does, at a turn, with chunks made with the old conditioning (worker/turns.py)
PLAYOUT_POLICIES: tuple[str, ...] = ("keep", "drop_unplayed", "trim", "cover")

# A record stamped further ahead than this is refused (clock skew beyond reason).
MAX_FUTURE_SKEW = timedelta(minutes=5)
U63 = 2**63 - 1
U32 = 2**32 - 1
I31 = 2**31 - 1


def encode_switches(on: set[str] | frozenset[str] | list[str]) -> str:
    """The compact switch-state string: names that are on, sorted, comma-separated."""
    unknown = sorted(set(on) - set(SWITCH_NAMES))
    if unknown:
        raise ValueError(f"unknown switch(es) {unknown}; valid switches: {', '.join(SWITCH_NAMES)}")
    return ",".join(sorted(on))


def decode_switches(state: str) -> frozenset[str]:
    """Inverse of ``encode_switches``; an empty string means every switch off."""
    return frozenset(s for s in state.split(",") if s)


# ---------------------------------------------------------------------------------------------
# The declaration


@dataclass(frozen=True)
class Col:
    """One field of a record kind. ``lo``/``hi``: inclusive bounds (numbers: value, label: length,
    json: ``hi`` bytes); ``values``: an enum's valid values; ``since``: the migration that added an
    optional column (None: in the kind's first table)."""

    name: str
    type: str  # a key of TYPES
    lo: float | int | None = None
    hi: float | int | None = None
    nullable: bool = False
    description: str | None = None
    values: tuple[str, ...] = ()
    since: str | None = None


@dataclass(frozen=True)
class Kind:
    """One record kind: its ClickHouse table, its list in ``TelemetryBatch`` and its own columns."""

    name: str
    table: str
    batch_field: str
    doc: str
    columns: tuple[Col, ...]
    ingested: bool = True  # False: refused by POST /v1/telemetry (evaluations: POST /v1/evaluations, evaluator token)


def label(name: str, **kw) -> Col:
    return Col(name, "label", 1, 128, **kw)


def ms(name: str, **kw) -> Col:
    """A non-negative finite number (a duration or an amount)."""
    return Col(name, "float", 0.0, None, **kw)


def integer(name: str, lo: int, hi: int, **kw) -> Col:
    return Col(name, "int", lo, hi, **kw)


COMMON: tuple[Col, ...] = (
    label("worker_id"),
    label("session_id"),
    label("release"),
    label("gpu_kind", description="the GPU's device name (torch/NVML, e.g. 'NVIDIA H200') or its kind; stored "
                                  "as the canonical kind (collector/gpu_kinds.py: 'h200')"),
    Col("ts", "ts", description="UTC; a naive datetime is taken as UTC"),
    Col("simulated", "bool", description="written by the fleet simulator (default false)"),
)

KINDS: tuple[Kind, ...] = (
    Kind("step", "steps", "steps", "One denoising step (one 4-frame chunk) of one session.", (
        integer("step", 0, U32),
        ms("diffusion_ms"),
        ms("step_period_ms", description="wall time between chunk deliveries"),
        ms("decode_ms", nullable=True),
        ms("cache_upkeep_ms", nullable=True),
        ms("attention_ms", nullable=True),
        ms("allreduce_ms", nullable=True),
        Col("late", "bool", description="the chunk missed its 166.7 ms deadline"),
        integer("playout_depth", 0, 65535, description="chunks buffered for the player"),
        Col("reset_step", "bool", description="a delta rotation happened in this step"),
        ms("energy_mj", nullable=True, description="NVML energy delta over the step, summed over the session's GPUs"),
        integer("mem_allocated_bytes", 0, U63),
        integer("mem_reserved_bytes", 0, U63),
        integer("buffers_registered", 0, U32, description="fused-kernel buffer registry size"),
        Col("switches", "switches"),
        Col("fp8_saturated", "float", 0.0, 1.0, nullable=True, since="022", description=(
            "fraction in [0, 1] of the step's FP8 activation elements (inputs of linears quantized with static "
            "scales) at the FP8 maximum (+-448: clipped, or rounded up from |x/scale| >= 432); measured on "
            "sampled steps only, null on the others and when static_scales is off")),
        ms("sm_clock_mhz", nullable=True, since="120", description=(
            "mean SM clock of the session's GPUs over the step (MHz, the worker's NVML samples); null without "
            "NVML. A power-capped or throttled GPU runs below its top clock")),
    )),
    Kind("gpu_sample", "gpu_samples", "gpu_samples", "One NVML reading of one GPU (~10 Hz).", (
        integer("gpu_index", 0, 1023),
        ms("power_w", nullable=True),
        ms("energy_mj", nullable=True, description="cumulative energy counter"),
        integer("sm_clock_mhz", 0, U32, nullable=True),
        integer("mem_used_bytes", 0, U63, nullable=True),
        Col("temp_c", "float", nullable=True),
        integer("throttle_reasons", 0, U63, nullable=True),
    )),
    Kind("session", "sessions", "sessions", "A session's start (phase='start') or end (phase='end') summary.", (
        Col("phase", "enum", values=("start", "end")),
        integer("first_forward_tokens", 1, I31, description="tokens of the session's first forward"),
        ms("streamed_s"),
        integer("frames", 0, U63),
        ms("avg_fps", nullable=True),
        integer("late_chunks", 0, U63),
        ms("stall_ms"),
        integer("tp_size", 1, 1024, description="GPUs one session's model is split over (tensor parallel)"),
        label("shape", description="the model preset's name"),
        Col("switches", "switches"),
        integer("cond_tokens", 1, I31, nullable=True, since="040",
                description="conditioning (prompt) tokens; null from workers before migration 040"),
        integer("decoder_height", 1, 65535, nullable=True, since="040", description="decoded frame height, pixels"),
        integer("decoder_width", 1, 65535, nullable=True, since="040", description="decoded frame width, pixels"),
        integer("chunk_frames", 1, 1024, nullable=True, since="040", description="video frames per chunk (per step)"),
        ms("ttff_ms", nullable=True, since="090",
           description="session start to the player's first frame, ms (end phase; null: playback never began)"),
        integer("preroll", 1, 64, nullable=True, since="090", description="chunks buffered before playback began"),
        integer("gpu_mem_total_bytes", 1, U63, nullable=True, since="110",
                description="total memory of one of the session's GPUs (NVML/torch), bytes; null from workers "
                            "before migration 110"),
    )),
    Kind("event", "events", "events", "Something that happened: a switch applied, a rollback, an OOM, a reset, ...", (
        Col("kind", "enum", values=EVENT_KINDS),
        Col("detail", "json", hi=65536, description="a JSON object (text in Arrow), at most 65536 bytes"),
    )),
    Kind("evaluation", "evaluations", "evaluations", (
        "One judge's result of ``livestep evaluate`` for one configuration against the plain path "
        "(session_id: the evaluation run; gpu_kind and release: what it was measured on)."), (
        Col("configuration", "switches", description="the switches the candidate ran with"),
        Col("switch", "enum", values=EVALUATED, description="the numeric switch judged, or production (all on)"),
        label("preset", description="the model preset's name"),
        Col("metric", "enum", values=EVALUATION_METRICS),
        Col("value", "float", description="the judge's statistic (see metric)"),
        Col("band_lo", "float", nullable=True,
            description="the band's lower end: the lowest ratio of a correct implementation (1: the plain path)"),
        Col("band_hi", "float", nullable=True,
            description="the band's top (the judge's bound): the highest ratio of a correct implementation"),
        Col("verdict", "enum", values=EVALUATION_VERDICTS),
        integer("n", 0, U32, description="runs (free-running), steps (teacher-forced), segments (drift)"),
        integer("step", 0, U32, nullable=True, description="a curve point's last step (null: a summary)"),
        label("evaluator", nullable=True, since="130",
              description="the evaluator token's name that posted it (POST /v1/evaluations sets it; null: no evidence)"),
        label("device_type", nullable=True, since="130", description="the device it ran on, read from it: cuda, cpu"),
        integer("tp", 1, 64, nullable=True, since="130", description="the tensor-parallel size whose rank it ran"),
        integer("steps", 0, U32, nullable=True, since="130", description="steps of its teacher-forced and free-running runs"),
        integer("seeds", 0, U32, nullable=True, since="130", description="weight seeds (each its own prompt and noise)"),
        integer("reruns", 0, U32, nullable=True, since="130",
                description="the band's runs per seed: correct implementations of the plain path"),
        integer("nonfinite", 0, U32, nullable=True, since="130",
                description="non-finite values its judge saw (its value is then the largest Float64)"),
    ), ingested=False),
    Kind("turn", "turns", "turns", "A conversational turn: new conditioning mid-session (worker/turns.py); ts is its "
         "arrival. latency_ms = wait_ms + recompute_ms + generation_ms + queue_ms.", (
        integer("turn", 0, U32, description="the turn's index in its session"),
        integer("step", 0, U32, description="the first step that used its conditioning"),
        Col("speaking", "bool", description="the character's next utterance (false: it listens)"),
        integer("cond_tokens", 1, U32, description="the conditioning's length in tokens"),
        Col("policy", "enum", values=PLAYOUT_POLICIES, description="what the player did with the older chunks"),
        integer("queue_depth", 0, 65535, description="chunks buffered for the player at arrival"),
        integer("dropped_chunks", 0, U32, description="older chunks the policy dropped unplayed"),
        integer("superseded", 0, U32, description="earlier turns of the same step boundary it replaced"),
        ms("wait_ms", description="arrival -> the recompute's start (the step in progress)"),
        ms("recompute_ms", description="the cross-attention K/V recompute"),
        ms("generation_ms", description="the first chunk's step, start -> delivery"),
        ms("queue_ms", description="the rest: a producer held back, older chunks played first"),
        ms("latency_ms", description="arrival -> playback of the first chunk that uses it, by the player's clock"),
        ms("stall_ms", description="the player's stall between arrival and that playback"),
        Col("generated_at", "ts", description="the first chunk using it was delivered to the player"),
        Col("played_at", "ts", description="that chunk's playback began"),
    )),
)

# The session columns that say which shape a session ran: detector key -> the column(s) it is made of.
SHAPE_KEYS: dict[str, tuple[str, ...]] = {
    "first_forward_tokens": ("first_forward_tokens",),
    "cond_tokens": ("cond_tokens",),
    "decoder_resolution": ("decoder_height", "decoder_width"),
    "tp_size": ("tp_size",),
    "chunk_frames": ("chunk_frames",),
}

# ---------------------------------------------------------------------------------------------
# Derived: types, models, Arrow schemas, ingest checks


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
