"""Helpers of the api tests: sessions whose sampled steps carry ``fp8_saturated``, and a small fleet."""

from __future__ import annotations

from datetime import datetime, timedelta

from collector import records
from tests.collector.helpers import step_rows

STATIC = "fp8_cache,ring_cache,static_scales"


def fp8_session(store, sid: str, release: str, gpu_kind: str, sat: float | None, ts: datetime, *,
                worker_id: str = "w1", switches: str = STATIC) -> None:
    """24 steps of session ``sid`` from ``ts`` into ``store``; steps 7, 15 and 23 are sampled with
    ``sat`` (None: no step sampled), the others carry null."""
    rows = step_rows(24, session_id=sid, release=release, gpu_kind=gpu_kind, worker_id=worker_id, switches=switches,
                     ts=ts)
    for r in rows:
        r["fp8_saturated"] = sat if r["step"] % 8 == 7 else None
    store.insert_arrow("steps", records.to_arrow("step", rows), dedup_token=sid)


def fp8_fleet(store, end: datetime) -> None:
    """40 sessions on v7/h200, 10 of them saturating (on 5 workers), and 40 clean ones on v7/h100, all
    started 6 hours before ``end`` (a minute apart)."""
    for i in range(40):
        t = end - timedelta(hours=6, minutes=i)
        fp8_session(store, f"v7-h200-{i}", "v7", "h200", 2e-3 if i % 4 == 0 else 0.0, t, worker_id=f"w{i % 5}")
        fp8_session(store, f"v7-h100-{i}", "v7", "h100", 0.0, t)
