"""Test helper: an evaluation's overall verdict stored as ``livestep evaluate`` ships it (an evaluation
record), so control-plane tests can give a numeric switch the evidence the gate needs, or withhold it."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

from collector.records import to_arrow


def put_evaluation(store, switch: str, gpu_kind: str, release: str, verdict: str = "pass",
                   ts: datetime | None = None) -> str:
    """Store one evaluation run's ``overall`` row; returns its evaluation id."""
    eid = uuid.uuid4().hex[:16]
    row = {"worker_id": "evaluate", "session_id": eid, "release": release, "gpu_kind": gpu_kind,
           "ts": ts or datetime.now(UTC) - timedelta(seconds=1), "configuration": "fp8_cache,rope_at_write",
           "switch": switch, "preset": "tiny", "metric": "overall", "value": 0.0 if verdict == "pass" else 1.0,
           "band_lo": None, "band_hi": None, "verdict": verdict, "n": 2, "step": None}
    store.insert_arrow("evaluations", to_arrow("evaluation", [row]), dedup_token=f"test-evaluation-{eid}")
    return eid


def evaluate_release(store, switch: str, release: str) -> list[str]:
    """A passing evaluation of ``switch`` on every GPU kind ``release`` runs on (its sessions say which):
    what turning a numeric switch back on for a release needs. Returns the kinds."""
    from api.evaluation_gate import kinds_in

    kinds = kinds_in(store, release)
    assert kinds, f"release {release} has no sessions: no GPU kind to evaluate on"
    for k in kinds:
        put_evaluation(store, switch, k, release)
    return kinds
