"""Every date and ISO-week parameter is bounded: out of range is a 422 naming it, never a 500; and the
OpenAPI documents the 422 body the server sends (``{"detail": str}``, api/errors.py)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from tests.collector.helpers import make_settings


@pytest.fixture
def client(store, tmp_path):
    settings = make_settings(f"chdb://{store.dsn.path}?database={store.database}", tmp_path, role="api",
                             reports_dir=tmp_path / "reports")
    with TestClient(create_app(settings)) as c:
        yield c


@pytest.mark.parametrize("method,url,words", [
    ("POST", "/v1/reports/0999-W01", ["week", "0999-W01", "pattern"]),  # was a 500 from the store
    ("POST", "/v1/reports/2025-W53", ["2025-W53", "does not exist"]),
    ("GET", "/v1/reports/2301-W01.json", ["2301-W01"]),
    ("GET", "/dashboard/memory?end=0001-01-01T00:30:00%2B01:00", ["end", "out of range"]),  # was OverflowError
    ("GET", "/dashboard/sessions?end=0001-01-02T00:00:00Z", ["end", "2000-01-01"]),
    ("GET", "/dashboard/sessions?start=9999-12-31T23:00:00-02:00", ["start", "out of range"]),
    ("GET", "/v1/switches/history?start=1999-12-31T23:59:59Z", ["start", "2000-01-01"]),
])
def test_out_of_range_dates_and_weeks_are_422_naming_them(client, method, url, words):
    r = client.request(method, url)
    assert r.status_code == 422, (url, r.status_code, r.text[:300])
    detail = r.json()["detail"]
    assert isinstance(detail, str) and all(w in detail for w in words), (url, detail)


def test_the_openapi_declares_the_422_body_the_server_sends(client):
    spec = client.get("/openapi.json").json()
    assert "HTTPValidationError" not in spec["components"]["schemas"]
    assert spec["components"]["schemas"]["ErrorBody"]["properties"]["detail"]["type"] == "string"
    r422 = [op["responses"]["422"] for item in spec["paths"].values() for op in item.values()
            if "content" in op["responses"].get("422", {})]
    assert len(r422) > 20
    assert all(r["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorBody"} for r in r422)
