"""Helpers of the collector/server tests: record rows, Arrow bodies, settings, waiting for the writer."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa

from collector import records

ARROW = "application/vnd.apache.arrow.stream"
INGEST_TOKEN = "e2e-ingest-token"  # the ingest token of an app served for a test (tests/e2e/conftest.py)


def chdb_dsn(chdb_dir: str) -> str:
    """A fresh database in this process's chDB directory (the ``chdb_dir`` fixture)."""
    return f"chdb://{chdb_dir}?database=t_{uuid.uuid4().hex[:12]}"


def migrated_store(chdb_dir: str):
    """A migrated store on a fresh database of ``chdb_dir`` (a module-scoped fixture's; it drops it after)."""
    from collector.store import open_store

    store = open_store(chdb_dsn(chdb_dir))
    store.migrate()
    return store


def step_rows(n: int, session_id: str = "s1", start: int = 0, worker_id: str = "w1", release: str = "r1",
              ts: datetime | None = None, **over) -> list[dict]:
    """``n`` valid step rows; values exactly representable in Float32 so reads compare exactly."""
    t0 = (ts or datetime.now(UTC) - timedelta(hours=12)).replace(microsecond=0)
    rows = []
    for i in range(start, start + n):
        r = {"worker_id": worker_id, "session_id": session_id, "release": release, "gpu_kind": "cpu",
                 "ts": t0 + timedelta(milliseconds=166 * i), "step": i, "diffusion_ms": 150.5 + i % 4,
                 "step_period_ms": 166.5, "decode_ms": None, "cache_upkeep_ms": 6.25, "attention_ms": None, "allreduce_ms": None,
                 "late": i % 5 == 0, "playout_depth": 2, "reset_step": i % 42 == 41, "energy_mj": None,
                 "mem_allocated_bytes": 1000 + i, "mem_reserved_bytes": 4096, "buffers_registered": 1,
                 "switches": "fp8_cache,ring_cache"}
        r.update(over)
        rows.append(r)
    return rows


def event_row(kind: str = "reset", session_id: str = "s1", **over) -> dict:
    r = {"worker_id": "w1", "session_id": session_id, "release": "r1", "gpu_kind": "cpu",
             "ts": datetime.now(UTC) - timedelta(minutes=1), "kind": kind, "detail": {"why": "test"}}
    r.update(over)
    return r


def turn_rows(n: int, session_id: str = "s1", **over) -> list[dict]:
    """``n`` valid turn rows (worker/turns.py's record); Float32-exact values, parts summing to the latency."""
    t0 = (datetime.now(UTC) - timedelta(hours=12)).replace(microsecond=0)
    rows = []
    for i in range(n):
        ts = t0 + timedelta(seconds=3 * i)
        r = {"worker_id": "w1", "session_id": session_id, "release": "r1", "gpu_kind": "cpu", "ts": ts, "turn": i,
             "step": 18 * i + 5, "speaking": i % 2 == 0, "cond_tokens": 40 + i, "policy": "trim", "queue_depth": 3,
             "dropped_chunks": 2, "superseded": 0, "wait_ms": 12.5, "recompute_ms": 0.25, "generation_ms": 150.0,
             "queue_ms": 80.25, "latency_ms": 243.0, "stall_ms": 0.0, "generated_at": ts + timedelta(milliseconds=162),
             "played_at": ts + timedelta(milliseconds=243)}
        r.update(over)
        rows.append(r)
    return rows


def arrow_body(kind: str, rows: list[dict], table: pa.Table | None = None) -> bytes:
    table = table if table is not None else records.to_arrow(kind, rows)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def json_rows(rows: list[dict]) -> list[dict]:
    return [{k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in r.items()} for r in rows]


def make_settings(dsn: str, tmp_path: Path, **over):
    from api.settings import Settings

    base = {"clickhouse_dsn": dsn, "spool_dir": tmp_path / "spool", "flush_interval_s": 0.05, "retry_max_s": 0.2,
                "role": "collector", "host": "127.0.0.1"}
    base.update(over)
    return Settings(**base)


def wait_for(pred, timeout_s: float = 60.0, what: str = "condition", every_s: float = 0.02):
    """Poll ``pred`` every ``every_s`` until it returns a truthy value (the writer is asynchronous); fail
    after ``timeout_s``. Its value."""
    deadline = time.monotonic() + timeout_s
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(every_s)


def drained(app) -> bool:
    """Every spooled batch is committed to the store."""
    return app.state.spool.stats()["batches"] == 0


@contextmanager
def store_before(store, migration: str) -> Iterator:
    """A second database beside ``store``'s, migrated with every file before ``migration`` (a store as the
    release before it left it: the later files did not exist either, and they may read its columns); its
    ``migrate()`` then applies ``migration`` and every later file. Dropped afterwards."""
    from collector.store import Store

    old = Store(store.dsn.redacted().replace(store.database, store.database + "_old"))
    files = old.migration_files
    old.migration_files = lambda cluster=False: [f for f in files(cluster) if f.name < migration]
    insert_arrow = old.insert_arrow

    def insert_as_that_release(table: str, data, **kw):
        """Rows as that release's workers sent them: the columns its tables have (later fields were not sent)."""
        have = {r[0] for r in old.query_rows(
            "SELECT name FROM system.columns WHERE database = {db:String} AND table = {t:String}",
            {"db": old.database, "t": table})}
        return insert_arrow(table, data.select([c for c in data.column_names if c in have]), **kw)

    old.insert_arrow = insert_as_that_release
    try:
        old.migrate()
        del old.migration_files  # the class's again: every file
        yield old
    finally:
        old.command(f"DROP DATABASE IF EXISTS {old.database}")
