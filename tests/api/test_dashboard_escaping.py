"""Labels come from workers: a session id or worker id that is HTML shows as text on every dashboard
table, and a link to a session's page carries its id percent-encoded."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from api import dashboard as d
from collector import records
from tests.collector.helpers import step_rows

HOSTILE = '<a href="x"><img src=x onerror=alert(1)>'
END = datetime(2026, 11, 10, 12, tzinfo=UTC)
RANGE = {"start": (END - timedelta(days=1)).isoformat(), "end": END.isoformat()}


@pytest.fixture
def hostile(store):
    t0 = END - timedelta(hours=2)
    rows = step_rows(24, session_id=HOSTILE, worker_id=HOSTILE, ts=t0)
    store.insert_arrow("steps", records.to_arrow("step", rows), dedup_token="hostile")
    start = {"worker_id": HOSTILE, "session_id": HOSTILE, "release": "r1", "gpu_kind": "h200", "ts": t0,
             "phase": "start", "first_forward_tokens": 700, "streamed_s": 0.0, "frames": 0, "avg_fps": None,
             "late_chunks": 0, "stall_ms": 0.0, "tp_size": 3, "shape": "prod57b", "switches": ""}
    records.SessionRecord.model_validate(start)
    store.insert_arrow("sessions", records.to_arrow("session", [start]), dedup_token="hostile-session")
    return store


@pytest.mark.parametrize("path", ["/dashboard/sessions", "/dashboard/memory"])
def test_worker_labels_are_text_in_tables(client, hostile, path):
    r = client.get(path, params=RANGE)
    assert r.status_code == 200, r.text
    assert "<img" not in r.text and 'onerror=alert(1)>' not in r.text
    assert "&lt;img src=x onerror=alert(1)&gt;" in r.text  # shown, as text
    if path == "/dashboard/sessions":
        assert 'href="/dashboard/sessions/%3Ca%20href%3D%22x%22%3E%3Cimg%20src%3Dx%20onerror%3Dalert%281%29%3E"' in r.text


def test_link_cells_escape_text_and_address():
    html = d.table([{"a": d.Link('/p?x="1"&y=<2>', "<b>t</b>"), "b": "<a href='evil'>x</a>"}])
    assert "<td><a href=\"/p?x=&quot;1&quot;&amp;y=&lt;2&gt;\">&lt;b&gt;t&lt;/b&gt;</a></td>" in html
    assert "<a href='evil'>" not in html  # a string starting like a link is text
