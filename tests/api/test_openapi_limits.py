"""The OpenAPI document states the limits the server enforces and every status an operation answers
(api/openapi_limits.py): numbers equal to the settings in force, and with every role's tokens set a
request without a token -- or with the wrong one -- gets a status its operation documents."""

from __future__ import annotations

from fastapi.testclient import TestClient

from api.http_limits import MAX_HEAD_BYTES
from collector import records
from tests.api.conftest import ADMIN, real_app


def test_the_limits_in_the_document_are_the_ones_in_force(store, settings, monkeypatch):
    monkeypatch.setenv("LIVESTEP_HEADER_TIMEOUT_S", "7")
    app = real_app(store, settings.model_copy(update={"max_body_bytes": 5 << 20, "max_decoded_bytes": 9 << 20}))
    doc = TestClient(app).get("/openapi.json").json()
    assert doc["info"]["x-livestep-limits"] == {
        "max_head_bytes": MAX_HEAD_BYTES, "idle_timeout_s": 10.0, "header_timeout_s": 7.0, "body_timeout_s": 60.0,
        "max_connections": 1024, "max_body_bytes": 5 << 20, "max_decoded_bytes": 9 << 20,
        "max_batch_rows": records.MAX_BATCH_ROWS}
    assert "| a request's head, from its first byte | 7 s | 408, connection closed |" in doc["info"]["description"]
    for path, item in doc["paths"].items():
        for method, op in item.items():
            assert {"408", "431", "503"} <= set(op["responses"]), (method, path)
    start = next(p for p in doc["paths"]["/v1/fleet/fps"]["get"]["parameters"] if p["name"] == "start")
    assert "at most 400 days" in start["description"]


def test_with_tokens_set_every_refusal_is_a_documented_status(store, settings):
    app = real_app(store, settings.model_copy(update={"read_tokens": ["a-read-token"], "ingest_tokens": ["ing"]}))
    app.state.store = store
    with TestClient(app) as c:
        doc = c.get("/openapi.json").json()
        undocumented = []
        for path, item in doc["paths"].items():
            if "{" in path:
                continue
            for method, op in item.items():
                for headers in ({}, {"Authorization": "Bearer not-a-token"}, {"Authorization": f"Bearer {ADMIN}"}):
                    r = c.request(method.upper(), path, headers=headers, follow_redirects=False)
                    if str(r.status_code) not in op["responses"]:
                        undocumented.append((method, path, r.status_code, r.text[:100]))
        assert undocumented == []


def test_serve_help_lists_the_connection_bounds_in_force(monkeypatch, capsys):
    import pytest

    from api.cli import build_parser

    monkeypatch.setenv("LIVESTEP_BODY_TIMEOUT_S", "42")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    out = capsys.readouterr().out
    for var in ("LIVESTEP_IDLE_TIMEOUT_S", "LIVESTEP_HEADER_TIMEOUT_S", "LIVESTEP_MAX_CONNECTIONS"):
        assert var in out
    assert "LIVESTEP_BODY_TIMEOUT_S      42.0" in out and str(MAX_HEAD_BYTES) in out
