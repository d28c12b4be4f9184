"""Migrations as a command and as a start-up check: ``livestep migrate`` on chDB, a dry run of the
cluster DDL, the layouts never mixed, a server that refuses a schema that is not current, and an
install without its migration files refusing to start."""

from __future__ import annotations

import hashlib
import os
import re
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


# What each shipped file applies (its statements, whitespace aside): a fragment or a catalogue state is
# part of every file that names it, so editing one must not change what a shipped file applies (a fresh
# store would differ from an upgraded one). A new file adds its line here.
SHIPPED = {
    "001_raw_tables.sql": "5ef40d9266b43170",
    "002_session_stats.sql": "965e80d8d394e24f",
    "010_findings.sql": "f947196759732690",
    "011_job_runs.sql": "0ad76ee2a7eb7a4a",
    "012_fleet_daily.sql": "5e74197e24c46c03",
    "013_session_fleet.sql": "d44a3098b2470dd9",
    "020_switches.sql": "d36d64cf2613d8fe",
    "021_session_switch_state.sql": "c784337f6a875419",
    "022_fp8_saturation.sql": "456b2ff12660a6e5",
    "030_rule_source.sql": "89756fe212f8b087",
    "031_incidents.sql": "3a9542116b44777b",
    "040_session_shape.sql": "c1a84ce826cd19e0",
    "080_turns.sql": "b6d4d96a4fb94cb6",
    "090_session_start.sql": "f89c42eb6ef5c7a8",
    "100_evaluations.sql": "6f8531ef1943100b",
    "110_gpu_memory_total.sql": "9450597ef5b0965e",
    "111_incident_evidence_at.sql": "e202cf1183c90e14",
    "120_step_sm_clock.sql": "f0f5432e2c43512f",
    "130_evaluation_provenance.sql": "cadf9c2c0c00f7b6",
}


def test_a_shipped_migration_applies_what_it_applied_when_it_shipped():
    now = {f.name: hashlib.sha256(";".join(re.sub(r"\s+", "", s) for s in migrations.statements(f)).encode())
           .hexdigest()[:16] for f in schema_files()}
    changed = sorted(n for n in SHIPPED if now.get(n) != SHIPPED[n])
    assert not changed, (f"{changed}: a shipped migration's statements changed (a fragment of collector/migrations.py "
                         "or a State of collector/catalog.py edited?): add a new state and migration instead")
    new = {n: h for n, h in now.items() if n not in SHIPPED}
    assert not new, f"new migration file(s): add them to SHIPPED: {new}"
