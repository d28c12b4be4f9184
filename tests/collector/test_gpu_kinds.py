"""GPU kinds are canonical at ingest: the worker's device name is stored as its kind, unknown names as a slug."""

from datetime import UTC, datetime

import pyarrow as pa
import pytest

from collector import records
from collector.gpu_kinds import canonical_gpu_kind
from collector.routes import ARROW_STREAM, parse_body
from collector.spool import IpcStream


@pytest.mark.parametrize("name,kind", [
    ("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA B200", "b200"), ("h200", "h200"),
    ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA GH200 480GB", "gh200"), ("AMD Instinct MI300X", "mi300x"),
    ("cpu", "cpu"), ("NVIDIA GeForce RTX 4090", "geforce-rtx-4090"),
])
def test_device_names_map_to_kinds(name, kind):
    assert canonical_gpu_kind(name) == kind
    assert canonical_gpu_kind(kind) == kind  # idempotent: a canonical kind is its own


def test_an_unknown_name_is_a_stable_slug_never_empty():
    assert canonical_gpu_kind("Some Vendor X-9000") == canonical_gpu_kind("some vendor x 9000") == "some-vendor-x-9000"
    odd = canonical_gpu_kind("ÄÖ")
    assert odd and odd == canonical_gpu_kind("ÄÖ") and len(canonical_gpu_kind("Z" * 128)) <= 128


def _session(**over):
    row = {"worker_id": "w", "session_id": "s", "release": "r1", "gpu_kind": "NVIDIA H200", "ts": datetime.now(UTC),
           "phase": "end", "first_forward_tokens": 1024, "streamed_s": 1.0, "frames": 4, "late_chunks": 0,
           "stall_ms": 0.0, "tp_size": 1, "shape": "tiny", "switches": "", "gpu_mem_total_bytes": 150_000_000_000}
    row.update(over)
    return row


def test_json_records_store_the_kind_and_the_gpu_memory():
    r = records.SessionRecord(**_session())
    assert r.gpu_kind == "h200" and r.gpu_mem_total_bytes == 150_000_000_000
    assert records.SessionRecord(**_session(gpu_mem_total_bytes=None)).gpu_mem_total_bytes is None


def _arrow(rows) -> bytes:
    sink = pa.BufferOutputStream()
    t = records.to_arrow("session", rows)
    with pa.ipc.new_stream(sink, t.schema) as w:
        w.write_table(t)
    return sink.getvalue().to_pybytes()


def test_arrow_bodies_store_the_kind():
    got = parse_body(ARROW_STREAM, _arrow([_session(), _session(gpu_kind="NVIDIA H100 80GB HBM3")]))["session"]
    assert not isinstance(got, IpcStream)  # rewritten, not spooled as sent
    assert got.column("gpu_kind").to_pylist() == ["h200", "h100"]
    same = parse_body(ARROW_STREAM, _arrow([_session(gpu_kind="h200")]))["session"]
    assert isinstance(same, IpcStream)  # already canonical: the body is spooled as is
