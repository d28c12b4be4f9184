"""Switch state: rules per scope and cohort, how a worker's switches resolve, and the audit trail.

    board = get_switchboard(store)
    board.resolve(worker_id="w3", release="v7", gpu_kind="h200")   # ({"fused_allreduce": False}, version)
    board.explain(worker_id="w3", release="v7", gpu_kind="h200")   # per switch: the deciding rule and why
    board.set("fused_allreduce", False, scope="release=v7", actor="alice", reason="leak")  # -> Decision

A rule sets one switch for a scope (canonical 'key=value,...' over gpu_kind/release/worker_id,
'' = the whole fleet), optionally only for a cohort of workers (a canary: stable bucket
``bucket(worker_id, salt=<switch>)`` in [lo, hi); the hash is salted per switch, so a 10 % canary of
one switch does not land on the workers of another's).

The precedence model (docs: README "Control plane and alerts"; tests: tests/api/test_rule_precedence.py):

1. **The most recent decision covering a worker wins.** A rule covers a worker when every key of its
   scope equals the worker's label and, for a cohort rule, the worker's bucket lies in the cohort.
   Among the active rules of a switch that cover a worker, the one with the highest version (written
   last) decides. Specificity does not matter: a release-wide re-enable written after older
   worker-scoped rules reaches every worker of the release; a worker-scoped override written after a
   fleet-wide rule applies to that worker.
2. **A broader manual decision supersedes the narrower automatic rules it covers.** A manual write
   (``source="api"``) at scope S withdraws every active automatic rule (alert, incident, canary) of that
   switch whose scope lies strictly inside S, so clearing S's rule later never brings stale automatic
   rules back. Narrower manual rules are left in place (by rule 1 they are overridden while S's rule is
   newer, and come back if it is cleared).
3. **Any write at scope S ends the canaries of that switch inside S** (their cohort rules are
   withdrawn; api/canary.py then reports the canary cancelled): a decision for the whole scope ends the
   experiment.
4. **A numeric switch turned on reaches only GPU kinds with evidence.** A rule turning a switch of
   ``NUMERIC_SWITCHES`` on covers a worker only when the evaluation gate holds a passing evaluation that
   counts for the worker's GPU kind and release (api/evaluation_gate.py ``evidenced``, read at the poll):
   a kind that joined after the write was never checked by it. Otherwise the next most recent covering
   rule decides (a fleet "off" stays off for it), or none does.
5. A switch no rule covers is *undecided*: it is left out of ``resolve`` and the worker keeps the value
   it started with (a worker reproducing the leak with buffer_per_shape on keeps it; a plain worker
   stays plain). Clearing a scope's own rule lets the next most recent covering rule decide again.

A write that would change no worker of its scope (the most recent rule covering the whole scope
already gives that value and no newer rule inside the scope differs) is recorded as a no-op decision.
Every decision goes to ``switch_audit``. One lock per store serialises writes in this process (chDB is
one process), so versions are strictly increasing.

Resolution, writes, the audit trail and the cached snapshot stay here, one state machine (a write
invalidates the snapshot a resolve reads, under one lock); what they read apart: scopes, names and cohort
buckets (api/switch_scopes.py) and the two records, ``Rule`` and ``Decision`` (api/switch_rules.py).
"""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson

from analytics import queries as aq
from api.switch_rules import AUTOMATIC_SOURCES, Decision, Rule
from api.switch_scopes import (  # noqa: F401 (re-exported: imported from here)
    BUCKETS,
    SCOPE_KEYS,
    SwitchError,
    bucket,
    canonical_scope,
    check_name,
    covers,
    overlaps,
    parse_scope,
    rollout_wave,
)
from collector.records import SWITCH_NAMES
from collector.switch_names import NUMERIC_SWITCHES, PRODUCTION_OFF

# The production configuration a release's workers start with (every optimization on; the fault switch
# and the playout policies but the production one off: switch_names.PRODUCTION_OFF). Information for dashboards only (GET /v1/switches/rules ``defaults``): never sent to a worker as
# a decision -- a switch no rule names is left to the worker.
DEFAULTS: dict[str, bool] = {n: n not in PRODUCTION_OFF for n in SWITCH_NAMES}


def aware(t: datetime) -> datetime:
    """``t`` as an aware time: a naive one is taken as UTC."""
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


_RULE_COLS = aq.RULE_COLUMNS
_AUDIT_COLS = aq.AUDIT_COLUMNS


class Switchboard:
    """Rules of one store, cached for ``cache_s`` seconds (writes in this process invalidate)."""

    def __init__(self, store, cache_s: float = 0.5):
        self.store = store
        self.cache_s = cache_s
        self.lock = threading.RLock()
        self._cached: tuple[float, list[Rule], int] | None = None
        self._evidence: dict[tuple[str, str], tuple[float, frozenset[str]]] = {}  # (kind, release) -> evidenced
        self._last_ts: datetime | None = None

    # -- reads -----------------------------------------------------------------------------------
    def _load(self) -> tuple[list[Rule], int]:
        rows = aq.switch_rules(self.store)
        rules = [Rule(*r) for r in rows]
        version = max((r.version for r in rules), default=0)
        return [r for r in rules if r.active and r.name in SWITCH_NAMES], version

    def snapshot(self) -> tuple[list[Rule], int]:
        """Active rules and the board's version (bumped by every change)."""
        c = self._cached
        now = time.monotonic()
        if c is not None and now - c[0] <= self.cache_s:
            return c[1], c[2]
        rules, version = self._load()
        self._cached = (now, rules, version)
        return rules, version

    def invalidate(self) -> None:
        self._cached = None
        self._evidence.clear()

    def deciding(self, name: str, labels: dict[str, str]) -> Rule | None:
        """The rule that decides ``name`` for a worker with these labels: the most recent covering it."""
        return max((r for r in self.snapshot()[0] if r.name == name and r.matches(labels)),
                   key=lambda r: r.version, default=None)

    def resolve(self, worker_id: str | None = None, release: str | None = None,
                gpu_kind: str | None = None, waves: int = 1, wave_s: float = 0.0,
                now: datetime | None = None) -> tuple[dict[str, bool], int]:
        """The switches some rule covering one worker decides (undecided names are left out: the worker
        keeps its own value), and the board version. With ``waves`` > 1 a rule reaches this worker only
        ``wave(worker) * wave_s`` after it was written (``rollout_wave``): until then the rule before it decides."""
        labels = _labels(worker_id, release, gpu_kind)
        rules, version = self.snapshot()
        if waves > 1 and wave_s > 0 and worker_id is not None:
            t = now or datetime.now(UTC)
            rules = [r for r in rules
                     if aware(r.updated_at) + timedelta(seconds=rollout_wave(worker_id, r.name, waves) * wave_s) <= t]
        best: dict[str, Rule] = {}
        for r in rules:
            if r.matches(labels) and (r.name not in best or r.version > best[r.name].version) and not self._withheld(
                    r, labels):
                best[r.name] = r
        return {n: best[n].value for n in SWITCH_NAMES if n in best}, version

    def _withheld(self, r: Rule, labels: dict[str, str]) -> str | None:
        """Why a rule does not reach this worker though it covers it (None: it does): a numeric switch turned
        on, and the gate holds no evidence for the worker's GPU kind and release (api/evaluation_gate.py
        ``evidenced``; cached ``cache_s`` per kind and release)."""
        if not r.value or r.name not in NUMERIC_SWITCHES:
            return None
        kind, release = labels.get("gpu_kind"), labels.get("release")
        if not kind or not release:
            return (f"{r.name} changes the model's numerics and is on only for a GPU kind and release with a passing "
                    "evaluation: this poll names no " + ("gpu_kind" if not kind else "release"))
        now = time.monotonic()
        hit = self._evidence.get((kind, release))
        if hit is None or now - hit[0] > self.cache_s:
            from api.evaluation_gate import evidenced

            if len(self._evidence) > 1024:  # labels are the workers' own: keep the cache bounded
                self._evidence.clear()
            hit = self._evidence[(kind, release)] = (now, frozenset(evidenced(self.store, kind, release)))
        if r.name in hit[1]:
            return None
        return (f"{r.name} changes the model's numerics and the gate holds no passing evaluation of it that counts "
                f"for gpu_kind={kind}, release={release} (GET /v1/evaluations/latest): the rule reaches that GPU "
                "kind once one is posted")

    def explain(self, worker_id: str | None = None, release: str | None = None,
                gpu_kind: str | None = None) -> dict[str, dict[str, Any]]:
        """For each switch: its value for this worker (None = undecided), the rule that decided it and why,
        and the other rules that cover the worker or its scope but do not decide (older, outside a cohort)."""
        labels = _labels(worker_id, release, gpu_kind)
        rules, _ = self.snapshot()
        out: dict[str, dict[str, Any]] = {}
        for name in SWITCH_NAMES:
            mine = sorted((r for r in rules if r.name == name and covers(r.scope_dict, labels)),
                          key=lambda r: -r.version)
            withheld = {id(r): w for r in mine if (w := self._withheld(r, labels))}
            covering = [r for r in mine if r.in_cohort(worker_id) and id(r) not in withheld]
            top = covering[0] if covering else None
            others = []
            for r in mine:
                if r is top:
                    continue
                if id(r) in withheld:
                    why = withheld[id(r)]
                elif r in covering:
                    why = f"older (version {r.version} < {top.version}): the most recent covering rule decides"
                elif worker_id is None:
                    why = "a cohort rule: it covers only workers in its cohort (no worker_id given)"
                else:
                    why = (f"worker not in its cohort: bucket {bucket(worker_id, name)} (salted by {name!r}) "
                           f"not in [{r.bucket_lo}, {r.bucket_hi})")
                others.append({**r.as_dict(), "why_not": why})
            if top is None:
                why = ("no rule covers this worker: it keeps the value it started with "
                       f"(production default {'on' if DEFAULTS[name] else 'off'})")
            else:
                where = f"scope {top.scope or '(whole fleet)'}" + (
                    f", cohort {top.cohort} (bucket {bucket(worker_id or '', name)} in "
                    f"[{top.bucket_lo}, {top.bucket_hi}))" if top.cohort else "")
                why = (f"the most recent of {len(covering)} rule(s) covering this worker: {where}, set "
                       f"{'on' if top.value else 'off'} by {top.actor} ({top.as_dict()['source']}) at "
                       f"{top.updated_at.isoformat()}: {top.reason}")
            out[name] = {"value": None if top is None else top.value, "decided_by": None if top is None else
                         top.as_dict(), "why": why, "not_deciding": others}
        return out

    def effective(self, name: str, scope: str | dict[str, str] | None) -> bool | None:
        """The value the most recent rule covering the whole of ``scope`` gives the switch (cohort rules
        aside); None when no rule covers it. Newer rules inside the scope may differ for some of its
        workers: ``exceptions`` lists them."""
        want = parse_scope(scope)
        best = self._covering(name, want)
        return best.value if best is not None else None

    def _covering(self, name: str, want: dict[str, str]) -> Rule | None:
        return max((r for r in self.snapshot()[0] if r.name == name and not r.cohort and covers(r.scope_dict, want)),
                   key=lambda r: r.version, default=None)

    def exceptions(self, name: str, scope: str | dict[str, str] | None, value: bool | None = None) -> list[Rule]:
        """Rules newer than the most recent one covering all of ``scope`` that apply to some of its workers
        (narrower scopes, overlapping scopes, cohorts) with another value than ``value`` (default: the
        covering rule's); these workers resolve differently from the rest of the scope."""
        want = parse_scope(scope)
        base = self._covering(name, want)
        value = (base.value if base is not None else None) if value is None else value
        floor = base.version if base is not None else 0
        return [r for r in self.snapshot()[0] if r.name == name and r.version > floor and r is not base
                and overlaps(r.scope_dict, want) and r.value != value]

    def rules(self) -> list[Rule]:
        return sorted(self.snapshot()[0], key=lambda r: (r.name, r.scope, r.cohort))

    # -- writes ----------------------------------------------------------------------------------
    def _next_version(self) -> int:
        return aq.switch_rules_version(self.store) + 1

    def _write_rule(self, name: str, scope: str, cohort: str, value: bool, active: bool, lo: int, hi: int,
                    actor: str, reason: str, source: str = "api") -> int:
        version = self._next_version()
        self.store.client().insert(
            "switch_rules",
            [[name, scope, cohort, value, active, lo, hi, version, actor, reason, datetime.now(UTC), source]],
            column_names=_RULE_COLS,
        )
        self.invalidate()
        return version

    def record(self, d: Decision) -> Decision:
        """Append a decision to the audit table (applied or not); changes also become control-plane
        events (``rollback`` for an alert's or an incident's flip, ``canary_*`` for canaries) next to the
        workers' own."""
        with self.lock:  # decisions of this process are strictly ordered in time (ms resolution)
            d.ts = d.ts.replace(microsecond=d.ts.microsecond // 1000 * 1000)
            if self._last_ts is not None and d.ts <= self._last_ts:
                d.ts = self._last_ts + timedelta(milliseconds=1)
            self._last_ts = d.ts
        self.store.client().insert(
            "switch_audit",
            [[d.ts, d.source, d.action, d.name, d.scope, d.cohort, d.old_value, d.new_value, d.changed,
              d.version, d.actor, d.reason, d.ref, orjson.dumps(d.evidence, default=str).decode()]],
            column_names=_AUDIT_COLS,
        )
        kind = "rollback" if d.source in ("alert", "incident") else d.action if d.action.startswith("canary_") else None
        if d.changed and kind:
            self._event(kind, d)
        return d

    def _event(self, kind: str, d: Decision) -> None:
        from collector.records import to_arrow

        scope = parse_scope(d.scope)
        row = {"worker_id": "control-plane", "session_id": d.ref or d.cohort or "-",
               "release": scope.get("release", "*"), "gpu_kind": scope.get("gpu_kind", "*"), "ts": d.ts,
               "simulated": False, "kind": kind,
               "detail": {"switch": d.name, "scope": d.scope, "cohort": d.cohort, "old": d.old_value,
                          "new": d.new_value, "who": d.actor, "why": d.reason, "version": d.version}}
        try:
            self.store.insert_arrow("events", to_arrow("event", [row]),
                                    dedup_token=f"control-plane-{kind}-{d.version}-{d.ts.timestamp()}")
        except Exception:  # the audit row is the record; the event is a convenience for dashboards
            import logging

            logging.getLogger("livestep.switchboard").exception("control-plane event not stored")

    def set(self, name: str, value: bool, scope: str | dict[str, str] | None = None, *, actor: str, reason: str,
            source: str = "api", ref: str = "", evidence: dict[str, Any] | None = None,
            action: str = "set") -> Decision:
        """Turn a switch on or off for a scope (the precedence model in the module docstring); a no-op
        (recorded) when every worker of the scope already resolves to ``value`` by rules (with no rule the
        workers keep their own values, so a rule is written even for the production default)."""
        check_name(name)
        scope_s = canonical_scope(scope)
        want = parse_scope(scope_s)
        with self.lock:
            self.invalidate()
            old = self.effective(name, scope_s)
            ev = dict(evidence or {})
            differing = self.exceptions(name, scope_s, value)
            if old == value and not differing:
                _, version = self.snapshot()
                return self.record(Decision(name, scope_s, "", old, value, False, version, "noop", source, actor,
                                            reason, ref, {**ev, "noop": f"already {'on' if old else 'off'}"}))
            if differing:
                ev["overrides"] = [f"{r.scope or '(fleet)'}{' ' + r.cohort if r.cohort else ''}" for r in differing]
            self._write_rule(name, scope_s, "", value, True, 0, BUCKETS, actor, reason, source)
            ended = self._withdraw(name, want, actor, reason, lambda r: bool(r.cohort))
            if ended:
                ev["cohort_rules_withdrawn"] = ended
            if source not in AUTOMATIC_SOURCES:
                gone = self._withdraw(name, want, actor, reason,
                                      lambda r: not r.cohort and r.automatic and r.scope != scope_s)
                if gone:
                    ev["superseded_automatic_rules"] = gone
            version = self.snapshot()[1]
            return self.record(Decision(name, scope_s, "", old, value, True, version, action, source, actor,
                                        reason, ref, ev))

    def clear(self, name: str, scope: str | dict[str, str] | None = None, *, actor: str, reason: str,
              source: str = "api") -> Decision:
        """Remove the scope's own rule: the switch inherits from broader rules again (None when none
        decides it: workers keep the value they have)."""
        check_name(name)
        scope_s = canonical_scope(scope)
        with self.lock:
            self.invalidate()
            old = self.effective(name, scope_s)
            own = [r for r in self.snapshot()[0] if (r.name, r.scope, r.cohort) == (name, scope_s, "")]
            if not own:
                _, version = self.snapshot()
                return self.record(Decision(name, scope_s, "", old, old, False, version, "noop", source, actor,
                                            reason, "", {"noop": "no rule of its own in this scope"}))
            r = own[0]
            version = self._write_rule(name, scope_s, "", r.value, False, r.bucket_lo, r.bucket_hi, actor, reason,
                                       r.source)
            new = self.effective(name, scope_s)
            return self.record(Decision(name, scope_s, "", old, new, old != new, version, "clear", source, actor,
                                        reason, "", {"rule_removed": True}))

    def _withdraw(self, name: str, want: dict[str, str], actor: str, reason: str, which) -> list[str]:
        """Withdraw the active rules of ``name`` inside scope ``want`` that ``which(rule)`` selects; their
        'scope[ cohort]' labels."""
        gone = []
        for r in self.snapshot()[0]:
            if r.name == name and covers(want, r.scope_dict) and which(r):
                self._write_rule(r.name, r.scope, r.cohort, r.value, False, r.bucket_lo, r.bucket_hi, actor, reason,
                                 r.source)
                gone.append(f"{r.scope or '(fleet)'}{' ' + r.cohort if r.cohort else ''}")
        return gone

    def withdraw_cohort(self, name: str, scope: str, cohort: str, *, actor: str, reason: str) -> bool:
        """Withdraw one cohort rule without an audit row of its own (the caller records the decision)."""
        scope_s = canonical_scope(scope)
        with self.lock:
            self.invalidate()
            for r in self.snapshot()[0]:
                if (r.name, r.scope, r.cohort) == (name, scope_s, cohort):
                    self._write_rule(name, scope_s, cohort, r.value, False, r.bucket_lo, r.bucket_hi, actor, reason,
                                     r.source)
                    return True
        return False

    def set_cohort(self, name: str, value: bool, scope: str, cohort: str, lo: int, hi: int, *, actor: str,
                   reason: str, source: str, action: str, evidence: dict[str, Any] | None = None) -> Decision:
        check_name(name)
        if not (0 <= lo < hi <= BUCKETS):
            raise SwitchError(f"cohort buckets [{lo}, {hi}) must satisfy 0 <= lo < hi <= {BUCKETS}")
        scope_s = canonical_scope(scope)
        with self.lock:
            old = self.effective(name, scope_s)
            version = self._write_rule(name, scope_s, cohort, value, True, lo, hi, actor, reason, source)
            return self.record(Decision(name, scope_s, cohort, old, value, True, version, action, source, actor,
                                        reason, cohort, dict(evidence or {})))

    def clear_cohort(self, name: str, scope: str, cohort: str, *, actor: str, reason: str, source: str,
                     action: str, evidence: dict[str, Any] | None = None) -> Decision:
        scope_s = canonical_scope(scope)
        with self.lock:
            self.invalidate()
            live = [r for r in self.snapshot()[0] if (r.name, r.scope, r.cohort) == (name, scope_s, cohort)]
            version = self.snapshot()[1]
            if live:
                r = live[0]
                version = self._write_rule(name, scope_s, cohort, r.value, False, r.bucket_lo, r.bucket_hi,
                                           actor, reason, r.source)
            return self.record(Decision(name, scope_s, cohort, live[0].value if live else None,
                                        self.effective(name, scope_s), bool(live), version, action, source,
                                        actor, reason, cohort, dict(evidence or {})))

    # -- history ---------------------------------------------------------------------------------
    def history(self, *, name: str | None = None, source: str | None = None, changed: bool | None = None,
                start: datetime | None = None, end: datetime | None = None, limit: int = 100,
                offset: int = 0) -> list[dict[str, Any]]:
        df = aq.switch_audit(self.store, name=name, source=source, changed=changed, start=start, end=end,
                             limit=limit, offset=offset)
        out = []
        for row in df.iter_rows(named=True):
            row["ts"] = row["ts"].isoformat()
            row["evidence"] = orjson.loads(row["evidence"] or "{}")
            out.append(row)
        return out


def _labels(worker_id: str | None, release: str | None, gpu_kind: str | None) -> dict[str, str]:
    return {k: v for k, v in (("worker_id", worker_id), ("release", release), ("gpu_kind", gpu_kind)) if v}


_boards: dict[int, Switchboard] = {}
_boards_lock = threading.Lock()


def get_switchboard(store, cache_s: float | None = None) -> Switchboard:
    """The process's switchboard for ``store`` (one per store object)."""
    with _boards_lock:
        b = _boards.get(id(store))
        if b is None or b.store is not store:
            b = _boards[id(store)] = Switchboard(store, 0.5 if cache_s is None else cache_s)
        elif cache_s is not None:
            b.cache_s = cache_s
        return b
