"""evaluate-detectors' hold-out classes: incidents of ``analytics.holdout``'s fleet (not the simulator's).

    livestep evaluate-detectors --seeds 20 --only hold_power_capped,hold_session_age,hold_trap_longer_sessions

Each (class, seed) generates a hold-out fleet (real device names through the ingest checks) with its
scenario, runs the detectors over their own trailing windows (``analytics.jobs.window``) at ``LADDER_H``
hours after the onset and scores what ``analytics.detector_eval`` scores (found, scope right, attribution,
severity), plus whether the finding **names the condition** by the last rung (``Case.condition``: a text its evidence's
``condition``, its attribution or its sentence must hold, e.g. ``first_forward_tokens > 1``). Benign
classes (a healthy release; a release whose sessions are twice as long, per step unchanged) count every
acting finding (warning or critical, of any detector, power and session age included) as a false alarm.

Then, where the incident logic is registered (``set_incident_sync``: the api's ``api.incidents.sync``, which
``livestep evaluate-detectors`` registers; the analytics never import the api), the same fleet is replayed
through it on the simulated clock (``incident_pass``): each day from the onset to the last rung, every
detector runs as the scheduler runs it (``analytics.jobs.run_job``: its findings written, the previous
judgement resolved) at its time of day (``SCHEDULE``), and after each run the findings are handed to the
incident logic as the server's hand-off does (``sync(store, now=...)``, no receivers: notifications are
counted, not posted). Measured: incidents opened (the class's one cause: goal <= 1; a benign class: 0),
switch flips, and notifications per incident-day (the notifications of one incident on one day; goal <= 3).
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
# the incident pass: the scheduler's daily runs (analytics.jobs.start_scheduler), minutes after 02:00 UTC; memory
# and power, hourly there, run once a day here (their hourly hand-offs notify only on a change of state)
SCHEDULE = (("memory", 0), ("power", 0), ("regressions", 0), ("session_age", 10), ("changepoints", 20), ("drift", 30))
SCHEDULE_HOUR = 2

_incident_sync = None


def set_incident_sync(fn) -> None:
    """Register ``fn(store, now=...) -> report`` (``api.incidents.sync``: a report with ``changed``, ``flips``
    and ``notifications``) as the incident logic the hold-out runs are replayed through (None: not measured)."""
    global _incident_sync
    _incident_sync = fn


def incident_pass(store, sync, onset, last) -> dict:
    """Replay the detectors and the incident hand-off day by day from ``onset`` to ``last`` (module
    docstring). Returns incidents (opened), reopened, flips, notifications, incident_days (an incident open
    on a day counts that day) and the most notifications one incident got on one day."""
    from analytics import jobs

    day = onset.replace(hour=SCHEDULE_HOUR, minute=0, second=0, microsecond=0)
    if day <= onset:
        day += timedelta(days=1)
    opened, reopened, open_now = set(), 0, set()
    flips, per_day, inc_days = 0, {}, set()
    while day <= last:
        for name, minute in SCHEDULE:
            now = day + timedelta(minutes=minute)
            jobs.run_job(name, store, trigger="evaluation", end=now)
            rep = sync(store, now=now)
            for c in rep.changed:
                if "opened" in c["events"] or "reopened" in c["events"]:
                    open_now.add(c["id"])
                    opened.add(c["id"])
                    reopened += "reopened" in c["events"]
                if "resolved" in c["events"]:
                    inc_days.add((c["id"], now.date()))
                    open_now.discard(c["id"])
            flips += len(rep.flips)
            for n in rep.notifications:
                per_day[(n["incident"], now.date())] = per_day.get((n["incident"], now.date()), 0) + 1
            inc_days |= {(i, now.date()) for i in open_now}
        day += timedelta(days=1)
    return {"incidents": len(opened), "reopened": reopened, "flips": flips,
            "notifications": sum(per_day.values()), "incident_days": len(inc_days),
            "max_notifications_day": max(per_day.values(), default=0)}


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
        if _incident_sync is not None:
            out.incidents = incident_pass(store, _incident_sync, res.onset, ends[-1])
    finally:
        drop_database(store, store.database)
    out.seconds = time.perf_counter() - t0
    return out
