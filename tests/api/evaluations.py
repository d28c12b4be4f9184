"""Test helper: an evaluation's overall verdict stored as ``livestep evaluate`` ships it (an evaluation
record), so control-plane tests can give a numeric switch the evidence the gate needs, or withhold it."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

from collector.records import to_arrow


def put_evaluation(store, switch: str, gpu_kind: str, release: str, verdict: str = "pass",
                   ts: datetime | None = None, **provenance) -> str:
    """Store one evaluation run's ``overall`` row, as POST /v1/evaluations stores it: with an evaluator and
    the provenance the gate checks (by default enough for ``gpu_kind``: on its device, a shape its fleet
    runs, the gate's minimum steps, seeds and band runs; override any of them); returns its id."""
    from api import evaluation_gate as G

    eid = uuid.uuid4().hex[:16]
    shapes = G._shapes(store, gpu_kind, release)
    preset, tp = shapes[0] if shapes else (G.DEFAULT_PRESET, 3)
    row = {"worker_id": "evaluate", "session_id": eid, "release": release, "gpu_kind": gpu_kind,
           "ts": ts or datetime.now(UTC) - timedelta(seconds=1), "configuration": "fp8_cache,rope_at_write",
           "switch": switch, "preset": preset, "metric": "overall", "value": 0.0 if verdict == "pass" else 1.0,
           "band_lo": None, "band_hi": None, "verdict": verdict, "n": 2, "step": None, "evaluator": "test",
           "device_type": "cpu" if gpu_kind == "cpu" else "cuda", "tp": tp, "steps": G.MIN_STEPS,
           "seeds": G.MIN_SEEDS, "reruns": G.MIN_RERUNS, "nonfinite": 0, **provenance}
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
