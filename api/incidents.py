"""Incidents: findings grouped by root cause, each with one lifecycle, one action and few notifications.

    handoff = install(settings, store)        # the scheduler hands every job's findings here (api/app.py)
    report = sync(store, now=..., notifier=...)   # recompute from the open findings, act, notify
    rows = list_incidents(store, state="mitigated")

Grouping (Alertmanager's ``group_by``): an incident is one cause over its whole life, keyed ``kind | release``
(``cause_key``): a release's regression on every GPU kind, its per-process memory findings and their roll-up,
and the switch the analytics blame for it (a day later, say) are one incident; a finding without a release
(a power cap on a GPU kind, a change point) is keyed by its kind and scope without ``worker_id``. The
incident's scope (where it acts) is its findings' common scope: the release, and the GPU kind when all of
its evidence is on one; its switch is the one most of its findings blame ('' when none explains it). A change
point on a GPU kind where a regression incident of a release is open, the release first seen on or before
the change's day, is explained by that release gaining share: it is evidence of that incident, not a new one
(two such releases first seen the same day: no explanation, never list order); so is one whose evidence names
that release as the one gaining share on its kind, though the regression was judged on other kinds only; one
with no such release joins the open power incident of its kind (the clocks fell, the step time followed), else
the open drift incident with a drift that began on or before it, of its metric or another on its kind, or of
its metric on another kind (a trend that crossed the change-point threshold: the same cause, not a second
incident). A drift of a release with an open
regression incident joins it; one on a GPU kind with an open power incident joins that (a step in the series
reads as a trend over the drift's window).

A cause keeps its incident when the finding that keyed it leaves while the evidence it gathered stays
(``continued``: a power cap's change point and drift outlive the power detector's "change", which a few days
of cap make the baseline).

Lifecycle: ``opened`` (first evidence) -> ``escalated`` (severity rose, or new evidence after the switch
rule was lifted) -> ``mitigated`` (its switch rule is in force: off for every worker of the scope) ->
``resolved`` (no evidence left for ``RESOLVE_AFTER``: a daily detector that misses a slow cause one day does
not resolve and reopen it) -> ``reopened`` (evidence again). An operator lifting the rule while
evidence remains (a manual re-enable supersedes the incident's rule) puts a mitigated incident back to
``opened`` (event ``rule_lifted``); evidence that starts after the lift escalates it and acts again. An
incident without a switch is never mitigated: it alerts and flips nothing ("no switch explains it").

One action per incident, at the incident's scope: a critical incident with a switch turns it off once
(``source="incident"``: an automatic rule, so a later manual re-enable supersedes it, see
api/switchboard.py). Per-process evidence never writes a rule of its own. New evidence after an operator
lifted the rule, and that started after the lift, acts once more (the re-enable brought the problem back).

Notifications (Alertmanager's ``group_wait`` and ``repeat_interval``): one per incident per hand-off, and
only when its state changed (a hand-off that opens and mitigates an incident sends one notification with
the final state: the job's batch is the group wait), or, while it is not resolved, once a day (``repeat_s``:
the daily digest). They go, signed like any delivery (api/alerts.py ``sign``), to the
external receivers ``LIVESTEP_WEBHOOK_URLS`` (none set: recorded in ``incident_log`` only). Nothing is
posted to this server's own ``/v1/alerts``: the hand-off is a function call.

Every state change, flip and notification is a row of ``incident_log`` (sql/031_incidents.sql).
Over 450 lines: the incident lifecycle (grouping, state, action, notification) is one state machine over
one table under one lock.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson

from analytics import queries as aq
from analytics.describe import describe
from analytics.findings import INCIDENT_KINDS
from api.notify import Notifier
from api.switchboard import canonical_scope, get_switchboard, parse_scope

log = logging.getLogger("livestep.incidents")

KINDS: tuple[str, ...] = INCIDENT_KINDS  # analytics/findings.py: the kinds whose findings open incidents
# kinds that join the incident of the cause that explains them (a change point, a drift) before their own
JOINING_KINDS = frozenset({"changepoint", "drift"})
STATES: tuple[str, ...] = ("opened", "escalated", "mitigated", "resolved", "reopened")
OPEN_STATES = frozenset(STATES) - {"resolved"}
SEVERITY_RANK = {"info": 0, "warning": 1, "critical": 2}
DEFAULT_REPEAT_S = 86400.0  # one daily digest of an incident still open (Alertmanager's repeat_interval)
# an incident whose evidence is gone stays open this long before it resolves (Alertmanager's resolve_timeout):
# a detector that finds a slow cause on one day and not the next must not resolve and reopen it each time
RESOLVE_AFTER = timedelta(hours=48)  # two missed daily runs (the server's LIVESTEP_INCIDENT_RESOLVE_AFTER_S)
EVIDENCE_STAMP = timedelta(hours=1)  # how stale the stored time of an incident's last evidence may get
NOTIFICATION_VERSION = "livestep-incident/1"
_COLS = aq.INCIDENT_COLUMNS
_locks: dict[int, threading.Lock] = {}
_locks_guard = threading.Lock()


def _lock(store) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(id(store), threading.Lock())


def incident_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def _utc(t: Any) -> datetime:
    if isinstance(t, str):
        t = datetime.fromisoformat(t)
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)


def finding_key(f: dict[str, Any]) -> str:
    return f"{f['kind']}|{f['scope']}|{f['metric']}|{_utc(f['window_start']).isoformat()}"


def root_cause(f: dict[str, Any]) -> tuple[str, str, str]:
    """(kind, scope without worker_id, switch) of a finding."""
    scope = {k: v for k, v in parse_scope(f["scope"] or "").items() if k != "worker_id"}
    return f["kind"], canonical_scope(scope), f.get("attribution") or ""


def cause_key(f: dict[str, Any]) -> str:
    """The incident a finding belongs to over the cause's whole life: its kind and release (a release's
    regression on every GPU kind, and the switch blamed for it days later, are one cause), or, for a
    finding without a release (a change point, a power cap), its kind and scope without worker."""
    kind, scope, _ = root_cause(f)
    release = parse_scope(scope).get("release")
    return f"{kind}|release={release}" if release else f"{kind}|{scope}"


@dataclass
class Group:
    kind: str
    cause: str
    findings: list[dict[str, Any]] = field(default_factory=list)

    @property
    def key(self) -> str:
        return self.cause

    @property
    def scope(self) -> str:
        """Where the incident acts: the release (and the GPU kind when all its evidence is on one), or, for
        a cause without a release, its findings' common scope."""
        own = [f for f in self.findings if cause_key(f) == self.cause] or self.findings  # not the joined ones
        scopes = [parse_scope(root_cause(f)[1]) for f in own]
        common = {k: v for k, v in scopes[0].items() if all(sc.get(k) == v for sc in scopes[1:])}
        return canonical_scope(common)

    @property
    def gpu_kinds(self) -> set[str]:
        return {k for f in self.findings if (k := parse_scope(f["scope"] or "").get("gpu_kind"))}

    @property
    def switch(self) -> str:
        """The switch its findings blame: the one most of them name (the most severe first), '' if none."""
        named = [f.get("attribution") for f in sorted(self.findings, key=lambda f: -SEVERITY_RANK.get(f["severity"], 0))
                 if f.get("attribution")]
        return max(dict.fromkeys(named), key=named.count) if named else ""

    @property
    def severity(self) -> str:
        return max((f["severity"] for f in self.findings), key=lambda s: SEVERITY_RANK.get(s, 0), default="info")

    def summary(self) -> str:
        """The roll-up's sentence (the finding without a worker), else the most severe one's; and the count."""
        lead = min(self.findings, key=lambda f: ("worker_id=" in f["scope"], -SEVERITY_RANK.get(f["severity"], 0),
                                                 finding_key(f)))
        who = f"switch {self.switch}" if self.switch else "no switch explains it"
        kinds = f"; on {', '.join(sorted(self.gpu_kinds))}" if len(self.gpu_kinds) > 1 else ""
        return f"{describe(lead)} [{who}; {len(self.findings)} finding(s){kinds}]"[:1000]


def group_findings(findings: list[dict[str, Any]]) -> list[Group]:
    """Open warning/critical findings of the incident kinds, grouped by cause (module docstring)."""
    groups: dict[str, Group] = {}
    later = []
    for f in findings:
        if f["kind"] not in KINDS or f.get("status", "open") != "open" or SEVERITY_RANK.get(f["severity"], 0) < 1:
            continue
        if f["kind"] in JOINING_KINDS:
            later.append(f)
            continue
        key = cause_key(f)
        groups.setdefault(key, Group(f["kind"], key)).findings.append(f)
    regressions = [g for g in groups.values() if g.kind == "regression"]
    for f in sorted(later, key=lambda f: f["kind"] != "drift"):  # drift first: a change point may follow it
        if f["kind"] == "drift":
            rel = parse_scope(f["scope"] or "").get("release")
            # the same release's regression: the same cause; else its GPU kind's power cap (a step in the
            # series reads as a trend over the drift's window: the clocks fell, the step time followed)
            home = groups.get(f"regression|release={rel}") or _explaining_power(f, groups)
        else:
            home = (_explaining_regression(f, regressions) or _explaining_power(f, groups)
                    or _explaining_drift(f, groups))
        if home is None:
            key = cause_key(f)
            home = groups.setdefault(key, Group(f["kind"], key))
        home.findings.append(f)
    return sorted(groups.values(), key=lambda g: g.key)


def _explaining_power(cp: dict[str, Any], groups: dict[str, Group]) -> Group | None:
    """The open power incident of the change point's GPU kind (its clocks fell: the step time follows)."""
    gpu = parse_scope(cp["scope"] or "").get("gpu_kind")
    return groups.get(f"power|gpu_kind={gpu}") if gpu else None


def _explaining_drift(cp: dict[str, Any], groups: dict[str, Group]) -> Group | None:
    """The open drift incident that explains the change point: a trend that crossed Otava's threshold reads
    as a step, the same cause. Its drift began on or before the change's day and is, in this order of
    preference, of the change point's metric on its GPU kind; of another daily metric on its kind (a late-chunk
    rate steps as the step time drifts); of its metric on another kind (the drift job runs after the change
    points: a kind's own drift may be found a run later than its step). The latest-begun such incident of the
    first tier that has one; None when two tie."""
    gpu = parse_scope(cp["scope"] or "").get("gpu_kind")
    day = _utc(cp["window_start"])
    tiers: list[list[tuple[datetime, Group]]] = [[], [], []]
    for g in groups.values():
        if g.kind != "drift":
            continue
        drifts = [f for f in g.findings if f["kind"] == "drift" and _utc(f["window_start"]) <= day]
        here = [f for f in drifts if parse_scope(f["scope"] or "").get("gpu_kind", gpu) == gpu]
        for tier, mine in enumerate(([f for f in here if f["metric"] == cp["metric"]], here,
                                     [f for f in drifts if f["metric"] == cp["metric"]])):
            if mine:
                tiers[tier].append((min(_utc(f["window_start"]) for f in mine), g))
                break
    return _latest(next((t for t in tiers if t), []))


def _latest(best: list[tuple[datetime, Group]]) -> Group | None:
    """The group of the latest time; None when none or when two groups share it (never list order)."""
    if not best:
        return None
    latest = max(t for t, _ in best)
    top = {g.key: g for t, g in best if t == latest}
    return next(iter(top.values())) if len(top) == 1 else None


def _gaining(cp: dict[str, Any]) -> str:
    """The release the change point's evidence says gained share across the change ('' if none)."""
    ev = cp.get("evidence") or "{}"
    try:
        ev = orjson.loads(ev) if isinstance(ev, (str, bytes)) else ev
    except orjson.JSONDecodeError:
        return ""
    return str(ev.get("release_gaining") or "") if isinstance(ev, dict) else ""


def _explaining_regression(cp: dict[str, Any], regressions: list[Group]) -> Group | None:
    """The open regression incident whose release was first seen latest on or before the change's day, among
    those on the change point's GPU kind and those of the release the change point says gained share there
    (a cause blamed on a switch some workers of each kind run may be judged on one kind and step another's
    daily series); None when none or when two tie."""
    gpu = parse_scope(cp["scope"] or "").get("gpu_kind")
    day = _utc(cp["window_start"])
    gaining = _gaining(cp)
    best: list[tuple[datetime, Group]] = []
    for g in regressions:
        same_kind = gpu is not None and (not g.gpu_kinds or gpu in g.gpu_kinds)
        if not same_kind and not (gaining and parse_scope(g.scope).get("release") == gaining):
            continue
        first = min(_utc(f["window_start"]) for f in g.findings)
        if first <= day + timedelta(days=1):
            best.append((first, g))
    return _latest(best)


def continued(groups: dict[str, Group], known: dict[str, dict[str, Any]]) -> dict[str, Group]:
    """A cause keeps its incident when the finding that keyed it is gone but the evidence it gathered is not:
    a group with no open incident of its own, whose findings were evidence of exactly one open incident that
    has no group now, continues that incident (a power cap's change is no longer new to the power detector a
    few days on, while the change points and the drift it explained remain: one incident, not a second)."""
    owner: dict[str, str] = {}
    for key, inc in known.items():
        if inc["state"] != "resolved" and key not in groups:
            owner.update(dict.fromkeys(inc["evidence_keys"], key))
    out: dict[str, Group] = {}
    for key, g in groups.items():
        inc = known.get(key)
        heirs = {owner[k] for f in g.findings if (k := finding_key(f)) in owner}
        if (inc is None or inc["state"] == "resolved") and len(heirs) == 1 and (old := heirs.pop()) not in out:
            out[old] = Group(g.kind, old, g.findings)
        else:
            out[key] = g
    return out


# -- storage -------------------------------------------------------------------------------------------

def _open_findings(store) -> list[dict[str, Any]]:
    df = aq.open_findings(store, KINDS)
    return list(df.iter_rows(named=True))


def _load(store) -> dict[str, dict[str, Any]]:
    df = aq.incidents_frame(store)
    out = {}
    for r in df.iter_rows(named=True):
        r["evidence_keys"] = orjson.loads(r["evidence_keys"] or "[]")
        r["evidence"] = orjson.loads(r["evidence"] or "[]")
        out[r["key"]] = r
    return out


_last_version = [0]


def _version() -> int:
    v = max(time.time_ns() // 1000, _last_version[0] + 1)
    _last_version[0] = v
    return v


def _write(store, rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    data = []
    for r in rows:
        r["version"] = _version()
        data.append([orjson.dumps(r[c], default=str).decode() if c in ("evidence_keys", "evidence") else r[c]
                     for c in _COLS])
    store.client().insert("incidents", data, column_names=_COLS)


def _log(store, entries: list[tuple[datetime, str, str, str, dict[str, Any]]]) -> None:
    if entries:
        store.client().insert("incident_log", [[ts, i, ev, st, orjson.dumps(d, default=str).decode()]
                                               for ts, i, ev, st, d in entries],
                              column_names=["ts", "incident_id", "event", "state", "detail"])


def list_incidents(store, state: str | None = None, kind: str | None = None, limit: int = 100,
                   offset: int = 0) -> list[dict[str, Any]]:
    """Incidents, not resolved first, then newest first; ``state`` 'open' = every state but resolved."""
    df = aq.incidents_frame(store, state=state, kind=kind, limit=limit, offset=offset)
    out = []
    for r in df.iter_rows(named=True):
        r["evidence_keys"] = orjson.loads(r["evidence_keys"] or "[]")
        r["evidence"] = orjson.loads(r["evidence"] or "[]")
        out.append(_public(r))
    return out


def incident_log(store, incident: str | None = None, start: datetime | None = None,
                 end: datetime | None = None, limit: int = 1000) -> list[dict[str, Any]]:
    df = aq.incident_log_frame(store, incident, start, end, limit)
    return [{**r, "ts": r["ts"].isoformat(), "detail": orjson.loads(r["detail"] or "{}")}
            for r in df.iter_rows(named=True)]


def flip_cost(store, inc: dict[str, Any], now: datetime | None = None, limit: int = 50) -> dict[str, Any]:
    """What the incident's flip cost the live sessions: the workers' ``flip_cost`` events (collector/flip_fields.py)
    that turned its switch off in its scope since it opened, summed (late chunks and stall after each flip, the
    slowest poll -> new configuration, time out of service), with the newest ``limit`` flips. Nothing without a
    switch."""
    from analytics import queries  # the read layer (SQL lives there)

    out: dict[str, Any] = {"flips": 0, "workers": 0, "late_chunks": 0, "stall_ms": 0.0, "max_stall_ms": None,
                           "max_to_new_config_ms": None, "out_of_service_ms": 0.0, "recent": []}
    if not inc.get("switch"):
        return out
    start = _utc(inc["opened_at"])
    end = (now or datetime.now(UTC)) + timedelta(minutes=1)
    filters = {k: inc[k] for k in ("release", "gpu_kind") if inc.get(k)}
    df = queries.flip_costs(store, start, end, switch=inc["switch"], filters=filters)
    rows = [r for r in df.iter_rows(named=True) if r["value"] is False or r["value"] == 0]
    if not rows:
        return out
    stalls = [r["stall_ms"] for r in rows]
    to_new = [r["to_new_config_ms"] for r in rows if r["to_new_config_ms"] is not None]
    out.update(flips=len(rows), workers=len({r["worker_id"] for r in rows}),
               late_chunks=sum(r["late_chunks"] for r in rows), stall_ms=sum(stalls), max_stall_ms=max(stalls),
               max_to_new_config_ms=max(to_new) if to_new else None,
               out_of_service_ms=sum(r["out_of_service_ms"] or 0.0 for r in rows),
               recent=[{**{k: r[k] for k in ("worker_id", "session_id", "mode", "step", "applied_step", "late_chunks",
                                                "stall_ms", "to_new_config_ms", "out_of_service_ms", "error")},
                        "ts": _utc(r["ts"]).isoformat()} for r in rows[:limit]])
    return out


def flip_cost_brief(c: dict[str, Any]) -> str:
    """One line of ``flip_cost`` for the incidents page."""
    if not c["flips"]:
        return "no flip reported yet"
    worst = "" if c["max_to_new_config_ms"] is None else f", slowest poll -> new config {c['max_to_new_config_ms']:.0f} ms"
    return (f"{c['flips']} flips on {c['workers']} workers: {c['late_chunks']} late chunks, stall "
            f"{c['stall_ms']:.0f} ms{worst}, out of service {c['out_of_service_ms']:.0f} ms")


def _public(r: dict[str, Any]) -> dict[str, Any]:
    out = {k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in r.items() if k != "version"}
    out["evidence_count"] = len(r["evidence_keys"])
    return out


# -- the sync: findings -> incidents -> action -> notification ------------------------------------------

@dataclass
class SyncReport:
    """What one hand-off did: incidents whose state changed, flips, notifications sent (or recorded)."""

    changed: list[dict[str, Any]] = field(default_factory=list)
    flips: list[dict[str, Any]] = field(default_factory=list)
    notifications: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"changed": self.changed, "flips": self.flips, "notifications": self.notifications}


def _brief(f: dict[str, Any]) -> dict[str, Any]:
    return {"kind": f["kind"], "scope": f["scope"], "metric": f["metric"],
            "window_start": _utc(f["window_start"]).isoformat(), "severity": f["severity"],
            "attribution": f.get("attribution") or "", "value": f.get("value"), "summary": describe(f)[:300]}


def _in_force(board, switch: str, scope: str) -> bool:
    """The incident's rule is in force: the switch is off for every worker of its scope."""
    return board.effective(switch, scope) is False and not board.exceptions(switch, scope)


def sync(store, *, now: datetime | None = None, notifier: Notifier | None = None,
         repeat_s: float = DEFAULT_REPEAT_S, resolve_after: timedelta = RESOLVE_AFTER) -> SyncReport:
    """Recompute incidents from the open findings, act once per incident, notify on change or repeat.

    Idempotent: a second call with nothing new changes nothing, flips nothing and (within ``repeat_s``)
    notifies nothing."""
    now = _utc(now or datetime.now(UTC))
    rep = SyncReport()
    with _lock(store):
        board = get_switchboard(store)
        known = _load(store)
        groups = continued({g.key: g for g in group_findings(_open_findings(store))}, known)
        writes: list[dict[str, Any]] = []
        logs: list[tuple[datetime, str, str, str, dict[str, Any]]] = []
        for key in sorted(set(groups) | set(known)):
            g, inc = groups.get(key), known.get(key)
            if g is None and (inc is None or inc["state"] == "resolved"):
                continue
            before = inc["state"] if inc else None
            # what is stored, before ``inc`` (the same dict) is updated: new evidence must be told apart from it
            stored = None if inc is None else {"keys": list(inc["evidence_keys"]),
                                               "at": inc.get("evidence_at") or inc["updated_at"]}
            events: list[str] = []
            if g is None:  # no evidence left: resolved once it has stayed away ``resolve_after``
                last = inc.get("evidence_at") or inc["updated_at"]
                if now - _utc(last) < resolve_after:
                    continue
                inc.update(state="resolved", resolved_at=now, evidence_keys=[], evidence=[])
                events.append("resolved")
            else:
                keys = sorted(finding_key(f) for f in g.findings)
                if inc is None:
                    inc = {"id": incident_id(key), "key": key, "kind": g.kind, "scope": g.scope,
                           "release": parse_scope(g.scope).get("release", ""),
                           "gpu_kind": parse_scope(g.scope).get("gpu_kind", ""), "switch": g.switch,
                           "evidence_at": now,
                           "state": "opened", "severity": g.severity, "opened_at": now, "mitigated_at": None,
                           "resolved_at": None, "lifted_at": None, "notified_at": None, "notifications": 0,
                           "flips": 0, "acted": False, "evidence_keys": []}
                    events.append("opened")
                elif inc["state"] == "resolved":
                    inc.update(state="reopened", resolved_at=None, mitigated_at=None, lifted_at=None, acted=False)
                    events.append("reopened")
                if SEVERITY_RANK[g.severity] > SEVERITY_RANK.get(inc["severity"], 0) and before is not None:
                    inc["state"] = "escalated"
                    events.append("escalated")
                inc.update(severity=g.severity, summary=g.summary(), evidence_keys=keys, evidence_at=now,
                           evidence=[_brief(f) for f in sorted(g.findings, key=finding_key)][:50])
                if not inc["acted"]:  # until it acts, the cause's scope and switch follow its evidence (blame
                    # that arrives later joins it); the decision made keeps the scope and switch it was made at
                    inc.update(scope=g.scope, switch=g.switch, release=parse_scope(g.scope).get("release", ""),
                               gpu_kind=parse_scope(g.scope).get("gpu_kind", ""))
                switch, scope = inc["switch"], inc["scope"]
                if switch:
                    in_force = _in_force(board, switch, scope)
                    if inc["acted"] and not in_force and inc["state"] == "mitigated":
                        inc.update(state="opened", mitigated_at=None, lifted_at=now)  # an operator re-enabled it
                        events.append("rule_lifted")
                    lifted = inc.get("lifted_at")
                    if (inc["acted"] and not in_force and lifted is not None
                            and any(_utc(f["window_start"]) > _utc(lifted) for f in g.findings)):
                        inc.update(acted=False, state="escalated", lifted_at=None)  # it came back after the lift
                        events.append("escalated")
                    if g.severity == "critical" and not inc["acted"]:
                        d = board.set(switch, False, scope, actor=f"incident:{inc['id']}", reason=inc["summary"],
                                      source="incident", ref=inc["id"],
                                      evidence={"incident": inc["id"], "key": key, "findings": len(keys)})
                        inc["acted"] = True
                        if d.changed:
                            inc["flips"] += 1
                            rep.flips.append({"incident": inc["id"], **d.to_dict()})
                            logs.append((now, inc["id"], "flip", inc["state"], {"switch": switch, "scope": scope,
                                                                                "version": d.version}))
                        in_force = _in_force(board, switch, scope)
                    if in_force and inc["acted"] and inc["state"] != "mitigated":
                        inc.update(state="mitigated", mitigated_at=inc["mitigated_at"] or now)
                        events.append("mitigated")
            changed = bool(events)
            due = (not changed and inc["state"] != "resolved" and inc["notified_at"] is not None
                   and (now - _utc(inc["notified_at"])).total_seconds() >= repeat_s)
            if not changed and not due:
                if g is not None and (stored is None or inc["evidence_keys"] != stored["keys"]
                                      or now - _utc(stored["at"]) >= EVIDENCE_STAMP):
                    writes.append(inc)  # new evidence (or its hourly stamp) of an unchanged incident: nobody notified
                continue
            inc["updated_at"] = now
            for ev in events:
                logs.append((now, inc["id"], ev, inc["state"], {"from": before, "severity": inc["severity"]}))
            if changed:
                rep.changed.append({"id": inc["id"], "key": key, "from": before, "to": inc["state"],
                                    "events": events})
            sent = _notify(notifier, inc, before, events, repeat=due)
            inc["notified_at"] = now
            inc["notifications"] += 1
            rep.notifications.append(sent)
            logs.append((now, inc["id"], "repeat" if due else "notified", inc["state"], sent))
            writes.append(inc)
        _write(store, writes)
        _log(store, logs)
    return rep


def _notify(notifier: Notifier | None, inc: dict[str, Any], before: str | None, events: list[str],
            repeat: bool) -> dict[str, Any]:
    body = {"version": NOTIFICATION_VERSION, "status": "resolved" if inc["state"] == "resolved" else "firing",
            "transition": {"from": before, "to": inc["state"], "events": events, "repeat": repeat},
            "incident": _public({**inc, "version": 0})}
    if notifier is None or not notifier.urls:
        return {"incident": inc["id"], "state": inc["state"], "delivered": [], "receivers": 0}
    return {"incident": inc["id"], "state": inc["state"], "receivers": len(notifier.urls),
            "delivered": notifier.post(orjson.dumps(body, default=str))}


@dataclass
class Handoff:
    """The scheduler's findings listener: every job's findings go to ``sync`` in this process."""

    store: Any
    notifier: Notifier | None
    repeat_s: float = DEFAULT_REPEAT_S
    resolve_after: timedelta = RESOLVE_AFTER
    reports: list[SyncReport] = field(default_factory=list)

    def __call__(self, rows: list[dict[str, Any]]) -> None:
        try:
            self.reports.append(sync(self.store, notifier=self.notifier, repeat_s=self.repeat_s,
                                     resolve_after=self.resolve_after))
            del self.reports[:-20]
        except Exception:  # an incident failure never breaks the job that wrote the findings
            log.exception("incident hand-off failed")


def install(settings, store) -> Handoff | None:
    """Register the hand-off with analytics.jobs (None when the analytics are not importable)."""
    try:
        from analytics.jobs import add_findings_listener
    except ImportError as e:
        log.info("findings are not handed to incidents: analytics.jobs unavailable (%s)", e)
        return None
    urls = settings.webhook_url_list
    h = Handoff(store, Notifier(urls, settings.webhook_secret or "") if urls else None, settings.incident_repeat_s,
                timedelta(seconds=settings.incident_resolve_after_s))
    add_findings_listener(h)
    return h


def uninstall(h: Handoff | None) -> None:
    if h is None:
        return
    try:
        from analytics.jobs import remove_findings_listener
    except ImportError:
        return
    remove_findings_listener(h)


def install_evaluation() -> None:
    """Register ``sync`` with ``livestep evaluate-detectors`` (analytics/holdout_eval.py ``set_incident_sync``),
    so its hold-out fleets are replayed through the service's own grouping, actions and notifications (the
    analytics never import the api)."""
    from analytics import holdout_eval

    holdout_eval.set_incident_sync(sync)
