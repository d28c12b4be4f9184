"""The telemetry file: batches recorded now, shipped later (``--telemetry-file``, ``livestep replay``).

    w = TelemetryFileWriter(path)                     # appends; the client's sender thread writes
    w.write(batch_id, "step", rows, body); w.close()
    scan = read_file(path)                            # scan.batches: [FileBatch], scan.torn: bool

The file is an Arrow IPC stream (``application/vnd.apache.arrow.stream``) of ``FILE_SCHEMA``: one
row per batch the client would have POSTed -- its ``batch_id`` (the ``Idempotency-Key``), its record
``kind``, its ``rows`` and its ``body``, the exact Arrow IPC stream of that kind's rows
(``client.encode_arrow``). ``livestep replay`` POSTs each body under its key, so the collector
stores a batch once however often the file is replayed, and a batch shipped live before it was
also filed (its ack lost) is not stored twice.

Why this and not the spool's segment format: any Arrow reader opens the file
(``pa.ipc.open_stream(path).read_all()``), the bodies are byte for byte what the collector ingests
(no re-encoding on replay), and the worker does not depend on the collector's spool internals.
What the spool's CRC framing gives -- a torn tail after a crash -- the stream's own framing gives
too: every message carries its length, so a batch cut short by a crash is recognised and left
out (``torn``). Each writer (one per client) appends its own stream; a file written by several
runs is their streams one after another, which ``read_file`` reads in order. A writer opening a
file whose last stream was cut by a crash first truncates the partial batch and ends that stream.

Imports only pyarrow: the GPU machine's worker path has no server packages.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

FORMAT_VERSION = "1"
FILE_SCHEMA = pa.schema(
    [
        pa.field("batch_id", pa.string(), nullable=False),
        pa.field("kind", pa.string(), nullable=False),
        pa.field("rows", pa.int32(), nullable=False),
        pa.field("body", pa.binary(), nullable=False),
    ],
    metadata={b"livestep.telemetry_file": FORMAT_VERSION.encode()},
)
_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # an Arrow IPC stream's end-of-stream marker


class TelemetryFileError(ValueError):
    """The file is not a telemetry file (or not one this version reads)."""


@dataclass(frozen=True)
class FileBatch:
    batch_id: str
    kind: str
    rows: int
    body: bytes


@dataclass
class FileScan:
    """What ``read_file`` found: the complete batches, in order, and where the good bytes end."""

    batches: list[FileBatch] = field(default_factory=list)
    streams: int = 0
    torn: bool = False  # the last stream ends in a partial message (a crash mid-write)
    good_end: int = 0  # bytes up to the last complete message
    closed: bool = True  # the last stream ends with its end-of-stream marker


def read_file(path: str | Path) -> FileScan:
    """Every complete batch of every stream in the file; a torn tail is left out and flagged."""
    data = Path(path).read_bytes()
    scan = FileScan()
    br = pa.BufferReader(pa.py_buffer(data))
    while br.tell() < len(data):
        reader = pa.ipc.MessageReader.open_stream(br)
        schema = None
        while True:
            before = br.tell()
            try:
                msg = reader.read_next_message()
            except StopIteration:  # end-of-stream marker, or the end of the file
                scan.closed = data[before : before + len(_EOS)] == _EOS
                scan.good_end = br.tell()
                break
            except (pa.ArrowInvalid, OSError):  # a message cut short
                scan.torn, scan.closed = True, False
                return scan
            if msg.type == "schema":  # a stream's start (a writer that died unrepaired may precede it)
                schema = pa.ipc.read_schema(msg)
                if (schema.metadata or {}).get(b"livestep.telemetry_file") != FORMAT_VERSION.encode():
                    raise TelemetryFileError(
                        f"{path} is not a livestep telemetry file (version {FORMAT_VERSION}): its schema is {schema}"
                    )
                scan.streams += 1
            elif schema is None or msg.type != "record batch":
                raise TelemetryFileError(f"{path}: byte {before} is not a telemetry file's message ({msg.type})")
            else:
                batch = pa.ipc.read_record_batch(msg, schema)
                for r in batch.to_pylist():
                    scan.batches.append(FileBatch(r["batch_id"], r["kind"], r["rows"], r["body"]))
            scan.good_end = br.tell()
        if not scan.closed:
            break  # a stream without its end marker is the file's last
    return scan


class TelemetryFileWriter:
    """Appends batches to a telemetry file as one Arrow IPC stream (one record batch per write).

    Each ``write`` reaches the OS before it returns (a crash of the worker loses nothing written;
    ``fsync`` only at ``close``: a crash of the machine may). Called from the client's sender thread;
    a lock makes it safe from any thread. Raises ``OSError`` / ``TelemetryFileError`` (the client
    counts the batch as lost, reason ``file_error``).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists() and self.path.stat().st_size:
            scan = read_file(self.path)  # raises on a file that is not ours: never append to it
            if scan.torn or not scan.closed:  # a crash cut the last stream: end it where it was whole
                with open(self.path, "r+b") as f:
                    f.truncate(scan.good_end)
                    f.seek(scan.good_end)
                    if scan.streams and not scan.closed:
                        f.write(_EOS)
        self._file = open(self.path, "ab")  # noqa: SIM115 - held until close()
        self._writer = pa.ipc.new_stream(self._file, FILE_SCHEMA)  # the schema reaches the OS with the first batch
        self.batches = 0
        self.rows = 0

    def write(self, batch_id: str, kind: str, rows: int, body: bytes) -> None:
        batch = pa.record_batch([pa.array([batch_id]), pa.array([kind]), pa.array([rows], pa.int32()),
                                 pa.array([body], pa.binary())], schema=FILE_SCHEMA)
        with self._lock:
            self._writer.write_batch(batch)
            self._file.flush()
            self.batches += 1
            self.rows += rows

    def close(self) -> None:
        """End the stream, fsync, close. Idempotent."""
        with self._lock:
            if self._file.closed:
                return
            try:
                self._writer.close()
                self._file.flush()
                os.fsync(self._file.fileno())
            finally:
                self._file.close()
