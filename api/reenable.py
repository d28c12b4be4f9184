"""Re-enabling a switch after a flip: back on for the workers the flip turned off, and nobody else.

    out = reenable(store, "cuda_graphs", "release=v2", actor="op", reason="fixed in v2.1")
    out["reenabled"]        # ['hw00', 'hw10', 'hw20']: the workers that ran it when it was turned off

A flip (an incident's, an alert's or an operator's "off" at a scope) covers every worker of its scope, the
workers that never ran the switch included: a cause seen on every GPU kind is one decision at the release's
scope, though only one worker of each kind ran the switch. Turning that scope back on with one rule (``PUT
/v1/switches/{name}`` with ``value: true``, which reaches every worker of its scope) would turn the switch on
for workers that never ran it. ``POST /v1/switches/{name}/reenable`` (api/routes/switches.py) instead:

1. finds the flips of scope S: the active "off" rules of the switch inside S, and the most recent rule
   covering all of S when it is off (``Switchboard`` rules; cohort rules are canaries, not flips);
2. finds the workers they changed: each worker of S whose latest session that started in ``LOOKBACK`` before
   the flip covering it ran the switch (the session's final switch state), and each worker whose
   ``flip_cost`` events since then report that a flip turned it off (the worker's own account);
3. turns it on for each of them (a manual rule at S plus its ``worker_id``, audited as any write), then lifts
   the flips inside S (their rules cleared): S's other workers keep the value they have, which the flip did
   not change. A flip broader than S (the whole fleet off) stays: S's other workers remain off by it.

The incident whose rule it was sees its rule lifted (api/incidents.py ``rule_lifted``) as after any manual
re-enable. A numeric switch turned on needs the evaluation gate's evidence for S, as any write turning it on.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from analytics import queries
from api.switchboard import aware, canonical_scope, check_name, covers, get_switchboard, parse_scope
from collector.records import decode_switches

LOOKBACK = timedelta(days=7)  # a worker's latest session before the flip, this far back at most


class ReenableError(Exception):
    """Nothing to re-enable in the scope (no flip turned the switch off there)."""


def flips(board, name: str, scope: dict[str, str]) -> list:
    """The active, non-cohort "off" rules of ``name`` that decide workers of ``scope``: inside it, and the
    most recent rule covering all of it when that one is off."""
    rules = [r for r in board.rules() if r.name == name and not r.cohort]
    inside = [r for r in rules if not r.value and covers(scope, r.scope_dict)]
    outer = max((r for r in rules if covers(r.scope_dict, scope)), key=lambda r: r.version, default=None)
    if outer is not None and not outer.value and outer not in inside:
        inside.append(outer)
    return sorted(inside, key=lambda r: r.version)


def changed_workers(store, name: str, scope: dict[str, str], off: list, now: datetime) -> dict[str, str]:
    """worker_id -> how we know the flips ``off`` turned ``name`` off for it (module docstring, step 2)."""
    since = min(aware(r.updated_at) for r in off)
    out: dict[str, str] = {}
    s = queries.session_frame(store, since - LOOKBACK, now + timedelta(minutes=1), filters=scope or None)
    latest: dict[str, dict] = {}
    for row in s.sort("start_ts").iter_rows(named=True):
        labels = {k: row[k] for k in ("worker_id", "release", "gpu_kind")}
        mine = [r for r in off if covers(r.scope_dict, labels)]
        if mine and aware(row["start_ts"]) < min(aware(r.updated_at) for r in mine):
            latest[row["worker_id"]] = row
    for w, row in latest.items():
        if name in decode_switches(row["switch_state"] or ""):
            out[w] = f"its latest session before the flip ({row['session_id']}) ran {name}"
    costs = queries.flip_costs(store, since, now + timedelta(minutes=1), switch=name, filters=scope or None)
    for row in costs.iter_rows(named=True):
        if row["value"] in (False, 0) and row["worker_id"] not in out:
            out[row["worker_id"]] = f"its flip_cost event of session {row['session_id']} reports {name} turned off"
    return dict(sorted(out.items()))


def reenable(store, name: str, scope: str | dict[str, str] | None, *, actor: str, reason: str,
             now: datetime | None = None) -> dict[str, Any]:
    """Turn ``name`` back on for the workers of ``scope`` its flips turned off; lift the flips inside
    ``scope`` for the rest (module docstring). Raises ``ReenableError`` when no flip turned it off there."""
    check_name(name)
    scope_s = canonical_scope(scope)
    want = parse_scope(scope_s)
    board = get_switchboard(store)
    now = now or datetime.now(UTC)
    with board.lock:
        board.invalidate()
        off = flips(board, name, want)
        if not off:
            raise ReenableError(f"{name} is not turned off by any rule in scope {scope_s or '(fleet)'}: nothing to "
                                "re-enable (GET /v1/switches/rules lists the rules)")
        workers = changed_workers(store, name, want, off, now)
        evidence = {"reenable": scope_s or "(fleet)", "flips": [f"{r.scope or '(fleet)'} v{r.version} ({r.source})"
                                                               for r in off]}
        decisions = [board.set(name, True, {**want, "worker_id": w}, actor=actor, reason=reason, source="api",
                               evidence={**evidence, "why_this_worker": why}).to_dict()
                     for w, why in workers.items()]
        lifted = [r for r in off if covers(want, r.scope_dict)]
        decisions += [board.clear(name, r.scope, actor=actor, reason=reason).to_dict() for r in lifted]
    kept = [r for r in off if r not in lifted]
    return {"switch": name, "scope": scope_s, "reenabled": list(workers), "why": workers,
            "lifted": [r.scope or "(fleet)" for r in lifted], "still_off_by": [r.scope or "(fleet)" for r in kept],
            "decisions": decisions}
