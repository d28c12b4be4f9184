"""The ingest route: ``POST /v1/telemetry`` (JSON ``TelemetryBatch`` or one-kind Arrow IPC stream).

    app.include_router(collector.routes.router)   # needs app.state.spool and app.state.settings

A 200 means every row of the batch is in the durable spool (fsync'd); the block writer inserts it
into ClickHouse later. Every bad input gets a 4xx whose ``detail`` says what was wrong and what is
valid, and nothing of that batch is stored: 400 unreadable body, 401 no token, 403 not an ingest
token, 413 size (the body's bytes, or what an Arrow body decodes to: rows and bytes, read from its
metadata before any buffer is decompressed, collector/ipc_budget.py), 415 content type or encoding,
422 values or schema; 429 + Retry-After while the spool is over its bound. Bodies that are large, or
decode large, are parsed in the thread pool, never on the event loop.

This module is the HTTP side (headers, token, body bytes, Idempotency-Key, spool answers); reading a
body is collector/ingest_bodies.py's, checking its values collector/ingest_checks.py's (their public
names are importable from here too).
"""

from __future__ import annotations

import hashlib

import orjson
from fastapi import APIRouter, HTTPException, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.types import ASGIApp, Receive, Scope, Send

from collector import records
from collector.auth import bearer_token, check_bearer
from collector.ingest_bodies import (  # noqa: F401 (re-exported: tests and analytics/holdout.py import them here)
    ARROW_STREAM,
    CONTENT_TYPES,
    JSON,
    decoded_within,
    parse_arrow,
    parse_body,
    parse_json,
)
from collector.ingest_checks import CHECKS, BadBatchError, check_table  # noqa: F401 (re-exported, as above)
from collector.limits import DEFAULT as DEFAULT_LIMITS
from collector.spool import KeyConflictError, SpoolError, SpoolFullError
from collector.spool_keys import keyed_id, unkeyed_id

_THREADPOOL_BYTES = 1 << 20  # parse bodies that are (or decode to) more than this off the event loop


# ---------------------------------------------------------------------------------------------
# The route

def _inline_refs(schema: dict) -> dict:
    defs = schema.pop("$defs", {})

    def walk(node):
        if isinstance(node, dict):
            if "$ref" in node:
                return walk(dict(defs[node["$ref"].rsplit("/", 1)[-1]]))
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    return walk(schema)


class IngestAck(BaseModel):
    batch_id: str
    rows: dict[str, int]
    duplicate: bool


class ErrorBody(BaseModel):
    detail: str


class _IngestRoute(APIRoute):
    """``POST /v1/telemetry`` straight into ``ingest_asgi``: FastAPI's per-request machinery
    (``Request``, dependency solving, body and response-model handling) is skipped; the route is
    declared, documented in OpenAPI and matched like any other."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] != "POST":  # 405 and its Allow header, as FastAPI answers them
            await super().handle(scope, receive, send)
            return
        await ingest_asgi(scope, receive, send)


router = APIRouter(tags=["collector"], route_class=_IngestRoute)

_ERRORS = {
    s: {"model": ErrorBody, "description": d}
    for s, d in {400: "unreadable body or header", 401: "missing bearer token",
                 403: "bearer token that is not an ingest token", 413: "body too large",
                 409: "Idempotency-Key already used for a different body (nothing stored)",
                 415: "unknown content type, or a Content-Encoding (send bodies unencoded; an Arrow "
                      "stream may compress its own buffers)", 422: "invalid values or schema",
                 429: "spool full: retry after Retry-After seconds"}.items()
}
_HEADERS_READ = frozenset((b"authorization", b"content-type", b"content-length", b"idempotency-key",
                           b"content-encoding"))


class _ClientGoneError(Exception):
    """The client disconnected before its body arrived: nobody to answer."""


def _headers(scope: Scope) -> dict[bytes, str]:
    """The request headers ingest reads: the first of each, decoded as latin-1 (as Starlette does)."""
    out: dict[bytes, str] = {}
    for name, value in scope["headers"]:
        if name in _HEADERS_READ and name not in out:
            out[name] = value.decode("latin-1")
    return out


def _ack(batch_id: str, rows: dict[str, int], duplicate: bool) -> bytes:
    """The 200 body (``IngestAck``), encoded directly: the hot path skips response-model validation."""
    return orjson.dumps({"batch_id": batch_id, "rows": rows, "duplicate": duplicate})


def _check_token(auth: str | bytes, tokens: list[str]) -> None:
    """The ingest role (collector/auth.py's rule); open when no ingest tokens are set (settings allow
    that on a loopback bind only)."""
    if tokens:
        check_bearer(auth.decode("latin-1") if isinstance(auth, bytes) else auth, tokens, "ingest",
                     ["LIVESTEP_INGEST_TOKENS"])


async def _read_body(receive: Receive, cl: str | None, limit: int) -> bytes:
    if cl is not None:
        if not cl.strip().isdigit():
            raise HTTPException(400, f"Content-Length {cl!r} is not valid: a byte count")
        if int(cl) > limit:
            raise HTTPException(413, f"body of {int(cl)} bytes is over the limit of {limit} bytes; "
                                     "send smaller batches")
    chunks, n = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGoneError
        chunk = message.get("body", b"")
        n += len(chunk)
        if n > limit:
            raise HTTPException(413, f"body is over the limit of {limit} bytes; send smaller batches")
        if not message.get("more_body", False):
            return b"".join((*chunks, chunk)) if chunks else chunk
        chunks.append(chunk)


def _batch_id(key: str | None, body: bytes, authorization: str) -> str:
    """The spool's id of a batch: ``sha256:<body>`` without a key; with one, ``<token scope>/<key>#<body
    digest>``: keys are scoped per ingest token (two workers' "batch-1" are two batches) and a key
    reused with a different body is told apart from a retry (409, see ``_ingest``)."""
    digest = hashlib.sha256(body).hexdigest()
    if key is None:
        return unkeyed_id(digest)
    key = key.strip()
    if not 1 <= len(key) <= 200 or not key.isprintable() or not key.isascii():
        raise HTTPException(400, "Idempotency-Key is not valid: 1 to 200 printable ASCII characters "
                                 "(one per batch, the same on every retry)")
    token = bearer_token(authorization)
    scope = hashlib.sha256(token.encode()).hexdigest()[:16] if token else "open"
    return keyed_id(scope, key, digest)


def _key_conflict(key: str) -> HTTPException:
    return HTTPException(409, str(KeyConflictError(key)))


async def _ingest(scope: Scope, receive: Receive) -> bytes:
    """One request -> the 200 body once the batch is durable; ``HTTPException`` for every refusal."""
    state = scope["app"].state
    settings = state.settings
    headers = _headers(scope)
    _check_token(headers.get(b"authorization", ""), settings.ingest_tokens)
    media = headers.get(b"content-type", "").split(";")[0].strip().lower()
    if media not in CONTENT_TYPES:
        raise HTTPException(415, f"Content-Type {media or '(none)'!r} is not supported; valid: "
                                 f"{', '.join(CONTENT_TYPES)}")
    encoding = headers.get(b"content-encoding", "identity").strip().lower()
    if encoding not in ("identity", ""):  # else a gzip body would be read as JSON: a confusing 400
        raise HTTPException(415, f"Content-Encoding {encoding[:40]!r} is not supported; send the body unencoded "
                                 "(identity). An Arrow IPC stream may compress its own buffers (zstd, lz4), "
                                 "bounded by what they decode to")
    body = await _read_body(receive, headers.get(b"content-length"), settings.max_body_bytes)
    key = headers.get(b"idempotency-key")
    batch_id = _batch_id(key, body, headers.get(b"authorization", ""))
    spool = state.spool
    conflict = key is not None and spool.key_conflict(batch_id)  # the key names another body: nothing stored
    if conflict and not spool.previous_release_key(key.strip()):
        raise _key_conflict(key.strip())
    shown = key.strip() if key is not None else batch_id  # the ack names the batch as the client did
    metrics = getattr(state, "ingest_metrics", None)  # collector/metrics.py (None in apps without it)
    known = spool.known(batch_id)
    if known is not None:  # a retry of a stored batch: no need to parse it again
        if metrics is not None:
            metrics.deduplicated()
        return _ack(shown, known, True)
    limits = state.writer.limits if getattr(state, "writer", None) is not None else DEFAULT_LIMITS
    try:
        size = decoded_within(body, settings.max_decoded_bytes) if media == ARROW_STREAM else None
        if max(len(body), size.bytes if size else 0) > _THREADPOOL_BYTES:  # decompress + parse off the loop
            tables = await run_in_threadpool(parse_body, media, body, limits, settings.max_decoded_bytes, size)
        else:
            tables = parse_body(media, body, limits, settings.max_decoded_bytes, size)
    except BadBatchError as e:
        if metrics is not None and e.rows:
            metrics.refused_rows(e.status, e.rows)
        raise HTTPException(e.status, str(e)) from e
    if not tables:
        return _ack(shown, {}, False)
    # a key is looked up only as a key (collector/spool_keys.py): its own scoped id above, and here the
    # bare key a release before scoped keys spooled, a duplicate only for the same rows
    if key is not None and (previous := spool.previous_release_duplicate(shown, tables)) is not None:
        if metrics is not None:
            metrics.deduplicated()
        return _ack(shown, previous, True)
    if conflict:
        raise _key_conflict(shown)
    try:
        ack = await spool.submit_async(batch_id, tables)
    except KeyConflictError as e:  # a twin request with the same key and another body won the race
        raise HTTPException(409, str(e)) from e
    except SpoolError as e:
        status = 429 if isinstance(e, SpoolFullError) else 503
        if metrics is not None:
            metrics.refused_rows(status, {k: t.num_rows for k, t in tables.items()})
        if status == 429:
            raise HTTPException(429, str(e), headers={"Retry-After": str(e.retry_after_s)}) from e
        raise HTTPException(503, f"{e}; the batch was not stored, retry it", headers={"Retry-After": "1"}) from e
    if metrics is not None and ack.duplicate:
        metrics.deduplicated()
    elif metrics is not None:
        metrics.accepted(ack.rows)
    return _ack(shown, ack.rows, ack.duplicate)


async def ingest_asgi(scope: Scope, receive: Receive, send: Send) -> None:
    """``POST /v1/telemetry`` as a plain ASGI app (``scope["app"]`` is the server's app). Refusals
    are answered as FastAPI's default handler answers an ``HTTPException``: ``{"detail": ...}``."""
    extra: list[tuple[bytes, bytes]] = []
    try:
        body, status = await _ingest(scope, receive), 200
    except HTTPException as e:
        body, status = orjson.dumps({"detail": e.detail}), e.status_code
        extra = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (e.headers or {}).items()]
        metrics = getattr(scope["app"].state, "ingest_metrics", None)
        if metrics is not None:
            metrics.refused(status)
    except _ClientGoneError:
        return
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-length", str(len(body)).encode()), (b"content-type", b"application/json"),
                            *extra]})
    await send({"type": "http.response.body", "body": body})


def with_ingest_fast_lane(app: ASGIApp) -> ASGIApp:
    """``app`` with ``POST /v1/telemetry`` answered before its middleware and routing (what
    ``livestep serve`` runs): the same handler as the declared route, one dispatch instead of ten."""

    async def fast_lane(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/v1/telemetry" and scope["method"] == "POST":
            scope["app"] = app
            await ingest_asgi(scope, receive, send)
        else:
            await app(scope, receive, send)

    return fast_lane


@router.post(
    "/v1/telemetry",
    response_model=IngestAck,
    responses=_ERRORS,
    summary="Ingest a batch of telemetry records (durable once acked)",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                JSON: {"schema": _inline_refs(records.TelemetryBatch.model_json_schema())},
                ARROW_STREAM: {"schema": {"type": "string", "format": "binary"}},
            },
        }
    },
)
async def ingest(request: Request) -> Response:
    """The declared endpoint (OpenAPI); ``_IngestRoute`` serves POST through ``ingest_asgi``."""
    try:
        return Response(await _ingest(request.scope, request.receive), media_type=JSON)
    except _ClientGoneError:
        return Response(status_code=400)
