"""The OpenAPI document states what the server enforces beyond each route's own declarations: the
limits (head bytes, deadlines, connections, body and decoded bytes, rows per batch) and every status
an operation can answer, so a client generated from it -- or schemathesis -- meets no surprise.

    document(app)      # in create_app, after errors.install: wraps app.openapi once

Statuses are derived from what serves the operation, not typed per route:

- every operation: 408 (head or body too slow) and 431 (head too large) from api/http_limits.py, 503
  when the connection bound is reached (uvicorn's plain-text answer);
- a dependency: the reader / admin checks (api/deps.py) answer 401 and 403 (a reader's page 303 to
  /login), the store dependency 503 while the store is unreachable;
- a path parameter, or a query parameter naming a thing that must exist in the store (``_MUST_EXIST``),
  answers 404 when it does not.

``info.x-livestep-limits`` holds the limits as numbers, ``info.description`` as a table.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute

_MUST_EXIST = frozenset(("release", "baseline", "candidate", "name"))  # query names answered 404 when unknown
# statuses a route answers that neither its declaration nor the rules above give (reads its body itself)
_ALSO = {("post", "/v1/alerts"): {413: "body over the webhook's byte limit"},
         ("get", "/logout"): {303: "to /login, the session cookie dropped"}}
_ERROR = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}


def limits_of(app: FastAPI) -> dict[str, Any]:
    """The limits this app's server enforces, by name (the numbers the document states)."""
    from api.http_limits import MAX_HEAD_BYTES, HttpLimits
    from collector import records

    settings, http = app.state.settings, HttpLimits()
    return {
        "max_head_bytes": MAX_HEAD_BYTES,
        "idle_timeout_s": http.idle_timeout_s,
        "header_timeout_s": http.header_timeout_s,
        "body_timeout_s": http.body_timeout_s,
        "max_connections": http.max_connections,
        "max_body_bytes": settings.max_body_bytes,
        "max_decoded_bytes": settings.max_decoded_bytes,
        "max_batch_rows": records.MAX_BATCH_ROWS,
    }


def _statuses(limits: dict[str, Any]) -> dict[int, dict]:
    return {
        408: {"description": f"the request's head did not arrive within {limits['header_timeout_s']:g} s of its "
                             f"first byte, or its body within {limits['body_timeout_s']:g} s of the head; the "
                             "connection is closed", "content": _ERROR},
        431: {"description": f"request line and headers over {limits['max_head_bytes']} bytes; the connection is "
                             "closed", "content": _ERROR},
        503: {"description": f"over {limits['max_connections']} open connections (plain text), or the store "
                             "is unreachable (retry after Retry-After)",
              "content": {**_ERROR, "text/plain": {"schema": {"type": "string"}}}},
    }


def _dependency_statuses() -> dict[Any, dict[int, str]]:
    from api import deps

    auth = {401: "no usable bearer token", 403: "a token that is not this role's"}
    return {
        deps.require_reader: {**auth, 303: "a browser page without a session: sent to /login"},
        deps.require_admin: auth,
        deps.get_store: {503: "the store is unreachable; retry after Retry-After"},
    }


def _calls(dependant) -> set:
    out, todo = set(), [dependant]
    while todo:
        d = todo.pop()
        out.add(d.call)
        todo.extend(d.dependencies)
    return out


def _api_routes(app: FastAPI) -> list:
    """The app's operations (path_format, methods, dependant), routers included: FastAPI >= 0.16x includes
    routers lazily (``iter_route_contexts`` resolves them); older ones list ``APIRoute``s directly."""
    from fastapi import routing

    if hasattr(routing, "iter_route_contexts"):
        return [rc for rc in routing.iter_route_contexts(app.routes) if isinstance(rc.original_route, APIRoute)]
    return [r for r in app.routes if isinstance(r, APIRoute)]


def _route_statuses(route, by_dependency: dict) -> dict[int, str]:
    out: dict[int, str] = {}
    for call in _calls(route.dependant):
        out.update(by_dependency.get(call, {}))
    names = [p.name for p in route.dependant.path_params]
    queries = [p.alias for p in route.dependant.query_params if p.alias in _MUST_EXIST]
    for d in route.dependant.dependencies:  # query parameters of dependencies (time ranges, pages)
        queries += [p.alias for p in d.query_params if p.alias in _MUST_EXIST]
    if names or queries:
        out[404] = f"no such {' / '.join(names + queries)} in the store"
    return out


def _state_range_rules(op: dict, route) -> None:
    """The time-range rules a schema cannot express, in the ``start`` parameter's description."""
    from api.routes._common import MAX_RANGE, optional_range, time_range

    calls = _calls(route.dependant)
    rule = (f"; before end, and end - start at most {MAX_RANGE.days} days (422 otherwise)" if time_range in calls
            else "; before end (422 otherwise)" if optional_range in calls else None)
    for p in op.get("parameters", []) if rule else []:
        if p.get("in") == "query" and p.get("name") == "start" and rule not in p.get("description", ""):
            p["description"] = p.get("description", "") + rule


def _table(limits: dict[str, Any]) -> str:
    rows = [
        ("request line + headers", f"{limits['max_head_bytes']} bytes", "431, connection closed"),
        ("no request begun on a connection", f"{limits['idle_timeout_s']:g} s", "connection closed"),
        ("a request's head, from its first byte", f"{limits['header_timeout_s']:g} s", "408, connection closed"),
        ("a request's body, from its head", f"{limits['body_timeout_s']:g} s", "408, connection closed"),
        ("open connections", str(limits["max_connections"]), "503"),
        ("POST /v1/telemetry body", f"{limits['max_body_bytes']} bytes", "413"),
        ("an Arrow body, decoded (buffers decompressed)", f"{limits['max_decoded_bytes']} bytes", "413"),
        ("rows of one kind per request (JSON list, Arrow body)", str(limits["max_batch_rows"]), "422 (JSON) / 413 (Arrow)"),
    ]
    lines = ["", "", "## Limits the server enforces", "", "| what | limit | beyond it |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    lines += ["", ("Field bounds are in each schema (minimum, maximum, maxLength, maxItems); a timestamp must "
                   "lie within the store's retention and at most the allowed skew in the future (422 names both).")]
    return "\n".join(lines)


def _document(doc: dict, app: FastAPI) -> dict:
    limits = limits_of(app)
    info = doc.setdefault("info", {})
    info["x-livestep-limits"] = limits
    info["description"] = (info.get("description") or "") + _table(limits)
    everywhere = _statuses(limits)
    by_dependency = _dependency_statuses()
    routes = {(m.lower(), r.path_format): r for r in _api_routes(app) for m in r.methods}
    for path, item in doc.get("paths", {}).items():
        for method, op in item.items():
            if not isinstance(op, dict) or "responses" not in op:
                continue
            responses = op["responses"]
            route = routes.get((method, path))
            found = {**(_route_statuses(route, by_dependency) if route is not None else {}),
                     **_ALSO.get((method, path), {})}
            if route is not None:
                _state_range_rules(op, route)
            for status, text in found.items():
                content = {} if status == 303 else _ERROR
                responses.setdefault(str(status), {"description": text, **({"content": content} if content else {})})
            for status, response in everywhere.items():
                have = responses.setdefault(str(status), response)
                if have is not response:  # the route documents it already: add what else may come
                    have.setdefault("content", {}).update(
                        {k: v for k, v in response.get("content", {}).items() if k not in have.get("content", {})})
            if path == "/v1/telemetry" and method == "post":
                op["description"] = (op.get("description") or "") + (
                    f"\n\nA body of at most {limits['max_body_bytes']} bytes; an Arrow IPC stream may compress its "
                    f"buffers (zstd, lz4) but decodes to at most {limits['max_decoded_bytes']} bytes and "
                    f"{limits['max_batch_rows']} rows (read from its metadata, before decoding: 413 beyond); a "
                    f"JSON body has at most {limits['max_batch_rows']} rows per list. No Content-Encoding (415).")
    return doc


def document(app: FastAPI) -> None:
    """``app.openapi`` states the server's limits and every status (generated once, then cached)."""
    generate = app.openapi

    def openapi() -> dict:
        if getattr(app, "_limits_documented", None) is None:
            app.openapi_schema = None
            doc = generate()
            app.openapi_schema = _document(doc, app)
            app._limits_documented = True
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
