"""One auth rule for every role (api/deps.py): no bearer token is 401 + WWW-Authenticate, a token that
is not the role's is 403 naming the role (never echoing the token); a non-loopback bind without a
required variable fails at startup naming it; each app reads its settings once and keeps them."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from api.settings import SettingsError
from tests.api.conftest import ADMIN, make_settings, real_app

READ, INGEST, WRONG = "test-read-token", "test-ingest-token", "not-a-token-of-ours"
WRITE = {"value": False, "scope": "release=v7", "who": "t", "why": "auth test"}
EMPTY_BATCH = {"schema_version": 1}  # a valid telemetry body with no rows


@pytest.fixture
def locked(store, tmp_path):
    """An app with every role's tokens set (on loopback: the tokens switch the checks on)."""
    s = make_settings(tmp_path, read_tokens=[READ], ingest_tokens=[INGEST])
    with TestClient(real_app(store, s)) as c, TestClient(_collector(store, s)) as ingest:
        yield c, ingest


def _collector(store, settings):
    """The same settings in a collector-role server: POST /v1/telemetry (its own fast lane, same rule)."""
    return real_app(store, settings.model_copy(update={"role": "collector"}))


def _calls(c, ingest):
    return {
        "reader": lambda h: c.get("/v1/switches", headers=h),
        "admin": lambda h: c.put("/v1/switches/compile", json=WRITE, headers=h),
        "ingest": lambda h: ingest.post("/v1/telemetry", json=EMPTY_BATCH, headers=h),
    }


@pytest.mark.parametrize("role,allowed,refused", [
    ("reader", [READ, INGEST, ADMIN], [WRONG]),  # workers poll switches with their ingest token
    ("admin", [ADMIN], [WRONG, READ, INGEST]),
    ("ingest", [INGEST], [WRONG, READ, ADMIN]),
])
def test_missing_token_is_401_and_a_token_not_of_the_role_403(locked, role, allowed, refused):
    call = _calls(*locked)[role]
    for headers in ({}, {"Authorization": ""}, {"Authorization": "Basic dTpw"}, {"Authorization": "Bearer "}):
        r = call(headers)
        assert r.status_code == 401, (headers, r.text)
        assert r.headers["www-authenticate"] == "Bearer" and f"<{role} token>" in r.json()["detail"]
    for token in refused:
        r = call({"Authorization": f"Bearer {token}"})
        assert r.status_code == 403, (token, r.text)
        assert re.search(f"needs an? {role} token", r.json()["detail"]) and token not in r.text
        assert "www-authenticate" not in r.headers
    for token in allowed:
        assert call({"Authorization": f"Bearer {token}"}).status_code == 200, token


def test_every_read_route_has_the_same_rule(locked):
    c, _ = locked
    for path in ("/v1/sessions", "/v1/findings", "/v1/switches/rules", "/v1/canaries", "/v1/reports",
                 "/dashboard/switches"):
        assert c.get(path).status_code == 401, path
        assert c.get(path, headers={"Authorization": f"Bearer {WRONG}"}).status_code == 403, path
        assert c.get(path, headers={"Authorization": f"Bearer {INGEST}"}).status_code == 200, path
    assert c.get("/v1/health").status_code == 200  # load balancers: never a token


def test_roles_are_open_on_loopback_when_their_tokens_are_unset(store, tmp_path):
    s = make_settings(tmp_path, admin_tokens=[])
    with TestClient(real_app(store, s)) as c, TestClient(_collector(store, s)) as ingest:
        for call in _calls(c, ingest).values():
            assert call({}).status_code == 200
            assert call({"Authorization": f"Bearer {WRONG}"}).status_code == 200  # nothing to check against


REQUIRED = {"LIVESTEP_INGEST_TOKENS": "ingest_tokens", "LIVESTEP_READ_TOKENS": "read_tokens",
            "LIVESTEP_ADMIN_TOKENS": "admin_tokens", "LIVESTEP_WEBHOOK_SECRET": "webhook_secret"}
FULL = {"LIVESTEP_INGEST_TOKENS": "i", "LIVESTEP_READ_TOKENS": "r", "LIVESTEP_ADMIN_TOKENS": "a",
        "LIVESTEP_WEBHOOK_SECRET": "s" * 32}


@pytest.fixture
def server_env(monkeypatch, tmp_path):
    for name in (*FULL, "LIVESTEP_HOST", "LIVESTEP_ROLE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LIVESTEP_SPOOL_DIR", str(tmp_path / "spool"))
    return monkeypatch


@pytest.mark.parametrize("missing", list(REQUIRED))
def test_a_non_loopback_bind_without_a_required_variable_fails_at_startup_naming_it(server_env, missing):
    from api.app import create_app

    server_env.setenv("LIVESTEP_HOST", "0.0.0.0")
    for name, value in FULL.items():
        if name != missing:
            server_env.setenv(name, value)
    with pytest.raises(SettingsError) as e:
        create_app()  # what `livestep serve` builds: the settings are read and checked here, once
    msg = str(e.value)
    assert missing in msg and "0.0.0.0" in msg
    assert [n for n in REQUIRED if n in msg] == [missing]  # only the one that is missing
    server_env.setenv(missing, FULL[missing])
    assert create_app().state.settings.host == "0.0.0.0"


def test_each_app_reads_its_settings_once_and_keeps_them(server_env, store, tmp_path):
    from api.app import create_app

    server_env.setenv("LIVESTEP_ROLE", "api")
    server_env.setenv("LIVESTEP_CLICKHOUSE_DSN", store.dsn.redacted())
    server_env.setenv("LIVESTEP_READ_TOKENS", "first")
    first = create_app()
    server_env.setenv("LIVESTEP_READ_TOKENS", "second")  # the env changes after the first app was built
    second = create_app()
    overridden = real_app(store, make_settings(tmp_path, read_tokens=["mine"]))  # a test's own settings
    third = create_app()
    for app in (first, second, overridden, third):
        app.state.store = store

    def status(app, token):
        with TestClient(app) as c:
            return c.get("/v1/switches", headers={"Authorization": f"Bearer {token}"}).status_code

    assert (status(first, "first"), status(first, "second"), status(first, "mine")) == (200, 403, 403)
    assert (status(second, "second"), status(second, "first"), status(second, "mine")) == (200, 403, 403)
    assert (status(overridden, "mine"), status(overridden, "second")) == (200, 403)
    assert (status(third, "second"), status(third, "mine")) == (200, 403)  # the override did not leak
