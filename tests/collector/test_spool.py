"""The spool: durable appends in order, duplicates stored once, torn tails cut, bounded, replayable."""

from __future__ import annotations

import pyarrow as pa
import pytest

from collector import records
from collector.spool import IpcStream, Spool, SpoolFullError
from tests.collector.helpers import step_rows


def _t(n, start=0, sid="s1"):
    return {"step": records.to_arrow("step", step_rows(n, session_id=sid, start=start))}


def _steps(spool, entries):
    return [s for t in spool.read(entries).get("step", []) for s in t.column("step").to_pylist()]


def test_acked_batches_survive_reopen_in_order(tmp_path):
    sp = Spool(tmp_path, max_bytes=1 << 24)
    acks = [sp.submit(f"b{i}", _t(3, start=3 * i)).result() for i in range(4)]
    assert [a.seq for a in acks] == [1, 2, 3, 4] and not any(a.duplicate for a in acks)
    assert acks[0].rows == {"step": 3}
    sp.close()
    sp = Spool(tmp_path, max_bytes=1 << 24)
    entries = sp.take(max_rows=1000)
    assert [e.batch_id for e in entries] == ["b0", "b1", "b2", "b3"]
    assert _steps(sp, entries) == list(range(12))
    sp.close()


def test_duplicate_batch_is_spooled_once(tmp_path):
    sp = Spool(tmp_path, max_bytes=1 << 24)
    acks = [sp.submit("same", _t(5)).result() for _ in range(10)]
    assert [a.duplicate for a in acks] == [False] + [True] * 9
    assert all(a.rows == {"step": 5} for a in acks)
    assert sp.stats()["batches"] == 1
    sp.close()


def test_torn_tail_is_cut_and_appends_continue(tmp_path):
    sp = Spool(tmp_path, max_bytes=1 << 24)
    sp.submit("b0", _t(2)).result()
    sp.close()
    seg = max(tmp_path.glob("seg-*.log"))
    with open(seg, "ab") as f:  # a crash mid-write: half a header, never acked
        f.write(b"LSP1\x00\x01")
    sp = Spool(tmp_path, max_bytes=1 << 24)
    assert seg.stat().st_size > 0 and [e.batch_id for e in sp.take(100)] == ["b0"]
    assert sp.submit("b1", _t(2, start=2)).result().seq == 2
    assert _steps(sp, sp.take(100)) == [0, 1, 2, 3]
    sp.close()


def test_committed_batches_are_forgotten_but_their_ids_remembered(tmp_path):
    sp = Spool(tmp_path, max_bytes=1 << 24, segment_bytes=64 * 1024)
    for i in range(30):  # several segments
        sp.submit(f"b{i}", _t(50, start=50 * i)).result()
    assert len(list(tmp_path.glob("seg-*.log"))) > 2
    entries = sp.take(max_rows=10_000)
    sp.log_intent(entries[0].seq, entries[-1].seq)
    sp.mark_committed(entries[-1].seq)
    assert sp.stats()["batches"] == 0 and sp.stats()["bytes"] == 0
    assert len(list(tmp_path.glob("seg-*.log"))) == 1  # only the active segment is left
    sp.close()
    sp = Spool(tmp_path, max_bytes=1 << 24)
    assert sp.take(100) == []
    assert sp.submit("b7", _t(50)).result().duplicate  # a late retry of a stored batch
    assert sp.submit("new", _t(1)).result().seq == 31
    sp.close()


def test_uncommitted_intent_is_recovered(tmp_path):
    sp = Spool(tmp_path, max_bytes=1 << 24)
    for i in range(3):
        sp.submit(f"b{i}", _t(1, start=i)).result()
    sp.log_intent(1, 2)  # crash after logging the block, before its commit
    sp.close()
    sp = Spool(tmp_path, max_bytes=1 << 24)
    assert sp.recovered_intent == (1, 2)
    assert [e.seq for e in sp.entries_between(1, 2)] == [1, 2]
    sp.close()


def test_over_bound_is_refused_with_retry_after(tmp_path):
    sp = Spool(tmp_path, max_bytes=64 * 1024)
    with pytest.raises(SpoolFullError, match="retry after") as e:
        for i in range(1000):
            sp.submit(f"b{i}", _t(20)).result()
    assert e.value.retry_after_s >= 1
    assert 0 < sp.stats()["bytes"] <= 64 * 1024
    sp.close()


def test_async_submits_share_writes_and_twins_are_acked_once(tmp_path):
    import asyncio

    sp = Spool(tmp_path, max_bytes=1 << 24)

    async def main():
        unique = [sp.submit_async(f"u{i}", _t(2, start=2 * i)) for i in range(20)]
        twins = [sp.submit_async("twin", _t(3, start=100)) for _ in range(5)]
        return await asyncio.gather(*unique, *twins)

    acks = asyncio.run(main())
    assert [a.duplicate for a in acks[20:]].count(False) == 1
    assert all(a.rows == {"step": 3} for a in acks[20:])
    assert sorted(a.seq for a in acks if not a.duplicate) == list(range(1, 22))
    sp.close()
    sp = Spool(tmp_path, max_bytes=1 << 24)
    assert len(sp.take(10_000)) == 21
    sp.close()


def test_batches_read_from_memory_equal_the_same_batches_read_back_from_disk(tmp_path, monkeypatch):
    from collector import spool as spool_mod

    t = records.to_arrow("step", step_rows(4, start=100))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, t.schema) as w:
        w.write_table(t)
    stream = IpcStream(sink.getvalue().to_pybytes(), t.num_rows, t)
    monkeypatch.setattr(spool_mod, "RECENT_BYTES", 3 * 4096)  # room for some batches only: the rest from disk
    sp = Spool(tmp_path, max_bytes=1 << 24)
    for i in range(6):  # tables, IPC streams with their table, one IPC stream without
        tables = _t(3, start=3 * i) if i % 2 else {"step": stream if i != 4 else stream._replace(table=None)}
        sp.submit(f"b{i}", tables).result()
    mem = sp.read(sp.take(max_rows=1000))
    assert 0 < len(sp._recent) < 6  # both paths taken
    sp.close()
    sp = Spool(tmp_path, max_bytes=1 << 24)
    entries = sp.take(max_rows=1000)
    disk = sp.read(entries)
    assert [x.to_pylist() for x in mem["step"]] == [x.to_pylist() for x in disk["step"]]
    assert len(mem["step"]) == 6
    sp.close()
