"""Where a switch rule applies: switch names checked, scopes ('key=value,...' over gpu_kind / release /
worker_id) parsed and compared, and a worker's stable cohort bucket (canaries, rollout waves). The
precedence model that uses them is in api/switchboard.py."""

from __future__ import annotations

import hashlib

from collector import catalog
from collector.records import SWITCH_NAMES

SCOPE_KEYS: tuple[str, ...] = ("gpu_kind", "release", "worker_id")
BUCKETS = 100


class SwitchError(ValueError):
    """An unknown switch, a malformed scope or cohort; the message lists what is valid."""


def check_name(name: str) -> str:
    if name not in SWITCH_NAMES:
        raise SwitchError(f"unknown switch {name!r}; valid switches: {', '.join(SWITCH_NAMES)}")
    return name


def parse_scope(scope: str | dict[str, str] | None) -> dict[str, str]:
    """'release=v7,gpu_kind=h200' or a dict -> a dict of scope keys (validated)."""
    if scope is None:
        return {}
    if isinstance(scope, dict):
        items = list(scope.items())
    else:
        items = []
        for part in (p.strip() for p in scope.split(",")):
            if not part:
                continue
            k, sep, v = part.partition("=")
            if not sep:
                raise SwitchError(f"scope part {part!r} is not key=value; valid keys: {', '.join(SCOPE_KEYS)}")
            items.append((k.strip(), v.strip()))
    out: dict[str, str] = {}
    for k, v in items:
        if k not in SCOPE_KEYS:
            raise SwitchError(f"unknown scope key {k!r}; valid keys: {', '.join(SCOPE_KEYS)}")
        v = str(v)
        if not v or len(v) > 128 or any(c in v for c in ",="):
            raise SwitchError(f"scope value for {k!r} must be 1-128 characters without ',' or '='")
        if k in out and out[k] != v:
            raise SwitchError(f"scope key {k!r} given twice with different values")
        out[k] = v
    return out


def canonical_scope(scope: str | dict[str, str] | None) -> str:
    """A scope, validated (``parse_scope``), in the catalogue's canonical form (findings key on the same)."""
    return catalog.canonical_scope(parse_scope(scope))


def bucket(worker_id: str, salt: str = "") -> int:
    """A worker's stable cohort bucket in [0, 100): the same on every server and every poll. Cohort rules
    salt it with their switch's name, so canaries of different switches pick independent cohorts."""
    key = f"{salt}/{worker_id}" if salt else worker_id
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % BUCKETS


def rollout_wave(worker_id: str, name: str, waves: int) -> int:
    """The wave in [0, waves) in which a change of switch ``name`` reaches this worker (salted by the name, so
    the same workers do not always go first)."""
    return bucket(worker_id, f"rollout/{name}") * waves // BUCKETS


def covers(outer: dict[str, str], inner: dict[str, str]) -> bool:
    """Every worker of scope ``inner`` is in scope ``outer`` (outer's keys all hold in inner)."""
    return all(inner.get(k) == v for k, v in outer.items())


def overlaps(a: dict[str, str], b: dict[str, str]) -> bool:
    """Some worker can be in both scopes (no key with two different values)."""
    return all(b.get(k, v) == v for k, v in a.items())
