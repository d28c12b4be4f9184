"""The telemetry file (collector/telemetry_file.py) and the client's filing of batches into it."""

from __future__ import annotations

import socket

import pyarrow as pa
import pytest

from collector.client import ClientConfigError, TelemetryClient, make_client
from collector.telemetry_file import FILE_SCHEMA, TelemetryFileError, TelemetryFileWriter, read_file
from tests.collector.helpers import event_row, step_rows


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _steps_of(batches) -> list[int]:
    out = []
    for b in batches:
        assert b.kind == "step"
        t = pa.ipc.open_stream(b.body).read_all()
        assert t.num_rows == b.rows
        out += t.column("step").to_pylist()
    return out


def test_a_file_only_client_files_every_batch_with_its_key(tmp_path):
    path = tmp_path / "t.arrows"
    c = TelemetryClient(None, telemetry_file=path, batch_rows=10)
    for r in step_rows(25):
        c.put("step", r)
    c.put("event", event_row())
    assert c.close(5.0)
    assert c.stats() | {"dropped_by": None} == {"sent": 0, "filed": 26, "dropped": 0, "failed_batches": 0,
                                                 "retries": 0, "buffered": 0, "dropped_by": None}
    scan = read_file(path)
    assert (scan.streams, scan.torn, scan.closed) == (1, False, True)
    assert sorted(b.rows for b in scan.batches) == [1, 5, 10, 10]
    assert len({b.batch_id for b in scan.batches}) == 4
    # any Arrow reader opens the file: one row per batch
    t = pa.ipc.open_stream(path.read_bytes()).read_all()
    assert t.schema.equals(FILE_SCHEMA) and t.num_rows == 4
    assert sorted(_steps_of([b for b in scan.batches if b.kind == "step"])) == list(range(25))


def test_a_collector_that_cannot_be_reached_costs_nothing_with_a_file(tmp_path):
    path = tmp_path / "t.arrows"
    c = TelemetryClient(f"http://127.0.0.1:{_closed_port()}", telemetry_file=path, batch_rows=10,
                        give_up_after_s=0.2, backoff_base_s=0.01, backoff_max_s=0.05, report_drops_s=0.01)
    for r in step_rows(30):
        c.put("step", r)
    assert c.close(10.0)
    assert (c.sent, c.filed, c.dropped, c.failed_batches) == (0, 30, 0, 0)
    assert sorted(_steps_of(read_file(path).batches)) == list(range(30))  # and no telemetry_dropped: nothing was lost


def test_a_torn_tail_is_left_out_and_the_next_writer_repairs_it(tmp_path):
    path = tmp_path / "t.arrows"
    w = TelemetryFileWriter(path)
    for i in range(3):
        w.write(f"k{i}", "step", 1, b"x" * (100 + i))
    w._file.flush()
    whole = path.read_bytes()  # the worker died here: no end-of-stream marker
    scan = read_file(path)
    assert ([b.batch_id for b in scan.batches], scan.torn, scan.closed) == (["k0", "k1", "k2"], False, False)
    path.write_bytes(whole[:-20])  # ... or mid-write: the last batch is cut short
    scan = read_file(path)
    assert [b.batch_id for b in scan.batches] == ["k0", "k1"] and scan.torn
    w2 = TelemetryFileWriter(path)  # a later run appends after repairing the end of the first stream
    w2.write("k3", "event", 2, b"y" * 8)
    w2.close()
    scan = read_file(path)
    assert [b.batch_id for b in scan.batches] == ["k0", "k1", "k3"]
    assert (scan.streams, scan.torn, scan.closed) == (2, False, True)
    assert scan.batches[2].body == b"y" * 8 and scan.batches[2].rows == 2


def test_not_a_telemetry_file_is_refused_never_appended_to(tmp_path):
    other = tmp_path / "other.arrows"
    table = pa.table({"a": [1, 2]})
    with pa.ipc.new_stream(str(other), table.schema) as w:
        w.write_table(table)
    before = other.read_bytes()
    with pytest.raises(TelemetryFileError, match="not a livestep telemetry file"):
        read_file(other)
    with pytest.raises(ClientConfigError, match="not a livestep telemetry file"):
        TelemetryClient(None, telemetry_file=other)
    assert other.read_bytes() == before
    with pytest.raises(ClientConfigError, match="telemetry file"):
        TelemetryClient(None, telemetry_file=tmp_path)  # a directory
    with pytest.raises(ClientConfigError, match="a collector URL or a telemetry file"):
        TelemetryClient(None)
    assert isinstance(make_client(None, telemetry_file=tmp_path / "n.arrows"), TelemetryClient)


def test_a_full_disk_is_a_counted_loss_never_an_exception(tmp_path):
    c = TelemetryClient(None, telemetry_file="/dev/full", batch_rows=5, report_drops_s=None)
    for r in step_rows(10):
        c.put("step", r)  # never raises
    assert not c.close(5.0)
    st = c.stats()
    assert (st["filed"], st["dropped"], st["dropped_by"]) == (0, 10, {"file_error": 10})
    assert "No space left" in c.last_error
