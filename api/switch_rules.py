"""The control plane's two records: a ``Rule`` (one switch's value for a scope, optionally a cohort, as the
``switch_rules`` table holds it) and a ``Decision`` (what a write did, as ``switch_audit`` records it)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

from api.switch_scopes import bucket, covers, parse_scope

AUTOMATIC_SOURCES = frozenset({"alert", "incident", "canary"})


@dataclass(frozen=True)
class Rule:
    name: str
    scope: str
    cohort: str
    value: bool
    active: bool
    bucket_lo: int
    bucket_hi: int
    version: int
    actor: str
    reason: str
    updated_at: datetime
    source: str = ""  # api | alert | incident | canary ('' for rules written before sql/030)

    @property
    def scope_dict(self) -> dict[str, str]:
        return parse_scope(self.scope)

    @property
    def automatic(self) -> bool:
        """Written by the system (an alert, an incident, a canary), not by an operator."""
        if self.source:
            return self.source in AUTOMATIC_SOURCES
        return self.actor.startswith(("alert:", "incident", "canary"))  # rules older than the column

    def in_cohort(self, worker_id: str | None) -> bool:
        return not self.cohort or (worker_id is not None
                                   and self.bucket_lo <= bucket(worker_id, self.name) < self.bucket_hi)

    def matches(self, labels: dict[str, str]) -> bool:
        return covers(self.scope_dict, labels) and self.in_cohort(labels.get("worker_id"))

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "scope": self.scope, "cohort": self.cohort, "value": self.value,
                "buckets": [self.bucket_lo, self.bucket_hi], "version": self.version, "who": self.actor,
                "why": self.reason, "source": self.source or ("alert" if self.automatic else "api"),
                "updated_at": self.updated_at.isoformat()}


@dataclass
class Decision:
    """What a write did: changed=False is a recorded no-op."""

    name: str
    scope: str
    cohort: str
    old_value: bool | None
    new_value: bool | None
    changed: bool
    version: int
    action: str
    source: str
    actor: str
    reason: str
    ref: str = ""
    evidence: dict[str, Any] = field(default_factory=dict)
    ts: datetime = field(default_factory=lambda: datetime.now(UTC))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ts"] = self.ts.isoformat()
        return d
