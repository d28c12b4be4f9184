"""``livestep serve`` bounds a request's head (api/http_limits.py): a huge header is answered 431 and
its connection closed before the server reads it all, ordinary requests and bodies pass, and the
server keeps answering."""

from __future__ import annotations

import socket

import httpx
import pytest

from api.http_limits import MAX_HEAD_BYTES
from tests.collector.helpers import ARROW, arrow_body, step_rows
from tests.e2e.test_serve_kill import AUTH, Server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture
def srv(tmp_path):
    s = Server(tmp_path).start()
    yield s
    if s.proc.poll() is None:
        s.kill()


def _raw_get_with_header(srv: Server, header_bytes: int) -> bytes:
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
        sock.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\nX-Big: ")
        sent, chunk = 0, b"a" * 65536
        try:
            while sent < header_bytes:
                sock.sendall(chunk)
                sent += len(chunk)
            sock.sendall(b"\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server closed the connection: what it answered is below
        out = b""
        try:
            while data := sock.recv(65536):
                out += data
        except ConnectionResetError:
            pass
        return out


def test_a_huge_header_is_431_and_closed_early_while_normal_requests_pass(srv):
    answer = _raw_get_with_header(srv, 64 << 20)  # 64 MiB: the server stops reading long before
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
    assert str(MAX_HEAD_BYTES).encode() in answer
    with httpx.Client(base_url=srv.url, timeout=10) as h:
        assert h.get("/v1/health", headers={"X-Ok": "b" * 8000}).status_code == 200
        body = arrow_body("step", step_rows(3000))  # a body far larger than the head bound still goes in
        assert len(body) > 2 * MAX_HEAD_BYTES
        r = h.post("/v1/telemetry", content=body, headers={**AUTH, "content-type": ARROW, "idempotency-key": "big"})
        assert r.status_code == 200, r.text
    assert _raw_get_with_header(srv, 2 * MAX_HEAD_BYTES).startswith(b"HTTP/1.1 431")
    assert httpx.get(f"{srv.url}/v1/health", timeout=10).status_code == 200
