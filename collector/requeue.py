"""``livestep spool requeue``: put quarantined batches into the store after the operator fixed the cause.

    livestep spool requeue [--spool-dir var/spool] [--dsn chdb:///...]   # with chDB: server stopped

The block writer quarantines a batch only when the store refused its content, alone, three times
(collector/writer.py); the files stay in ``<spool>/quarantine/`` until they are stored. Each is inserted
under the token the writer used for it alone (``<spool id>:<seq>-<seq>:<kind>``), without the rows of
it already in the store, so running this twice, or after a replay stored it, stores nothing twice.
A batch stored has its files removed; one still refused stays, and the command says why and exits 1.
The embedded store (chDB) is one process per directory: stop ``livestep serve`` first; against a
ClickHouse server it can run beside the collector (whose health then shows the quarantine emptied).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
from pydantic import ValidationError

from collector.limits import read_limits
from collector.records import ARROW_SCHEMAS, conform
from collector.settings import CollectorSettings
from collector.spool import spool_uid
from collector.spool_quarantine import quarantine_paths, quarantined
from collector.spool_storage import fsync_dir
from collector.store import Store, not_landed, open_store
from collector.writer import batch_token, insert_parts


class RequeueError(Exception):
    """The quarantine cannot be read (no spool there); the message says what was expected."""


@dataclass(frozen=True)
class Outcome:
    seq: int
    kind: str
    rows: int
    stored: int  # rows inserted now (0: all of them were in the store already)
    error: str | None  # why the store still refuses it (files kept)


def requeue(spool_dir: Path, store: Store) -> list[Outcome]:
    """Insert every quarantined batch of the spool in ``spool_dir``; remove the files of those stored."""
    uid = spool_uid(spool_dir)
    if uid is None:
        raise RequeueError(f"{spool_dir} is not a spool directory (no spool.id); pass the collector's "
                           "--spool-dir (LIVESTEP_SPOOL_DIR)")
    limits = read_limits(store)
    out = []
    for q in quarantined(spool_dir):
        try:
            table = conform(q.kind, pa.ipc.open_stream(q.path.read_bytes()).read_all())
            table = table.cast(ARROW_SCHEMAS[q.kind]) if table.schema != ARROW_SCHEMAS[q.kind] else table
            missing = not_landed(store, q.kind, table)
            if missing.num_rows:
                insert_parts(store, limits, q.kind, missing, batch_token(uid, q.seq, q.kind))
        except Exception as e:  # noqa: BLE001 (reported per batch; its files stay)
            out.append(Outcome(q.seq, q.kind, q.rows, 0, f"{type(e).__name__}: {e}"[:500]))
            continue
        for p in quarantine_paths(spool_dir, q.seq, q.kind):
            p.unlink(missing_ok=True)
        fsync_dir(q.path.parent)
        out.append(Outcome(q.seq, q.kind, q.rows, missing.num_rows, None))
    return out


def register(subparsers) -> None:
    p = subparsers.add_parser("spool", help="the collector's spool: requeue quarantined batches",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="spool_command", metavar="ACTION", required=True)
    r = sub.add_parser("requeue", help="insert quarantined batches under their original dedup tokens")
    from collector.settings import default_paths

    paths = default_paths()
    r.add_argument("--spool-dir", help=f"spool directory (default LIVESTEP_SPOOL_DIR, else <LIVESTEP_HOME or "
                   f"./var>/spool: here {paths['spool']})")
    r.add_argument("--dsn", help=f"store DSN (default LIVESTEP_CLICKHOUSE_DSN, else chdb://<LIVESTEP_HOME or "
                   f"./var>/chdb: here {paths['dsn']})")
    r.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # the collector's own settings (collector -> api would be an edge against the layers)
    try:
        settings = CollectorSettings(**{k: v for k, v in {"clickhouse_dsn": args.dsn, "spool_dir": args.spool_dir}.items()
                                        if v is not None})
    except ValidationError as e:
        raise RequeueError("; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())) from e
    spool_dir = Path(settings.spool_dir)
    store = open_store(settings.clickhouse_dsn)
    store.migrate()
    outcomes = requeue(spool_dir, store)
    if not outcomes:
        print(f"no quarantined batches in {os.fspath(spool_dir / 'quarantine')}")
        return 0
    for o in outcomes:
        what = (f"stored {o.stored} of {o.rows} rows" + (" (the rest were stored already)" if o.stored < o.rows else "")
                if o.error is None else f"still refused, kept: {o.error}")
        print(f"batch {o.seq} ({o.kind}, {o.rows} rows): {what}")
    left = sum(o.error is not None for o in outcomes)
    print(f"{len(outcomes) - left} requeued, {left} still quarantined")
    return 1 if left else 0
