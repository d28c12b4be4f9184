"""What ``/docs`` and ``/redoc`` show about auth, and ReDoc with nothing from the internet.

    install(app)   # after errors.install: the OpenAPI gains the HTTPBearer scheme; /redoc served offline

The routes read ``Authorization: Bearer <token>`` as a header parameter (api/deps.py); OpenAPI says a
header named Authorization is ignored as a parameter, so Swagger UI offered no way to send it. Here
every operation that takes that header (or answers 401, like the ingest route that reads it itself)
instead names the ``HTTPBearer`` security scheme (Swagger's
Authorize button), as FastAPI's own ``fastapi.security.HTTPBearer`` would declare it; what the server
checks does not change. ReDoc's bundle (served by fastapi-offline) draws its vendor's logo from a CDN:
``/redoc`` here loads a copy of that bundle with the logo's address emptied (one console error offline
otherwise), and nothing else differs. This customisation is its own function, beside
api/errors.py's; both amend ``app.openapi`` through ``amend_openapi``.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html
from fastapi.responses import HTMLResponse, Response

SCHEME = "HTTPBearer"
REDOC_JS = "/docs-assets/redoc.standalone.js"
VENDOR_LOGO = "https://cdn.redoc.ly/redoc/logo-mini.svg"


def bearer_security(openapi: dict) -> dict:
    """``openapi`` with the HTTPBearer scheme, named by every operation that takes an Authorization header."""
    schemes = openapi.setdefault("components", {}).setdefault("securitySchemes", {})
    schemes[SCHEME] = {"type": "http", "scheme": "bearer",
                       "description": "a livestep token: ingest, read or admin (LIVESTEP_*_TOKENS)"}
    for path in openapi.get("paths", {}).values():
        for op in path.values():
            if not isinstance(op, dict):
                continue
            params = op.get("parameters", [])
            auth = [p for p in params if p.get("in") == "header" and p.get("name", "").lower() == "authorization"]
            if auth:
                op["parameters"] = [p for p in params if p not in auth]
                if not op["parameters"]:
                    del op["parameters"]
            if auth or "401" in op.get("responses", {}):  # the ingest route reads its header itself
                op["security"] = [{SCHEME: []}]
    return openapi


def amend_openapi(app: FastAPI, amend) -> None:
    """``app.openapi`` returns ``amend`` applied to what it returned so far: generated once, then cached."""
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = amend(generate())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


@lru_cache(maxsize=1)
def _offline_redoc_js() -> bytes:
    import fastapi_offline

    js = (Path(fastapi_offline.__file__).parent / "static" / "redoc.standalone.js").read_text()
    return js.replace(VENDOR_LOGO, "").encode()


def install(app: FastAPI) -> None:
    amend_openapi(app, bearer_security)
    app.router.routes = [r for r in app.router.routes if getattr(r, "path", None) != "/redoc"]  # fastapi-offline's

    @app.get(REDOC_JS, include_in_schema=False)
    async def redoc_js() -> Response:
        return Response(_offline_redoc_js(), media_type="text/javascript",
                        headers={"Cache-Control": "public, max-age=86400"})

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_redoc_html(openapi_url=f"{root}{app.openapi_url}", title=f"{app.title} - ReDoc",
                              redoc_js_url=f"{root}{REDOC_JS}", with_google_fonts=False,
                              redoc_favicon_url=f"{root}/static-offline-docs/favicon.png")
