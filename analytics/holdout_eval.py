"""evaluate-detectors' hold-out classes: incidents of ``analytics.holdout``'s fleet (not the simulator's).

    livestep evaluate-detectors --seeds 20 --only hold_power_capped,hold_session_age,hold_trap_longer_sessions

Each (class, seed) generates a hold-out fleet (real device names through the ingest checks) with its
scenario, runs the detectors over their own trailing windows (``analytics.jobs.window``) at ``LADDER_H``
hours after the onset and scores what ``analytics.detector_eval`` scores (found, scope right, attribution,
severity), plus whether the finding **names the condition** by the last rung (``Case.condition``: a text its evidence's
``condition``, its attribution or its sentence must hold, e.g. ``first_forward_tokens > 1``). Benign
classes (a healthy release; a release whose sessions are twice as long, per step unchanged) count every
acting finding (warning or critical, of any detector, power and session age included) as a false alarm.
"""

from __future__ import annotations

import json
import time
import uuid
from datetime import timedelta

DAYS = 10.0
ONSET_DAY = 6.0
LADDER_H = (24, 72, 96)
SESSIONS_PER_DAY = 30.0
# what counts as acting, of every detector the hold-out fleet is read by
ACTING = ("memory", "regressions", "changepoints", "drift", "power", "session_age")


def detectors():
    from analytics import power, session_age
    from analytics.detector_eval import _detectors

    return {**_detectors(), "power": power.run, "session_age": session_age.run}


def _names_condition(want: str, rows: list[dict]) -> bool:
    from analytics.describe import describe

    for r in rows:
        ev = json.loads(r["evidence"])
        text = " ".join(str(x) for x in (ev.get("condition"), ev.get("segment"), r.get("attribution"), describe(r)))
        if want in text:
            return True
    return False


def run_case(case, seed: int, chdb_dir: str):
    """One hold-out (class, seed): an ``analytics.detector_eval.Outcome``."""
    from analytics import holdout, jobs
    from analytics.detector_eval import COMMITTED, Outcome, _attribution_state, _judge_rows, sim_end
    from collector.migrations import drop_database
    from collector.store import open_store

    t0 = time.perf_counter()
    store = open_store(f"chdb://{chdb_dir}?database=h_{uuid.uuid4().hex[:12]}")
    store.migrate()
    out = Outcome(case.name, seed)
    try:
        res = holdout.generate(store, scenario=case.incident, seed=seed, end=sim_end(seed), days=DAYS,
                               onset_day=case.onset_day or ONSET_DAY, sessions_per_day=SESSIONS_PER_DAY)
        rel, det = res.release, detectors()
        ends = [min(res.onset + timedelta(hours=h), res.end) for h in case.ladder_h or LADDER_H]
        if case.detector:
            for end in ends:
                rows = det[case.detector](store, *jobs.window(case.detector, end=end))
                found, right, hits = _judge_rows(case, rel, rows, res.kinds)
                if not found:
                    continue
                hours = (end - res.onset).total_seconds() / 3600
                if not out.found:  # the first rung that finds it: recall, scope, condition, severity
                    out.found, out.scope_right, out.hours_to_first = True, right, hours
                    out.hours_to_scope = hours
                if case.condition and not out.condition_right:  # named by the last rung at the latest
                    out.condition_right = _names_condition(case.condition, hits)
                if case.severity and not out.severity_right:  # the severity it reaches by the last rung
                    out.severity_right = any(r["severity"] == case.severity for r in hits)
                if case.attribution and out.hours_to_attribution is None:  # at the first rung that commits
                    committed = all(_attribution_state(r) in COMMITTED for r in hits)
                    if committed or end == ends[-1]:
                        out.attribution_right = committed and all(r["attribution"] == case.attribution for r in hits)
                        out.hours_to_attribution = hours
            if out.found and case.attribution and out.attribution_right is None:
                out.attribution_right = False
        else:
            for name in ACTING:
                rows = det[name](store, *jobs.window(name, end=ends[-1]))
                out.false_alarms += [f"{name}:{r['scope']}:{r['metric']}" for r in rows
                                     if r["severity"] in ("warning", "critical")]
    finally:
        drop_database(store, store.database)
    out.seconds = time.perf_counter() - t0
    return out
