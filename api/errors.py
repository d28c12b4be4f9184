"""Every 4xx body is ``{"detail": "<what was wrong and what is valid>"}``, and the OpenAPI says so.

    install(app)      # in create_app: request-validation errors answered as one sentence; the
                      # generated OpenAPI documents that body (``ErrorBody``) for every 422

FastAPI answers a request that fails validation with ``detail`` as a list of error objects and
documents that (``HTTPValidationError``) for every operation. livestep answers every refusal -- its
own ``HTTPException``s and FastAPI's validation errors alike -- with ``detail`` as one string naming
the parameter, what it got and what is valid (what a person reading a 4xx needs), so the OpenAPI's
422 is rewritten to ``ErrorBody`` everywhere: the schema matches what the server sends, for clients
generated from it and for schemathesis (tests/api/test_openapi_fuzz.py checks every operation).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from api.openapi_docs import amend_openapi
from collector.routes import ErrorBody

_FASTAPI_ERROR_SCHEMAS = ("HTTPValidationError", "ValidationError")


def validation_detail(exc: RequestValidationError) -> str:
    """FastAPI's validation errors as one sentence: where, what it says, what was sent (first five)."""
    parts = []
    for err in exc.errors()[:5]:
        loc = err.get("loc", ())
        where = f"{loc[0]} parameter '{'.'.join(map(str, loc[1:]))}'" if len(loc) > 1 else ".".join(map(str, loc))
        shown = repr(err.get("input"))
        parts.append(f"{where}: {err.get('msg')} (got {shown if len(shown) <= 60 else shown[:57] + '...'})")
    return "; ".join(parts) or "invalid request"


def _error_body_schema(openapi: dict) -> dict:
    """``openapi`` with every reference to FastAPI's validation-error schemas pointing at ``ErrorBody``."""
    schemas = openapi.setdefault("components", {}).setdefault("schemas", {})
    schemas.setdefault("ErrorBody", ErrorBody.model_json_schema())
    for name in _FASTAPI_ERROR_SCHEMAS:
        schemas.pop(name, None)
    wanted = {f"#/components/schemas/{n}" for n in _FASTAPI_ERROR_SCHEMAS}

    def walk(node):
        if isinstance(node, dict):
            if node.get("$ref") in wanted:
                node["$ref"] = "#/components/schemas/ErrorBody"
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(openapi.get("paths", {}))
    for path in openapi.get("paths", {}).values():
        for op in path.values():
            r422 = op.get("responses", {}).get("422") if isinstance(op, dict) else None
            if r422 is not None:
                r422["description"] = "invalid parameter or body: detail names it and what is valid"
    return openapi


def install(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid_request(request: Request, exc: RequestValidationError):
        return JSONResponse({"detail": validation_detail(exc)}, status_code=422)

    amend_openapi(app, _error_body_schema)
