"""Power and clocks: GPUs held at their power cap (or slowed by heat), from the worker's GPU samples.

    rows = run(store, start, end)            # findings of kind 'power', scoped to a GPU kind or a worker
    rows = judge(minutes, end)               # the same on ``queries.power_minutes``' frame (tests)

The worker sends an NVML reading of every GPU at ~10 Hz (worker/telemetry.py: power, SM clock, the clocks'
event reasons). The reasons are the bits of NVML's ``nvmlClocksEventReasons`` mask, which DCGM exports as
``DCGM_FI_DEV_CLOCK_THROTTLE_REASONS`` with the same bits and names (``DCGM_CLOCKS_THROTTLE_REASON_*``,
dcgm_fields.h): ``THROTTLE_REASONS`` below. Only the minutes in which the worker was stepping are read (a
GPU sample joined with the steps of the same worker and minute), so idle clocks never count, and the step
time of those same minutes is the effect put beside the samples.

Per GPU kind, the last ``RECENT`` of the window is compared with the rest of it (the kind's baseline):

- a **change**: a slowing reason's share of the samples rose by at least ``MIN_SHARE_RISE`` and the SM
  clock fell by at least ``MIN_CLOCK_DROP`` (Mann-Whitney U over the per-minute clocks, p < ``MAX_P``).
  A warning when the step (diffusion) time of those minutes rose by ``MIN_STEP_EFFECT`` or more, else info;
- a **level** (no baseline, or the reason was already there): a kind whose samples carry a slowing reason
  in ``BOUND_SHARE`` or more of its busy minutes is power- (or heat-) bound: an info note with the clock and
  the step time of its throttled minutes against its unthrottled ones (the real H200 was: 60% of samples
  at the software power cap, 1,768 MHz against 1,978);
- a **worker** of a kind with no change of its own whose share and clock stand out from its peers' in the
  recent part by the same margins (one badly cooled or capped machine): scoped to that worker.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import numpy as np
import polars as pl
from scipy.stats import mannwhitneyu

from analytics import queries
from analytics.findings import finding

# NVML clocks-event reason bits = DCGM's clock-throttle reasons: bit -> (DCGM name, slows a busy GPU)
THROTTLE_REASONS: dict[int, tuple[str, bool]] = {
    0x1: ("GPU_IDLE", False),
    0x2: ("CLOCKS_SETTING", False),
    0x4: ("SW_POWER_CAP", True),
    0x8: ("HW_SLOWDOWN", True),
    0x10: ("SYNC_BOOST", False),
    0x20: ("SW_THERMAL", True),
    0x40: ("HW_THERMAL", True),
    0x80: ("HW_POWER_BRAKE", True),
    0x100: ("DISPLAY_CLOCKS", False),
}
SLOWING: dict[str, int] = {name: bit for bit, (name, slows) in THROTTLE_REASONS.items() if slows}
METRIC = "sm_clock_mhz"
RECENT = timedelta(hours=24)
WINDOW = timedelta(days=7)
MIN_SHARE_RISE = 0.2  # of the samples, absolute
MIN_CLOCK_DROP = 0.05  # relative
MIN_STEP_EFFECT = 0.05  # relative rise of the median diffusion time that makes it a warning
BOUND_SHARE = 0.3
MIN_MINUTES = 30  # busy minutes on each side of a comparison
MIN_LEVEL_SAMPLES = 100  # samples (10 s at the worker's 10 Hz) for a note of standing throttling
MAX_P = 1e-3


def run(store, start: datetime, end: datetime) -> list[dict]:
    """The power findings over [start, end)."""
    return judge(queries.power_minutes(store, start, end, SLOWING), end, start)


def _share(g: pl.DataFrame, reason: str) -> float:
    n = g["samples"].sum()
    return float((g[reason] * g["samples"]).sum() / n) if n else 0.0


def _median(g: pl.DataFrame, col: str) -> float | None:
    v = g[col].drop_nulls()
    return float(v.median()) if len(v) else None


def _clock_drop(now: pl.DataFrame, before: pl.DataFrame) -> tuple[float, float] | None:
    """(relative drop of the median SM clock, one-sided Mann-Whitney p) of ``now`` against ``before``."""
    a, b = now[METRIC].drop_nulls().to_numpy(), before[METRIC].drop_nulls().to_numpy()
    if len(a) < MIN_MINUTES or len(b) < MIN_MINUTES or np.median(b) <= 0:
        return None
    p = float(mannwhitneyu(a, b, alternative="less").pvalue)
    return 1 - float(np.median(a)) / float(np.median(b)), p


def _side(g: pl.DataFrame) -> dict:
    return {"busy_minutes": g.height, "samples": int(g["samples"].sum()), "sm_clock_mhz": _median(g, METRIC),
            "power_w": _median(g, "power_w"), "power_max_w": None if g.is_empty() else g["power_max_w"].max(),
            "diffusion_ms": _median(g, "diffusion_ms"),
            "shares": {r: round(_share(g, r), 4) for r in SLOWING}}


def _effect(now: pl.DataFrame, before: pl.DataFrame) -> float | None:
    a, b = _median(now, "diffusion_ms"), _median(before, "diffusion_ms")
    return None if a is None or not b else a / b - 1


def _condition(reasons: list[str], now: dict, before: dict | None, effect: float | None, versus: str) -> str:
    parts = [f"{r} in {now['shares'][r]:.0%} of samples" + (f" ({versus} {before['shares'][r]:.0%})" if before else "")
             for r in reasons]
    clock = f"SM clock {now['sm_clock_mhz']:,.0f} MHz" + (
        f" ({versus} {before['sm_clock_mhz']:,.0f})" if before and before["sm_clock_mhz"] else "")
    step = "" if effect is None else f", diffusion {effect:+.0%}"
    return ", ".join(parts) + f"; {clock}{step}"


def _row(scope: dict, now_g: pl.DataFrame, before_g: pl.DataFrame | None, reasons: list[str], start, end,
         kind_of_judgement: str, effect: float | None, p: float | None, extra: dict | None = None) -> dict:
    now, before = _side(now_g), None if before_g is None else _side(before_g)
    acting = kind_of_judgement != "level" and effect is not None and effect >= MIN_STEP_EFFECT
    evidence = {"judgement": kind_of_judgement, "reasons": reasons,
                "dcgm_field": "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "recent": now, "baseline": before,
                "condition": _condition(reasons, now, before, effect, "peers" if kind_of_judgement == "worker" else "was"), "step_time_effect": effect,
                "clock_p_value": p, **(extra or {})}
    return finding("power", scope, METRIC, start, end, value=now["sm_clock_mhz"] or 0.0,
                   baseline=None if before is None else before["sm_clock_mhz"], effect=effect,
                   confidence=None if p is None else 1 - p, severity="warning" if acting else "info",
                   evidence=evidence)


def _rising(now: pl.DataFrame, before: pl.DataFrame) -> list[str]:
    return [r for r in SLOWING if _share(now, r) - _share(before, r) >= MIN_SHARE_RISE]


def _level(g: pl.DataFrame) -> dict | None:
    """A kind's standing throttling: the reasons over ``BOUND_SHARE``, and its throttled minutes (half or
    more of their samples slowed) against its unthrottled ones (none slowed)."""
    reasons = [r for r in SLOWING if _share(g, r) >= BOUND_SHARE]
    if not reasons or g["samples"].sum() < MIN_LEVEL_SAMPLES:
        return None
    slowed = g.select(pl.max_horizontal([pl.col(r) for r in reasons]).alias("s"))["s"]
    hot, cool = g.filter(slowed >= 0.5), g.filter(slowed == 0)
    effect = _effect(hot, cool) if hot.height and cool.height else None
    return {"reasons": reasons, "effect": effect,
            "throttled": {"minutes": hot.height, "sm_clock_mhz": _median(hot, METRIC), "diffusion_ms": _median(hot, "diffusion_ms")},
            "unthrottled": {"minutes": cool.height, "sm_clock_mhz": _median(cool, METRIC),
                            "diffusion_ms": _median(cool, "diffusion_ms")}}


def judge(m: pl.DataFrame, end: datetime, start: datetime | None = None) -> list[dict]:
    """Findings from busy minutes (``queries.power_minutes``' columns) up to ``end``."""
    if m.is_empty():
        return []
    end = end.replace(tzinfo=UTC) if end.tzinfo is None else end  # a store's naive timestamps are UTC
    start = start or end - WINDOW
    cut = end - RECENT
    rows = []
    for (kind,), g in m.group_by("gpu_kind", maintain_order=True):
        now, before = g.filter(pl.col("minute") >= cut), g.filter(pl.col("minute") < cut)
        if now.is_empty():
            continue
        changed = None
        if now.height >= MIN_MINUTES and before.height >= MIN_MINUTES and (rising := _rising(now, before)):
            drop = _clock_drop(now, before)
            if drop is not None and drop[0] >= MIN_CLOCK_DROP and drop[1] < MAX_P:
                changed = _row({"gpu_kind": kind}, now, before, rising, start, end, "change",
                               _effect(now, before), drop[1],
                               {"releases_recent": sorted(now["release"].unique().to_list())})
        if changed:
            rows.append(changed)
            continue
        if (lv := _level(now)) is not None:
            rows.append(_row({"gpu_kind": kind}, now, None, lv["reasons"], start, end, "level", lv["effect"], None,
                             {"throttled": lv["throttled"], "unthrottled": lv["unthrottled"]}))
        rows += _workers(kind, now, start, end)
    return rows


def _workers(kind: str, now: pl.DataFrame, start, end) -> list[dict]:
    """Workers of one kind whose recent throttling stands out from their peers'."""
    out = []
    workers = now["worker_id"].unique().sort().to_list()
    if len(workers) < 3:
        return out
    for w in workers:
        mine, peers = now.filter(pl.col("worker_id") == w), now.filter(pl.col("worker_id") != w)
        if mine.height < MIN_MINUTES or not (rising := _rising(mine, peers)):
            continue
        drop = _clock_drop(mine, peers)
        if drop is None or drop[0] < MIN_CLOCK_DROP or drop[1] >= MAX_P:
            continue
        out.append(_row({"gpu_kind": kind, "worker_id": w}, mine, peers, rising, start, end, "worker",
                        _effect(mine, peers), drop[1], {"peers": len(workers) - 1}))
    return out
