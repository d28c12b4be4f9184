"""The schema: the migration files that ship, their cluster form, which ones a database has applied.

    plan = pending(store)                      # sql/NNN_*.sql not yet applied (single node)
    migrate(store)                             # apply them, record each in schema_migrations
    migrate(store, cluster="main", dry_run=True)   # sql/ ON CLUSTER 'main' (generated): parse-check, print
    ensure_current(store, cluster=None)        # what the server roles do at start (see below)

The files are package data, found through ``importlib.resources``: ``collector/sql/`` in an installed
wheel (setup.py copies the repo's top-level ``sql/`` there), the repo's own ``sql/`` in a source
checkout. Finding no file at all is a ``SchemaError`` (a broken install), never a silent no-op.

A file may name a fragment, ``{{name}}``, that this module writes (``FRAGMENTS``): ``{{session_stats_view}}``
is the SELECT of the session_stats view as of that file's number, from collector/catalog.py's
``SESSION_STATES`` (each state with the migration that added it), so the view is declared once and a
migration that adds a state names the view instead of restating it; ``{{record_columns}}`` and
``{{session_table_columns}}`` are the columns every record table and every per-session table starts with.
``livestep migrate --dry-run`` prints the statements as they run.

Each applied file is one row of ``schema_migrations`` (name, layout): layout ``single`` for ``sql/``,
``cluster:<name>`` for the same files in their cluster form (``cluster_form`` below: Replicated +
Distributed, generated from the single-node statements) applied ON CLUSTER '<name>' (``{shard}``,
``{replica}``, ``{database}``, ``{table}`` stay server macros). A
database never mixes the two: single-node DDL is refused where cluster migrations are recorded, and
cluster DDL where single-node ones are. Every file is idempotent (IF NOT EXISTS), so a crash
mid-file is repaired by applying it again.

The server roles (``ensure_current``): without a cluster, pending single-node files are applied at
start (chDB's default; against a server too unless ``migrate_on_start`` is off), then checked; with a
cluster nothing is applied (DDL ON CLUSTER is an operator's step, ``livestep migrate --cluster``) and a
schema that is not current stops the server, naming the files and the command.

A materialized view a file alters (``ALTER TABLE v MODIFY QUERY``) is reloaded right after the file
(``DETACH``/``ATTACH``, ``reload_views``): the views deduplicate a replayed block by the insert's
token (``deduplicate_blocks_in_dependent_materialized_views``, collector/store.py), and ClickHouse
derives a view's block ids from the view as it is held in memory. A view altered in the running
process derives other ids than the same view loaded at the next start, so a block stored before a
kill -9 and replayed after it was counted twice in ``session_stats`` (issue 30; measured on chDB 4.4,
ClickHouse 26.9: tests/collector/test_view_replay.py). Reloaded at once, the view holds the ids it
will hold after any restart. While a view is detached (milliseconds) an insert by another process does not
reach it: against a server, apply a migration that alters a view with the collectors stopped.

The cluster form. Each single-node statement becomes its cluster form by rule, so a migration is written once:
- a telemetry table (sharded: every table not in ``REPLICATED_EVERYWHERE``) becomes a
  ``Replicated*MergeTree`` ``<name>_local`` on every shard (keeper path with ``{shard}``) and a
  ``Distributed`` ``<name>`` over it, sharded by ``SHARD_KEYS`` (a session's rows on one shard, so
  the per-session views are exact on each shard); its dedup window becomes the replicated one;
- a control-plane table in ``REPLICATED_EVERYWHERE`` (small, read-after-write) becomes one replica set
  over every node (keeper path without ``{shard}``, no Distributed table);
- a materialized view runs on each shard's local rows: ``FROM``/``TO`` name the ``_local`` tables;
- ``ALTER TABLE t ADD COLUMN`` goes to ``t_local`` and then to the Distributed ``t`` (no codec there:
  a Distributed table stores nothing); ``MODIFY QUERY`` of a view is renamed like its ``CREATE``.
The rules reproduced the hand-kept ``sql/cluster/`` files statement for statement before those were
removed (issue 28); tests/collector/test_cluster_sql.py checks them (parse, layout, the same columns
as one node).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

from collector import catalog


class Store(Protocol):
    """What migrations need of a store (collector/store.py's ``Store``; declared here so that the
    schema does not import the connection that applies it: store -> migrations, never back)."""

    database: str
    dsn: Any

    def command(self, sql: str, parameters: dict | None = None, settings: dict | None = None) -> Any: ...

    def query_rows(self, sql: str, parameters: dict | None = None) -> list[tuple]: ...

    def client(self) -> Any: ...

    def migration_files(self, cluster: bool = False) -> list[Path]: ...

_FILE = re.compile(r"^[0-9]{3}_[A-Za-z0-9_]+\.sql$")
_CLUSTER_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,127}$")
SINGLE = "single"
TABLE = "schema_migrations"


class SchemaError(Exception):
    """The schema cannot be applied or is not current; the message says what to run."""


def _schema_root() -> Path:
    """``collector/sql`` of an installed wheel, else ``sql/`` beside the packages (a source checkout)."""
    packaged = resources.files("collector") / "sql"
    if packaged.is_dir():
        return Path(str(packaged))
    return Path(__file__).resolve().parent.parent / "sql"


SQL_DIR = _schema_root()


def schema_files(cluster: bool = False) -> list[Path]:
    """The migration files in order (``sql/``; a cluster applies the same files in their cluster form,
    ``statements``); a ``SchemaError`` when there are none."""
    folder = SQL_DIR
    files = sorted(p for p in folder.glob("*.sql") if _FILE.match(p.name)) if folder.is_dir() else []
    if not files:
        raise SchemaError(f"no migration files (NNN_name.sql) in {folder}: this livestep install is broken "
                          f"(a wheel ships them under collector/sql/); reinstall it")
    return files


def layout_of(cluster: str | None) -> str:
    if cluster is None:
        return SINGLE
    if not _CLUSTER_NAME.match(cluster):
        raise SchemaError(f"cluster name {cluster!r} is not valid: a letter or _, then letters, digits, _ . -")
    return f"cluster:{cluster}"


def split_statements(sql: str) -> list[str]:
    """Split a DDL file into statements (``;`` at line end; ``--`` comment lines dropped)."""
    lines = [ln for ln in sql.splitlines() if not ln.strip().startswith("--")]
    out, cur = [], []
    for ln in lines:
        cur.append(ln)
        if ln.rstrip().endswith(";"):
            stmt = "\n".join(cur).strip().rstrip(";").strip()
            if stmt:
                out.append(stmt)
            cur = []
    rest = "\n".join(cur).strip()
    if rest:
        out.append(rest)
    return out


def session_stats_view(version: int) -> str:
    """The session_stats view's SELECT as migration ``version`` applies it: the states up to it."""
    items = [*catalog.SESSION_KEY, *(f"{s.sql:<56} AS {s.name}" for s in catalog.SESSION_STATES if s.since <= version)]
    return "SELECT\n    " + ",\n    ".join(items) + f"\nFROM steps\nGROUP BY {', '.join(catalog.SESSION_KEY)}"


def _columns(*cols: tuple[str, str]) -> str:
    return ",\n    ".join(f"{name:<19} {typ}" for name, typ in cols)


# The columns every record's table starts with (collector/records.py's COMMON, as the store keeps them),
# and those every per-session aggregate table starts with (its key, then the states every view keeps).
RECORD_COLUMNS_DDL = _columns(("worker_id", "LowCardinality(String)"), ("session_id", "String"),
                              ("release", "LowCardinality(String)"), ("gpu_kind", "LowCardinality(String)"),
                              ("ts", "DateTime64(3, 'UTC') CODEC(DoubleDelta, ZSTD(1))"), ("simulated", "Bool"))
SESSION_TABLE_COLUMNS_DDL = _columns(*((k, "String" if k == "session_id" else "LowCardinality(String)")
                                       for k in catalog.SESSION_KEY),
                                     ("simulated", "SimpleAggregateFunction(max, Bool)"),
                                     ("first_ts", "SimpleAggregateFunction(min, DateTime64(3, 'UTC'))"))
# {{name}} in a file -> its text for the file's number. Only session_stats_view depends on the number; the
# others never change (a file that names one must apply what it applied when it shipped).
FRAGMENTS = {"session_stats_view": session_stats_view, "record_columns": lambda _: RECORD_COLUMNS_DDL,
             "session_table_columns": lambda _: SESSION_TABLE_COLUMNS_DDL}
_FRAGMENT = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def expand(text: str, version: int) -> str:
    """A statement's ``{{fragment}}`` markers written out for migration ``version``."""
    def repl(m: re.Match) -> str:
        if m.group(1) not in FRAGMENTS:
            raise SchemaError(f"unknown fragment {m.group(0)} in migration {version:03d}; valid: "
                              f"{', '.join(sorted(FRAGMENTS))}")
        return FRAGMENTS[m.group(1)](version)

    return _FRAGMENT.sub(repl, text)


def statements(path: Path, cluster: str | None = None) -> list[str]:
    """A file's statements as they run (fragments written out); for ``cluster``, their cluster form
    ON CLUSTER '<cluster>'."""
    stmts = [expand(s, int(path.name[:3])) for s in split_statements(path.read_text())]  # comments dropped first
    if cluster is None:
        return stmts
    return [s.replace("'{cluster}'", f"'{cluster}'") for s in cluster_form(stmts)]


def created_tables() -> dict[str, str]:
    """Table name -> the ``CREATE TABLE`` statement of ``sql/`` that creates it (single node)."""
    out = {}
    for f in schema_files():
        for stmt in statements(f):
            if m := _CREATE_TABLE.match(stmt):
                out[m.group(1)] = stmt
    return out


def table_engines(store: Store, tables: list[str]) -> list[tuple[str, str, str]]:
    """(name, partition key, full engine clause: TTL and settings too) of each of ``tables`` the store has."""
    return store.query_rows("SELECT name, partition_key, engine_full FROM system.tables WHERE database = "
                            "currentDatabase() AND name IN {names:Array(String)}", {"names": tables})


def _bookkeeping_ddl(cluster: str | None) -> list[str]:
    if cluster is None:
        create = (f"CREATE TABLE IF NOT EXISTS {TABLE} (name String, applied_at DateTime64(3, 'UTC') "
                  "DEFAULT now64(3)) ENGINE = ReplacingMergeTree ORDER BY name")
        add_layout = f"ALTER TABLE {TABLE} ADD COLUMN IF NOT EXISTS layout LowCardinality(String) DEFAULT '{SINGLE}'"
        return [create, add_layout]
    # replicated to every node (no {shard}), like the control-plane tables (REPLICATED_EVERYWHERE)
    return [(f"CREATE TABLE IF NOT EXISTS {TABLE} ON CLUSTER '{cluster}' (name String, applied_at "
             f"DateTime64(3, 'UTC') DEFAULT now64(3), layout LowCardinality(String) DEFAULT '{SINGLE}') "
             "ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/all/{database}/{table}', '{replica}') "
             "ORDER BY name")]


def applied(store: Store) -> dict[str, str]:
    """File name -> layout of every migration recorded in the store's database (empty if none)."""
    cols = {r[0] for r in store.query_rows(
        "SELECT name FROM system.columns WHERE database = {d:String} AND table = {t:String}",
        {"d": store.database, "t": TABLE})}
    if not cols:
        return {}
    layout = "layout" if "layout" in cols else f"'{SINGLE}'"
    return dict(store.query_rows(f"SELECT name, {layout} FROM {TABLE} FINAL"))


@dataclass(frozen=True)
class Step:
    """One file to apply: its name and its statements as they will run (the views it alters reloaded)."""

    name: str
    statements: list[str]


def pending(store: Store, cluster: str | None = None) -> list[Step]:
    """The files of ``sql/`` (their cluster form for ``cluster``) the store has not applied, in order.
    A ``SchemaError`` when the database holds migrations of the other layout."""
    want = layout_of(cluster)
    done = applied(store)
    other = sorted({lay for lay in done.values() if lay != want})
    if other:
        have = ", ".join(other)
        hint = (f"set LIVESTEP_CLUSTER / --cluster {other[0].split(':', 1)[1]}" if other[0] != SINGLE
                else "use a fresh database for the cluster schema")
        raise SchemaError(f"database {store.database} holds {have} migrations, not {want}: it never mixes "
                          f"single-node and cluster tables; {hint}")
    steps = [(f.name, statements(f, cluster)) for f in store.migration_files(cluster is not None) if f.name not in done]
    return [Step(name, stmts + reload_views(stmts)) for name, stmts in steps]


_MODIFY_QUERY = re.compile(r"^\s*ALTER\s+TABLE\s+([A-Za-z0-9_.`]+)(\s+ON\s+CLUSTER\s+'[^']*')?\s+MODIFY\s+QUERY\b",
                           re.IGNORECASE)


def reload_views(statements: list[str]) -> list[str]:
    """``DETACH``/``ATTACH`` of every view whose query ``statements`` alter (``MODIFY QUERY``), in the
    same cluster clause: the statements that make the running server hold each view as a restart
    would load it (see the module docstring)."""
    out = []
    for stmt in statements:
        m = _MODIFY_QUERY.match(stmt)
        if m is not None:
            view, on_cluster = m.group(1), m.group(2) or ""
            out += [f"DETACH TABLE IF EXISTS {view}{on_cluster} SYNC", f"ATTACH TABLE {view}{on_cluster}"]
    return out


def check_parses(store: Store, steps: list[Step]) -> None:
    """Parse every statement with the store's own parser (``formatQuery``; nothing is executed)."""
    for step in steps:
        for stmt in step.statements:
            try:
                store.query_rows("SELECT formatQuery({q:String})", {"q": stmt})
            except Exception as e:  # clickhouse-connect / chdb raise many types
                raise SchemaError(f"{step.name}: the store does not parse {stmt[:80]!r}...: {e}") from e


def migrate(store: Store, cluster: str | None = None, dry_run: bool = False) -> list[Step]:
    """Apply (or, ``dry_run``, parse-check only) the pending files; return them.

    On chDB a cluster is refused unless ``dry_run`` (chDB is one node, it has no keeper)."""
    layout = layout_of(cluster)
    if cluster is not None and store.dsn.embedded and not dry_run:
        raise SchemaError("chDB is a single node: apply the cluster schema to a ClickHouse server of the "
                          "cluster (--dsn http(s)://...), or check it here with --dry-run")
    steps = pending(store, cluster)
    if dry_run:
        check_parses(store, steps)
        return steps
    for stmt in _bookkeeping_ddl(cluster):
        store.command(stmt)
    for step in steps:
        for stmt in step.statements:
            store.command(stmt)
        store.client().insert(TABLE, [[step.name, layout]], column_names=["name", "layout"])
    return steps


def ensure_current(store: Store, cluster: str | None = None, apply: bool = True) -> list[str]:
    """At a server's start: apply pending single-node files (``apply``, no cluster), then require none
    pending. Returns the names applied; a ``SchemaError`` naming what is missing and what to run."""
    if cluster is not None and store.dsn.embedded:
        raise SchemaError("LIVESTEP_CLUSTER is set but the store is chDB (one node): point "
                          "LIVESTEP_CLICKHOUSE_DSN at a ClickHouse server of the cluster, or unset LIVESTEP_CLUSTER")
    done = store.migrate() if cluster is None and apply else []
    left = pending(store, cluster)
    if left:
        flag = f" --cluster {cluster}" if cluster else ""
        raise SchemaError(f"the schema of {store.database} is not current: {len(left)} migration(s) not applied "
                          f"({', '.join(s.name for s in left[:5])}{', ...' if len(left) > 5 else ''}); run "
                          f"`livestep migrate{flag}` (with this server's LIVESTEP_CLICKHOUSE_DSN) first")
    return done


def drop_database(store: Store, database: str, sync: bool = False) -> None:
    """Drop a whole database (the demo's and the detector benchmark's throwaway ones)."""
    if not _CLUSTER_NAME.match(database):
        raise SchemaError(f"database name {database!r} is not valid: letters, digits, '_', '.', '-'")
    store.command(f"DROP DATABASE IF EXISTS {database}{' SYNC' if sync else ''}")


def recreate_database(store: Store, database: str) -> None:
    """An empty database of that name (dropped first, SYNC: a deferred drop would outlive a short process)."""
    drop_database(store, database, sync=True)
    store.command(f"CREATE DATABASE {database}")


# -- the cluster form -----------------------------------------------------------------------------
# Small tables that must be read-after-write consistent: replicated to every node, never sharded.
REPLICATED_EVERYWHERE = frozenset({"job_runs", "fleet_daily", "fleet_daily_marks", "switch_rules", "switch_audit",
                                   "alert_deliveries", "canaries", "incidents", "incident_log"})
# The Distributed shard key per sharded table (default: one session on one shard).
SHARD_KEYS = {"findings": "kind, scope, metric"}
DEFAULT_SHARD_KEY = "session_id"
ON_CLUSTER = "ON CLUSTER '{cluster}'"
_SHARDED_PATH = "/clickhouse/tables/{shard}/{database}/{table}"
_EVERYWHERE_PATH = "/clickhouse/tables/all/{database}/{table}"

_CREATE_TABLE = re.compile(r"^CREATE TABLE IF NOT EXISTS (\w+)")
_CREATE_VIEW = re.compile(r"^CREATE MATERIALIZED VIEW IF NOT EXISTS (\w+) TO (\w+) AS")
_ALTER = re.compile(r"^ALTER TABLE (\w+)(\s+)")
_ENGINE = re.compile(r"ENGINE = (\w*)MergeTree(?:\(([^)]*)\))?")
_CODEC = re.compile(r"\s+CODEC\((?:[^()]|\([^()]*\))*\)")


class ClusterDDLError(Exception):
    """A single-node statement has no cluster form by the rules; the message names it and the forms."""


def _sharded(table: str) -> bool:
    return table not in REPLICATED_EVERYWHERE


def _engine(stmt: str, table: str) -> str:
    path = _SHARDED_PATH if _sharded(table) else _EVERYWHERE_PATH

    def repl(m: re.Match) -> str:
        args = f"'{path}', '{{replica}}'" + (f", {m.group(2)}" if m.group(2) else "")
        return f"ENGINE = Replicated{m.group(1)}MergeTree({args})"

    out, n = _ENGINE.subn(repl, stmt, count=1)
    if n != 1:
        raise ClusterDDLError(f"CREATE TABLE {table}: no *MergeTree engine to replicate: {stmt[:80]!r}")
    return out.replace("non_replicated_deduplication_window", "replicated_deduplication_window")


def _local_refs(query: str, sharded: set[str]) -> str:
    """A view's query reading the shard's ``_local`` tables (``FROM t``, ``JOIN t``, ``t.column``)."""
    for t in sharded:
        query = re.sub(rf"\b(FROM|JOIN)(\s+){t}\b(?!_)", rf"\1\2{t}_local", query)
        query = re.sub(rf"(?<![\w.]){t}\.(?=[A-Za-z_])", f"{t}_local.", query)
    return query


def _distributed(table: str) -> str:
    key = SHARD_KEYS.get(table, DEFAULT_SHARD_KEY)
    return (f"CREATE TABLE IF NOT EXISTS {table} {ON_CLUSTER} AS {table}_local\n"
            f"ENGINE = Distributed('{{cluster}}', currentDatabase(), {table}_local, cityHash64({key}))")


def cluster_form(stmts: list[str]) -> list[str]:
    """The cluster statements of one file's single-node ``stmts``."""
    views_of = {m.group(2) for s in stmts if (m := _CREATE_VIEW.match(s))}  # tables a view of this file fills
    out: list[str] = []
    pending_distributed: list[str] = []
    for stmt in stmts:
        if m := _CREATE_VIEW.match(stmt):
            view, target = m.groups()
            local = _read_tables(stmt)
            to = f"{target}_local" if _sharded(target) else target
            body = _local_refs(stmt[m.end():], local)
            out.append(f"CREATE MATERIALIZED VIEW IF NOT EXISTS {view} {ON_CLUSTER} TO {to} AS{body}")
            if target in pending_distributed:
                pending_distributed.remove(target)
                out.append(_distributed(target))
        elif m := _CREATE_TABLE.match(stmt):
            table = m.group(1)
            name = f"{table}_local" if _sharded(table) else table
            out.append(_engine(f"CREATE TABLE IF NOT EXISTS {name} {ON_CLUSTER}{stmt[m.end():]}", table))
            if _sharded(table):
                if table in views_of:
                    pending_distributed.append(table)  # after the view that fills it
                else:
                    out.append(_distributed(table))
        elif m := _ALTER.match(stmt):
            table, space, rest = m.group(1), m.group(2), stmt[m.end():]
            if rest.startswith("MODIFY QUERY"):
                out.append(f"ALTER TABLE {table} {ON_CLUSTER}{space}{_local_refs(rest, _read_tables(stmt))}")
            elif not rest.startswith("ADD COLUMN"):
                raise ClusterDDLError(f"ALTER TABLE {table}: only ADD COLUMN and MODIFY QUERY have a cluster form")
            elif _sharded(table):
                out.append(f"ALTER TABLE {table}_local {ON_CLUSTER}{space}{rest}")
                out.append(f"ALTER TABLE {table} {ON_CLUSTER}{space}{_CODEC.sub('', rest)}")
            else:
                out.append(f"ALTER TABLE {table} {ON_CLUSTER}{space}{rest}")
        else:
            raise ClusterDDLError(f"no cluster form for {stmt[:80]!r}: valid forms are CREATE TABLE IF NOT EXISTS, "
                                  "CREATE MATERIALIZED VIEW IF NOT EXISTS ... TO ..., ALTER TABLE ... ADD COLUMN / "
                                  "MODIFY QUERY")
    out += [_distributed(t) for t in pending_distributed]
    return out


def _read_tables(stmt: str) -> set[str]:
    """The sharded tables a view's query reads (``FROM``/``JOIN``)."""
    return {t for t in re.findall(r"\b(?:FROM|JOIN)\s+(\w+)", stmt) if _sharded(t)}
