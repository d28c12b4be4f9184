"""The spool's storage and journal alone (collector/spool_storage.py, collector/spool_journal.py):
records round-trip and survive a restart, a torn tail is cut, segments rotate and are given back only
when stored; the writer's journal recovers the block in flight."""

from __future__ import annotations

from collector import records
from collector.spool_journal import Journal
from collector.spool_storage import SegmentStorage, decode_payload, encode_payload
from tests.collector.helpers import step_rows


def _payload(i: int) -> tuple[bytes, dict[str, int]]:
    return encode_payload(f"b{i}", {"step": records.to_arrow("step", step_rows(3, session_id=f"s{i}"))})


def _append(st: SegmentStorage, seqs: range):
    out = []
    for i in seqs:
        payload, rows = _payload(i)
        out += st.append([(i, f"b{i}", rows, payload)])
    return out


def test_records_round_trip_and_are_found_again_after_a_restart(tmp_path):
    st = SegmentStorage(tmp_path, segment_bytes=1 << 20)
    assert st.scan(lambda e, p: None) == 0
    st.open_active(1)
    entries = _append(st, range(1, 6))
    assert [decode_payload(st.read(e))[0] for e in entries] == [f"b{i}" for i in range(1, 6)]
    st.close()
    found = []
    again = SegmentStorage(tmp_path, segment_bytes=1 << 20)
    assert again.scan(lambda e, p: found.append((e.seq, e.batch_id, decode_payload(p)[1]["step"].num_rows))) == 5
    assert found == [(i, f"b{i}", 3) for i in range(1, 6)]


def test_a_torn_tail_is_cut_at_start(tmp_path):
    st = SegmentStorage(tmp_path, segment_bytes=1 << 20)
    st.scan(lambda e, p: None)
    st.open_active(1)
    [e] = _append(st, range(1, 2))
    st.close()
    with open(e.segment, "ab") as f:  # a crash in the middle of the next record
        f.write(b"LSP1\x00\x01")
    size = e.segment.stat().st_size
    again = SegmentStorage(tmp_path, segment_bytes=1 << 20)
    assert again.scan(lambda e, p: None) == 1
    assert e.segment.stat().st_size == size - 6


def test_segments_rotate_and_are_given_back_only_once_stored(tmp_path):
    st = SegmentStorage(tmp_path, segment_bytes=1)  # every append fills a segment
    st.scan(lambda e, p: None)
    st.open_active(1)
    entries = _append(st, range(1, 4))
    assert len({e.segment for e in entries}) == 3
    assert set(st.stored(2)) == {entries[0].segment, entries[1].segment}
    st.delete(list(st.stored(2)))
    assert not entries[0].segment.exists() and entries[2].segment.exists()


def test_the_active_segment_rotates_away_only_when_all_of_it_is_stored(tmp_path):
    st = SegmentStorage(tmp_path, segment_bytes=1 << 20)
    st.scan(lambda e, p: None)
    st.open_active(1)
    entries = _append(st, range(1, 4))
    assert not st.rotate_if_stored(2, min_bytes=0, next_seq=4)  # batch 3 not stored yet
    assert not st.rotate_if_stored(3, min_bytes=1 << 30, next_seq=4)  # stored, but small: kept
    assert st.rotate_if_stored(3, min_bytes=0, next_seq=4)
    assert list(st.stored(3)) == [entries[0].segment]


def test_the_journal_recovers_the_block_in_flight_and_forgets_a_committed_one(tmp_path):
    j = Journal(tmp_path)
    assert (j.committed, j.intent, j.split) == (0, None, None)
    j.log_intent(1, 5)
    j.log_split(1, 5, frozenset({"step"}))
    j.close()
    j = Journal(tmp_path)  # a crash before the commit: the block is replayed the same way
    assert (j.committed, j.intent, j.split) == (0, (1, 5), frozenset({"step"}))
    j.log_commit(5)
    j.log_intent(6, 9)
    j.log_commit(9)
    j.close()
    with open(tmp_path / "writer.log", "ab") as f:
        f.write(b"intent 10")  # torn: the intent never completed
    j = Journal(tmp_path)
    assert (j.committed, j.intent) == (9, None)
