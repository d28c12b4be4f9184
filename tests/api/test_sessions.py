"""GET /v1/sessions (filters, paging, figures from session_stats) and GET /v1/sessions/{id}/steps."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.settings import Settings
from collector import records
from tests.collector.helpers import step_rows

T1 = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=2)
T0 = T1 - timedelta(days=1)


def _insert(store, rows, token):
    store.insert_arrow("steps", records.to_arrow("step", rows), dedup_token=token)


@pytest.fixture
def sessions_client(store, tmp_path):
    _insert(store, step_rows(10, session_id="s1", release="v1", worker_id="w1", ts=T1, gpu_kind="h200"), "a")
    _insert(store, step_rows(3, session_id="s2", release="v2", worker_id="w2", ts=T1 + timedelta(minutes=1),
                             gpu_kind="h100", step_period_ms=200.0), "b")
    _insert(store, step_rows(5, session_id="s3", release="v1", worker_id="w1", ts=T0, gpu_kind="h200"), "c")
    settings = Settings(clickhouse_dsn=f"chdb://{store.dsn.path}?database={store.database}", role="api",
                        spool_dir=tmp_path / "spool", read_tokens=["reader"])
    with TestClient(create_app(settings), headers={"Authorization": "Bearer reader"}) as c:
        yield c


def _ids(r):
    assert r.status_code == 200, r.text
    return [s["session_id"] for s in r.json()["sessions"]]


def test_lists_sessions_newest_first_with_exact_figures(sessions_client):
    r = sessions_client.get("/v1/sessions")
    assert _ids(r) == ["s2", "s1", "s3"] and r.json()["total"] == 3
    s1 = r.json()["sessions"][1]
    assert (s1["release"], s1["gpu_kind"], s1["worker_id"]) == ("v1", "h200", "w1")
    assert (s1["steps"], s1["frames"], s1["late_chunks"], s1["reset_steps"]) == (10, 40, 2, 0)
    assert s1["streamed_s"] == pytest.approx(1.665)
    assert s1["fps"] == pytest.approx(40 / 1.665)
    assert s1["step_period_ms_p50"] == 166.5 and s1["mem_reserved_max"] == 4096
    assert s1["switches"] == "fp8_cache,ring_cache" and s1["simulated"] is False
    assert datetime.fromisoformat(s1["first_ts"]) == T1
    assert datetime.fromisoformat(s1["last_ts"]) == T1 + timedelta(milliseconds=166 * 9)


@pytest.mark.parametrize("query,want", [
    ("release=v1", ["s1", "s3"]),
    ("gpu_kind=h100", ["s2"]),
    ("worker_id=w1&release=v1", ["s1", "s3"]),
    ("min_streamed_s=1", ["s1"]),
    ("release=nope", []),
    ("simulated=false", ["s2", "s1", "s3"]),
    ("simulated=true", []),
])
def test_filters(sessions_client, query, want):
    r = sessions_client.get(f"/v1/sessions?{query}")
    assert _ids(r) == want and r.json()["total"] == len(want)


def test_time_range_selects_overlapping_sessions(sessions_client):
    c = sessions_client
    start = (T1 - timedelta(hours=1)).isoformat()
    assert _ids(c.get("/v1/sessions", params={"start": start})) == ["s2", "s1"]
    assert _ids(c.get("/v1/sessions", params={"end": start})) == ["s3"]
    assert _ids(c.get("/v1/sessions", params={"start": T0.isoformat(), "end": (T0 + timedelta(seconds=1)).isoformat()})) == ["s3"]


def test_paging(sessions_client):
    c = sessions_client
    r = c.get("/v1/sessions?limit=1&offset=1")
    assert _ids(r) == ["s1"] and (r.json()["total"], r.json()["limit"], r.json()["offset"]) == (3, 1, 1)
    pages = [s for off in range(3) for s in _ids(c.get(f"/v1/sessions?limit=1&offset={off}"))]
    assert pages == ["s2", "s1", "s3"]
    r = c.get("/v1/sessions?offset=10")
    assert _ids(r) == [] and r.json()["total"] == 3


@pytest.mark.parametrize("query,words", [
    ("limit=0", ["limit", "greater than or equal to 1"]),
    ("limit=5000", ["limit", "less than or equal to 1000"]),
    ("offset=-1", ["offset"]),
    ("min_streamed_s=-1", ["min_streamed_s"]),
    ("min_streamed_s=abc", ["min_streamed_s", "number"]),
    ("start=yesterday", ["start", "datetime"]),
    ("start=2026-02-01T00:00:00Z&end=2026-01-01T00:00:00Z", ["start", "must be before end"]),
    ("release=" + "x" * 200, ["release", "at most 128"]),
    ("end=0999-01-01T00:00:00Z", ["end", "out of range", "2000-01-01"]),
    ("end=0001-01-01T00:30:00%2B01:00", ["end", "out of range", "2200-01-01"]),  # was an OverflowError (500)
    ("start=9999-12-31T23:30:00-01:00", ["start", "out of range"]),
])
def test_bad_queries_are_422_with_the_reason(sessions_client, query, words):
    r = sessions_client.get(f"/v1/sessions?{query}")
    assert r.status_code == 422
    for w in words:
        assert w in r.json()["detail"], (w, r.json())


def test_steps_of_a_session_paged_in_step_order(sessions_client):
    c = sessions_client
    r = c.get("/v1/sessions/s1/steps?limit=4&offset=4")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["total"] == 10 and [s["step"] for s in body["steps"]] == [4, 5, 6, 7]
    s = body["steps"][0]
    assert (s["diffusion_ms"], s["step_period_ms"], s["cache_upkeep_ms"], s["decode_ms"], s["late"]) == \
        (150.5, 166.5, 6.25, None, False)
    assert datetime.fromisoformat(s["ts"]) == T1 + timedelta(milliseconds=166 * 4)


def test_unknown_session_is_404_and_bad_paging_422(sessions_client):
    r = sessions_client.get("/v1/sessions/nope/steps")
    assert r.status_code == 404 and "GET /v1/sessions" in r.json()["detail"]
    assert sessions_client.get("/v1/sessions/s1/steps?limit=0").status_code == 422


def test_read_token_required_when_configured(sessions_client):
    assert sessions_client.get("/v1/sessions", headers={"Authorization": ""}).status_code == 401
    assert sessions_client.get("/v1/sessions", headers={"Authorization": "Bearer wrong"}).status_code == 403
    assert sessions_client.get("/v1/health", headers={"Authorization": ""}).status_code == 200


def test_session_ids_with_a_slash_are_routed_on_every_session_route(store, sessions_client):
    """A session id is any 1-128 character label: 'a/b' (sent as a/b or a%2Fb) reaches its routes."""
    _insert(store, step_rows(4, session_id="room/7", ts=T1), "slash")
    c = sessions_client
    for path in ("/v1/sessions/room/7/steps", "/v1/sessions/room%2F7/steps"):
        r = c.get(path)
        assert r.status_code == 200 and r.json()["session_id"] == "room/7" and r.json()["total"] == 4, r.text
    assert c.get("/v1/sessions/room/8/steps").status_code == 404
