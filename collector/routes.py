"""The ingest route: ``POST /v1/telemetry`` (JSON ``TelemetryBatch`` or one-kind Arrow IPC stream).

    app.include_router(collector.routes.router)   # needs app.state.spool and app.state.settings

A 200 means every row of the batch is in the durable spool (fsync'd); the block writer inserts it
into ClickHouse later. Every bad input gets a 4xx whose ``detail`` says what was wrong and what is
valid, and nothing of that batch is stored: 400 unreadable body, 401 no token, 403 not an ingest
token, 413 size (the body's bytes, or what an Arrow body decodes to: rows and bytes, read from its
metadata before any buffer is decompressed, collector/ipc_budget.py), 415 content type or encoding,
422 values or schema; 429 + Retry-After while the spool is over its bound. Bodies that are large, or
decode large, are parsed in the thread pool, never on the event loop.
"""

from __future__ import annotations

import hashlib
import time
from datetime import UTC, datetime
from typing import Any, NamedTuple

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
from fastapi import APIRouter, HTTPException, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.routing import APIRoute
from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from collector import records
from collector.auth import bearer_token, check_bearer
from collector.ipc_budget import Decoded, decoded_size
from collector.limits import DEFAULT as DEFAULT_LIMITS
from collector.limits import Limits
from collector.spool import IpcStream, KeyConflictError, SpoolError, SpoolFullError, read_ipc_stream
from collector.spool_keys import keyed_id, unkeyed_id

ARROW_STREAM = "application/vnd.apache.arrow.stream"
JSON = "application/json"
CONTENT_TYPES = (ARROW_STREAM, JSON)
_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"
_BATCH = TypeAdapter(records.TelemetryBatch)
_THREADPOOL_BYTES = 1 << 20  # parse bodies that are (or decode to) more than this off the event loop
_DEFAULT_MAX_DECODED = 64 << 20  # collector/settings.py's default, for callers without settings


class BadBatchError(Exception):
    """A batch that cannot be stored; ``status`` is the 4xx to answer, the message says what is valid."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.rows: dict[str, int] = {}  # the rows of a batch read before it was refused, by kind (metrics)


# ---------------------------------------------------------------------------------------------
# Column checks: the bounds collector/records.py declares (those the store's column types can hold),
# in the format ``records.CHECKS`` derives: (type, lo, hi) per column.

CHECKS: dict[str, dict[str, tuple]] = records.CHECKS


def _np(col: pa.ChunkedArray, fill) -> np.ndarray:
    """A numeric column as numpy (nulls, allowed where the schema allows them, replaced by ``fill``)."""
    if col.null_count:
        col = col.fill_null(fill)
    return col.to_numpy()


def _first(mask: np.ndarray) -> int | None:
    return int(np.argmax(mask)) if mask.any() else None


def _bad(kind: str, col: str, row: int, value: Any, valid: str) -> BadBatchError:
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return BadBatchError(422, f"{kind} row {row} column '{col}' = {shown} is not valid: {valid}")


def _first_of(col: pa.ChunkedArray, value) -> int:
    return _first(np.asarray(pc.equal(col, value).fill_null(False).to_numpy(zero_copy_only=False)))


class _Plan(NamedTuple):
    """A kind's checks grouped by type, as column indices: one numpy reduction per group, not per column."""

    floats: dict[tuple[float | None, float | None], tuple[int, ...]]  # (lo, hi), None: unbounded -> columns
    ints: dict[tuple[int, int], tuple[int, ...]]  # (lo, hi) -> columns
    labels: dict[tuple[int, int], tuple[int, ...]]  # (min chars, max chars) -> columns
    ts: tuple[int, ...]
    enums: tuple[tuple[int, frozenset[str]], ...]
    switches: tuple[int, ...]
    json: tuple[str, ...]  # names: checked row by row by ``_explain``'s rule
    required: tuple[bool, ...]  # per column: nulls not allowed


def _plan(kind: str) -> _Plan:
    schema = records.ARROW_SCHEMAS[kind]
    floats: dict = {}
    ints: dict = {}
    labels: dict = {}
    ts, enums, switches, js = [], [], [], []
    for name, check in CHECKS[kind].items():
        i, what = schema.get_field_index(name), check[0]
        if what == "float":
            floats.setdefault((check[1], check[2] if len(check) > 2 else None), []).append(i)
        elif what == "int":
            ints.setdefault((check[1], check[2]), []).append(i)
        elif what == "label":
            labels.setdefault((check[1], check[2]), []).append(i)
        elif what == "ts":
            ts.append(i)
        elif what == "enum":
            enums.append((i, frozenset(check[1])))
        elif what == "switches":
            switches.append(i)
        else:
            js.append(name)
    return _Plan({k: tuple(v) for k, v in floats.items()}, {k: tuple(v) for k, v in ints.items()},
                 {k: tuple(v) for k, v in labels.items()},
                 tuple(ts), tuple(enums), tuple(switches), tuple(js), tuple(not f.nullable for f in schema))


_PLANS = {kind: _plan(kind) for kind in CHECKS}
_GOOD_SWITCHES: set[str] = set()  # switch-state strings already found valid (bounded)


def _switches_ok(v: str | None) -> bool:
    if v in _GOOD_SWITCHES:
        return True
    if v is None or len(v) > 512 or not records.decode_switches(v) <= set(records.SWITCH_NAMES):
        return False
    if len(_GOOD_SWITCHES) < 4096:
        _GOOD_SWITCHES.add(v)
    return True


def _all_valid(kind: str, table: pa.Table, limits: Limits) -> bool:
    """True only if every check of ``_explain`` passes (a False is settled by ``_explain``).

    Whole groups of columns at once: all bounded-below floats in one ``min``/``max``, NaN failing
    every comparison; integers grouped by bounds; labels, enums and switch states over their
    distinct values.
    """
    plan = _PLANS[kind]
    cols = table.columns
    nulls = [c.null_count for c in cols]
    n = table.num_rows
    for required, k in zip(plan.required, nulls, strict=True):
        if k and required:
            return False

    def numeric(idx: tuple[int, ...], fill) -> np.ndarray | None:
        parts = [cols[i].fill_null(fill).to_numpy() if nulls[i] else cols[i].to_numpy()
                 for i in idx if nulls[i] != n]  # an all-null optional column: nothing to check
        return (parts[0] if len(parts) == 1 else np.concatenate(parts)) if parts else None

    for (lo, hi), idx in plan.floats.items():
        a = numeric(idx, 0.0)
        if a is not None and not ((a.min() > -np.inf if lo is None else a.min() >= lo)
                                  and (a.max() < np.inf if hi is None else a.max() <= hi)):
            return False
    for (lo, hi), idx in plan.ints.items():
        a = numeric(idx, lo)
        if a is not None and not (a.min() >= lo and a.max() <= hi):
            return False
    if plan.ts:
        now_ms = int(time.time() * 1000)
        oldest, newest = limits.oldest_ms(kind, now_ms), now_ms + int(records.MAX_FUTURE_SKEW.total_seconds() * 1000)
        for i in plan.ts:
            a = cols[i].to_numpy().view("int64")
            if not (a.min() >= oldest and a.max() <= newest):
                return False
    for (lo, hi), idx in plan.labels.items():  # the distinct values of all these columns at once
        distinct = pa.chunked_array([ch for i in idx for ch in cols[i].chunks], pa.string()).unique()
        if not all(v is not None and lo <= len(v) <= hi for v in distinct.to_pylist()):
            return False
    for i, valid in plan.enums:
        if not all(v is None or v in valid for v in cols[i].unique().to_pylist()):
            return False
    for i in plan.switches:
        if not all(v is None or _switches_ok(v) for v in cols[i].unique().to_pylist()):
            return False
    return not plan.json  # JSON text columns are checked row by row, by ``_explain``


def check_table(kind: str, table: pa.Table, limits: Limits = DEFAULT_LIMITS) -> None:
    """Every value of ``table`` (already of ``records.ARROW_SCHEMAS[kind]``) within bounds, else 422;
    ``ts`` within what the store keeps (``limits``: its retention, collector/limits.py).

    A quick pass over whole groups of columns (~30 us per 100-row step batch) accepts valid batches;
    anything it doubts goes through ``_explain``, which finds the first invalid value and names it.
    """
    if table.num_rows and not _all_valid(kind, table, limits):
        _explain(kind, table, limits)


def _checked(kind: str, table: pa.Table, limits: Limits) -> None:
    """``check_table``; a refusal carries the batch's row count of ``kind`` (collector/metrics.py counts it)."""
    try:
        check_table(kind, table, limits)
    except BadBatchError as e:
        e.rows = {kind: table.num_rows}
        raise


def _explain(kind: str, table: pa.Table, limits: Limits) -> None:
    """Column by column, in schema order: raise the 422 that names the first invalid value (if any)."""
    schema = records.ARROW_SCHEMAS[kind]
    for f in schema:
        col = table.column(f.name)
        if not f.nullable and col.null_count:
            row = _first(np.asarray(col.is_null().to_numpy(zero_copy_only=False)))
            raise _bad(kind, f.name, row, None, "this column is required (no nulls)")
    now_ms = int(datetime.now(UTC).timestamp() * 1000)
    oldest, newest = limits.oldest_ms(kind, now_ms), now_ms + int(records.MAX_FUTURE_SKEW.total_seconds() * 1000)
    n = table.num_rows
    for name, check in CHECKS[kind].items():
        col = table.column(name)
        if col.null_count == n:  # all null (an optional field not measured here): nothing to check
            continue
        what = check[0]
        if what == "float":
            a = _np(col, 0.0)
            if not np.isfinite(a).all():
                row = _first(~np.isfinite(a))
                raise _bad(kind, name, row, col[row].as_py(), "a finite number (NaN and infinity are not valid)")
            hi = check[2] if len(check) > 2 else None
            if hi is not None and len(a) and (a.min() < check[1] or a.max() > hi):
                row = _first((a < check[1]) | (a > hi))
                raise _bad(kind, name, row, col[row].as_py(), f"a number in [{check[1]:g}, {hi:g}] (a fraction)")
            if check[1] is not None and len(a) and a.min() < check[1]:
                row = _first(a < check[1])
                raise _bad(kind, name, row, col[row].as_py(), f"a number >= {check[1]:g} (a duration or amount)")
        elif what == "int":
            lo, hi = check[1], check[2]
            a = _np(col, lo)
            if len(a) and (a.min() < lo or a.max() > hi):
                row = _first((a < lo) | (a > hi))
                raise _bad(kind, name, row, col[row].as_py(), f"an integer in [{lo}, {hi}]")
        elif what == "label":
            for v in pc.unique(col).to_pylist():
                if not check[1] <= len(v) <= check[2]:
                    raise _bad(kind, name, _first_of(col, v), v, f"a string of {check[1]} to {check[2]} characters")
        elif what == "ts":
            a = col.to_numpy().view("int64") if col.num_chunks == 1 else pc.cast(col, pa.int64()).to_numpy()
            row = _first((a < oldest) | (a > newest))
            if row is not None:
                first = datetime.fromtimestamp(oldest / 1000, UTC).isoformat(timespec="seconds")
                raise _bad(kind, name, row, str(col[row].as_py()),
                           f"a UTC time from {first} (retention: {limits.window_text(kind)}) to at most "
                           f"{records.MAX_FUTURE_SKEW} in the future")
        elif what == "enum":
            for v in pc.unique(col).to_pylist():
                if v is not None and v not in check[1]:
                    raise _bad(kind, name, _first_of(col, v), v, f"one of {', '.join(check[1])}")
        elif what == "switches":
            for v in pc.unique(col).to_pylist():
                if v is None:
                    continue
                unknown = sorted(records.decode_switches(v) - set(records.SWITCH_NAMES))
                if unknown or len(v) > 512:
                    raise _bad(kind, name, _first_of(col, v), v,
                               f"comma-separated switch names, unknown {unknown}; valid switches: "
                               f"{', '.join(records.SWITCH_NAMES)}")
        elif what == "json_object":
            for row, v in enumerate(col.to_pylist()):
                try:
                    ok = len(v) <= check[1] and isinstance(orjson.loads(v), dict)
                except orjson.JSONDecodeError:
                    ok = False
                if not ok:
                    raise _bad(kind, name, row, v, f"a JSON object as text, at most {check[1]} bytes")


# ---------------------------------------------------------------------------------------------
# Bodies -> {kind: arrow table of the canonical schema}

def _schema_text(schema: pa.Schema) -> str:
    return ", ".join(f"{f.name}: {f.type}" for f in schema)


def _validate_fully(table: pa.Table) -> None:
    """Every buffer, offset and length of every column checked before any compute reads it.

    The IPC reader checks only the framing, and compute trusts offsets: a body whose ``session_id``
    offsets were ``[0, -5, 22, 33]`` read out of bounds in ``_all_valid`` and crashed the server
    process. ~3 us per 100-row batch. Decoding stays in-process (not in a child process that a crash
    could not take the server with): this check makes the decoded arrays safe to compute on, and the
    seeded corpus of tests/collector/fuzz_bodies.py keeps it so; a child per body would cost more than
    the whole ingest path does now.
    """
    for name, col in zip(table.column_names, table.columns, strict=True):
        try:
            col.validate(full=True)
        except pa.ArrowException as e:
            raise BadBatchError(400, f"column '{name}' is not a valid Arrow array ({e}); send the stream "
                                     f"as pyarrow.ipc.new_stream writes it") from e


def _ingested(kind: str, rows: int = 1) -> None:
    """403 for a kind the ingest token may not write (evaluations: the gate's evidence, evaluator role)."""
    if kind in records.NOT_INGESTED and rows:
        raise BadBatchError(403, f"{kind} records are not accepted here: post an evaluation to POST /v1/evaluations "
                                 "with an evaluator token (LIVESTEP_EVALUATOR_TOKENS), never the ingest token")


def decoded_within(body: bytes, max_bytes: int) -> Decoded:
    """What the Arrow stream ``body`` decodes to, from its metadata (nothing decompressed); 413 when it
    is more than ``records.MAX_BATCH_ROWS`` rows or ``max_bytes`` bytes, 400 when it cannot be read."""
    if len(body) < 8 or body[-8:] != _EOS:
        raise BadBatchError(400, "truncated Arrow IPC stream: it must end with the end-of-stream marker "
                                 "(close the stream writer); send one record kind per body")
    try:
        size = decoded_size(body)
    except (ValueError, pa.ArrowException) as e:
        raise BadBatchError(400, f"not a readable Arrow IPC stream ({e}); expected one record batch stream "
                                 f"of one record kind, Content-Type {ARROW_STREAM}") from e
    if size.rows > records.MAX_BATCH_ROWS:
        raise BadBatchError(413, f"the Arrow stream decodes to {size.rows} rows, over the limit of "
                                 f"{records.MAX_BATCH_ROWS} rows per request; send smaller batches")
    if size.bytes > max_bytes:
        raise BadBatchError(413, f"the Arrow stream decodes to {size.bytes} bytes, over the limit of {max_bytes} "
                                 "decoded bytes per request (LIVESTEP_MAX_DECODED_BYTES); send smaller batches")
    return size


def parse_arrow(body: bytes, limits: Limits = DEFAULT_LIMITS, max_decoded_bytes: int = _DEFAULT_MAX_DECODED,
                checked: Decoded | None = None) -> dict[str, pa.Table | IpcStream]:
    """An Arrow IPC body -> {kind: table}; ``checked``: ``decoded_within`` already passed (the route's)."""
    if checked is None:
        decoded_within(body, max_decoded_bytes)  # before anything is decompressed
    try:
        schema, table, consumed = read_ipc_stream(body)
    except (pa.ArrowInvalid, pa.ArrowException, OSError, ValueError) as e:
        raise BadBatchError(400, f"not a readable Arrow IPC stream ({e}); expected one record batch stream "
                                 f"of one record kind, Content-Type {ARROW_STREAM}") from e
    _validate_fully(table)
    if consumed != len(body):
        raise BadBatchError(400, f"{len(body) - consumed} bytes follow the Arrow stream's end-of-stream marker; "
                                 "send exactly one stream per body")
    meta = schema.metadata or {}
    kind = meta.get(b"livestep.kind", b"").decode(errors="replace")
    if kind not in records.ARROW_SCHEMAS:
        raise BadBatchError(422, f"Arrow schema metadata livestep.kind = {kind!r} is not valid; valid kinds: "
                                 f"{', '.join(records.RECORD_KINDS)} (use collector.records.ARROW_SCHEMAS)")
    _ingested(kind)
    version = meta.get(b"livestep.schema_version", str(records.SCHEMA_VERSION).encode()).decode(errors="replace")
    if version != str(records.SCHEMA_VERSION):
        raise BadBatchError(422, f"livestep.schema_version {version!r} is not supported; valid: "
                                 f"{records.SCHEMA_VERSION}")
    want = records.ARROW_SCHEMAS[kind]
    canonical = schema.equals(want, check_metadata=True)
    if not canonical:  # the shipping client sends exactly ``want``; anything else is checked here
        table = records.conform(kind, table)  # an older worker's body: columns added since read as null
        names, want_names = table.schema.names, want.names
        schema = table.schema
        missing = [n for n in want_names if n not in names]
        extra = [n for n in names if n not in want_names]
        if missing or extra or len(set(names)) != len(names):
            raise BadBatchError(422, f"{kind} columns do not match: missing {missing}, unexpected {extra}; "
                                     f"valid columns: {_schema_text(want)}")
        wrong = [f"{f.name} is {schema.field(f.name).type}, expected {f.type}"
                 for f in want if schema.field(f.name).type != f.type]
        if wrong:
            raise BadBatchError(422, f"{kind} column types do not match: {'; '.join(wrong)}; "
                                     f"valid columns: {_schema_text(want)}")
        table = table.select(want_names)
        table = pa.Table.from_arrays(table.columns, schema=want)
    _checked(kind, table, limits)
    if (fixed := records.canonical_labels(table)) is not table:  # a device name: stored as its kind
        table, canonical = fixed, False
    if not table.num_rows:
        return {}
    # the shipping client's exact schema: spool the validated body as is (no re-encoding)
    return {kind: IpcStream(body, table.num_rows, table) if canonical else table}


def _loc(loc: tuple) -> str:
    out = ""
    for p in loc:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "body"


_KIND_OF_LIST = records.BATCH_FIELDS


def _validation_message(e: ValidationError) -> tuple[int, str]:
    errs = e.errors(include_url=False)
    if any(err["type"] == "json_invalid" for err in errs):
        msg = next(err["msg"] for err in errs if err["type"] == "json_invalid")
        return 400, f"body is not valid JSON ({msg}); expected a TelemetryBatch object (see /openapi.json)"
    parts = []
    for err in errs[:5]:
        loc = err["loc"]
        text = f"{_loc(loc)}: {err['msg']}"
        if err["type"] not in ("missing", "extra_forbidden"):
            shown = repr(err.get("input"))
            text += f" (got {shown if len(shown) <= 60 else shown[:57] + '...'})"
        kind = _KIND_OF_LIST.get(loc[0]) if loc else None
        if err["type"] in ("missing", "extra_forbidden") and kind and len(loc) >= 3:
            text += f"; valid {kind} fields: {', '.join(records.MODELS[kind].model_fields)}"
        elif not loc:
            text += "; expected a TelemetryBatch object: {\"steps\": [...], \"gpu_samples\": [...], " \
                    "\"sessions\": [...], \"events\": [...]}"
        elif err["type"] == "extra_forbidden" and len(loc) == 1:
            text += f"; valid top-level fields: {', '.join(records.TelemetryBatch.model_fields)}"
        parts.append(text)
    more = f" (and {len(errs) - 5} more)" if len(errs) > 5 else ""
    return 422, f"{len(errs)} invalid value(s): " + "; ".join(parts) + more


def parse_json(body: bytes, limits: Limits = DEFAULT_LIMITS) -> dict[str, pa.Table]:
    try:
        batch = _BATCH.validate_json(body)
    except ValidationError as e:
        status, msg = _validation_message(e)
        raise BadBatchError(status, msg) from e
    out = {}
    for kind, models in batch.by_kind().items():
        if not models:
            continue
        _ingested(kind)
        schema = records.ARROW_SCHEMAS[kind]
        cols = {name: [getattr(m, name) for m in models] for name in schema.names}
        for c in records.columns(kind):
            if c.type == "json":
                cols[c.name] = [orjson.dumps(d).decode() for d in cols[c.name]]
        table = pa.Table.from_pydict(cols, schema=schema)  # ts kept to the millisecond, like the store
        _checked(kind, table, limits)  # the store's column bounds on top of the model's
        out[kind] = table
    return out


def parse_body(content_type: str, body: bytes, limits: Limits = DEFAULT_LIMITS,
               max_decoded_bytes: int = _DEFAULT_MAX_DECODED,
               checked: Decoded | None = None) -> dict[str, pa.Table | IpcStream]:
    try:
        if content_type == ARROW_STREAM:
            return parse_arrow(body, limits, max_decoded_bytes, checked)
        return parse_json(body, limits)
    except BadBatchError:
        raise
    except Exception as e:  # anything unexpected while reading input is the input's fault: never a 5xx
        raise BadBatchError(400, f"could not read the {content_type} body ({type(e).__name__}: {e}); "
                                 f"valid bodies: a TelemetryBatch JSON object or an Arrow IPC stream of one "
                                 f"record kind") from e


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
