"""Fixtures of the api tests: an app with the api routers mounted on the ``store`` fixture.

Uses ``api.app.create_app`` (the real factory, api role, on the test's store) or a bare FastAPI
with the api's routers; either way the test's ``Settings`` (known test secrets) is the app's
``app.state.settings``, the one copy its routes read.
"""

from __future__ import annotations

import importlib

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from api.settings import Settings

ADMIN = "test-admin-token"
SECRET = "test-webhook-secret"
MY_ROUTES = ("switches", "alerts", "canaries", "queries", "reports", "dashboard")


def make_settings(tmp_path, **kw) -> Settings:
    base = {"host": "127.0.0.1", "role": "api", "admin_tokens": [ADMIN], "webhook_secret": SECRET,
            "spool_dir": tmp_path / "spool", "reports_dir": tmp_path / "reports", "switch_cache_s": 0}
    return Settings(**{**base, **kw})


def real_app(store, settings: Settings) -> FastAPI:
    """The server's own factory (api role), on the test's store."""
    from api.app import create_app

    app = create_app(settings.model_copy(update={"clickhouse_dsn": store.dsn.redacted()}))
    app.state.store = store
    return app


def bare_app(store, settings: Settings) -> FastAPI:
    app = FastAPI()
    for name in MY_ROUTES:
        app.include_router(importlib.import_module(f"api.routes.{name}").router)
    app.state.store, app.state.settings = store, settings
    return app


@pytest.fixture
def settings(tmp_path):
    return make_settings(tmp_path)


@pytest.fixture
def app(store, settings):
    return real_app(store, settings)


@pytest.fixture
def client(app):
    with TestClient(app) as c:
        yield c


@pytest.fixture
def admin():
    return {"Authorization": f"Bearer {ADMIN}"}
