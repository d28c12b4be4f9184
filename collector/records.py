"""The wire contract: the only types that cross worker -> collector (DESIGN.md "Records").

Four record kinds (step, gpu_sample, session, event) as pydantic models for validation at the
collector, and one Arrow schema per kind for the Arrow IPC body. Field names are stable: SQL,
analytics and dashboards key on them. Bump ``SCHEMA_VERSION`` only with a migration. An optional
column added later (``ADDED_COLUMNS``) keeps the version: a body without it (an older worker) is
still valid and stores it as null.

An Arrow IPC stream body carries one kind; its schema metadata names it
(``livestep.kind`` and ``livestep.schema_version``). A JSON body is a ``TelemetryBatch``.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal

import pyarrow as pa
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from collector.switch_names import SWITCH_NAMES  # re-exported: part of the contract

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
)

RECORD_KINDS: tuple[str, ...] = ("step", "gpu_sample", "session", "event")

# A record stamped further ahead than this is refused (clock skew beyond reason).
MAX_FUTURE_SKEW = timedelta(minutes=5)


def encode_switches(on: set[str] | frozenset[str] | list[str]) -> str:
    """The compact switch-state string: names that are on, sorted, comma-separated."""
    unknown = sorted(set(on) - set(SWITCH_NAMES))
    if unknown:
        raise ValueError(f"unknown switch(es) {unknown}; valid switches: {', '.join(SWITCH_NAMES)}")
    return ",".join(sorted(on))


def decode_switches(state: str) -> frozenset[str]:
    """Inverse of ``encode_switches``; an empty string means every switch off."""
    return frozenset(s for s in state.split(",") if s)


def _finite(v: float | None) -> float | None:
    if v is not None and not math.isfinite(v):
        raise ValueError("must be a finite number (NaN and infinity are not valid)")
    return v


def _switch_state(v: str) -> str:
    encode_switches(list(decode_switches(v)))  # raises with the valid names
    return v


Ms = Annotated[float, Field(ge=0), AfterValidator(_finite)]
OptMs = Annotated[float | None, Field(default=None, ge=0), AfterValidator(_finite)]
OptFloat = Annotated[float | None, Field(default=None), AfterValidator(_finite)]
OptFraction = Annotated[float | None, Field(default=None, ge=0, le=1), AfterValidator(_finite)]
Count = Annotated[int, Field(ge=0, lt=2**63)]
Label = Annotated[str, Field(min_length=1, max_length=128)]
SwitchState = Annotated[str, Field(max_length=512), AfterValidator(_switch_state)]


class _Record(BaseModel):
    """Fields every record carries."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    worker_id: Label
    session_id: Label
    release: Label
    gpu_kind: Label
    ts: datetime = Field(description="UTC; a naive datetime is taken as UTC")
    simulated: bool = Field(default=False, description="written by the fleet simulator")

    @field_validator("ts")
    @classmethod
    def _ts_utc_not_future(cls, v: datetime) -> datetime:
        v = v.replace(tzinfo=UTC) if v.tzinfo is None else v.astimezone(UTC)
        if v > datetime.now(UTC) + MAX_FUTURE_SKEW:
            raise ValueError(f"timestamp {v.isoformat()} is more than {MAX_FUTURE_SKEW} in the future")
        if v.year < 2000:
            raise ValueError("timestamp before 2000-01-01 is not valid")
        return v


class StepRecord(_Record):
    """One denoising step (one 4-frame chunk) of one session."""

    step: Count
    diffusion_ms: Ms
    step_period_ms: Ms = Field(description="wall time between chunk deliveries")
    decode_ms: OptMs
    cache_upkeep_ms: OptMs
    attention_ms: OptMs
    allreduce_ms: OptMs
    late: bool = Field(description="the chunk missed its 166.7 ms deadline")
    playout_depth: Count = Field(description="chunks buffered for the player")
    reset_step: bool = Field(description="a delta rotation happened in this step")
    energy_mj: OptMs = Field(description="NVML energy delta over the step, summed over the session's GPUs")
    mem_allocated_bytes: Count
    mem_reserved_bytes: Count
    buffers_registered: Count = Field(description="fused-kernel buffer registry size")
    switches: SwitchState
    fp8_saturated: OptFraction = Field(
        description="fraction in [0, 1] of the step's FP8 activation elements (inputs of linears quantized "
        "with static scales) at the FP8 maximum (+-448: clipped, or rounded up from |x/scale| >= 432); "
        "measured on sampled steps only, null on the others and when static_scales is off"
    )


class GpuSampleRecord(_Record):
    """One NVML reading of one GPU (~10 Hz)."""

    gpu_index: Annotated[int, Field(ge=0, lt=1024)]
    power_w: OptMs
    energy_mj: OptMs = Field(description="cumulative energy counter")
    sm_clock_mhz: Annotated[int | None, Field(default=None, ge=0)]
    mem_used_bytes: Annotated[int | None, Field(default=None, ge=0)]
    temp_c: OptFloat
    throttle_reasons: Annotated[int | None, Field(default=None, ge=0, lt=2**63)]


class SessionRecord(_Record):
    """A session's start (phase='start') or end (phase='end') summary."""

    phase: Literal["start", "end"]
    first_forward_tokens: Annotated[int, Field(ge=1, lt=2**31)]
    streamed_s: Ms
    frames: Count
    avg_fps: OptMs
    late_chunks: Count
    stall_ms: Ms
    tp_size: Annotated[int, Field(ge=1, le=1024)]
    shape: Label
    switches: SwitchState


class EventRecord(_Record):
    """Something that happened: a switch applied, a rollback, an OOM, a reset, ..."""

    kind: Annotated[str, Field(min_length=1, max_length=64)]
    detail: dict[str, Any] = Field(default_factory=dict)

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, v: str) -> str:
        if v not in EVENT_KINDS:
            raise ValueError(f"unknown event kind {v!r}; valid kinds: {', '.join(EVENT_KINDS)}")
        return v


MODELS: dict[str, type[_Record]] = {
    "step": StepRecord,
    "gpu_sample": GpuSampleRecord,
    "session": SessionRecord,
    "event": EventRecord,
}

# record kind -> ClickHouse table
TABLES: dict[str, str] = {"step": "steps", "gpu_sample": "gpu_samples", "session": "sessions", "event": "events"}


class TelemetryBatch(BaseModel):
    """The JSON body of ``POST /v1/telemetry``: any mix of kinds, at most a few thousand rows."""

    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1] = SCHEMA_VERSION
    steps: list[StepRecord] = Field(default_factory=list, max_length=100_000)
    gpu_samples: list[GpuSampleRecord] = Field(default_factory=list, max_length=100_000)
    sessions: list[SessionRecord] = Field(default_factory=list, max_length=100_000)
    events: list[EventRecord] = Field(default_factory=list, max_length=100_000)

    def by_kind(self) -> dict[str, list[_Record]]:
        return {"step": self.steps, "gpu_sample": self.gpu_samples, "session": self.sessions, "event": self.events}


# ---------------------------------------------------------------------------------------------
# Arrow: one schema per kind, the same columns as the model and the ClickHouse table.

_TS = pa.timestamp("ms", tz="UTC")
_COMMON = [
    pa.field("worker_id", pa.string(), nullable=False),
    pa.field("session_id", pa.string(), nullable=False),
    pa.field("release", pa.string(), nullable=False),
    pa.field("gpu_kind", pa.string(), nullable=False),
    pa.field("ts", _TS, nullable=False),
    pa.field("simulated", pa.bool_(), nullable=False),
]


def _schema(kind: str, fields: list[pa.Field]) -> pa.Schema:
    meta = {b"livestep.kind": kind.encode(), b"livestep.schema_version": str(SCHEMA_VERSION).encode()}
    return pa.schema(_COMMON + fields, metadata=meta)


ARROW_SCHEMAS: dict[str, pa.Schema] = {
    "step": _schema(
        "step",
        [
            pa.field("step", pa.int64(), nullable=False),
            pa.field("diffusion_ms", pa.float64(), nullable=False),
            pa.field("step_period_ms", pa.float64(), nullable=False),
            pa.field("decode_ms", pa.float64()),
            pa.field("cache_upkeep_ms", pa.float64()),
            pa.field("attention_ms", pa.float64()),
            pa.field("allreduce_ms", pa.float64()),
            pa.field("late", pa.bool_(), nullable=False),
            pa.field("playout_depth", pa.int64(), nullable=False),
            pa.field("reset_step", pa.bool_(), nullable=False),
            pa.field("energy_mj", pa.float64()),
            pa.field("mem_allocated_bytes", pa.int64(), nullable=False),
            pa.field("mem_reserved_bytes", pa.int64(), nullable=False),
            pa.field("buffers_registered", pa.int64(), nullable=False),
            pa.field("switches", pa.string(), nullable=False),
            pa.field("fp8_saturated", pa.float64()),
        ],
    ),
    "gpu_sample": _schema(
        "gpu_sample",
        [
            pa.field("gpu_index", pa.int64(), nullable=False),
            pa.field("power_w", pa.float64()),
            pa.field("energy_mj", pa.float64()),
            pa.field("sm_clock_mhz", pa.int64()),
            pa.field("mem_used_bytes", pa.int64()),
            pa.field("temp_c", pa.float64()),
            pa.field("throttle_reasons", pa.int64()),
        ],
    ),
    "session": _schema(
        "session",
        [
            pa.field("phase", pa.string(), nullable=False),
            pa.field("first_forward_tokens", pa.int64(), nullable=False),
            pa.field("streamed_s", pa.float64(), nullable=False),
            pa.field("frames", pa.int64(), nullable=False),
            pa.field("avg_fps", pa.float64()),
            pa.field("late_chunks", pa.int64(), nullable=False),
            pa.field("stall_ms", pa.float64(), nullable=False),
            pa.field("tp_size", pa.int64(), nullable=False),
            pa.field("shape", pa.string(), nullable=False),
            pa.field("switches", pa.string(), nullable=False),
        ],
    ),
    "event": _schema(
        "event",
        [
            pa.field("kind", pa.string(), nullable=False),
            pa.field("detail", pa.string(), nullable=False),  # JSON text
        ],
    ),
}


# Optional columns added after a kind's first schema (each with its migration): a body without them
# (an older worker, a batch spooled before the upgrade) is valid and reads them as null.
ADDED_COLUMNS: dict[str, tuple[str, ...]] = {"step": ("fp8_saturated",)}


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


def _check_same_columns() -> None:
    for kind, model in MODELS.items():
        cols = list(ARROW_SCHEMAS[kind].names)
        assert cols == list(model.model_fields), (kind, cols, list(model.model_fields))
        for name in ADDED_COLUMNS.get(kind, ()):
            assert ARROW_SCHEMAS[kind].field(name).nullable, (kind, name)


_check_same_columns()


def to_arrow(kind: str, rows: list[dict[str, Any]]) -> pa.Table:
    """Rows (dicts with the model's field names) -> an Arrow table of that kind's schema.

    Used by the shipping client; no validation here (the collector validates).
    """
    import orjson

    schema = ARROW_SCHEMAS[kind]
    cols: dict[str, list[Any]] = {name: [] for name in schema.names}
    for r in rows:
        for name in schema.names:
            v = r.get(name)
            if name == "detail" and not isinstance(v, str):
                v = orjson.dumps(v or {}).decode()
            elif name == "simulated" and v is None:
                v = False
            cols[name].append(v)
    return pa.Table.from_pydict(cols, schema=schema)
