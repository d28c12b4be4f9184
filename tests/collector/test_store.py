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


def test_dedup_token_behaviour_the_writer_relies_on(store):
    """What chDB's non-replicated deduplication window does with insert_deduplication_token (the block
    writer's design rests on it): the token alone decides, per partition (other rows with a token
    already used are dropped), a new token stores the same rows again, and the insert's answer does
    not tell a deduplicated insert from a stored one (so the writer asks the store by row key)."""
    from tests.collector.helpers import step_rows

    t0 = datetime(2026, 11, 1, 23, 59, 59, tzinfo=UTC)
    block = records.to_arrow("step", step_rows(10, ts=t0))  # steps 0-5 on Nov 1, 6-9 on Nov 2

    def count():
        return store.query_rows("SELECT count() FROM steps")[0][0]

    store.insert_arrow("steps", block, dedup_token="T")
    assert count() == 10 and store.query_rows("SELECT uniqExact(_partition_id) FROM steps") == [(2,)]
    answer = store.client().insert_arrow("steps", block, settings={"insert_deduplication_token": "T"})
    assert count() == 10 and answer.written_rows == 10  # deduplicated, yet it answers 10 rows written
    store.insert_arrow("steps", block.slice(8), dedup_token="T")  # a part of it: dropped too
    store.insert_arrow("steps", records.to_arrow("step", step_rows(3, start=100, ts=t0)), dedup_token="T")
    assert count() == 10  # other rows under a token already used in their partition: dropped
    store.insert_arrow("steps", block.slice(0, 2), dedup_token="U")  # the same rows, another token
    assert count() == 12
    assert store.query_rows("SELECT countMerge(steps) FROM session_stats") == [(12,)]  # the view alike
