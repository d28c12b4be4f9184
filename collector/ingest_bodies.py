"""Ingest bodies -> ``{kind: Arrow table of the canonical schema}``: an Arrow IPC stream of one kind, or
a JSON ``TelemetryBatch``.

    tables = parse_body(ARROW_STREAM, body, limits)   # BadBatchError(4xx, what is valid) for a bad body

An Arrow body is bounded before anything is decompressed (``decoded_within``: rows and bytes read from
its metadata, collector/ipc_budget.py), every buffer validated before compute reads it, its schema
matched (an older worker's missing columns read as null) and its values checked
(collector/ingest_checks.py). The shipping client's exact schema is spooled as sent (``IpcStream``).
"""

from __future__ import annotations

import orjson
import pyarrow as pa
from pydantic import TypeAdapter, ValidationError

from collector import records
from collector.ingest_checks import BadBatchError, check_counted
from collector.ipc_budget import Decoded, decoded_size
from collector.limits import DEFAULT as DEFAULT_LIMITS
from collector.limits import Limits
from collector.spool import IpcStream, read_ipc_stream

ARROW_STREAM = "application/vnd.apache.arrow.stream"
JSON = "application/json"
CONTENT_TYPES = (ARROW_STREAM, JSON)
_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"
_BATCH = TypeAdapter(records.TelemetryBatch)
DEFAULT_MAX_DECODED = 64 << 20  # collector/settings.py's default, for callers without settings


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


def parse_arrow(body: bytes, limits: Limits = DEFAULT_LIMITS, max_decoded_bytes: int = DEFAULT_MAX_DECODED,
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
    check_counted(kind, table, limits)
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
        check_counted(kind, table, limits)  # the store's column bounds on top of the model's
        out[kind] = table
    return out


def parse_body(content_type: str, body: bytes, limits: Limits = DEFAULT_LIMITS,
               max_decoded_bytes: int = DEFAULT_MAX_DECODED,
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
