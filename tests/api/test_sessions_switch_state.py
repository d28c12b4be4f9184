"""A session whose switches changed mid-stream reports the switch state of its latest steps, in both
``GET /v1/sessions`` and analytics' session frame (the one per-session SQL, analytics.queries)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from fastapi.testclient import TestClient

from analytics import queries
from api.app import create_app
from api.settings import Settings
from collector import records
from tests.collector.helpers import step_rows

T0 = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=3)
BEFORE, AFTER = "fp8_cache,ring_cache", "fp8_cache"


@pytest.mark.parametrize("arrival", ["in_order", "late_first_block"])
def test_final_switch_state_after_a_mid_stream_change(store, tmp_path, arrival):
    # Keep the session's two blocks as separate partial rows of session_stats (no merge), so the
    # query itself must pick the row of the latest steps.
    store.command("SYSTEM STOP MERGES session_stats")
    first = step_rows(6, session_id="chg", ts=T0, switches=BEFORE)
    second = step_rows(6, session_id="chg", ts=T0, start=6, switches=AFTER)
    blocks = [("a", first), ("b", second)]
    if arrival == "late_first_block":  # the earlier steps land last (a spooled batch replayed late)
        blocks.reverse()
    for token, rows in blocks:
        store.insert_arrow("steps", records.to_arrow("step", rows), dedup_token=token)
    assert store.query_rows("SELECT count() FROM session_stats WHERE session_id = 'chg'")[0][0] == 2

    df = queries.session_frame(store, T0 - timedelta(hours=1), T0 + timedelta(hours=1))
    assert df["session_id"].to_list() == ["chg"]
    assert df["switch_state"].to_list() == [AFTER] and df["steps"].to_list() == [12]

    settings = Settings(clickhouse_dsn=f"chdb://{store.dsn.path}?database={store.database}", role="api",
                        spool_dir=tmp_path / "spool", read_tokens=["reader"])
    with TestClient(create_app(settings), headers={"Authorization": "Bearer reader"}) as c:
        r = c.get("/v1/sessions")
    assert r.status_code == 200, r.text
    [s] = r.json()["sessions"]
    assert (s["session_id"], s["switches"], s["steps"]) == ("chg", AFTER, 12)
