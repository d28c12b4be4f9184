"""The metric catalogue: every per-session metric and every fleet threshold, declared once.

    from collector import catalog
    catalog.FPS_BUDGET, catalog.CHUNK_DEADLINE_MS, catalog.MIN_STREAMED_S   # 24.0, 166.7, 1.0
    catalog.METRICS_BY_NAME["step_period_ms"]  # Metric(unit="ms", higher_is_worse=True, ...)
    [m for m in catalog.METRICS if m.regression_floor]   # what the release-regression judge compares

A session's figures are SQL over its finalized ``session_stats`` row (``SESSION_COLUMNS``: the merged
aggregate states) and expressions over those (``METRICS``: fps, step period, late rate, ...). Every
consumer derives from these two tuples: the read layer's per-session SELECT (analytics/queries.py), the
detectors' metric tables (regressions, change points, drift, variance), the API's ``Metric`` enum and
the dashboard's charts. The view that fills ``session_stats`` is ``SESSION_STATES`` (one aggregate
state per column), from which every migration's ``{{session_stats_view}}`` derives. Adding a per-session
metric is one ``Metric`` here; a new step field adds its ``Col`` in collector/records.py, its ``State``
and ``Column`` here, and a migration that adds the column and applies ``{{session_stats_view}}``.

Stdlib only: the worker may import it (the shipping client's side of the wire has no server packages).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

# -- fleet thresholds (DESIGN.md: the paper's facts) ------------------------------------------------
FPS_BUDGET = 24.0  # real time: sessions at or below it are counted (the fleet figure)
FPS_LOW = 23.5  # the paper's second fleet figure: worker averaged > 23.5 fps in 99.5% of sessions
FRAMES_PER_STEP = 4  # one step delivers one chunk of 4 frames
CHUNK_DEADLINE_MS = 1000.0 * FRAMES_PER_STEP / FPS_BUDGET  # 166.7 ms: one chunk's deadline
MIN_STREAMED_S = 1.0  # the population of every fps fraction: sessions that streamed at least this long

# Fleet proportions: finding metric -> the fps a session at or below counts against
FPS_FRACTIONS: dict[str, float] = {"frac_le_24fps": FPS_BUDGET, "frac_le_23_5fps": FPS_LOW}

# Cohort filters of the read layer (a session's labels, and ``switches``: its final switch state)
FILTER_KEYS: tuple[str, ...] = ("release", "gpu_kind", "worker_id", "session_id", "switches")
LABEL_KEYS: tuple[str, ...] = ("release", "gpu_kind", "worker_id", "session_id")


def canonical_scope(labels: Mapping[str, object]) -> str:
    """{'release': 'v7', 'gpu_kind': 'h100'} -> 'gpu_kind=h100,release=v7' (sorted by key; a list of
    values is joined by '|', sorted). The key of a finding's, incident's and switch rule's scope."""
    parts = []
    for k in sorted(labels):
        v = labels[k]
        v = "|".join(sorted(str(x) for x in v)) if isinstance(v, (list, tuple, set, frozenset)) else str(v)
        parts.append(f"{k}={v}")
    return ",".join(parts)


# -- per-session columns: the finalized session_stats row --------------------------------------------
@dataclass(frozen=True)
class Column:
    """One column of a finalized session: ``sql`` merges the session's partial rows (sql/002, 021, 022).
    ``summary``: served as is (a number or null) in GET /v1/sessions's ``SessionSummary``."""

    name: str
    sql: str
    detail: bool = False  # only in the session listing (GET /v1/sessions), not in analytics' frames
    summary: bool = False


SESSION_COLUMNS: tuple[Column, ...] = (
    Column("start_ts", "min(first_ts)"),
    Column("end_ts", "max(last_ts)"),
    Column("simulated", "max(simulated)"),
    Column("steps", "countMerge(steps)"),
    Column("late_chunks", "countIfMerge(late_chunks)"),
    Column("period_ms_sum", "sumMerge(period_ms_sum)"),
    Column("diffusion_ms", "avgMerge(diffusion_ms_avg)"),
    Column("upkeep_ms", "avgMerge(upkeep_ms_avg)"),
    Column("energy_mj", "sumMerge(energy_mj_sum)"),
    Column("mem_reserved_max", "max(mem_reserved_max)"),
    Column("buffers_max", "max(buffers_max)"),
    # the switch state at the session's latest step: argMax as max((ts, switches)), merges in any order (sql/021)
    Column("switch_state", "tupleElement(max(switch_last), 2)"),
    Column("reset_steps", "countIfMerge(reset_steps)", detail=True),
    Column("period_ms_q", "quantilesTDigestMerge(0.5, 0.95, 0.99)(period_ms_q)", detail=True),
    Column("diffusion_ms_q", "quantilesTDigestMerge(0.5, 0.95, 0.99)(diffusion_ms_q)", detail=True),
    Column("sm_clock_mhz", "avgMerge(sm_clock_avg)", summary=True),  # sql/120: mean SM clock over the steps
)
# FP8 saturation per session (sql/022; analytics/saturation.py): over the session's sampled steps
FP8_COLUMNS: tuple[Column, ...] = (
    Column("sampled_steps", "countIfMerge(fp8_sampled)"),
    Column("saturating_steps", "countIfMerge(fp8_sat_steps)"),
    Column("static_steps", "countIfMerge(fp8_static_steps)"),
    Column("sat_max", "toFloat64(max(fp8_sat_max))"),
    Column("sat_mean", "toFloat64(avgMerge(fp8_sat_avg))"),
)
SUMMARY_COLUMNS: tuple[Column, ...] = tuple(c for c in SESSION_COLUMNS if c.summary)
SESSION_QUANTILES: tuple[float, ...] = (0.5, 0.95, 0.99)  # the levels of the detail columns' t-digests


# -- the session_stats view: a block of steps -> its sessions' partial rows ----------------------------
@dataclass(frozen=True)
class State:
    """One column of session_stats as its materialized view fills it from a block of ``steps`` (``sql``),
    and ``since``, the migration that added it (sql/NNN). A migration's ``{{session_stats_view}}``
    (collector/migrations.py) is the view over the states up to its own number, so every migration
    still applies the view it applied when it shipped. Append only: a state's expression never changes
    (a new one is a new column, its migration and its number)."""

    name: str
    sql: str
    since: int = 2


SESSION_KEY: tuple[str, ...] = ("release", "gpu_kind", "worker_id", "session_id")  # a session_stats row's key
_Q = "quantilesTDigestState(0.5, 0.95, 0.99)"  # SESSION_QUANTILES
SESSION_STATES: tuple[State, ...] = (
    State("simulated", "max(simulated)"),
    State("first_ts", "min(ts)"),
    State("last_ts", "max(ts)"),
    State("steps", "countState()"),
    State("late_chunks", "countIfState(toUInt8(late))"),
    State("reset_steps", "countIfState(toUInt8(reset_step))"),
    State("period_ms_sum", "sumState(toFloat64(step_period_ms))"),
    State("diffusion_ms_q", f"{_Q}(diffusion_ms)"),
    State("period_ms_q", f"{_Q}(step_period_ms)"),
    State("diffusion_ms_avg", "avgState(diffusion_ms)"),
    State("upkeep_ms_avg", "avgState(cache_upkeep_ms)"),
    State("attention_ms_avg", "avgState(attention_ms)"),
    State("energy_mj_sum", "sumState(energy_mj)"),
    State("mem_reserved_max", "max(mem_reserved_bytes)"),
    State("buffers_max", "max(buffers_registered)"),
    State("switches", "anyLast(toString(switches))"),
    # argMax(switches, ts) that merges in any order: (ts of the latest step, its state)
    State("switch_last", "max((ts, toString(steps.switches)))", since=21),
    State("fp8_sat_max", "max(fp8_saturated)", since=22),
    State("fp8_sat_avg", "avgState(fp8_saturated)", since=22),
    State("fp8_sampled", "countIfState(toUInt8(fp8_saturated IS NOT NULL))", since=22),
    State("fp8_sat_steps", "countIfState(toUInt8(ifNull(fp8_saturated > 0, 0)))", since=22),
    State("fp8_static_steps", "countIfState(toUInt8(fp8_saturated IS NOT NULL AND "
                              "has(splitByChar(',', toString(steps.switches)), 'static_scales')))", since=22),
    State("sm_clock_avg", "avgState(sm_clock_mhz)", since=120),
)


# -- per-session metrics ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Metric:
    """A per-session figure: ``sql`` over the finalized columns; what the detectors judge of it.

    ``finding``: the name findings carry (kept stable: stored findings and alerts key on it).
    ``regression_floor``: what the release-regression judge needs beyond the noise (None: not judged):
    the relative floor on the ratio of medians, or for a ``share`` the absolute floor on the difference
    of proportions (tested as a proportion of chunks).
    ``daily``: (aggregate of a day's sessions, absolute floor in the metric's units: the smallest change
    of the segment means worth a finding) for the change-point and drift passes; the name of the daily
    series is the finding name, with ``_p50`` for a median.
    ``variance``: the variance detector notes a wider spread of it."""

    name: str
    unit: str  # "ms", "mJ", "ratio", "fps", "s"
    sql: str
    description: str
    higher_is_worse: bool = True
    aggregation: str = "mean"  # how a session's steps become it: mean, sum, share, ratio
    finding: str = ""
    regression_floor: float | None = None
    daily: tuple[str, float] | None = None
    variance: bool = False
    threshold: float | None = None  # a fleet threshold drawn and judged against (the deadline, the budget)

    @property
    def finding_name(self) -> str:
        return self.finding or self.name


METRICS: tuple[Metric, ...] = (
    Metric("streamed_s", "s", "period_ms_sum / 1000", "seconds streamed: the sum of the step periods",
           higher_is_worse=False, aggregation="sum", threshold=MIN_STREAMED_S),
    Metric("fps", "fps", f"steps * {FRAMES_PER_STEP} / greatest(period_ms_sum / 1000, 1e-9)",
           "frames / streamed seconds", higher_is_worse=False, aggregation="ratio", threshold=FPS_BUDGET),
    Metric("step_period_ms", "ms", "period_ms_sum / steps", "mean wall time between chunk deliveries",
           regression_floor=0.03, daily=("median", 1.5), variance=True, threshold=CHUNK_DEADLINE_MS),
    Metric("diffusion_ms", "ms", "diffusion_ms", "mean diffusion (denoising) time of a step",
           regression_floor=0.03, daily=("median", 1.5), variance=True),
    Metric("upkeep_ms", "ms", "upkeep_ms", "mean KV-cache upkeep time of a step", finding="cache_upkeep_ms",
           regression_floor=0.10, daily=("median", 0.1)),
    Metric("energy_per_chunk_mj", "mJ", "energy_mj / steps", "GPU energy per chunk (NVML counter deltas)",
           regression_floor=0.03, daily=("median", 4000.0)),
    Metric("late_rate", "ratio", "late_chunks / steps", "share of chunks that missed their deadline",
           aggregation="share", finding="late_chunk_rate", regression_floor=0.01, daily=("mean", 0.005)),
)
METRICS_BY_NAME: dict[str, Metric] = {m.name: m for m in METRICS}
# the per-session metrics the API serves (GET /v1/releases/distributions, /v1/releases/compare)
API_METRICS: tuple[str, ...] = ("fps", "step_period_ms", "diffusion_ms", "upkeep_ms", "energy_per_chunk_mj",
                                "late_rate")
