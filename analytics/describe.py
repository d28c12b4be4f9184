"""One sentence per finding: what its value, baseline and effect mean for its kind and metric.

    describe(row) -> "1.02 GB reserved per new prompt shape (+1 fused-kernel buffer per shape) over 14 shapes; ..."

The findings table keeps generic numeric columns (value, baseline, effect) so every detector writes the
same row; what they mean differs by kind (a share of sessions, bytes per shape, a median against a
baseline release's). The API's findings (``summary``), the dashboards, the weekly report, the CLI and
the alert webhook's audit reason all read this one sentence.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

_FPS_LIMIT = {"frac_le_24fps": "24", "frac_le_23_5fps": "23.5"}


def _evidence(row: Mapping[str, Any]) -> dict[str, Any]:
    ev = row.get("evidence")
    if isinstance(ev, str):
        try:
            ev = json.loads(ev or "{}")
        except ValueError:
            return {}
    return ev if isinstance(ev, dict) else {}


def _pct(x: float | None) -> str:
    return "?" if x is None else f"{100 * x:.3g}%"


def _num(x: float | None, unit: str = "") -> str:
    return "?" if x is None else f"{x:.4g}{unit}"


def _unit(metric: str) -> str:
    return " ms" if metric.endswith(("_ms", "_ms_p50")) else " mJ" if "_mj" in metric else ""


def _is_share(metric: str) -> bool:
    return metric.endswith("_rate") or metric.startswith("frac_")


def _measure(metric: str, x: float | None) -> str:
    return _pct(x) if _is_share(metric) else _num(x, _unit(metric))


def _hours(h: float) -> str:
    return f"{h * 60:.0f} min" if h < 1 else f"{h:.3g} h" if h < 48 else f"{h / 24:.3g} days"


def _fps(row, ev) -> str:
    limit = _FPS_LIMIT.get(row["metric"], "?")
    ci = f" (95% CI {_pct(ev.get('ci_low'))}-{_pct(ev.get('ci_high'))})" if "ci_low" in ev else ""
    week = f" in {ev['iso_week']}" if ev.get("iso_week") else ""
    return f"{_pct(row['value'])} of {ev.get('sessions', '?')} sessions at or below {limit} fps{week}{ci}"


def _memory_unit(name: str | None) -> str:
    """What a memory finding's explanation counts (analytics/memory.py's names)."""
    from analytics.memory import OVER_TIME, PER_SESSION, SIZED

    return {PER_SESSION: "session served", OVER_TIME: "hour", SIZED: "token of the new first-forward shapes"}.get(
        name, f"new {name or 'prompt'} shape")


def _memory(row, ev) -> str:
    if row["metric"] == "processes_growing_per_shape":
        grows = (f"{_num(row['value'])} of {_num(row['baseline'])} processes of this release reserve more memory "
                 f"with every {_memory_unit(ev.get('explained_by'))}")
        if ev.get("ambiguous_with"):  # the store cannot yet tell them apart: say so, with the evidence
            apart = [t.get("sessions_telling_apart") for t in ev.get("key_tests", [])
                     if ev.get("explained_by") in t.get("keys", []) and t.get("sessions_telling_apart") is not None]
            told = f"; {min(apart)} sessions tell them apart so far" if apart else ""
            grows += f", or with every {' or every '.join(_memory_unit(a) for a in ev['ambiguous_with'])}{told}"
        return grows
    per_shape = f"{row['value'] / 1e9:.3g} GB" if row["value"] is not None else "?"
    eff = row.get("effect")
    buffers = "" if eff is None else f" ({eff:+.2g} fused-kernel buffer{'' if eff == 1 else 's'} per shape)"
    shapes = f" over {ev['distinct_shapes']} shapes" if ev.get("distinct_shapes") is not None else ""
    start = f"; {row['baseline'] / 1e9:.3g} GB reserved at the start" if row.get("baseline") is not None else ""
    tto = ev.get("hours_to_oom")
    oom = (f"; out of memory in ~{_hours(tto)} at this rate"
           if isinstance(tto, int | float) and not isinstance(tto, bool) else "")
    unit = _memory_unit(ev.get("explained_by"))
    return f"{per_shape} reserved per {unit}{buffers}{shapes}{start}{oom}"


def _regression(row, ev) -> str:
    m = row["metric"]
    base = f" on {ev['baseline_release']}" if ev.get("baseline_release") else ""
    eff = row.get("effect")
    worse = "" if eff is None else (f", {eff * 100:+.3g} points worse" if _is_share(m) else f", {eff:+.1%} worse")
    # the medians are the cohorts'; the effect was judged within strata (analytics/stratified.py)
    within = " within session-length x prompt strata" if str(ev.get("comparison", "")).startswith("compared within") else ""
    return f"{m} {_measure(m, row['value'])} against {_measure(m, row['baseline'])}{base}{worse}{within}"


def _changepoint(row, ev) -> str:
    m, v, b = row["metric"], row["value"], row["baseline"]
    if _is_share(m):  # a rate's effect is judged against a shifted series: state the change in points
        eff = f" ({(v - b) * 100:+.3g} points)" if v is not None and b is not None else ""
    else:
        eff = f" ({row['effect']:+.1%})" if row.get("effect") is not None else ""
    gaining = f"; release gaining share: {ev['release_gaining']}" if ev.get("release_gaining") else ""
    within = " within session-length x prompt strata" if ev.get("strata") else ""  # analytics/strata.py
    return f"daily {m}{within} moved from {_measure(m, b)} to {_measure(m, v)}{eff}{gaining}"


def _canary(row, ev) -> str:
    status = row["metric"].removeprefix("canary_").replace("_", " ")
    verdicts = [v for v in ev.get("verdicts", []) if isinstance(v, dict) and v.get("regressed")]
    worst = max(verdicts, key=lambda v: v.get("effect") or 0, default=None)
    eff = ""
    if worst is not None and worst.get("effect") is not None:
        m = str(worst.get("metric", "?"))
        size = f"{worst['effect'] * 100:+.3g} points" if _is_share(m) else f"{worst['effect']:+.1%}"
        eff = f" (worst: {m} {size} worse)"
    return f"canary of {row.get('attribution') or '?'} {status}{eff}"


def _saturation(row, ev) -> str:
    ci = ev.get("ci95") or [None, None]
    return (f"{_pct(row['value'])} of {ev.get('sessions', '?')} sampled sessions clip FP8 activations "
            f"(95% CI {_pct(ci[0])}-{_pct(ci[1])}; tolerated {_pct(row['baseline'])})")


def _drift(row, ev) -> str:
    m = row["metric"]
    days = f" over {ev['days']} days" if ev.get("days") is not None else ""
    pct = f" ({row['effect'] * 100:+.3g}% a week)" if row.get("effect") is not None else ""
    return f"{m} drifts by {_measure(m, row['value'])} a day from {_measure(m, row['baseline'])}{pct}{days}"


def _variance(row, ev) -> str:
    base = f" than on {ev['baseline_release']}" if ev.get("baseline_release") else " than its baseline"
    ratio = f" ({row['effect'] + 1:.2g}x)" if row.get("effect") is not None else ""
    m = row["metric"].removesuffix("_spread")
    return (f"{m} spreads wider{base}: {_measure(m, row['value'])} against {_measure(m, row['baseline'])}"
            f"{ratio}, same median (a note, not a regression)")


def _power(row, ev) -> str:
    what = {"change": "clocks down", "worker": "clocks down against its peers", "level": "throttled"}
    return f"{what.get(ev.get('judgement'), 'throttled')}: {ev['condition']}"


_BY_KIND: dict[str, Callable[[Mapping[str, Any], dict[str, Any]], str]] = {
    "fps_fraction": _fps,
    "memory_growth": _memory,
    "regression": _regression,
    "changepoint": _changepoint,
    "canary": _canary,
    "fp8_saturation": _saturation,
    "drift": _drift,
    "variance": _variance,
    "power": _power,
}


def describe(row: Mapping[str, Any]) -> str:
    """The finding in one sentence (evidence as a dict or its JSON text); never raises."""
    fn = _BY_KIND.get(str(row.get("kind")))
    try:
        if fn is not None:
            return fn(row, _evidence(row))
        return f"{row.get('metric', '')} {_num(row.get('value'))} (baseline {_num(row.get('baseline'))})"
    except (KeyError, TypeError, ValueError, IndexError, AttributeError):
        return f"{row.get('metric', '')} {row.get('value')!s:.40} (baseline {row.get('baseline')!s:.40})"
