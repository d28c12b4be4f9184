"""Fixtures of the api tests: an app with the api routers mounted on the ``store`` fixture.

Uses ``api.app.create_app`` when it can (the real factory, api role, on the test's store); else a
bare FastAPI with the api's routers. Settings are overridden with known test secrets.
"""

from __future__ import annotations

import importlib

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from api.switch_settings import SwitchSettings, get_switch_settings

ADMIN = "test-admin-token"
SECRET = "test-webhook-secret"
MY_ROUTES = ("switches", "alerts", "canaries", "queries", "reports", "dashboard")


def make_settings(tmp_path, **kw) -> SwitchSettings:
    return SwitchSettings(host="127.0.0.1", admin_tokens=[ADMIN], webhook_secret=SECRET,
                          reports_dir=tmp_path / "reports", switch_cache_s=0, **kw)


def real_app(store, settings: SwitchSettings, tmp_path) -> FastAPI | None:
    """The server's own factory (api role), on the test's store; None until api.app exists."""
    try:
        from api.app import create_app
        from api.settings import Settings
    except ImportError:
        return None
    app = create_app(Settings(clickhouse_dsn=store.dsn.redacted(), role="api", host="127.0.0.1",
                              spool_dir=tmp_path / "spool", reports_dir=settings.reports_dir))
    app.state.store = store
    app.dependency_overrides[get_switch_settings] = lambda: settings
    return app


def bare_app(store, settings: SwitchSettings) -> FastAPI:
    app = FastAPI()
    for name in MY_ROUTES:
        try:
            mod = importlib.import_module(f"api.routes.{name}")
        except ModuleNotFoundError:
            continue
        app.include_router(mod.router)
    app.state.store = store
    app.dependency_overrides[get_switch_settings] = lambda: settings
    return app


@pytest.fixture
def settings(tmp_path):
    return make_settings(tmp_path)


@pytest.fixture
def app(store, settings, tmp_path):
    return real_app(store, settings, tmp_path) or bare_app(store, settings)


@pytest.fixture
def client(app):
    with TestClient(app) as c:
        yield c


@pytest.fixture
def admin():
    return {"Authorization": f"Bearer {ADMIN}"}
