"""A compressed Arrow body is bounded by what it decodes to (collector/ipc_budget.py, the ingest route):
rows and bytes read from the stream's metadata exactly, and a small zstd body that decodes to millions
of rows refused 413 naming the limit, without being decoded."""

from __future__ import annotations

import pyarrow as pa
import pytest

from collector import records
from collector.ipc_budget import decoded_size
from collector.routes import ARROW_STREAM, BadBatchError, parse_body
from tests.collector.helpers import ARROW, arrow_body, step_rows


def _stream(table: pa.Table, compression: str | None, repeat: int = 1, chunk: int | None = None) -> bytes:
    """``table`` written ``repeat`` times as one IPC stream (a bomb is many copies of one small batch)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema, options=pa.ipc.IpcWriteOptions(compression=compression)) as w:
        for _ in range(repeat):
            w.write_table(table, max_chunksize=chunk)
    return sink.getvalue().to_pybytes()


def _bomb(rows: int) -> bytes:
    one = records.to_arrow("step", step_rows(1) * 10_000)  # one row repeated: zstd makes it small
    return _stream(one, "zstd", repeat=rows // 10_000)


@pytest.mark.parametrize("compression", [None, "zstd", "lz4"])
def test_the_metadata_says_exactly_what_a_stream_decodes_to(compression):
    table = records.to_arrow("step", step_rows(1000))
    body = _stream(table, compression, chunk=300)
    got = pa.ipc.open_stream(body).read_all()
    assert decoded_size(body) == (got.num_rows, got.get_total_buffer_size()) and got.num_rows == 1000
    dict_table = pa.table({"a": pa.array(["x" * 100] * 1000).dictionary_encode()})  # dictionaries count too
    dict_body = _stream(dict_table, compression)
    assert decoded_size(dict_body).bytes >= 1000 * 4 + 100


def test_a_small_zstd_body_decoding_to_millions_of_rows_is_413_and_never_decoded(collector):
    c = collector()
    bomb = _bomb(2_000_000)
    rows, decoded = decoded_size(bomb)
    assert rows == 2_000_000 and decoded > 10 * len(bomb) and len(bomb) < 32 << 20  # ~320 MB from ~26 MB
    pool = pa.default_memory_pool()
    before = pool.bytes_allocated()
    peak_before = pool.max_memory()
    r = c.post("/v1/telemetry", content=bomb, headers={"content-type": ARROW})
    assert r.status_code == 413, r.text
    assert f"over the limit of {records.MAX_BATCH_ROWS} rows per request" in r.json()["detail"]
    # the server decoded none of it: Arrow's peak did not rise by anything near the bomb's size
    assert pool.max_memory() - max(peak_before, before) < 16 << 20, (peak_before, pool.max_memory())
    ok = c.post("/v1/telemetry", content=arrow_body("step", step_rows(5)), headers={"content-type": ARROW})
    assert ok.status_code == 200, ok.text


def test_decoded_bytes_are_bounded_too(collector):
    c = collector(max_decoded_bytes=1 << 20)
    body = _stream(records.to_arrow("step", step_rows(20_000)), "zstd")  # ~3 MB decoded, well under the rows bound
    assert len(body) < 1 << 20 < decoded_size(body).bytes
    r = c.post("/v1/telemetry", content=body, headers={"content-type": ARROW})
    assert r.status_code == 413, r.text
    assert "over the limit of 1048576 decoded bytes per request (LIVESTEP_MAX_DECODED_BYTES)" in r.json()["detail"]
    small = _stream(records.to_arrow("step", step_rows(200)), "zstd")  # a compressed body within bounds is stored
    r = c.post("/v1/telemetry", content=small, headers={"content-type": ARROW})
    assert r.status_code == 200 and r.json()["rows"] == {"step": 200}, r.text


def test_a_content_encoding_is_415_saying_what_to_send(collector):
    c = collector()
    r = c.post("/v1/telemetry", content=b"\x1f\x8b\x08\x00", headers={"content-type": "application/json",
                                                                      "content-encoding": "gzip"})
    assert r.status_code == 415 and "Content-Encoding 'gzip' is not supported" in r.json()["detail"]


def test_lying_metadata_is_400_not_a_crash():
    body = bytearray(_stream(records.to_arrow("step", step_rows(50)), "zstd"))
    i = body.find((50).to_bytes(8, "little"))  # RecordBatch.length in the batch's metadata
    body[i:i + 8] = (-(2**62)).to_bytes(8, "little", signed=True)
    with pytest.raises(BadBatchError) as e:
        parse_body(ARROW_STREAM, bytes(body))
    assert e.value.status == 400


def test_a_body_that_decodes_large_is_parsed_off_the_event_loop(collector, monkeypatch):
    import asyncio

    import collector.routes as routes

    where = []
    parse = routes.parse_body

    def recording(*args, **kw):
        try:
            asyncio.get_running_loop()
            where.append("event loop")
        except RuntimeError:
            where.append("thread pool")
        return parse(*args, **kw)

    monkeypatch.setattr(routes, "parse_body", recording)
    c = collector()
    small = _stream(records.to_arrow("step", step_rows(1) * 20_000), "zstd")  # < 1 MiB sent, ~3 MB decoded
    assert len(small) < 1 << 20 < decoded_size(small).bytes
    assert c.post("/v1/telemetry", content=small, headers={"content-type": ARROW}).status_code == 200
    tiny = arrow_body("step", step_rows(5))  # the hot path's 100-row batches stay on the loop (no hop)
    assert c.post("/v1/telemetry", content=tiny, headers={"content-type": ARROW}).status_code == 200
    assert where == ["thread pool", "event loop"]
