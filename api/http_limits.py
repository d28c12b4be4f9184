"""What a connection may cost the server: a bounded request head, head / body / idle deadlines and a
bound on concurrent connections, all enforced before (or beside) the app.

    limits = HttpLimits()                                  # LIVESTEP_HEADER_TIMEOUT_S ... (env)
    uvicorn.Config(app, **server_limits(limits))           # what ``livestep serve`` runs

uvicorn settings where uvicorn has one: ``timeout_keep_alive`` (idle between requests),
``limit_concurrency`` (beyond it a request is answered 503) and h11's ``h11_max_incomplete_event_size``.
The rest is a small subclass of uvicorn's httptools protocol (its parser with ``uvicorn[standard]``),
because uvicorn has no setting for it (0.54):

- the head: httptools has no size bound of its own (a 256 MiB header on ``/v1/health`` was read whole
  and answered 200 while the process grew by 250 MB). Over ``MAX_HEAD_BYTES`` the request is answered
  431 and its connection closed before more is buffered (and before any auth). 64 KiB is 8x what
  nginx takes by default and far beyond any client of this API.
- deadlines: uvicorn arms its keep-alive timer only after a response, and any byte disarms it, so a
  client that connects and says nothing, or sends a head or a body a byte at a time, held its
  connection for hours (issue 30: 200 such connections all open after 90 s). Here a fresh or idle
  connection is closed after ``idle_timeout_s`` without a request starting, a request's head must
  arrive within ``header_timeout_s`` of its first byte and its body within ``body_timeout_s`` of the
  head; past either the answer is 408 (if none was sent yet) and the connection is closed. The app's
  ``receive()`` then says ``http.disconnect``, so a handler waiting on the body stops too.

Proxies in front may bound these lower (nginx ``client_header_timeout``, ``client_body_timeout``,
``large_client_header_buffers``); see docs/DEPLOY.md.
"""

from __future__ import annotations

import logging
import time
from asyncio import AbstractEventLoop

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

MAX_HEAD_BYTES = 64 * 1024
log = logging.getLogger("livestep.http")


class _Deadline:
    """A loop timer that never fires before ``seconds`` of real (monotonic) time have passed.

    uvloop's timers count whole milliseconds from libuv's cached loop clock (``uv_now``, as stale as
    the current iteration's work), so a plain ``call_later`` closed an idle connection at 0.99988 s of
    a 1-s deadline. Fired early, this one re-arms for what is left. Same ``cancel()`` as a ``TimerHandle``
    (uvicorn cancels its keep-alive task through it)."""

    def __init__(self, loop: AbstractEventLoop, seconds: float, fn, *args):
        self._loop, self._fn, self._args = loop, fn, args
        self._due = time.monotonic() + seconds
        self._handle = loop.call_later(seconds, self._fire)

    def _fire(self) -> None:
        left = self._due - time.monotonic()
        if left > 0:
            self._handle = self._loop.call_later(left + 1e-3, self._fire)
            return
        self._fn(*self._args)

    def cancel(self) -> None:
        self._handle.cancel()


class _NeverEarly:
    """A connection's view of the event loop whose ``call_later`` is a ``_Deadline``: every timer the protocol
    arms (ours and uvicorn's own keep-alive timer) waits its full time; the rest is the loop's."""

    def __init__(self, loop: AbstractEventLoop):
        self._loop = loop

    def call_later(self, seconds: float, fn, *args) -> _Deadline:
        return _Deadline(self._loop, seconds, fn, *args)

    def __getattr__(self, name: str):
        return getattr(self._loop, name)


def _seconds(default: float, description: str):
    """A per-connection timeout: seconds, above 0 and at most an hour."""
    return Field(default=default, gt=0, le=3600, description=description)


class HttpLimits(BaseSettings):
    """Per-connection bounds of ``livestep serve`` (env ``LIVESTEP_*``); each bounded and documented."""

    model_config = SettingsConfigDict(env_prefix="LIVESTEP_", extra="ignore", validate_default=True)

    idle_timeout_s: float = _seconds(
        10.0, "a connection with no request started for this long (fresh, or kept alive after a "
        "response) is closed (uvicorn's timeout_keep_alive, also armed at connect)")
    header_timeout_s: float = _seconds(
        10.0, "a request's line and headers must arrive within this many seconds of its first byte, "
        "else 408 and the connection is closed")
    body_timeout_s: float = _seconds(
        60.0, "a request's whole body must arrive within this many seconds of its head (the largest "
        "ingest body, 32 MiB, needs about 0.6 MB/s), else 408 and the connection is closed")
    max_connections: int = Field(
        default=1024, ge=16, le=1_000_000,
        description="open connections (or running requests) beyond which a new request is answered 503 "
        "(uvicorn's limit_concurrency); each costs a file descriptor: `ulimit -n` must exceed it")

    def table(self) -> list[tuple[str, str, str]]:
        """(variable, value, meaning) per bound, for ``--help`` and the OpenAPI description."""
        out = [("(fixed)", f"{MAX_HEAD_BYTES} bytes", "request line + headers; beyond it 431, connection closed")]
        for name, f in type(self).model_fields.items():
            out.append((f"LIVESTEP_{name.upper()}", str(getattr(self, name)), f.description or ""))
        return out


def _detail(text: str) -> bytes:
    import orjson

    return orjson.dumps({"detail": text})


def _answer(status: bytes, body: bytes) -> bytes:
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)


_HEAD_431 = _answer(b"431 Request Header Fields Too Large",
                    _detail(f"request line and headers exceed {MAX_HEAD_BYTES} bytes; send smaller headers"))


class _HeadRefusedError(Exception):
    """Raised in the parser's callback to stop it once the head was refused."""


def _bounded_httptools(limits: HttpLimits):
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    slow_head = _answer(b"408 Request Timeout", _detail(
        f"the request line and headers did not arrive within {limits.header_timeout_s:g} s "
        f"(LIVESTEP_HEADER_TIMEOUT_S); send the head at once"))
    slow_body = _answer(b"408 Request Timeout", _detail(
        f"the request body did not arrive within {limits.body_timeout_s:g} s of its head "
        f"(LIVESTEP_BODY_TIMEOUT_S); send smaller bodies or send faster"))

    class BoundedHttpToolsProtocol(HttpToolsProtocol):
        """httptools with the head bounded in bytes and every phase of a connection bounded in time.

        Phases: ``idle`` (no request begun: uvicorn's keep-alive timer, armed at connect too), ``head``
        (first byte seen: ``header_timeout_s``), ``body`` (head complete: ``body_timeout_s``), ``app``
        (request complete; the app's time is its own) and back to ``idle`` after the response.
        """

        _read_in_head = 0  # bytes read while the head was incomplete
        _head = 0  # exact bytes of the head's url and header fields
        _in_head = True
        _refused = False
        _phase = "idle"
        _deadline: _Deadline | None = None

        # -- time -------------------------------------------------------------------------------
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.loop = _NeverEarly(self.loop)

        def _arm_idle(self) -> None:
            if self.timeout_keep_alive_task is None and not self.transport.is_closing():
                self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                     self.timeout_keep_alive_handler)

        def _arm(self, seconds: float | None, answer: bytes = b"") -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline = None if seconds is None else self.loop.call_later(seconds, self._too_slow, answer)

        def _too_slow(self, answer: bytes) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            cycle = self.cycle
            if self._phase == "head" or (cycle is not None and not cycle.response_started):
                if cycle is not None and self._phase == "body":
                    cycle.response_started = True  # the app's answer, if it comes, is not sent after ours
                self.transport.write(answer)
            log.debug("closing %s: %s phase too slow", self.client, self._phase)
            self.transport.close()  # connection_lost: the app's receive() says http.disconnect

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_idle()  # uvicorn arms it only after a response: a silent client stayed forever

        def connection_lost(self, exc) -> None:
            self._arm(None)
            super().connection_lost(exc)

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._arm(None)
            if self.cycle is not None and self.cycle.response_complete:  # answered before the body ended
                self._phase = "idle"
                self._arm_idle()
            else:
                self._phase = "app"

        def on_response_complete(self) -> None:
            super().on_response_complete()  # arms uvicorn's keep-alive timer (never early: ``_NeverEarly``)
            if self._phase == "app":
                self._phase = "idle"

        # -- bytes ------------------------------------------------------------------------------
        def _refuse(self) -> None:
            self._refused, self._in_head = True, False
            self._arm(None)
            self.transport.write(_HEAD_431)
            self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            if self._in_head:
                self._read_in_head += len(data)
            super().data_received(data)  # completes the head (or not) with what arrived
            if self._in_head and self._read_in_head > MAX_HEAD_BYTES and not self._refused:
                self._refuse()
            if self._phase == "idle":  # bytes that began no request (uvicorn disarmed the idle timer)
                self._arm_idle()

        def send_400_response(self, msg: str) -> None:
            if not self._refused:  # (the parser stopped because the head was refused: answered already)
                super().send_400_response(msg)

        def on_message_begin(self) -> None:
            self._in_head, self._read_in_head, self._head = True, 0, 0
            self._phase = "head"
            self._arm(limits.header_timeout_s, slow_head)
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
            self._phase = "body"
            self._arm(limits.body_timeout_s, slow_body)
            super().on_headers_complete()

    return BoundedHttpToolsProtocol


def server_limits(limits: HttpLimits | None = None) -> dict:
    """uvicorn settings bounding every connection (httptools, which ``uvicorn[standard]`` installs)."""
    limits = limits or HttpLimits()
    return {"http": _bounded_httptools(limits), "h11_max_incomplete_event_size": MAX_HEAD_BYTES,
            "timeout_keep_alive": limits.idle_timeout_s, "limit_concurrency": limits.max_connections}
