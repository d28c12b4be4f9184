"""sql/cluster/: every statement parses (chDB's parser, nothing executed against a cluster) and runs
ON CLUSTER; the large telemetry tables are sharded (``<name>_local`` with '{shard}' in its keeper
path, a Distributed ``<name>`` over it with a shard key); the small control-plane tables listed in
REPLICATED_EVERYWHERE are one replica set over every node (no '{shard}', no Distributed); every
embedded table has its cluster variant, and each cluster table has exactly the embedded columns
(once the ALTERs of later files are applied: a column added to a ``<name>_local`` is added to its
Distributed ``<name>`` too)."""

from __future__ import annotations

import re

import pytest

from collector.store import SQL_DIR, split_statements

CLUSTER_FILES = sorted((SQL_DIR / "cluster").glob("[0-9][0-9][0-9]_*.sql"))
STATEMENTS = [(f.name, i, s) for f in CLUSTER_FILES for i, s in enumerate(split_statements(f.read_text()))]
CREATES = [(n, i, s) for n, i, s in STATEMENTS if s.startswith("CREATE")]
ALTERS = [(n, i, s) for n, i, s in STATEMENTS if s.startswith("ALTER")]

# Small tables that must be read-after-write consistent: replicated to every node, never sharded.
REPLICATED_EVERYWHERE = {"job_runs", "fleet_daily", "fleet_daily_marks", "switch_rules", "switch_audit",
                         "alert_deliveries", "canaries", "incidents", "incident_log"}
# Embedded tables with no cluster variant: the migration bookkeeping of one store.
NOT_CLUSTERED = {"schema_migrations"}

_CREATE = re.compile(r"CREATE (TABLE|MATERIALIZED VIEW) IF NOT EXISTS (\w+) ON CLUSTER '\{cluster\}'")
_REPLICATED = re.compile(r"ENGINE = Replicated\w*MergeTree\('(/clickhouse/tables/[^']*)', '\{replica\}'")
_ALTER = re.compile(r"ALTER TABLE (\w+) ON CLUSTER '\{cluster\}'\s+(ADD COLUMN IF NOT EXISTS (\w+)|MODIFY QUERY)")
_DISTRIBUTED = re.compile(r"ENGINE = Distributed\('\{cluster\}', currentDatabase\(\), (\w+), (.+)\)\s*$", re.DOTALL)


def _tables() -> dict[str, dict]:
    """Name -> {kind: replicated | distributed | view, path, local, key, stmt} of every CREATE."""
    out = {}
    for name, _, stmt in CREATES:
        m = _CREATE.search(stmt)
        assert m, f"{name}: not a CREATE ... IF NOT EXISTS ... ON CLUSTER '{{cluster}}': {stmt[:80]}"
        table, info = m.group(2), {"stmt": stmt, "file": name}
        if m.group(1) == "MATERIALIZED VIEW":
            info["kind"] = "view"
        elif d := _DISTRIBUTED.search(stmt):
            info.update(kind="distributed", local=d.group(1), key=d.group(2).strip())
        elif r := _REPLICATED.search(stmt):
            info.update(kind="replicated", path=r.group(1))
        else:
            pytest.fail(f"{name}: {table} is neither Replicated*MergeTree, Distributed nor a materialized view")
        assert table not in out, f"{table} created twice"
        out[table] = info
    return out


def test_every_statement_creates_or_alters_on_cluster():
    assert len(CREATES) + len(ALTERS) == len(STATEMENTS)
    tables = _tables()
    for name, _, stmt in ALTERS:
        m = _ALTER.match(stmt)
        assert m, f"{name}: not an ALTER TABLE ... ON CLUSTER '{{cluster}}' ADD COLUMN IF NOT EXISTS / MODIFY QUERY"
        table, column = m.group(1), m.group(3)
        assert table in tables, f"{name}: ALTER of {table}, created by no earlier file"
        if column is None:
            assert tables[table]["kind"] == "view", f"{name}: MODIFY QUERY of a table"
            continue
        assert tables[table]["kind"] != "view", f"{name}: ADD COLUMN to a view"
        if tables[table]["kind"] == "replicated" and table.endswith("_local"):  # its Distributed table too
            over = table.removesuffix("_local")
            assert any((m2 := _ALTER.match(s2)) and m2.group(1) == over and m2.group(3) == column
                       for _, _, s2 in ALTERS), f"{name}: column {column} added to {table}, not to {over}"


def _embedded(store) -> dict[str, str]:
    return dict(store.query_rows("SELECT name, engine FROM system.tables WHERE database = {d:String}",
                                 {"d": store.database}))


def test_cluster_schema_covers_every_embedded_table(store):
    tables = _tables()
    for name, engine in _embedded(store).items():
        if name in NOT_CLUSTERED:
            continue
        if engine == "MaterializedView":
            assert tables.get(name, {}).get("kind") == "view", f"no cluster variant of the view {name}"
        elif name in REPLICATED_EVERYWHERE:
            assert tables.get(name, {}).get("kind") == "replicated", f"{name} must be replicated on every node"
        else:
            assert tables.get(name, {}).get("kind") == "distributed", f"{name} must be a Distributed table"


def test_telemetry_is_sharded_and_the_control_plane_replicated_everywhere():
    tables = _tables()
    distributed = {t: i for t, i in tables.items() if i["kind"] == "distributed"}
    for table, info in tables.items():
        if info["kind"] != "replicated":
            continue
        if table in REPLICATED_EVERYWHERE:
            assert "{shard}" not in info["path"], f"{table} is listed as replicated on every node"
            assert not any(d["local"] == table for d in distributed.values()), f"{table} must not be sharded"
        else:
            assert table.endswith("_local") and "{shard}" in info["path"], \
                f"{table}: a telemetry table is sharded ('{{shard}}' in its keeper path), or list it in REPLICATED_EVERYWHERE"
            over = distributed.get(table.removesuffix("_local"))
            assert over is not None and over["local"] == table, f"no Distributed {table.removesuffix('_local')}"
            assert over["key"] and over["key"] != "rand()", f"{table}: a Distributed shard key is required"
    for table in ("steps", "gpu_samples", "sessions", "events", "session_stats", "session_fleet"):
        assert distributed[table]["key"] == "cityHash64(session_id)", f"{table}: one session on one shard"
    assert REPLICATED_EVERYWHERE <= set(tables)
    for info in tables.values():  # views run on each shard's local rows
        if info["kind"] == "view":
            src = re.search(r"\bFROM (\w+)", info["stmt"]).group(1)
            dst = re.search(r"\bTO (\w+)", info["stmt"]).group(1)
            assert src.endswith("_local") and dst.endswith("_local"), info["stmt"][:120]


@pytest.mark.parametrize("name,i,stmt", STATEMENTS, ids=[f"{n}#{i}" for n, i, _ in STATEMENTS])
def test_statement_parses_and_runs_on_cluster(store, name, i, stmt):
    formatted = store.query_rows("SELECT formatQuery({q:String})", {"q": stmt})[0][0]
    assert "ON CLUSTER `{cluster}`" in formatted
    if formatted.startswith("ALTER"):  # checked by test_every_statement_creates_or_alters_on_cluster
        return
    assert formatted.startswith("CREATE")
    assert re.search(r"ENGINE = (Replicated\w*MergeTree\('/clickhouse/tables/[^']*', '\{replica\}'|Distributed\()",
                     formatted) or "MATERIALIZED VIEW" in formatted


def test_parse_check_rejects_a_broken_statement(store):
    with pytest.raises(Exception, match="Syntax error"):
        store.query_rows("SELECT formatQuery({q:String})", {"q": "CREATE TABLE t ON CLUSTER '{cluster}' (x UInt8"})


def _as_single_node(stmt: str, db: str) -> str:
    """A cluster table as a plain single-node table in ``db``: same columns, no keeper, no ON CLUSTER."""
    stmt = stmt.replace(" ON CLUSTER '{cluster}'", "")
    stmt = (re.sub(r"^ALTER TABLE (\w+)", rf"ALTER TABLE {db}.\1", stmt) if stmt.startswith("ALTER")
            else stmt.replace("IF NOT EXISTS ", f"IF NOT EXISTS {db}.", 1))
    stmt = re.sub(r"\b(TO|FROM) (\w+_local)\b", rf"\1 {db}.\2", stmt)
    return re.sub(r"Replicated(\w*MergeTree)\('[^']*',\s*'[^']*'(?:,\s*)?", r"\1(", stmt)


def test_cluster_tables_have_the_embedded_columns(store):
    tables = _tables()
    db = store.database + "_cluster"
    store.command(f"CREATE DATABASE IF NOT EXISTS {db}")
    try:
        c = store.client()
        for info in tables.values():
            if info["kind"] != "distributed":
                c.command(_as_single_node(info["stmt"], db))
        for _, _, stmt in ALTERS:  # in file order, as applied to a cluster (Distributed tables left out)
            if tables[_ALTER.match(stmt).group(1)]["kind"] != "distributed":
                c.command(_as_single_node(stmt, db))
        stored = {t for t, i in tables.items() if i["kind"] == "replicated"}

        def cols(database, names, suffix=""):
            return {(t.removesuffix(suffix), n, typ) for t, n, typ in store.query_rows(
                "SELECT table, name, type FROM system.columns WHERE database = {d:String} AND table IN {t:Array(String)}",
                {"d": database, "t": sorted(names)})}

        local = cols(db, stored, "_local")
        embedded = cols(store.database, {t.removesuffix("_local") for t in stored})
        assert {t for t, _, _ in embedded} == {t.removesuffix("_local") for t in stored}
        assert local == embedded
        for table in stored:  # and per table, so a failure names it
            name = table.removesuffix("_local")
            assert {x for x in local if x[0] == name} == {x for x in embedded if x[0] == name}, table
    finally:
        store.command(f"DROP DATABASE IF EXISTS {db}")


def test_the_generated_cluster_ddl_reproduces_the_hand_kept_files():
    """collector/cluster_ddl.py turns each sql/ file into exactly the statements of its sql/cluster/ twin
    (whitespace aside; within a file, independent ALTERs may come in another valid order)."""
    from collections import Counter

    from collector.cluster_ddl import cluster_statements

    def norm(stmts):
        return Counter(re.sub(r"\s+", " ", s).strip() for s in stmts)

    for f in CLUSTER_FILES:
        assert norm(cluster_statements(SQL_DIR / f.name)) == norm(split_statements(f.read_text())), f.name
