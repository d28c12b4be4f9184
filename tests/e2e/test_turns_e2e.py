"""A live tiny worker's turns end to end: worker -> shipping client -> real uvicorn (collector, spool,
writer) -> ClickHouse -> ``GET /v1/turns`` and the dashboards in headless Chromium (the turns page's
per-stage bars, the turn marks on the session's step chart)."""

from __future__ import annotations

import httpx
import pytest

from tests.api import browser
from tests.collector.helpers import INGEST_TOKEN, drained, wait_for
from worker.session import Worker
from worker.turns import TurnSchedule

pytestmark = pytest.mark.e2e


def test_a_live_workers_turns_reach_the_store_and_the_dashboards(app_server):
    app, url = app_server
    sched = TurnSchedule([(0.5, 6, True), (1.3, 14, False), (2.1, 9, True)])
    s = Worker("tiny", release="v-turns").run_session(seconds=6.0, collector_url=url, token=INGEST_TOKEN,
                                                      turns=sched, playout_policy="trim", seed=4)
    assert s.turns == 3 and s.telemetry_dropped == 0
    wait_for(lambda: drained(app), what="spool drained")
    store = app.state.store
    stored = store.query_rows("SELECT turn, step, policy FROM turns WHERE session_id = {s:String} ORDER BY turn",
                              {"s": s.session_id})
    assert [(t, p) for t, _, p in stored] == [(0, "trim"), (1, "trim"), (2, "trim")]
    body = httpx.get(f"{url}/v1/turns", params={"release": "v-turns"}).json()
    assert {r["part"] for r in body["rows"]} == {"latency", "wait", "recompute", "generation", "queue"}
    assert [st["turns"] for st in body["stages"]] == [3]
    if not browser.available():
        pytest.skip(f"no chromium at {browser.CHROMIUM}")
    session_html = httpx.get(f"{url}/dashboard/sessions/{s.session_id}").text
    assert '"name":"turns"' in session_html.replace(" ", "")
    with browser.Chromium() as chromium:
        for path in ("/dashboard/turns", f"/dashboard/sessions/{s.session_id}"):
            res = chromium.load(url + path)
            assert res.errors == [], (path, res.errors)
            assert res.charts > 0 and res.rendered == res.charts, (path, res)
