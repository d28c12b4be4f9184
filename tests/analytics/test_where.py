"""analytics/queries.py's Where: optional filters as one parameterized WHERE clause."""

from __future__ import annotations

from datetime import UTC, datetime

from analytics.queries import Where


def test_filters_left_out_when_not_given_and_values_only_as_parameters():
    t = datetime(2026, 12, 1, tzinfo=UTC)
    assert str(Where()) == "1"
    w = Where(limit=5).eq("name", None).eq("source", "").eq("changed", False, "Bool").since("ts", t).until("ts", t)
    assert str(w) == ("changed = {w_changed:Bool} AND ts >= {w_ts:DateTime64(3, 'UTC')} "
                      "AND ts < {w_ts_2:DateTime64(3, 'UTC')}")
    assert w.params == {"limit": 5, "w_changed": False, "w_ts": t, "w_ts_2": t}  # False is a value, None is not
    evil = "x' OR 1=1 --"
    w = Where().eq("release", evil).any_of("kind", ["a", "b"]).any_of("gpu_kind", [])
    assert evil not in str(w) and w.params == {"w_release": evil, "w_kind": ["a", "b"]}


def test_overlapping_windows_and_the_callers_own_conditions(store):
    lo, hi = datetime(2026, 11, 1, tzinfo=UTC), datetime(2026, 11, 8, tzinfo=UTC)
    w = Where().overlapping("window_start", "window_end", lo, hi).sql("position(scope, {s:String}) > 0", s="v1")
    assert str(w) == ("window_end > {w_window_end:DateTime64(3, 'UTC')} AND window_start < "
                      "{w_window_start:DateTime64(3, 'UTC')} AND position(scope, {s:String}) > 0")
    q = ("SELECT count() FROM (SELECT toDateTime64('2026-11-07 00:00:00', 3, 'UTC') AS window_start, "
         "toDateTime64('2026-11-09 00:00:00', 3, 'UTC') AS window_end, 'release=v1' AS scope) WHERE {w}")
    assert store.query_rows(q.replace("{w}", str(w)), w.params) == [(1,)]
    w2 = Where().overlapping("window_start", "window_end", hi, None)
    assert store.query_rows(q.replace("{w}", str(w2)), w2.params) == [(1,)]
    w3 = Where().overlapping("window_start", "window_end", None, lo)
    assert store.query_rows(q.replace("{w}", str(w3)), w3.params) == [(0,)]
