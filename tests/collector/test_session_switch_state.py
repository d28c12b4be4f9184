"""session_stats keeps a session's switch state as argMax(switches, ts) (sql/021): blocks inserted
out of time order, merged in any order, and rows stored before the migration read back the state of
the session's latest step."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from analytics import queries
from collector import records
from collector.migrations import SQL_DIR, statements
from tests.collector.helpers import step_rows, store_before

T0 = datetime(2026, 11, 2, 8, tzinfo=UTC)
MIGRATION = "021_session_switch_state.sql"


def _state(store) -> list[tuple[str, str]]:
    df = queries.session_frame(store, T0 - timedelta(hours=1), T0 + timedelta(hours=1))
    return sorted(zip(df["session_id"].to_list(), df["switch_state"].to_list(), strict=True))


def _insert(store, token, start, switches, session_id="s1"):
    rows = step_rows(5, session_id=session_id, start=start, ts=T0, switches=switches)
    store.insert_arrow("steps", records.to_arrow("step", rows), dedup_token=token)


def test_a_block_replayed_late_does_not_roll_the_switch_state_back(store):
    _insert(store, "later", 10, "fp8_cache,ring_cache")  # steps 10-14 land first
    _insert(store, "earlier", 0, "ring_cache")  # steps 0-4 replayed late: an older state
    assert _state(store) == [("s1", "fp8_cache,ring_cache")]
    store.command("OPTIMIZE TABLE session_stats FINAL")
    assert store.query_rows("SELECT count() FROM session_stats") == [(1,)]  # merged into one row
    assert _state(store) == [("s1", "fp8_cache,ring_cache")]
    _insert(store, "latest", 20, "")  # a later state still wins over the merged one, then merged again
    assert _state(store) == [("s1", "")]
    store.command("OPTIMIZE TABLE session_stats FINAL")
    assert _state(store) == [("s1", "")]


def test_rows_stored_before_the_migration_keep_their_switch_state(store):
    with store_before(store, MIGRATION) as old:
        assert "switch_last" not in {r[0] for r in old.query_rows("SELECT name FROM system.columns WHERE "
                                                                  "database = currentDatabase() AND table = 'session_stats'")}
        _insert(old, "a", 10, "fp8_cache,ring_cache")
        _insert(old, "b", 0, "ring_cache")
        _insert(old, "c", 0, "ring_cache", session_id="s2")
        assert old.migrate()[0] == MIGRATION
        assert old.migrate() == []  # applied once
        for stmt in statements(SQL_DIR / MIGRATION):  # idempotent (a crash mid-file)
            old.command(stmt)
        assert _state(old) == [("s1", "fp8_cache,ring_cache"), ("s2", "ring_cache")]
        _insert(old, "d", 20, "ring_cache", session_id="s2")  # new rows go through the altered view
        _insert(old, "e", 5, "", session_id="s1")  # older than s1's stored state: ignored
        old.command("OPTIMIZE TABLE session_stats FINAL")
        assert _state(old) == [("s1", "fp8_cache,ring_cache"), ("s2", "ring_cache")]
        assert old.query_rows("SELECT session_id, countMerge(steps) FROM session_stats GROUP BY session_id "
                              "ORDER BY session_id") == [("s1", 15), ("s2", 10)]


def test_the_switches_filter_selects_sessions_by_their_final_state(store):
    _insert(store, "s1-early", 0, "ring_cache")  # s1 flips to fp8_cache,ring_cache later
    _insert(store, "s1-late", 10, "fp8_cache,ring_cache")
    _insert(store, "s2", 0, "ring_cache", session_id="s2")  # s2 stays on ring_cache
    window = (T0 - timedelta(hours=1), T0 + timedelta(hours=1))

    def ids(switches):
        df = queries.session_frame(store, *window, {"switches": switches})
        rows, total = queries.session_list(store, {"switches": switches}, start=window[0], end=window[1])
        assert sorted(r["session_id"] for r in rows) == sorted(df["session_id"].to_list()) and total == len(rows)
        return sorted(df["session_id"].to_list())

    for merged in (False, True):  # partial rows (one per insert) and after the merge
        assert ids("ring_cache") == ["s2"]  # s1's early partial row does not make it a ring_cache session
        assert ids("fp8_cache,ring_cache") == ["s1"]
        assert ids(["ring_cache", "fp8_cache,ring_cache"]) == ["s1", "s2"]
        assert queries.session_frame(store, *window, {"switches": "ring_cache", "release": "nope"}).height == 0
        if not merged:
            store.command("OPTIMIZE TABLE session_stats FINAL")
