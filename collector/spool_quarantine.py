"""The spool's dead letters: batches the store refused for their content, kept aside as files.

    q = Quarantine(spool_dir)
    q.put(seq, kind, table, batch_id, error)   # <dir>/quarantine/<seq>-<kind>.arrow + .error.txt
    q.stats(); q.remove(seq, kind)
    quarantined(spool_dir)                      # what ``livestep spool requeue`` stores

Written by the block writer (collector/writer.py) only for a batch refused alone three times; never
final: ``livestep spool requeue`` (collector/requeue.py) stores them once the cause is fixed.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pyarrow as pa

from collector.records import ARROW_SCHEMAS
from collector.spool_storage import fsync_dir, write_durable


class Quarantined(NamedTuple):
    """One quarantined batch's rows of one kind, as the block writer left them."""

    seq: int
    kind: str
    path: Path  # the Arrow IPC stream (``path.with_suffix(".error.txt")``: why)
    rows: int


def quarantine_paths(directory: Path, seq: int, kind: str) -> tuple[Path, Path]:
    """The quarantine files of batch ``seq``'s ``kind`` rows: (Arrow IPC stream, error text)."""
    path = Path(directory) / "quarantine" / f"{seq:020d}-{kind}.arrow"
    return path, path.with_suffix(".error.txt")


def quarantined(directory: Path | str) -> list[Quarantined]:
    """The quarantined batches of the spool in ``directory``, in spool order."""
    out = []
    for p in sorted((Path(directory) / "quarantine").glob("*-*.arrow")):
        seq, _, kind = p.stem.partition("-")
        if not seq.isdigit() or kind not in ARROW_SCHEMAS:
            continue
        try:
            rows = sum(b.num_rows for b in pa.ipc.open_stream(p.read_bytes()))
        except (OSError, pa.ArrowException):
            rows = 0
        out.append(Quarantined(int(seq), kind, p, rows))
    return out


def remove(directory: Path, seq: int, kind: str) -> bool:
    """Remove batch ``seq``'s quarantined ``kind`` rows durably (with ``write_durable``'s tmp files).
    True if there were any."""
    path, err = quarantine_paths(directory, seq, kind)
    removed = False
    for p in (path, err, *(q.with_suffix(q.suffix + ".tmp") for q in (path, err))):
        try:
            p.unlink()
            removed = True
        except FileNotFoundError:
            pass
    if removed:
        fsync_dir(path.parent)
    return removed


class Quarantine:
    """The ``quarantine/`` folder of one spool directory."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self._stats: tuple[int, dict] | None = None

    def put(self, seq: int, kind: str, table: pa.Table, batch_id: str, error: str) -> Path:
        """Keep a batch's ``kind`` rows aside (an Arrow IPC stream + the error), durably."""
        path, err = quarantine_paths(self.dir, seq, kind)
        path.parent.mkdir(exist_ok=True)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
        write_durable(path, sink.getvalue().to_pybytes())
        write_durable(err, f"batch {batch_id}\n{error}\n".encode())
        return path

    def remove(self, seq: int, kind: str) -> bool:
        return remove(self.dir, seq, kind)

    def stats(self) -> dict:
        """{batches, rows} waiting (for health): rescanned when the folder changed (``livestep spool
        requeue`` may have emptied it from another process)."""
        qdir = self.dir / "quarantine"
        try:
            stamp = qdir.stat().st_mtime_ns
        except FileNotFoundError:
            return {"batches": 0, "rows": 0}
        if self._stats is None or self._stats[0] != stamp:
            found = quarantined(self.dir)
            self._stats = (stamp, {"batches": len(found), "rows": sum(q.rows for q in found)})
        return dict(self._stats[1])
