"""The request-head bound at the server: a request line + headers larger than ``MAX_HEAD_BYTES`` is
answered 431 and its connection closed before the server buffers more of it (and before any auth).

    uvicorn.Config(app, **server_limits())     # what ``livestep serve`` runs

uvicorn's httptools parser (its choice with ``uvicorn[standard]``) has no bound of its own: a 256 MiB
header on ``/v1/health`` was read whole and answered 200 while the process grew by 250 MB. The h11
parser has one (``h11_max_incomplete_event_size``), set to the same bound here. A proxy in front
(nginx ``large_client_header_buffers``, Envoy ``max_request_headers_kb``) may bound it lower; see
docs/DEPLOY.md. 64 KiB is 8x what nginx takes by default and far beyond any client of this API.
"""

from __future__ import annotations

MAX_HEAD_BYTES = 64 * 1024
_DETAIL = (f'{{"detail": "request line and headers exceed {MAX_HEAD_BYTES} bytes; send smaller headers"}}').encode()


class _HeadRefusedError(Exception):
    """Raised in the parser's callback to stop it once the head was refused."""


def _bounded_httptools():
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class BoundedHttpToolsProtocol(HttpToolsProtocol):
        """httptools, bounding each request's head twice: the bytes read while it is incomplete (so a
        huge header is never buffered whole) and its exact size once complete (url + header fields)."""

        _read_in_head = 0  # bytes read while the head was incomplete
        _head = 0  # exact bytes of the head's url and header fields
        _in_head = True
        _refused = False

        def _refuse(self) -> None:
            self._refused, self._in_head = True, False
            self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                                 b"content-type: application/json\r\n"
                                 b"content-length: " + str(len(_DETAIL)).encode() + b"\r\n"
                                 b"connection: close\r\n\r\n" + _DETAIL)
            self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            if self._in_head:
                self._read_in_head += len(data)
            super().data_received(data)  # completes the head (or not) with what arrived
            if self._in_head and self._read_in_head > MAX_HEAD_BYTES and not self._refused:
                self._refuse()

        def send_400_response(self, msg: str) -> None:
            if not self._refused:  # (the parser stopped because the head was refused: answered already)
                super().send_400_response(msg)

        def on_message_begin(self) -> None:
            self._in_head, self._read_in_head, self._head = True, 0, 0
            super().on_message_begin()

        def on_url(self, url: bytes) -> None:
            self._head += len(url)
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._head += len(name) + len(value) + 4
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._in_head = False
            if self._head > MAX_HEAD_BYTES:
                self._refuse()
                raise _HeadRefusedError  # stops the parser: the app never sees this request
            super().on_headers_complete()

    return BoundedHttpToolsProtocol


def server_limits() -> dict:
    """uvicorn settings bounding a request's head, whichever HTTP parser is installed."""
    try:
        import httptools  # noqa: F401
    except ImportError:
        return {"http": "h11", "h11_max_incomplete_event_size": MAX_HEAD_BYTES}
    return {"http": _bounded_httptools(), "h11_max_incomplete_event_size": MAX_HEAD_BYTES}
