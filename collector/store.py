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
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import clickhouse_connect
import polars as pl
import pyarrow as pa

from collector.migrations import SQL_DIR, schema_files, split_statements  # noqa: F401 (re-exported)
from collector.migrations import migrate as _migrate

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

    def ping(self) -> bool:
        try:
            return self.query_rows("SELECT 1") == [(1,)]
        except Exception:  # noqa: BLE001 -- any failure means "not reachable"
            return False


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
