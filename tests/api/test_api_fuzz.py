"""Schemathesis over the OpenAPI spec of the dashboard, switch, canary, report and alert routes:
no input gives a 5xx (bounded examples; writes sent with the admin token so validation is reached).
Signed alert bodies of arbitrary JSON shapes: never a 5xx, never a flip without a firing alert."""

from __future__ import annotations

import json

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api.alerts import PayloadError, parse_payload, sign
from tests.api.conftest import ADMIN, SECRET

PREFIXES = ("/v1/switches", "/v1/alerts", "/v1/canaries", "/v1/reports", "/v1/fleet", "/v1/releases",
            "/v1/findings", "/v1/memory", "/v1/sessions/{session_id}/events", "/v1/sessions/{session_id}/memory",
            "/dashboard")
FUZZ = settings(max_examples=12, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


def my_operations(app) -> list[tuple[str, str]]:
    spec = TestClient(app).get("/openapi.json").json()
    return sorted((m.upper(), p) for p, ops in spec["paths"].items() for m in ops
                  if p.startswith(PREFIXES))


def test_every_api_route_is_in_the_spec(app):
    ops = my_operations(app)
    for want in [("GET", "/v1/switches"), ("PUT", "/v1/switches/{name}"), ("POST", "/v1/alerts"),
                 ("POST", "/v1/canaries"), ("GET", "/v1/fleet/fps"), ("GET", "/v1/reports")]:
        assert want in ops


def test_no_input_gives_a_server_error(app, store):
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    failures = []
    for method, path in my_operations(app):
        op = schema[path][method]

        @given(case=op.as_strategy())
        @FUZZ
        def check(case):
            response = case.call(headers={"Authorization": f"Bearer {ADMIN}"})
            if response.status_code >= 500:
                failures.append((case.method, case.path, case.path_parameters, case.query, response.status_code,
                                 response.text[:300]))

        check()
    assert failures == []


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=20,
)
ALERTISH = st.fixed_dictionaries({
    "version": st.sampled_from(["4", "1", 4, None]),
    "status": st.sampled_from(["firing", "resolved", "pending", 1]),
    "alerts": st.lists(st.fixed_dictionaries({
        "status": st.sampled_from(["firing", "resolved", "x"]),
        "labels": st.dictionaries(st.sampled_from(["switch", "release", "gpu_kind", "scope", "worker_id", "a"]),
                                  st.sampled_from(["compile", "v7", "", "a=b", "release=v7", "warp", "x,y"]),
                                  max_size=4),
    }), max_size=3),
}) | st.fixed_dictionaries({"findings": st.lists(st.dictionaries(
    st.sampled_from(["kind", "scope", "status", "attribution", "severity", "window_start"]), JSON, max_size=6),
    max_size=3)})


@given(doc=JSON | ALERTISH)
@FUZZ
def test_parser_raises_payload_error_or_parses(doc):
    try:
        fmt, alerts = parse_payload(json.dumps(doc).encode())
    except PayloadError:
        return
    assert fmt in ("livestep", "alertmanager", "grafana") and isinstance(alerts, list)


def test_signed_arbitrary_bodies_never_5xx(client):
    seen: list[int] = []

    @given(doc=JSON | ALERTISH, n=st.integers(0, 10**6))
    @settings(max_examples=40, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def check(doc, n):
        body = json.dumps(doc).encode()
        r = client.post("/v1/alerts", content=body, headers={**sign(SECRET, body), "X-Nonce": str(n)})
        seen.append(r.status_code)
        assert r.status_code < 500, r.text

    check()
    assert any(s == 422 for s in seen) and any(s in (200, 409) for s in seen)


@pytest.mark.parametrize("raw", [b"", b"{}", b"\xff\xfe", b'{"findings": [' * 200])
def test_odd_bodies(client, raw):
    r = client.post("/v1/alerts", content=raw, headers=sign(SECRET, raw))
    assert r.status_code in (409, 422)
