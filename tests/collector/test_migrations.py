"""Migrations as a command and as a start-up check: ``livestep migrate`` on chDB, a dry run of the
cluster DDL, the layouts never mixed, a server that refuses a schema that is not current, and an
install without its migration files refusing to start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from collector import migrations
from collector.migrations import SchemaError, ensure_current, pending, schema_files
from collector.store import open_store
from tests.collector.helpers import chdb_dsn

REPO = Path(__file__).resolve().parents[2]


def livestep(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "api.cli", *args], cwd=cwd, env=dict(os.environ, PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=180, check=False)


def tables(store) -> set[str]:
    return {r[0] for r in store.query_rows("SELECT name FROM system.tables WHERE database = {d:String}",
                                           {"d": store.database})}


@pytest.mark.e2e
def test_migrate_command_on_chdb_then_a_dry_run_of_the_cluster_ddl(tmp_path):
    dsn = f"chdb://{tmp_path / 'db'}"
    files = [f.name for f in schema_files()]
    out = livestep("migrate", "--dsn", dsn, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert [ln.split()[1] for ln in out.stdout.splitlines() if ln.startswith("applied ")] == files
    assert out.stdout.strip().endswith(f"{len(files)} migration(s) applied; schema current")
    again = livestep("migrate", "--dsn", dsn, cwd=tmp_path)
    assert again.returncode == 0 and again.stdout.strip().endswith("(single): schema current")

    fresh = f"chdb://{tmp_path / 'db'}?database=clustered"
    dry = livestep("migrate", "--dsn", fresh, "--cluster", "main", "--dry-run", cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr
    cluster_files = [f.name for f in schema_files(cluster=True)]
    assert [ln.split()[1].rstrip(":") for ln in dry.stdout.splitlines() if ln.startswith("-- ")] == cluster_files
    assert "ON CLUSTER 'main'" in dry.stdout and "'{cluster}'" not in dry.stdout and "{replica}" in dry.stdout
    assert dry.stdout.strip().endswith(f"dry run: {len(cluster_files)} migration(s) pending on "
                                       f"chdb://{tmp_path / 'db'}?database=clustered (cluster:main); every "
                                       "statement parses; nothing applied")
    real = livestep("migrate", "--dsn", fresh, "--cluster", "main", cwd=tmp_path)
    assert real.returncode == 2 and "chDB is a single node" in real.stderr and "--dry-run" in real.stderr
    bad = livestep("migrate", "--dsn", fresh, "--cluster", "no way", cwd=tmp_path)
    assert bad.returncode == 2 and "cluster name 'no way' is not valid" in bad.stderr


def test_applied_files_are_recorded_with_their_layout(store):
    rows = dict(store.query_rows("SELECT name, layout FROM schema_migrations FINAL"))
    assert rows == {f.name: "single" for f in schema_files()}
    assert pending(store) == [] and store.migrate() == []


def test_a_dry_run_parses_and_applies_nothing(chdb_dir):
    fresh = open_store(chdb_dsn(chdb_dir))
    try:
        planned = migrations.migrate(fresh, cluster="main", dry_run=True)
        assert [s.name for s in planned] == [f.name for f in schema_files(cluster=True)]
        assert tables(fresh) == set()  # not even the bookkeeping table
        broken = [migrations.Step("999_broken.sql", ["CREATE TABLE t ON CLUSTER 'main' (x UInt8"])]
        with pytest.raises(SchemaError, match="999_broken.sql: the store does not parse"):
            migrations.check_parses(fresh, broken)
    finally:
        fresh.command(f"DROP DATABASE IF EXISTS {fresh.database}")


def test_layouts_are_never_mixed(store, chdb_dir):
    with pytest.raises(SchemaError, match="holds single migrations, not cluster:main.*fresh database"):
        pending(store, cluster="main")
    fresh = open_store(chdb_dsn(chdb_dir))
    try:  # a database where a cluster's migrations are recorded gets no single-node DDL
        fresh.command("CREATE TABLE schema_migrations (name String, layout String) ENGINE = ReplacingMergeTree ORDER BY name")
        fresh.client().insert("schema_migrations", [["001_raw_tables.sql", "cluster:main"]],
                              column_names=["name", "layout"])
        with pytest.raises(SchemaError, match="holds cluster:main migrations, not single.*--cluster main"):
            ensure_current(fresh)
        assert tables(fresh) == {"schema_migrations"}  # nothing single-node was created
        left = pending(fresh, cluster="main")
        assert [s.name for s in left] == [f.name for f in schema_files(cluster=True)][1:]
        assert all("ON CLUSTER 'main'" in stmt for s in left for stmt in s.statements if "CLUSTER" in stmt)
    finally:
        fresh.command(f"DROP DATABASE IF EXISTS {fresh.database}")


def test_a_cluster_setting_on_chdb_is_refused(store):
    with pytest.raises(SchemaError, match="LIVESTEP_CLUSTER is set but the store is chDB"):
        ensure_current(store, cluster="main")


def _app(dsn, tmp_path, **kw):
    from api.app import create_app
    from api.settings import Settings

    return create_app(Settings(clickhouse_dsn=dsn, role="all", host="127.0.0.1", spool_dir=tmp_path / "spool",
                               reports_dir=tmp_path / "reports", **kw))


def test_the_server_refuses_a_schema_that_is_not_current(tmp_path, chdb_dir):
    fresh = open_store(chdb_dsn(chdb_dir))
    try:
        with pytest.raises(SchemaError, match=r"not current: \d+ migration\(s\) not applied.*run `livestep migrate`"):
            with TestClient(_app(fresh.dsn.redacted(), tmp_path, migrate_on_start=False)):
                pass
        assert tables(fresh) == set()
        with TestClient(_app(fresh.dsn.redacted(), tmp_path)) as c:  # the default: migrated at start
            assert c.get("/v1/health").json()["store"]["reachable"] is True
        assert pending(fresh) == []
    finally:
        fresh.command(f"DROP DATABASE IF EXISTS {fresh.database}")


def test_no_migration_files_refuses_to_start(tmp_path, monkeypatch, chdb_dir):
    monkeypatch.setattr(migrations, "SQL_DIR", tmp_path / "empty")
    with pytest.raises(SchemaError, match="no migration files .* this livestep install is broken"):
        schema_files()
    fresh = open_store(chdb_dsn(chdb_dir))
    try:
        with pytest.raises(SchemaError, match="no migration files"):
            fresh.migrate()
        with pytest.raises(SchemaError, match="no migration files"):
            with TestClient(_app(fresh.dsn.redacted(), tmp_path)):
                pass
        assert "steps" not in tables(fresh)
    finally:
        fresh.command(f"DROP DATABASE IF EXISTS {fresh.database}")


def test_the_session_stats_view_is_the_catalogue_s_states_up_to_each_migration(store):
    """One declaration (collector/catalog.py SESSION_STATES): every state is a column of session_stats,
    every column is filled, and each migration's view holds exactly the states up to its number."""
    from collector import catalog

    cols = [r[0] for r in store.query_rows("SELECT name FROM system.columns WHERE database = {d:String} AND "
                                           "table = 'session_stats' ORDER BY position", {"d": store.database})]
    assert sorted(cols) == sorted([*catalog.SESSION_KEY, *(s.name for s in catalog.SESSION_STATES)])
    files = {int(f.name[:3]): f for f in schema_files()}
    for since in sorted({s.since for s in catalog.SESSION_STATES}):  # a state ships with the migration that applies it
        assert "{{session_stats_view}}" in files[since].read_text(), files[since].name
    v21, v22 = migrations.session_stats_view(21), migrations.session_stats_view(22)
    assert "AS switch_last" in v21 and "AS fp8_sat_max" not in v21 and "AS fp8_sat_max" in v22
    assert "AS sm_clock_avg" not in v22 and "AS sm_clock_avg" in migrations.session_stats_view(120)


def test_an_unknown_fragment_is_refused_with_the_valid_names():
    with pytest.raises(SchemaError, match=r"unknown fragment \{\{nope\}\} in migration 007; valid: record_columns, session_stats_view, session_table_columns"):
        migrations.expand("SELECT 1;\n{{nope}};", 7)
