"""The wire contract's declaration (collector/records.py derives the rest from it): every record kind
(``KINDS``) and every field of it (``Col``: name, type, bounds, nullability, the migration that added it),
the fields every record carries (``COMMON``), the shape keys the detectors judge (``SHAPE_KEYS``), the
enumerations (event kinds, evaluation metrics and verdicts, playout policies) and the switch-state string.
Standard library only, like collector/switch_names.py: no pydantic, no Arrow."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from collector.flip_fields import FLIP_COST_KIND
from collector.switch_names import FRAME_METRICS, NUMERIC_SWITCHES, SWITCH_NAMES

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
