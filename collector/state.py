"""The collector's health in one place: ``ok`` or ``degraded``, and why (``/v1/health`` and metrics read it).

    state = collector_state(store_reachable=True, spool=app.state.spool, writer=app.state.writer)
    state["status"], state["reasons"]       # "degraded", ["writer retrying since 12.5 s: ...", ...]

Degraded while any acked row is not on its way into the store: the store does not answer, the writer
is not running, the writer's inserts are failing (it retries for as long as it lasts), the spool refuses
ingest for space (its bound, or a full disk: 429/503 until the writer drains it), or batches wait
in quarantine (refused by the store for their content: ``livestep spool requeue`` once fixed).
"""

from __future__ import annotations

import time


def collector_state(store_reachable: bool, spool, writer) -> dict:
    """{status, reasons, spool, writer, quarantine}: plain values (JSON, or one gauge each)."""
    reasons: list[str] = []
    if not store_reachable:
        reasons.append("store unreachable")
    spool_stats = spool.stats() if spool is not None else None
    quarantine = spool.quarantine_stats() if spool is not None else {"batches": 0, "rows": 0}
    writer_stats = writer.stats() if writer is not None else None
    if writer_stats is not None:
        writer_stats["lag_s"] = spool_stats["oldest_age_s"] if spool_stats else 0.0
        last = writer_stats.pop("last_insert_at")
        writer_stats["since_last_insert_s"] = round(time.time() - last, 3) if last else None
        since = writer_stats.pop("failing_since")
        writer_stats["failing_for_s"] = round(time.time() - since, 3) if since else None
        if not writer_stats["alive"]:
            reasons.append("writer not running")
        if writer_stats["last_error"] is not None:
            reasons.append(f"writer retrying for {writer_stats['failing_for_s'] or 0:.1f} s: "
                           f"{writer_stats['last_error'][:200]}")
    if spool_stats is not None and spool_stats.get("refusing"):
        reasons.append(f"ingest refused for space: {spool_stats['refusing']}")
    if quarantine["batches"]:
        reasons.append(f"{quarantine['batches']} batch(es), {quarantine['rows']} rows, quarantined: refused by "
                       f"the store for their content; fix the cause, then `livestep spool requeue`")
    return {"status": "degraded" if reasons else "ok", "reasons": reasons, "spool": spool_stats,
            "writer": writer_stats, "quarantine": quarantine}
