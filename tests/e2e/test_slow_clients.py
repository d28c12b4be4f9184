"""``livestep serve`` closes slow and idle connections (api/http_limits.py): with 200 of them held at
once -- a head sent a byte at a time, a body sent a byte at a time, a connection that says nothing --
each is closed once its deadline passes (408 where a request was begun), none before it, and an
ordinary client is served meanwhile. Real sockets against a real uvicorn (a subprocess)."""

from __future__ import annotations

import selectors
import socket
import threading
import time

import httpx
import pytest

from tests.collector.helpers import ARROW, arrow_body, step_rows
from tests.e2e.test_serve_kill import AUTH, Server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

IDLE_S, HEAD_S, BODY_S = 1.0, 2.0, 3.0
DRIP_EVERY_S = 0.25


@pytest.fixture
def srv(tmp_path, monkeypatch):
    monkeypatch.setenv("LIVESTEP_IDLE_TIMEOUT_S", str(IDLE_S))
    monkeypatch.setenv("LIVESTEP_HEADER_TIMEOUT_S", str(HEAD_S))
    monkeypatch.setenv("LIVESTEP_BODY_TIMEOUT_S", str(BODY_S))
    s = Server(tmp_path).start()
    yield s
    if s.proc.poll() is None:
        s.kill()


class Slow:
    """One connection: what it sent first, what it drips (nothing: idle), what came back, when it closed."""

    def __init__(self, port: int, kind: str):
        self.kind, self.answer, self.closed_after = kind, b"", None
        # before the connection and its first byte: every deadline of the server starts after this
        # (so "not closed early" holds however late this process is scheduled)
        self.opened = time.monotonic()
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        if kind == "head":
            self.sock.sendall(b"GET /v1/health HTTP/1.1\r\n")
            self.drip = b"X"
        elif kind == "body":
            self.sock.sendall(b"POST /v1/telemetry HTTP/1.1\r\nHost: x\r\nAuthorization: " + AUTH["Authorization"].encode()
                              + b"\r\nContent-Type: " + ARROW.encode() + b"\r\nContent-Length: 100000\r\n\r\n")
            self.drip = b"\x00"
        else:
            self.drip = b""
        self.sock.setblocking(False)

    def read(self) -> None:
        try:
            data = self.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        self.answer += data
        if not data:
            self.close()

    def close(self) -> None:
        if self.closed_after is None:
            self.closed_after = time.monotonic() - self.opened
            self.sock.close()

    def tick(self) -> None:
        if self.drip and self.closed_after is None:
            try:
                self.sock.send(self.drip)
            except OSError:  # reset by the server: closed
                self.close()


def hold(port: int, n: int, until_s: float, meanwhile) -> list[Slow]:
    """``n`` slow connections, a third of each kind, driven from this thread until all are closed
    (or ``until_s``); ``meanwhile`` runs in another thread once they are all open."""
    kinds = ("head", "body", "idle")
    conns = [Slow(port, kinds[i % 3]) for i in range(n)]
    sel = selectors.DefaultSelector()
    for c in conns:
        sel.register(c.sock, selectors.EVENT_READ, c)
    side = threading.Thread(target=meanwhile, daemon=True)
    side.start()
    end, next_drip = time.monotonic() + until_s, 0.0
    while time.monotonic() < end and any(c.closed_after is None for c in conns):
        for key, _ in sel.select(timeout=0.05):
            key.data.read()
            if key.data.closed_after is not None:
                sel.unregister(key.fileobj)
        if time.monotonic() >= next_drip:
            for c in conns:
                c.tick()
                if c.closed_after is not None and c.sock.fileno() == -1:
                    try:
                        sel.unregister(c.sock)
                    except (KeyError, ValueError):
                        pass
            next_drip = time.monotonic() + DRIP_EVERY_S
    side.join(60)
    for c in conns:
        if c.closed_after is None:
            c.sock.close()
    return conns


def test_200_slow_and_idle_connections_are_closed_at_their_deadlines_and_others_are_served(srv):
    served = []

    def ordinary_client():
        with httpx.Client(base_url=srv.url, timeout=30) as h:
            served.append(h.get("/v1/health").status_code)
            served.append(h.post("/v1/telemetry", content=arrow_body("step", step_rows(50)),
                                 headers={**AUTH, "content-type": ARROW, "idempotency-key": "normal"}).status_code)

    deadline = {"idle": IDLE_S, "head": HEAD_S, "body": BODY_S}
    # dripping clients that were never closed would drip for this long: 20x the longest deadline
    conns = hold(srv.port, 200, until_s=20 * BODY_S, meanwhile=ordinary_client)

    assert served == [200, 200]
    still_open = [c.kind for c in conns if c.closed_after is None]
    assert still_open == [], f"{len(still_open)} connections never closed: {sorted(set(still_open))}"
    for c in conns:
        assert c.closed_after >= deadline[c.kind], (c.kind, c.closed_after)  # none closed early
    for c in conns:
        if c.kind in ("head", "body"):
            assert c.answer.startswith(b"HTTP/1.1 408"), (c.kind, c.answer[:200])
            assert (b"LIVESTEP_HEADER_TIMEOUT_S" if c.kind == "head" else b"LIVESTEP_BODY_TIMEOUT_S") in c.answer
        else:
            assert c.answer == b""  # nothing was asked: closed without an answer
    assert httpx.get(f"{srv.url}/v1/health", timeout=10).status_code == 200  # and it keeps serving


def test_beyond_the_connection_bound_a_request_is_503_until_idle_ones_are_closed(tmp_path, monkeypatch):
    monkeypatch.setenv("LIVESTEP_IDLE_TIMEOUT_S", str(IDLE_S))
    monkeypatch.setenv("LIVESTEP_MAX_CONNECTIONS", "16")
    srv = Server(tmp_path).start()
    try:
        held = [socket.create_connection(("127.0.0.1", srv.port), timeout=10) for _ in range(16)]
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:  # the 17th
            s.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(4096).startswith(b"HTTP/1.1 503"), "a request beyond the bound"
        for h in held:  # the idle deadline frees them: the server answers again
            h.settimeout(30)
            assert h.recv(1) == b""
            h.close()
        assert httpx.get(f"{srv.url}/v1/health", timeout=10).status_code == 200
    finally:
        if srv.proc.poll() is None:
            srv.kill()
