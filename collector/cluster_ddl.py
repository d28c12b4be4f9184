"""The cluster schema, generated from the single-node migrations (one source for both layouts).

    cluster_form(split_statements(Path("sql/002_session_stats.sql").read_text()))   # ON CLUSTER '{cluster}'

Each ``sql/NNN_*.sql`` statement becomes its cluster form by rule, so a migration is written once:
- a telemetry table (sharded: every table not in ``REPLICATED_EVERYWHERE``) becomes a
  ``Replicated*MergeTree`` ``<name>_local`` on every shard (keeper path with ``{shard}``) and a
  ``Distributed`` ``<name>`` over it, sharded by ``SHARD_KEYS`` (a session's rows on one shard, so
  the per-session views are exact on each shard); its dedup window becomes the replicated one;
- a control-plane table in ``REPLICATED_EVERYWHERE`` (small, read-after-write) becomes one replica set
  over every node (keeper path without ``{shard}``, no Distributed table);
- a materialized view runs on each shard's local rows: ``FROM``/``TO`` name the ``_local`` tables;
- ``ALTER TABLE t ADD COLUMN`` goes to ``t_local`` and then to the Distributed ``t`` (no codec there:
  a Distributed table stores nothing); ``MODIFY QUERY`` of a view is renamed like its ``CREATE``.
Every statement carries ``ON CLUSTER '{cluster}'`` (collector/migrations.py names the cluster);
``{shard}``, ``{replica}``, ``{database}`` and ``{table}`` stay server macros. The rules reproduced
the hand-kept ``sql/cluster/`` files statement for statement before those were removed (issue 28:
44 of the tree's 63 duplicate pairs); collector/migrations.py applies it for ``--cluster``, and
tests/collector/test_cluster_sql.py checks it (parse, layout, the same columns as one node).
"""

from __future__ import annotations

import re

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
