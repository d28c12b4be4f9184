"""The store: DSN parsing, idempotent migrations, deduplicated inserts that keep the MV exact."""

from datetime import UTC, datetime

import pytest

from collector import records
from collector.store import StoreError, parse_dsn, split_statements


def test_parse_dsn_forms():
    d = parse_dsn("chdb:///var/x?database=abc")
    assert d.embedded and d.path == "/var/x" and d.database == "abc"
    h = parse_dsn("https://u:p@ch.example:9443/prod")
    assert (h.host, h.port, h.user, h.password, h.database) == ("ch.example", 9443, "u", "p", "prod")
    assert "***" in h.redacted() and "p@" not in h.redacted()


@pytest.mark.parametrize("bad", ["mysql://x/y", "chdb://relative", "chdb:///x?database=bad-name", "http:///db"])
def test_parse_dsn_errors_list_valid_forms(bad):
    with pytest.raises(StoreError, match="valid|not valid"):
        parse_dsn(bad)


def test_split_statements_ignores_comments():
    assert split_statements("-- c\nSELECT 1;\n\nSELECT\n 2;\n") == ["SELECT 1", "SELECT\n 2"]


def test_migrate_is_idempotent(store):
    assert store.migrate() == []
    names = {r[0] for r in store.query_rows("SELECT name FROM schema_migrations")}
    assert {f.name for f in store.migration_files()} == names


def test_retried_batch_lands_once_in_table_and_view(store):
    now = datetime.now(UTC)
    rows = [
        {"worker_id": "w", "session_id": "s", "release": "r", "gpu_kind": "cpu", "ts": now, "step": i, "diffusion_ms": 100.0,
             "step_period_ms": 160.0, "late": i == 0, "playout_depth": 1, "reset_step": False, "mem_allocated_bytes": 0,
             "mem_reserved_bytes": 0, "buffers_registered": 0, "switches": ""}
        for i in range(5)
    ]
    t = records.to_arrow("step", rows)
    for _ in range(10):
        store.insert_arrow("steps", t, dedup_token="batch-1")
    assert store.query_rows("SELECT count() FROM steps") == [(5,)]
    got = store.query_rows("SELECT countMerge(steps), countIfMerge(late_chunks) FROM session_stats")
    assert got == [(5, 1)]
