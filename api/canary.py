"""Canaries: re-enable a switch for a fraction of a scope's workers, then promote or roll back.

    c = start_canary(store, "fused_allreduce", "release=v7", fraction=0.1, actor="alice", reason="fix in v7.1")
    result = evaluate(store, c["id"])        # pending | promoted | rolled_back | cancelled

The cohort is the workers whose stable bucket (api/switchboard.py ``bucket``, salted by the switch's
name) is below ``fraction * 100``; a cohort rule turns the switch on for them only: it is the most
recent rule covering them, so it reaches exactly the cohort whatever older rules say (the
switchboard's precedence model), and the rest of the scope must be off by rules when it starts. Once both the cohort and the
rest of the scope have streamed ``min_sessions`` sessions (>= 1 s) since the start, the cohort is
compared with the rest by ``analytics.regressions.compare`` (the release detector's judges) plus a
memory judge (peak reserved memory per session, the August leak's symptom). Any regression rolls
the canary back (the cohort rule is withdrawn: off again everywhere); none promotes it (on for the
whole scope). A numeric switch (api/evaluation_gate.py) needs a passing evaluation for the scope's
GPU kinds and release to start, and again to be promoted (else it rolls back). The decision and its
evidence go to the audit table and a ``canary`` finding (the weekly report shows both). A switch turned off in the scope meanwhile cancels the canary.

    schedule(scheduler, store)               # evaluate running canaries every 10 minutes (api/app.py's
                                             # lifespan, for any role that runs the analytics scheduler)
"""

from __future__ import annotations

import math
import uuid
from datetime import UTC, datetime
from typing import Any

import orjson

from analytics import queries as aq
from api import evaluation_gate
from api.switchboard import (
    BUCKETS,
    SwitchError,
    bucket,
    canonical_scope,
    check_name,
    get_switchboard,
    parse_scope,
)

EVALUATE_EVERY_S = 600
JOB_ID = "canaries"
MEMORY_FLOOR = 0.05  # the cohort's median peak reserved memory may exceed the rest's by 5 %
_COLS = aq.CANARY_COLUMNS


class CanaryError(Exception):
    """A canary that cannot start or does not exist; ``status`` is the HTTP status to answer."""

    def __init__(self, message: str, status: int = 409):
        super().__init__(message)
        self.status = status


def _write(store, row: dict[str, Any]) -> None:
    row = {**row, "updated_at": datetime.now(UTC)}
    if not isinstance(row["evidence"], str):
        row["evidence"] = orjson.dumps(row["evidence"], default=str, option=orjson.OPT_SERIALIZE_NUMPY).decode()
    store.client().insert("canaries", [[row[c] for c in _COLS]], column_names=_COLS)


def get_canary(store, canary_id: str) -> dict[str, Any]:
    df = aq.canaries_frame(store, canary_id=canary_id, limit=1)
    if df.height == 0:
        raise CanaryError(f"no canary {canary_id!r} (list them at GET /v1/canaries)", 404)
    row = df.row(0, named=True)
    row["evidence"] = orjson.loads(row["evidence"] or "{}")
    return row


def list_canaries(store, status: str | None = None, limit: int = 100, offset: int = 0) -> list[dict[str, Any]]:
    df = aq.canaries_frame(store, status=status, limit=limit, offset=offset)
    out = []
    for r in df.iter_rows(named=True):
        r["evidence"] = orjson.loads(r["evidence"] or "{}")
        out.append(r)
    return out


def start_canary(store, name: str, scope: str | dict[str, str] | None, *, fraction: float, actor: str,
                 reason: str, min_sessions: int = 20, now: datetime | None = None) -> dict[str, Any]:
    check_name(name)
    scope_s = canonical_scope(scope)
    if "worker_id" in parse_scope(scope_s):
        raise SwitchError("a canary scope cannot name one worker_id: the cohort is a fraction of the scope's workers")
    hi = round(fraction * BUCKETS)
    if not (0 < fraction < 1) or not (1 <= hi < BUCKETS):
        raise SwitchError(f"fraction {fraction} must lie in [0.01, 0.99] (cohorts are {BUCKETS} buckets)")
    board = get_switchboard(store)
    try:  # a numeric switch: only with a passing evaluation for the scope's GPU kinds and release
        evaluated = evaluation_gate.require_for_scope(store, name, parse_scope(scope_s))
    except evaluation_gate.GateError as e:  # logged and audited as a refused PUT is
        evaluation_gate.refused(board, name, scope_s, True, actor, reason, str(e), source="canary")
        raise CanaryError(str(e), e.status) from e
    with board.lock:
        board.invalidate()
        state = board.effective(name, scope_s)
        if state is not False:  # on, or no rule (each worker runs its own value): nothing to re-enable
            raise CanaryError(f"{name} is {'already on' if state else 'not turned off by any rule'} in scope "
                              f"{scope_s or '(fleet)'}; a canary re-enables a switch that a rule turned off")
        odd = [r for r in board.exceptions(name, scope_s) if not r.cohort]
        if odd:  # the rest of the scope would not all be off: the comparison would be spoiled
            raise CanaryError(f"{name} is not off for every worker of {scope_s or '(fleet)'}: newer rules "
                              f"{', '.join(r.scope or '(fleet)' for r in odd)} give it another value; clear "
                              "them (or set the scope off again) before a canary")
        if any(c["name"] == name and c["scope"] == scope_s for c in list_canaries(store, "running")):
            raise CanaryError(f"a canary of {name} in scope {scope_s or '(fleet)'} is already running")
        cid = uuid.uuid4().hex[:12]
        started = now or datetime.now(UTC)
        row = {"id": cid, "name": name, "scope": scope_s, "fraction": hi / BUCKETS, "bucket_lo": 0, "bucket_hi": hi,
               "min_sessions": min_sessions, "status": "running", "started_at": started, "decided_at": None,
               "actor": actor, "reason": reason, "evidence": {"evaluations": evaluated} if evaluated else {}}
        _write(store, row)
        board.set_cohort(name, True, scope_s, f"canary={cid}", 0, hi, actor=actor, reason=reason, source="canary",
                         action="canary_start", evidence={"canary": cid, "fraction": hi / BUCKETS})
    return get_canary(store, cid)


def _cohorts(store, name: str, scope: dict[str, str], hi: int, start: datetime,
             end: datetime) -> tuple[list[str], list[str]]:
    """The scope's workers seen since ``start``, split into the canary's cohort (bucket salted by the
    switch's name, as the cohort rule matches) and the rest."""
    workers = aq.workers_seen(store, start, end, scope)
    cohort = [w for w in workers if bucket(w, name) < hi]
    return cohort, [w for w in workers if bucket(w, name) >= hi]


def _memory_judge(store, treatment: dict, control: dict, start: datetime, end: datetime, min_samples: int):
    from analytics.stats import judge_continuous
    from api.views import sessions_in

    def peaks(f: dict) -> list[float]:
        df = sessions_in(store, start, end)
        for k, v in f.items():
            df = df.filter(df[k].is_in(v if isinstance(v, list) else [v]))
        return [float(x) for x in df["mem_reserved_max"].to_list()] if df.height else []

    return judge_continuous("mem_reserved_max", peaks(treatment), peaks(control), floor=MEMORY_FLOOR,
                            min_samples=min_samples).as_dict()


def _finite(v: Any) -> Any:
    """Evidence as strict JSON: NaN/inf (a judge without samples) become null."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_finite(x) for x in v]
    return v


def evaluate(store, canary_id: str, now: datetime | None = None) -> dict[str, Any]:
    """Judge a running canary: pending (too few sessions), promoted, rolled back or cancelled."""
    from analytics.findings import finding, write_findings
    from analytics.regressions import CONTINUOUS, compare

    c = get_canary(store, canary_id)
    if c["status"] != "running":
        return {"id": canary_id, "status": c["status"], "decided": False, "evidence": c["evidence"]}
    board = get_switchboard(store)
    now = now or datetime.now(UTC)
    cohort_key = f"canary={canary_id}"
    with board.lock:
        board.invalidate()
        live = [r for r in board.rules() if r.name == c["name"] and r.scope == c["scope"] and r.cohort == cohort_key]
        if not live:
            c.update(status="cancelled", decided_at=now, evidence={"why": "the cohort rule was withdrawn (the switch "
                                                                          "was turned off in the scope meanwhile)"})
            _write(store, c)
            return {"id": canary_id, "status": "cancelled", "decided": True, "evidence": c["evidence"]}
    scope = parse_scope(c["scope"])
    start = c["started_at"]
    cohort, rest = _cohorts(store, c["name"], scope, c["bucket_hi"], start, now)
    base = {k: v for k, v in scope.items()}
    treatment, control = {**base, "worker_id": cohort}, {**base, "worker_id": rest}
    evidence: dict[str, Any] = {"cohort_workers": len(cohort), "rest_workers": len(rest), "window": [start, now]}
    verdicts: list[dict[str, Any]] = []
    if cohort and rest:
        verdicts = compare(store, treatment, control, start, now)
        per_session = [v for v in verdicts if v["metric"] in CONTINUOUS]  # n = sessions, not chunks
        n_t = max((v["n_treatment"] for v in per_session), default=0)
        n_c = max((v["n_control"] for v in per_session), default=0)
    else:
        n_t = n_c = 0
    evidence.update(sessions_cohort=n_t, sessions_rest=n_c, min_sessions=c["min_sessions"])
    # the judges' own minimum too (a metric nobody reports, e.g. energy without NVML, has no say)
    short = [v["metric"] for v in verdicts if not v.get("enough_samples") and (v["n_treatment"] or v["n_control"])]
    if min(n_t, n_c) < c["min_sessions"] or short:
        evidence["judges_short_of_samples"] = short
        return {"id": canary_id, "status": "running", "decided": False, "pending": True, "evidence": evidence}
    verdicts.append(_memory_judge(store, treatment, control, start, now, c["min_sessions"]))
    regressed = [v["metric"] for v in verdicts if v.get("regressed")]
    gate = evaluation_gate.blocking(store, c["name"], scope)  # its evaluation may have failed meanwhile
    if gate:
        regressed.append("evaluation")
        evidence.update(gate)
    evidence.update(verdicts=_finite(verdicts), regressed=regressed)
    reason = (f"canary {canary_id}: cohort regressed on {', '.join(regressed)}" if regressed
              else f"canary {canary_id}: no regression in {n_t} cohort vs {n_c} other sessions")
    with board.lock:
        if regressed:
            d = board.clear_cohort(c["name"], c["scope"], cohort_key, actor="canary", reason=reason, source="canary",
                                   action="canary_rollback", evidence=evidence)
            status = "rolled_back"
        else:
            d = board.set(c["name"], True, c["scope"], actor="canary", reason=reason, source="canary",
                          action="canary_promote", ref=canary_id, evidence=evidence)
            board.withdraw_cohort(c["name"], c["scope"], cohort_key, actor="canary", reason=reason)
            status = "promoted"
    c.update(status=status, decided_at=now, evidence=evidence)
    _write(store, c)
    worst = max((v for v in verdicts if v.get("regressed")), key=lambda v: v.get("effect") or 0, default=None)
    f = finding("canary", c["scope"] or {}, f"canary_{status}", start, now,
                value=1.0 if regressed else 0.0, effect=_finite(worst["effect"]) if worst else None,
                confidence=_finite(1 - worst["p_value"]) if worst else None,
                severity="warning" if regressed else "info", attribution=c["name"],
                evidence={"canary": canary_id, **evidence})
    f["status"] = "resolved"  # a decided canary needs no action: never re-posted as an alert
    write_findings(store, f"canary:{canary_id}", start, now, [f], now=now)
    return {"id": canary_id, "status": status, "decided": True, "decision": d.to_dict(), "evidence": evidence}


def evaluate_running(store, now: datetime | None = None) -> list[dict[str, Any]]:
    """Evaluate every running canary (a scheduler job calls this)."""
    return [evaluate(store, c["id"], now) for c in list_canaries(store, "running", limit=1000)]


def schedule(scheduler, store) -> None:
    """Add the job that evaluates running canaries every ``EVALUATE_EVERY_S`` to an APScheduler
    scheduler (id ``JOB_ID``; adding it again replaces it, never a second job)."""
    scheduler.add_job(evaluate_running, "interval", seconds=EVALUATE_EVERY_S, args=[store], id=JOB_ID,
                      replace_existing=True, max_instances=1, coalesce=True)
