"""The OpenAPI document declares the HTTPBearer scheme on every operation that takes a token (Swagger's
Authorize button), and /redoc asks nothing of a CDN (api/openapi_docs.py)."""

from __future__ import annotations

import re

from fastapi.testclient import TestClient

from tests.api.conftest import make_settings, real_app


def test_bearer_scheme_declared_and_used(store, tmp_path):
    with TestClient(real_app(store, make_settings(tmp_path, role="all"))) as c:
        doc = c.get("/openapi.json").json()
    assert doc["components"]["securitySchemes"]["HTTPBearer"] == {
        "type": "http", "scheme": "bearer", "description": doc["components"]["securitySchemes"]["HTTPBearer"]["description"]}
    ops = {(m.upper(), p): op for p, item in doc["paths"].items() for m, op in item.items() if isinstance(op, dict)}
    secured = {k for k, op in ops.items() if op.get("security") == [{"HTTPBearer": []}]}
    assert ("PUT", "/v1/switches/{name}") in secured and ("GET", "/v1/switches") in secured
    assert ("POST", "/v1/telemetry") in secured
    leftover = [k for k, op in ops.items() for p in op.get("parameters", [])
                if p.get("in") == "header" and p["name"].lower() == "authorization"]
    assert leftover == []


def test_redoc_loads_nothing_from_a_cdn(store, tmp_path):
    with TestClient(real_app(store, make_settings(tmp_path))) as c:
        page = c.get("/redoc").text
        scripts = re.findall(r'<script src="([^"]+)"', page)
        assert scripts and all(s.startswith("/") for s in scripts), scripts
        for src in scripts:
            js = c.get(src)
            assert js.status_code == 200 and "cdn.redoc.ly" not in js.text and "cdn.jsdelivr" not in js.text
