"""Unit tests of the shipping client (collector/client.py) against a scripted stand-in collector.

``fake_collector`` is a real HTTP/1.1 server (http.server on an ephemeral loopback port) that
answers the next scripted status for each request (then 200) and records what it received:
method, path, headers and the decoded Arrow table. It is not our collector (tests of the real one
live in tests/e2e); it stands in for the network peer only.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import orjson
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from collector import client as client_mod
from collector.client import (
    AT_EXIT_TIMEOUT_S,
    ClientConfigError,
    NullClient,
    TelemetryClient,
    ingest_url,
    make_client,
    retry_after_s,
)


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    status: int
    table: pa.Table | None


@dataclass
class FakeCollector:
    url: str
    script: list[tuple[int, dict[str, str]]] = field(default_factory=list)  # (status, headers) per request
    received: list[Received] = field(default_factory=list)
    hold: threading.Event = field(default_factory=threading.Event)  # clear() to stall requests
    lock: threading.Lock = field(default_factory=threading.Lock)

    def answer(self, *statuses: int | tuple[int, dict[str, str]]) -> None:
        with self.lock:
            self.script.extend(s if isinstance(s, tuple) else (s, {}) for s in statuses)

    def acked(self) -> list[Received]:
        with self.lock:
            return [r for r in self.received if r.status == 200]

    def acked_rows(self, kind: str | None = None) -> int:
        return sum(
            r.table.num_rows
            for r in self.acked()
            if kind is None or r.table.schema.metadata[b"livestep.kind"].decode() == kind
        )

    def wait_requests(self, n: int, timeout_s: float = 10.0) -> bool:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            with self.lock:
                if len(self.received) >= n:
                    return True
            time.sleep(0.01)
        return False


def _handler(fake: FakeCollector):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the client expects
        disable_nagle_algorithm = True  # headers and body go out in two writes

        def log_message(self, *args):  # quiet
            pass

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            fake.hold.wait(30)
            with fake.lock:
                status, extra = fake.script.pop(0) if fake.script else (200, {})
            table = None
            try:
                table = pa.ipc.open_stream(body).read_all()
            except Exception:  # noqa: BLE001 - recorded as None
                table = None
            with fake.lock:
                fake.received.append(Received(self.path, dict(self.headers), status, table))
            rows = table.num_rows if table is not None else 0
            payload = b'{"batch_id": "x", "rows": {}, "duplicate": false, "n": %d}' % rows
            if status != 200:
                payload = b'{"detail": "scripted failure"}'
            self.send_response(status)
            for k, v in extra.items():
                self.send_header(k, v)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

    return Handler


@contextlib.contextmanager
def running_fake():
    fake = FakeCollector(url="")
    fake.hold.set()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(fake))
    server.daemon_threads = True
    fake.url = f"http://127.0.0.1:{server.server_address[1]}"
    t = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    try:
        yield fake
    finally:
        fake.hold.set()
        server.shutdown()
        server.server_close()


@pytest.fixture
def fake_collector():
    with running_fake() as fake:
        yield fake


# ---------------------------------------------------------------------------------------------
# the tests


REPO = client_mod.__file__.rsplit("/collector/", 1)[0]
T0 = datetime(2026, 11, 29, 10, 0, 0, tzinfo=UTC)
_LABELS = {"worker_id": "w1", "session_id": "s1", "release": "v1", "gpu_kind": "H200"}


def step_row(i: int, **over) -> dict:
    row = dict(
        _LABELS,
        ts=T0 + timedelta(milliseconds=167 * i),
        step=i,
        diffusion_ms=150.0 + i / 10,
        step_period_ms=166.7,
        decode_ms=None,
        cache_upkeep_ms=6.2,
        attention_ms=None,
        allreduce_ms=None,
        late=i % 7 == 0,
        playout_depth=3,
        reset_step=i % 42 == 0,
        energy_mj=None,
        mem_allocated_bytes=1 << 30,
        mem_reserved_bytes=2 << 30,
        buffers_registered=1,
        switches="fp8_cache,ring_cache",
    )
    row.update(over)
    return row


def event_row(i: int) -> dict:
    return dict(
        _LABELS, ts=T0 + timedelta(seconds=i), kind="switch_applied", detail={"switch": "fp8_cache", "i": i}
    )


def new_client(fake: FakeCollector, **kw) -> TelemetryClient:
    opts = {
        "token": "tok",
        "batch_rows": 10,
        "flush_interval_s": 30.0,
        "backoff_base_s": 0.01,
        "backoff_max_s": 0.05,
        "report_drops_s": None,  # exact counts below; the drop event has its own test
    }
    opts.update(kw)
    return TelemetryClient(fake.url, **opts)


def test_batches_by_size_per_kind_with_headers_and_values(fake_collector):
    c = new_client(fake_collector)
    for i in range(25):
        c.put("step", step_row(i))
        if i % 10 == 0:
            c.put("event", event_row(i))
    assert c.flush(10.0)
    got = fake_collector.acked()
    kinds = [r.table.schema.metadata[b"livestep.kind"].decode() for r in got]
    assert sorted(kinds) == ["event", "step", "step", "step"]
    step_tables = [r.table for r in got if r.table.schema.metadata[b"livestep.kind"] == b"step"]
    assert sorted(t.num_rows for t in step_tables) == [5, 10, 10]
    steps = pa.concat_tables(step_tables).sort_by("step")
    assert steps.column("step").to_pylist() == list(range(25))
    assert steps.column("ts").to_pylist() == [T0 + timedelta(milliseconds=167 * i) for i in range(25)]
    assert steps.column("late").to_pylist() == [i % 7 == 0 for i in range(25)]
    events = next(r.table for r in got if r.table.schema.metadata[b"livestep.kind"] == b"event")
    assert events.column("detail").to_pylist()[1] == '{"switch":"fp8_cache","i":10}'
    for r in got:
        assert r.path == "/v1/telemetry"
        assert r.headers["Content-Type"] == "application/vnd.apache.arrow.stream"
        assert r.headers["Authorization"] == "Bearer tok"
    assert len({r.headers["Idempotency-Key"] for r in got}) == len(got)
    assert (c.sent, c.dropped, c.failed_batches, c.buffered) == (28, 0, 0, 0)
    assert c.close()


def test_partial_batch_ships_after_flush_interval_without_flush(fake_collector):
    c = new_client(fake_collector, batch_rows=1000, flush_interval_s=0.05)
    for i in range(3):
        c.put("step", step_row(i))
    assert fake_collector.wait_requests(1)
    assert fake_collector.acked_rows("step") == 3
    c.close()


@pytest.mark.parametrize(
    "failures", [[500], [(429, {"Retry-After": "0"})], [503, 502, (429, {"Retry-After": "0.01"})]]
)
def test_retries_5xx_and_429_under_the_same_key(fake_collector, failures):
    fake_collector.answer(*failures)
    c = new_client(fake_collector)
    for i in range(10):
        c.put("step", step_row(i))
    assert c.flush(10.0)
    got = fake_collector.received
    assert len(got) == len(failures) + 1
    assert len({r.headers["Idempotency-Key"] for r in got}) == 1
    assert all(r.table.equals(got[0].table) for r in got)
    assert (c.sent, c.retries, c.dropped, c.failed_batches) == (10, len(failures), 0, 0)
    c.close()


@pytest.mark.parametrize("status", [400, 401, 403, 413, 415, 422])
def test_4xx_is_not_retried_and_counted(fake_collector, status, caplog):
    fake_collector.answer(status, status)
    c = new_client(fake_collector)
    with caplog.at_level("WARNING", logger="livestep.client"):
        for i in range(20):
            c.put("step", step_row(i))
        assert not c.flush(10.0)
    assert len(fake_collector.received) == 2  # two batches, one attempt each
    assert (c.sent, c.dropped, c.failed_batches, c.retries) == (0, 20, 2, 0)
    assert c.stats()["dropped_by"] == {"unauthorized" if status in (401, 403) else "refused": 20}
    assert sum(f"HTTP {status}" in m for m in caplog.messages) == 1  # logged once
    c.put("step", step_row(99))
    assert c.flush(10.0)
    assert c.sent == 1
    c.close()


def test_gives_up_after_max_attempts_and_counts(fake_collector):
    fake_collector.answer(*[503] * 10)
    c = new_client(fake_collector, max_attempts=3)
    for i in range(10):
        c.put("step", step_row(i))
    assert not c.flush(10.0)
    assert len(fake_collector.received) == 3
    assert len({r.headers["Idempotency-Key"] for r in fake_collector.received}) == 1
    assert (c.sent, c.dropped, c.failed_batches, c.retries, c.buffered) == (0, 10, 1, 2, 0)
    assert c.stats()["dropped_by"] == {"gave_up": 10}
    c.close()


def test_gives_up_after_give_up_time(fake_collector):
    fake_collector.answer(*[(503, {"Retry-After": "5"})] * 10)
    c = new_client(fake_collector, give_up_after_s=0.2)
    c.put("step", step_row(0))
    assert not c.flush(10.0)
    assert len(fake_collector.received) == 1  # Retry-After 5 s lies past the give-up time
    assert (c.dropped, c.failed_batches) == (1, 1)
    c.close()


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_connection_refused_then_collector_appears(fake_collector):
    port = closed_port()
    c = TelemetryClient(
        f"http://127.0.0.1:{port}",
        batch_rows=5,
        flush_interval_s=30.0,
        backoff_base_s=0.05,
        backoff_max_s=0.2,
    )
    for i in range(5):
        c.put("step", step_row(i))
    deadline = time.monotonic() + 10
    while c.retries < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert c.retries >= 2 and c.sent == 0
    server = ThreadingHTTPServer(("127.0.0.1", port), _handler(fake_collector))
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        assert c.flush(10.0)
        assert c.sent == 5 and fake_collector.acked_rows() == 5
        assert c.failed_batches == 0
    finally:
        c.close()
        server.shutdown()
        server.server_close()


def test_full_buffer_drops_new_records_and_put_returns(fake_collector):
    fake_collector.hold.clear()  # the collector stalls: nothing is acked
    c = new_client(fake_collector, max_queue=50)
    for i in range(200):
        c.put("step", step_row(i))  # must return although nothing drains
    assert c.dropped == 150 and c.buffered == 50
    assert c.stats()["dropped_by"] == {"queue_full": 150}
    fake_collector.hold.set()
    assert c.flush(10.0)
    assert (c.sent, c.dropped, c.buffered) == (50, 150, 0)
    assert sorted(
        pa.concat_tables([r.table for r in fake_collector.acked()]).column("step").to_pylist()
    ) == list(range(50))
    c.close()


def test_drops_are_reported_as_a_telemetry_dropped_event(fake_collector):
    fake_collector.hold.clear()
    c = new_client(fake_collector, max_queue=5, report_drops_s=0.01)
    for i in range(20):
        c.put("step", step_row(i))
    assert c.dropped == 15
    fake_collector.hold.set()
    assert c.flush(10.0)
    assert not c.close(10.0)  # 15 rows were dropped
    events = [
        r.table for r in fake_collector.acked() if r.table.schema.metadata[b"livestep.kind"] == b"event"
    ]
    rows = pa.concat_tables(events).to_pylist()
    assert {r["kind"] for r in rows} == {"telemetry_dropped"}
    assert sum(orjson.loads(r["detail"])["dropped"] for r in rows) == 15
    reasons = [orjson.loads(r["detail"])["reasons"] for r in rows]
    assert sum(r.get("queue_full", 0) for r in reasons) == 15 and all(set(r) == {"queue_full"} for r in reasons)
    assert {orjson.loads(r["detail"])["where"] for r in rows} == {"client"}  # the records IT dropped
    assert all({k: r[k] for k in _LABELS} == _LABELS for r in rows)
    assert c.sent == 5 + len(rows) and c.dropped == 15


def test_put_never_raises_on_bad_input(fake_collector):
    c = new_client(fake_collector)
    c.put("nope", step_row(0))  # unknown kind
    c.put("step", step_row(1, step="not a number"))  # unencodable row: left out, counted
    c.put("step", None)  # not a dict
    c.put("step", step_row(2))
    assert c.flush(10.0)
    assert c.sent == 1 and c.dropped == 3
    assert c.stats()["dropped_by"] == {"unknown_kind": 1, "unencodable": 2}
    assert fake_collector.acked()[0].table.column("step").to_pylist() == [2]
    c.close()


def test_close_ships_what_is_left_and_later_puts_are_dropped(fake_collector):
    c = new_client(fake_collector, batch_rows=1000)
    for i in range(7):
        c.put("step", step_row(i))
    assert c.close(5.0)
    assert fake_collector.acked_rows() == 7
    c.put("step", step_row(8))
    assert (c.sent, c.dropped) == (7, 1)
    assert c.stats()["dropped_by"] == {"after_close": 1}
    assert c.close(1.0) is False  # idempotent, never raises
    assert not c._thread.is_alive()


def test_close_with_collector_down_is_bounded_and_counts_the_rest():
    c = TelemetryClient(
        f"http://127.0.0.1:{closed_port()}", batch_rows=2, backoff_base_s=0.05, give_up_after_s=3600
    )
    for i in range(40):  # 20 step batches and 2 event batches, none of which can be shipped
        c.put("step", step_row(i))
        if i % 10 == 0:
            c.put("event", event_row(i))
    assert c.close(timeout_s=0.5) is False
    assert not c._thread.is_alive()
    assert (c.sent, c.dropped, c.buffered) == (0, 44, 0)
    assert c.stats()["dropped_by"] == {"close_timeout": 44}


def test_rows_put_while_close_ships_the_rest_are_shipped_not_dropped(fake_collector):
    """A producer thread still putting while close() flushes (the GPU sampler at a session's end):
    every row it put before close() returned is shipped; none counts as dropped."""
    fake_collector.hold.clear()  # the collector is slow: close() is still flushing
    c = new_client(fake_collector, batch_rows=1000)
    for i in range(5):
        c.put("step", step_row(i))
    closer = threading.Thread(target=lambda: c.close(10.0))
    closer.start()
    assert fake_collector.wait_requests(0) and _wait(lambda: c._closing)
    for i in range(5, 8):
        c.put("step", step_row(i))  # close() has begun: still accepted
    fake_collector.hold.set()
    closer.join(15)
    assert (c.sent, c.dropped, c.buffered) == (8, 0, 0)
    assert sorted(pa.concat_tables([r.table for r in fake_collector.acked()]).column("step").to_pylist()) == list(
        range(8))


def test_a_request_in_flight_past_close_is_counted_then_settled_by_its_real_fate(fake_collector):
    fake_collector.hold.clear()  # the collector takes longer than close() may wait
    c = new_client(fake_collector, batch_rows=1000, timeout_s=10.0)
    for i in range(5):
        c.put("step", step_row(i))
    assert not c.flush(0.2)  # the batch is in flight
    assert c.close(0.2) is False
    st = c.stats()
    assert (st["sent"], st["dropped"], st["dropped_by"], st["buffered"]) == (0, 5, {"close_timeout": 5}, 5)
    fake_collector.hold.set()  # ... and acks it after all
    c._thread.join(10)
    st = c.stats()
    assert (st["sent"], st["dropped"], st["dropped_by"], st["buffered"]) == (5, 0, {}, 0)


def test_a_batch_given_up_is_reported_with_its_reason(fake_collector):
    fake_collector.answer(503, 503)
    c = new_client(fake_collector, max_attempts=2, report_drops_s=0.01)
    for i in range(10):
        c.put("step", step_row(i))
    assert not c.flush(10.0)
    c.put("step", step_row(10))  # the collector is back: the drop event rides with the next batch
    assert c.close(10.0) is False
    events = [r.table for r in fake_collector.acked() if r.table.schema.metadata[b"livestep.kind"] == b"event"]
    (detail,) = [orjson.loads(d) for d in pa.concat_tables(events).column("detail").to_pylist()]
    assert detail["where"] == "client" and detail["dropped"] == 10 and detail["reasons"] == {"gave_up": 10}
    assert "HTTP 503" in detail["last_error"] and detail["failed_batches_total"] == 1


def _wait(cond, timeout_s: float = 10.0) -> bool:
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


def test_concurrent_puts_are_all_accounted_for(fake_collector):
    c = new_client(fake_collector, batch_rows=64, max_queue=1000)

    def producer(base):
        for i in range(500):
            c.put("step", step_row(base + i))

    threads = [threading.Thread(target=producer, args=(k * 1000,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert c.flush(10.0)
    assert c.sent + c.dropped == 2000
    steps = pa.concat_tables([r.table for r in fake_collector.acked()]).column("step").to_pylist()
    assert len(steps) == len(set(steps)) == c.sent
    c.close()


def test_null_client_and_make_client(fake_collector):
    n = make_client(None)
    assert isinstance(n, NullClient)
    n.put("step", step_row(0))
    assert n.flush() and n.close()
    assert (n.sent, n.dropped, n.failed_batches) == (0, 0, 0)
    c = make_client(fake_collector.url, token="t", batch_rows=1)
    assert isinstance(c, TelemetryClient)
    c.close()


def test_ingest_url_and_config_errors():
    assert ingest_url("http://h:8000") == "http://h:8000/v1/telemetry"
    assert ingest_url("http://h:8000/") == "http://h:8000/v1/telemetry"
    assert ingest_url("https://h/prefix") == "https://h/prefix/v1/telemetry"
    assert ingest_url("http://h/v1/telemetry") == "http://h/v1/telemetry"
    with pytest.raises(ClientConfigError, match="valid: http"):
        ingest_url("ftp://h")
    with pytest.raises(ClientConfigError, match="batch_rows"):
        TelemetryClient("http://h", batch_rows=0)


def test_retry_after_parsing():
    assert retry_after_s("3") == 3.0
    assert retry_after_s("0.5") == 0.5
    assert retry_after_s(None) is None
    assert retry_after_s("soon") is None
    assert retry_after_s("-1") is None
    later = (datetime.now(UTC) + timedelta(seconds=30)).strftime("%a, %d %b %Y %H:%M:%S GMT")
    assert 20 < retry_after_s(later) <= 30


def test_a_process_that_exits_without_close_still_ships_its_tail(fake_collector):
    # the exit flush's bound (AT_EXIT_TIMEOUT_S, 2 s) is for an idle machine: on a loaded one the
    # child's post and this process's fake collector get a fraction of a core, so the child is given
    # the bound scaled by the slowdown measured now (tests/machine.py); what is tested is that the
    # tail ships at exit, not how fast
    from tests.machine import slowdown

    budget = AT_EXIT_TIMEOUT_S * slowdown()
    code = (
        "import sys; from tests.collector.test_client import step_row; "
        "import collector.client as cc; from collector.client import TelemetryClient; "
        f"cc.AT_EXIT_TIMEOUT_S = {budget!r}; "
        f"c = TelemetryClient({fake_collector.url!r}, batch_rows=1000, flush_interval_s=60); "
        "[c.put('step', step_row(i)) for i in range(7)]; sys.exit(0)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=60 + budget)
    assert fake_collector.acked_rows("step") == 7


def test_import_pulls_no_server_code():
    code = (
        "import sys, collector.client; "
        "bad = [m for m in ('fastapi', 'chdb', 'clickhouse_connect', 'uvicorn', 'polars') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


_ANSWERS = st.sampled_from([200, 200, 200, 500, 502, 503, 429, 400, 413, 422])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(answers=st.lists(_ANSWERS, max_size=30), n_rows=st.integers(0, 120), batch_rows=st.integers(1, 40))
def test_every_row_is_accounted_for_whatever_the_collector_answers(answers, n_rows, batch_rows):
    with running_fake() as fake:
        fake.answer(*[(a, {"Retry-After": "0"}) if a == 429 else a for a in answers])
        c = new_client(fake, batch_rows=batch_rows, max_attempts=3, max_queue=10_000)
        for i in range(n_rows):
            c.put("step", step_row(i))
        c.flush(20.0)
        assert c.close(5.0) == (c.dropped == 0)
        assert c.sent + c.dropped == n_rows and c.buffered == 0
        acked = [r.table for r in fake.acked()]
        steps = pa.concat_tables(acked).column("step").to_pylist() if acked else []
        assert len(steps) == len(set(steps)) == c.sent  # acked once each, nothing acked twice
        by_key: dict[str, list[Received]] = {}
        for r in fake.received:
            by_key.setdefault(r.headers["Idempotency-Key"], []).append(r)
        for tries in by_key.values():
            assert all(t.table.equals(tries[0].table) for t in tries)  # a retry resends the same batch
            assert [t.status for t in tries[:-1]] == [
                t.status for t in tries[:-1] if t.status in (429, 500, 502, 503)
            ]
            assert len(tries) <= 3
