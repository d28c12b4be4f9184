"""sql/cluster/: every statement parses (chDB's parser, nothing executed against a cluster), every
statement runs ON CLUSTER, and the local tables have exactly the embedded schema's columns."""

from __future__ import annotations

import re

import pytest

from collector.store import SQL_DIR, split_statements

CLUSTER_FILES = sorted((SQL_DIR / "cluster").glob("[0-9][0-9][0-9]_*.sql"))
STATEMENTS = [(f.name, i, s) for f in CLUSTER_FILES for i, s in enumerate(split_statements(f.read_text()))]


def test_cluster_schema_covers_the_telemetry_files():
    names = {f.name for f in CLUSTER_FILES}
    assert {"001_raw_tables.sql", "002_session_stats.sql", "010_findings.sql"} <= names


@pytest.mark.parametrize("name,i,stmt", STATEMENTS, ids=[f"{n}#{i}" for n, i, _ in STATEMENTS])
def test_statement_parses_and_runs_on_cluster(store, name, i, stmt):
    formatted = store.query_rows("SELECT formatQuery({q:String})", {"q": stmt})[0][0]
    assert formatted.startswith("CREATE")
    assert "ON CLUSTER `{cluster}`" in formatted
    # sharded ('/clickhouse/tables/{shard}/...') or replicated to every node ('/clickhouse/tables/...'), or
    # a Distributed table over them, or a materialized view
    assert re.search(r"ENGINE = (Replicated\w*MergeTree\('/clickhouse/tables/[^']*', '\{replica\}'|Distributed\()",
                     formatted) or "MATERIALIZED VIEW" in formatted


def test_parse_check_rejects_a_broken_statement(store):
    with pytest.raises(Exception, match="Syntax error"):
        store.query_rows("SELECT formatQuery({q:String})", {"q": "CREATE TABLE t ON CLUSTER '{cluster}' (x UInt8"})


def _as_single_node(stmt: str) -> str:
    """A cluster local table as a plain single-node table: same columns, no keeper, no ON CLUSTER."""
    stmt = stmt.replace(" ON CLUSTER '{cluster}'", "")
    return re.sub(r"Replicated(\w*MergeTree)\('[^']*',\s*'[^']*'(?:,\s*)?", r"\1(", stmt)


def test_local_tables_have_the_embedded_columns(store):
    db = store.database + "_cluster"
    store.command(f"CREATE DATABASE IF NOT EXISTS {db}")
    try:
        c = store.client()
        for _, _, stmt in STATEMENTS:
            if "Distributed(" in stmt:
                continue
            c.command(_as_single_node(stmt).replace("IF NOT EXISTS ", f"IF NOT EXISTS {db}.", 1)
                      .replace(" TO session_stats_local", f" TO {db}.session_stats_local")
                      .replace("FROM steps_local", f"FROM {db}.steps_local"))

        def cols(database, suffix=""):
            return {(t.removesuffix(suffix), n, typ) for t, n, typ in store.query_rows(
                "SELECT table, name, type FROM system.columns WHERE database = {d:String} "
                "AND table IN ('steps', 'gpu_samples', 'sessions', 'events', 'session_stats', 'findings', "
                "'steps_local', 'gpu_samples_local', 'sessions_local', 'events_local', 'session_stats_local', "
                "'findings_local')", {"d": database})}

        embedded = cols(store.database)
        assert {t for t, _, _ in embedded} == {"steps", "gpu_samples", "sessions", "events", "session_stats",
                                                "findings"}
        assert cols(db, "_local") == embedded
    finally:
        store.command(f"DROP DATABASE IF EXISTS {db}")
