"""The ClickHouse store: one connection owner for every service (migrations: collector/migrations.py).

    store = open_store("chdb:///var/livestep/db")        # embedded (default), or
    store = open_store("http://user:pass@host:8123/livestep")   # a server
    store.migrate()                                       # idempotent, applied once
    df = store.query_df("SELECT count() AS n FROM steps WHERE release = {r:String}", {"r": "v1"})

DSN forms: ``chdb:///abs/dir`` or ``chdb:///abs/dir?database=name`` (embedded chDB through
clickhouse-connect), ``http(s)://[user[:pass]@]host[:port][/database]``. chDB allows one data
directory per OS process (DESIGN.md), so ``open_store`` caches one ``Store`` per DSN and refuses a
second chDB directory in the same process with a clear error. Threads share a store; each thread
gets its own client (a client per thread is faster than a shared one on chDB).

SQL lives in three modules (issue 28): the schema and its migrations (collector/migrations.py), the
reads behind every figure (analytics/queries.py), and this one: the connection, the inserts, and the
write path's own recovery read (``not_landed``: which rows of a batch the store holds already, asked by
collector/writer.py and ``livestep spool requeue``; the collector never imports the read layer).
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import clickhouse_connect
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from collector.migrations import SQL_DIR, schema_files, split_statements  # noqa: F401 (re-exported)
from collector.migrations import migrate as _migrate
from collector.records import TABLES

log = logging.getLogger("livestep.collector.store")
_DB_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


class StoreError(Exception):
    """The store cannot be reached or configured; the message says what is valid."""


@dataclass(frozen=True)
class Dsn:
    engine: str  # "chdb" | "http" | "https"
    path: str | None  # chdb data directory
    host: str | None
    port: int | None
    user: str | None
    password: str | None
    database: str

    @property
    def embedded(self) -> bool:
        return self.engine == "chdb"

    def redacted(self) -> str:
        if self.embedded:
            return f"chdb://{self.path}?database={self.database}"
        return f"{self.engine}://{self.user or 'default'}:***@{self.host}:{self.port}/{self.database}"


def parse_dsn(dsn: str) -> Dsn:
    """Parse a store DSN; errors list the valid forms."""
    valid = "valid forms: chdb:///abs/dir[?database=name], http(s)://[user[:pass]@]host[:port][/database]"
    parts = urlsplit(dsn)
    query = parse_qs(parts.query)
    if parts.scheme == "chdb":
        if parts.netloc or not parts.path.startswith("/"):
            raise StoreError(f"chDB DSN {dsn!r} must name an absolute directory (chdb:///abs/dir); {valid}")
        database = query.get("database", ["livestep"])[0]
        path, host, port, user, password = parts.path, None, None, None, None
    elif parts.scheme in ("http", "https"):
        if not parts.hostname:
            raise StoreError(f"DSN {dsn!r} has no host; {valid}")
        database = parts.path.strip("/") or query.get("database", ["livestep"])[0]
        path, host = None, parts.hostname
        port = parts.port or (8443 if parts.scheme == "https" else 8123)
        user, password = parts.username, parts.password
    else:
        raise StoreError(f"unknown store engine {parts.scheme!r} in DSN; {valid}")
    if not _DB_NAME.match(database):
        raise StoreError(f"database name {database!r} is not valid: letters, digits and _ only")
    return Dsn(parts.scheme, path, host, port, user, password, database)


class Store:
    """A ClickHouse database reached through clickhouse-connect (chDB in-process or a server)."""

    def __init__(self, dsn: str | Dsn):
        self.dsn = dsn if isinstance(dsn, Dsn) else parse_dsn(dsn)
        self._local = threading.local()
        self._migrate_lock = threading.Lock()
        if self.dsn.embedded:
            Path(self.dsn.path).mkdir(parents=True, exist_ok=True)
        # create the database first, through a client bound to the always-present 'default'
        self._raw_client("default").command(f"CREATE DATABASE IF NOT EXISTS {self.dsn.database}")

    # -- connection ------------------------------------------------------------------------------
    def _raw_client(self, database: str):
        d = self.dsn
        try:
            if d.embedded:
                return clickhouse_connect.get_client(dsn=f"chdb://{d.path}", database=database)
            return clickhouse_connect.get_client(
                host=d.host,
                port=d.port,
                username=d.user or "default",
                password=d.password or "",
                database=database,
                secure=d.engine == "https",
            )
        except Exception as e:  # clickhouse-connect / chdb raise many types
            raise StoreError(f"cannot open store {d.redacted()}: {e}") from e

    def client(self):
        """This thread's clickhouse-connect client, bound to the store's database."""
        c = getattr(self._local, "client", None)
        if c is None:
            c = self._local.client = self._raw_client(self.dsn.database)
        return c

    @property
    def database(self) -> str:
        return self.dsn.database

    # -- migrations (collector/migrations.py) -----------------------------------------------------
    def migration_files(self, cluster: bool = False) -> list[Path]:
        return schema_files(cluster)

    def migrate(self, cluster: str | None = None, dry_run: bool = False) -> list[str]:
        """Apply the files of ``sql/`` (their cluster form ON CLUSTER for ``cluster``) not yet recorded in
        ``schema_migrations``; return their names (``dry_run``: parse-check and return only)."""
        with self._migrate_lock:
            return [s.name for s in _migrate(self, cluster=cluster, dry_run=dry_run)]

    # -- reads and writes ------------------------------------------------------------------------
    def command(self, sql: str, parameters: dict[str, Any] | None = None, settings: dict | None = None):
        return self.client().command(sql, parameters=parameters, settings=settings)

    def query_arrow(self, sql: str, parameters: dict[str, Any] | None = None) -> pa.Table:
        return self.client().query_arrow(sql, parameters=parameters)

    def query_df(self, sql: str, parameters: dict[str, Any] | None = None) -> pl.DataFrame:
        """Run a query, return a polars DataFrame (through Arrow, no pandas)."""
        return pl.from_arrow(self.query_arrow(sql, parameters))  # type: ignore[return-value]

    def query_rows(self, sql: str, parameters: dict[str, Any] | None = None) -> list[tuple]:
        return self.client().query(sql, parameters=parameters).result_rows

    def insert_arrow(self, table: str, data: pa.Table, dedup_token: str | None = None) -> None:
        """Insert an Arrow table; ``dedup_token`` makes a retried batch land once.

        The materialized views fed by ``table`` are deduplicated with it (a retried batch must not
        count twice in ``session_stats``): every MV target table carries the dedup window too. On a
        cluster (collector/migrations.py: ``table`` is Distributed) the insert returns once every shard stored
        its rows (``insert_distributed_sync``), so the writer's ack means stored, as on one node
        (where the setting does nothing).
        """
        settings: dict[str, Any] = {"deduplicate_blocks_in_dependent_materialized_views": 1,
                                    "insert_distributed_sync": 1}
        if dedup_token:
            settings["insert_deduplication_token"] = dedup_token
        self.client().insert_arrow(table, data, settings=settings)

    def setting(self, name: str) -> str | None:
        """A server setting's value as the store reports it (None: no such setting)."""
        rows = self.query_rows("SELECT value FROM system.settings WHERE name = {n:String}", {"n": name})
        return str(rows[0][0]) if rows else None

    def ping(self) -> bool:
        try:
            return self.query_rows("SELECT 1") == [(1,)]
        except Exception:  # noqa: BLE001 -- any failure means "not reachable"
            return False


# -- the write path's own read: which rows of a batch the store holds already ---------------------------
# (collector/writer.py asks before a batch goes in alone). ``_LANDED_SQL`` must form byte for byte the row
# key that ``_row_keys`` forms from the batch in Arrow: the two forms of one key stay side by side.
# ``_ROW_KEY``: per kind, the column that tells a row apart from others of the same worker, session and ts
# (steps: the step number, GPU samples: the GPU, sessions: the phase, events: the event kind, turns: the
# turn's index).
_ROW_KEY = {"step": "step", "gpu_sample": "gpu_index", "session": "phase", "event": "kind",
            "evaluation": "metric",  # an evaluation run's rows are a millisecond apart (worker/evaluate.py)
            "turn": "turn"}


def _ts_ms(table: pa.Table) -> pa.ChunkedArray:
    """The rows' ts in whole milliseconds since the epoch, as the store keeps them (DateTime64(3))."""
    return pc.cast(pc.cast(table.column("ts"), pa.timestamp("ms", "UTC"), safe=False), pa.int64())


def _row_keys(kind: str, table: pa.Table) -> pa.Array:
    """``worker_id\\0session_id\\0ts in ms\\0key`` of each row, as ``_LANDED_SQL`` forms it in the store."""
    ms = _ts_ms(table)
    cols = [table.column("worker_id"), table.column("session_id"), ms, table.column(_ROW_KEY[kind])]
    return pc.binary_join_element_wise(*[pc.cast(c, pa.string()) for c in cols], "\0").combine_chunks()


_LANDED_SQL = """
SELECT k, count() FROM (
    SELECT concat(worker_id, '\\0', session_id, '\\0', toString(toUnixTimestamp64Milli(ts)), '\\0', toString({key})) AS k
    FROM {table}
    WHERE ts >= fromUnixTimestamp64Milli({{lo:Int64}}, 'UTC') AND ts <= fromUnixTimestamp64Milli({{hi:Int64}}, 'UTC')
      AND session_id IN {{s:Array(String)}}
) WHERE k IN {{keys:Array(String)}}
GROUP BY k"""


def not_landed(store: Store, kind: str, table: pa.Table) -> pa.Table:
    """The rows of one batch that are not in the store yet (all of them unless a block insert that
    raised, or an earlier attempt of this batch, stored some): one query on the store."""
    if table.num_rows == 0:
        return table
    keys = _row_keys(kind, table)
    lo, hi = pc.min_max(_ts_ms(table)).values()
    params = {"lo": lo.as_py(), "hi": hi.as_py(),
              "s": pc.unique(pc.cast(table.column("session_id"), pa.string())).to_pylist(),
              "keys": pc.unique(keys).to_pylist()}
    sql = _LANDED_SQL.format(key=_ROW_KEY[kind], table=TABLES[kind])
    stored = dict(store.query_rows(sql, params))
    if not stored:
        return table
    # a row key stored as often as the batch has it landed (a part lands whole: a key's rows share
    # one partition); any other count is another batch's rows, not these
    wanted = pc.value_counts(keys)
    landed = [k.as_py() for k, n in zip(wanted.field("values"), wanted.field("counts"), strict=True)
              if stored.get(k.as_py(), 0) >= n.as_py()]
    if not landed:
        return table
    log.warning("%s rows of a spool batch already stored (by a block insert that raised, or before a "
                "restart): %d of %d row keys not inserted again", kind, len(landed), len(wanted))
    return table.filter(pc.invert(pc.is_in(keys, value_set=pa.array(landed, pa.string()))))


_stores: dict[str, Store] = {}
_stores_lock = threading.Lock()


def open_store(dsn: str) -> Store:
    """The process's ``Store`` for ``dsn`` (cached: chDB allows one directory per process)."""
    parsed = parse_dsn(dsn)
    key = parsed.redacted()
    with _stores_lock:
        if key in _stores:
            return _stores[key]
        if parsed.embedded:
            other = {s.dsn.path for s in _stores.values() if s.dsn.embedded} - {parsed.path}
            if other:
                raise StoreError(
                    f"this process already uses chDB directory {other.pop()}; chDB allows one data "
                    f"directory per process (use another database in the same directory: ?database=name)"
                )
        store = _stores[key] = Store(parsed)
        return store
