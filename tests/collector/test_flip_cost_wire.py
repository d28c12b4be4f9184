"""A flip's cost through the wire: a tiny worker session flips a switch, its ``flip_cost`` event goes through the real
shipping client and collector (uvicorn, spool, writer, chDB) and reads back field for field (analytics/queries.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from analytics import queries
from collector.flip_fields import FLIP_COST_FIELDS
from tests.api.live import serve
from tests.collector.conftest import TOKEN
from tests.collector.helpers import drained, wait_for
from worker.session import Worker


def test_flip_cost_records_round_trip_through_the_collector(collector):
    c = collector()
    t0 = datetime.now(UTC) - timedelta(seconds=5)
    with serve(c.app) as url:
        w = Worker("tiny", device="cpu", release="v-flip", worker_id="w-flip")
        s = w.run_session(steps=10, realtime=False, collector_url=url, token=TOKEN,
                          switch_source={4: {"ring_cache": True, "rope_at_write": True}}.get)
    assert s.telemetry_dropped == 0 and len(s.flips) == 1
    wait_for(lambda: drained(c.app), what="the spool drained")
    sent = s.flips[0]
    assert sent.keys() == FLIP_COST_FIELDS.keys() and sent["mode"] == "inline" and sent["applied_step"] == 4
    df = queries.flip_costs(c.app.state.store, t0, datetime.now(UTC) + timedelta(seconds=5))
    got = {r["switch"]: r for r in df.iter_rows(named=True)}
    assert set(got) == {"ring_cache", "rope_at_write"}  # one row per switch the flip changed
    r = got["ring_cache"]
    assert r["value"] is True and (r["release"], r["worker_id"], r["session_id"]) == ("v-flip", "w-flip", s.session_id)
    for k in ("mode", "step", "applied_step", "late_chunks", "steps_observed", "error"):
        assert r[k] == sent[k], k
    for k in ("stall_ms", "to_new_config_ms", "apply_ms", "out_of_service_ms"):
        assert abs(r[k] - sent[k]) < 1e-6, k
    assert r["build_ms"] is None  # inline: no background build
    only = queries.flip_costs(c.app.state.store, t0, datetime.now(UTC) + timedelta(seconds=5), switch="ring_cache",
                              filters={"release": "v-other"})
    assert only.is_empty()
