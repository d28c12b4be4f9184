"""The table ``livestep evaluate-detectors`` prints (analytics/detector_eval.py): recall, scope, attribution,
severity, condition and hours per class and detector, the totals against the goals, and the incident pass's
incidents per cause and notifications per incident-day (analytics/holdout_eval.py)."""

from __future__ import annotations

import statistics

from analytics.memory import SEPARATE_P, key_of


def _median_h(hours: list[float]) -> str:
    """The median of a column of hours, or '-' where no outcome has one (never committed, say)."""
    return f"{statistics.median(hours):.0f}" if hours else "-"


def _pct(k: int, n: int) -> str:
    return f"{100 * k / n:5.1f}% ({k}/{n})" if n else "   -"


def summarize(outcomes: list, catalog: tuple) -> list[str]:
    """The table of ``outcomes`` (detector_eval's ``Outcome``) of ``catalog``'s cases (its ``CATALOG``): per class,
    then per detector, then the totals against the goals."""
    lines = [(f"{'class':<26} {'detector':<12} {'recall':>14} {'scope right':>14} {'attrib right':>14} "
             f"{'severity':>14} {'condition':>14} {'h to first':>10} {'h to scope':>10} {'h to attrib':>11} {'ambiguous 1st':>14} "
             f"{'false alarms':>16}")]
    by_case: dict[str, list] = {}
    for o in outcomes:
        by_case.setdefault(o.case, []).append(o)
    cases = {c.name: c for c in catalog}
    for name, os_ in by_case.items():
        c = cases[name]
        if c.detector:
            found = [o for o in os_ if o.found]
            att = [o for o in found if o.attribution_right is not None]
            sev = [o for o in found if o.severity_right is not None]
            hours = [o.hours_to_first for o in os_ if o.hours_to_first is not None]
            scoped = [o.hours_to_scope for o in os_ if o.hours_to_scope is not None]
            attributed = [o.hours_to_attribution for o in os_ if o.hours_to_attribution is not None]
            amb = [o for o in found if o.ambiguous_first is not None]
            cond = [o for o in found if o.condition_right is not None]
            lines.append(
                f"{name:<26} {c.detector:<12} {_pct(len(found), len(os_)):>14} "
                f"{_pct(sum(o.scope_right for o in found), len(found)):>14} "
                f"{_pct(sum(bool(o.attribution_right) for o in att), len(att)) if c.attribution else '-':>14} "
                f"{_pct(sum(bool(o.severity_right) for o in sev), len(sev)) if c.severity else '-':>14} "
                f"{_pct(sum(bool(o.condition_right) for o in cond), len(cond)) if c.condition else '-':>14} "
                f"{_median_h(hours):>10} {_median_h(scoped):>10} {_median_h(attributed):>11} "
                f"{_pct(sum(bool(o.ambiguous_first) for o in amb), len(amb)) if amb else '-':>14} {'-':>16}")
        else:
            fa = sum(bool(o.false_alarms) for o in os_)
            note = f" notes {_pct(sum(bool(o.note_found) for o in os_), len(os_))}" if c.note else ""
            lines.append(f"{name:<26} {'(benign)':<12} {'-':>14} {'-':>14} {'-':>14} {'-':>14} {'-':>14} {'-':>10} {'-':>10} "
                         f"{'-':>11} {'-':>14} "
                         f"{_pct(fa, len(os_)):>16}{note}")
    lines.append("")
    for name, os_ in by_case.items():  # keys never committed to: what the store held
        waits = [o.key_evidence for o in os_ if o.found and o.key_evidence and not o.scope_right]
        pairs = [t for e in waits for t in e["tests"] if t["sessions_telling_apart"] is not None]
        if waits:
            apart = statistics.median(t["sessions_telling_apart"] for t in pairs) if pairs else float("nan")
            p_key = [min(t["p_value"][k] for k in t["keys"] if key_of(k) == cases[name].key) for t in pairs]
            lines.append(f"  {name}: key ambiguous to the end in {len(waits)}/{len(os_)}; against its rivals a "
                         f"median {apart:.0f} sessions tell them apart, the key's own growth beyond the rival at "
                         f"median p {statistics.median(p_key) if p_key else float('nan'):.2g} (needs < "
                         f"{SEPARATE_P:g})")
    lines.append("")
    lines.append(f"{'detector':<14} {'recall':>14} {'scope right':>14}")
    for d in dict.fromkeys(c.detector for c in catalog if c.detector):
        os_ = [o for o in outcomes if cases[o.case].detector == d]
        found = [o for o in os_ if o.found]
        lines.append(f"{d:<14} {_pct(len(found), len(os_)):>14} {_pct(sum(o.scope_right for o in found), len(found)):>14}")
    inc = [o for o in outcomes if cases[o.case].detector]
    ben = [o for o in outcomes if not cases[o.case].detector]
    found = [o for o in inc if o.found]
    drift = [o for o in outcomes if o.case == "drift" and o.hours_to_first is not None]
    lines.append("")
    lines.append(f"overall recall {_pct(len(found), len(inc))} (goal >= 95%); scope right "
                 f"{_pct(sum(o.scope_right for o in found), len(found))} (goal >= 95%); benign releases with a "
                 f"false alarm {_pct(sum(bool(o.false_alarms) for o in ben), len(ben))} (goal <= 5%)")
    n_drift = sum(1 for o in outcomes if o.case == "drift")
    lines.append(f"0.5%/day drift flagged within 10 days: {_pct(sum(o.hours_to_first <= 240 for o in drift), n_drift)}")
    lines += _incident_lines(outcomes, cases)
    return lines


def _incident_lines(outcomes: list, cases: dict) -> list[str]:
    """Per class replayed through the incident logic (holdout_eval.incident_pass): seeds within the goal of
    incidents per cause (<= 1; a benign class: 0), the incidents' median and most, flips, and notifications per
    incident-day (all of them over all incident-days; the worst incident-day)."""
    measured = [o for o in outcomes if o.incidents is not None]
    if not measured:
        return []
    head = (f"{'class':<26} {'incidents <= goal':>18} {'incidents med/max':>18} {'reopened':>9} {'flips max':>9} "
            f"{'notif/inc-day':>14} {'worst inc-day':>14}")
    lines = ["", head]
    by_case: dict[str, list] = {}
    for o in measured:
        by_case.setdefault(o.case, []).append(o)
    within_all = n_all = 0
    worst_all, notes_all, days_all = 0, 0, 0
    for name, os_ in by_case.items():
        goal = 1 if cases[name].detector else 0
        n_inc = [o.incidents["incidents"] for o in os_]
        within = sum(n <= goal for n in n_inc)
        notes = sum(o.incidents["notifications"] for o in os_)
        days = sum(o.incidents["incident_days"] for o in os_)
        worst = max(o.incidents["max_notifications_day"] for o in os_)
        within_all, n_all = within_all + within, n_all + len(os_)
        worst_all, notes_all, days_all = max(worst_all, worst), notes_all + notes, days_all + days
        lines.append(f"{name:<26} {_pct(within, len(os_)):>18} {statistics.median(n_inc):>9g}/{max(n_inc):<8d} "
                     f"{sum(o.incidents['reopened'] for o in os_):>9d} {max(o.incidents['flips'] for o in os_):>9d} "
                     f"{(notes / days if days else 0):>14.2f} {worst:>14d}")
    lines.append("")
    lines.append(f"incidents per cause within the goal (<= 1; benign: 0) {_pct(within_all, n_all)}; notifications per "
                 f"incident-day {notes_all / days_all if days_all else 0:.2f}, worst incident-day {worst_all} (goal <= 3)")
    return lines
