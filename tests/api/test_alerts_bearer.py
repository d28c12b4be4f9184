"""POST /v1/alerts with a bearer token per sender (Alertmanager's ``http_config.authorization``) instead
of an HMAC signature: a known sender's token acts, an unknown one is 401, the sender is audited, and
the alert dedup keys keep a re-delivered notification from acting twice."""

from __future__ import annotations

import orjson
import pytest
from fastapi.testclient import TestClient

from api.settings import SettingsError, load_settings
from tests.api.conftest import make_settings, real_app
from tests.api.test_alerts import am, switch_of

AM_TOKEN = "am-bearer-token-0123456789"
GRAFANA_TOKEN = "grafana-bearer-token-0123456789"


@pytest.fixture
def client(store, tmp_path):
    settings = make_settings(tmp_path, webhook_bearer_tokens=f"alertmanager={AM_TOKEN},grafana={GRAFANA_TOKEN}")
    with TestClient(real_app(store, settings)) as c:
        yield c


def post(client, doc, token):
    return client.post("/v1/alerts", content=orjson.dumps(doc),
                       headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"})


def test_a_senders_bearer_token_flips_and_is_audited_by_name(client):
    r = post(client, am(), AM_TOKEN)
    assert r.status_code == 200, r.text
    assert r.json()["flipped"] == 1 and r.json()["sender"] == "alertmanager"
    assert switch_of(client, release="v7") is False
    hist = client.get("/v1/switches/history", params={"source": "alert"}).json()["decisions"]
    assert [d["actor"] for d in hist] == ["alert:alertmanager@alertmanager"]


def test_repeated_notifications_flip_once(client):
    """Alertmanager re-sends a group every repeat_interval, byte for byte: no signature to replay-check,
    the alert keys dedup."""
    assert [post(client, am(), AM_TOKEN).json()["flipped"] for _ in range(3)] == [1, 0, 0]


@pytest.mark.parametrize("authorization,fragment", [
    ("Bearer not-a-configured-token-123", "not one of LIVESTEP_WEBHOOK_BEARER_TOKENS"),
    ("Basic dXNlcjpwYXNz", "not 'Bearer <token>'"),
    ("Bearer ", "not 'Bearer <token>'"),
])
def test_unknown_or_malformed_bearer_is_401_and_flips_nothing(client, authorization, fragment):
    r = client.post("/v1/alerts", content=orjson.dumps(am()),
                    headers={"Content-Type": "application/json", "Authorization": authorization})
    assert r.status_code == 401 and fragment in r.json()["detail"]
    assert "not-a-configured" not in r.json()["detail"]  # the token is never echoed
    assert switch_of(client, release="v7") is None


def test_without_configured_senders_a_bearer_is_401_even_on_loopback(store, tmp_path):
    with TestClient(real_app(store, make_settings(tmp_path))) as c:
        r = post(c, am(), AM_TOKEN)
        assert r.status_code == 401 and "LIVESTEP_WEBHOOK_BEARER_TOKENS" in r.json()["detail"]
        assert switch_of(c, release="v7") is None


def test_a_reader_or_admin_token_is_not_a_sender_token(store, tmp_path):
    from tests.api.conftest import ADMIN

    settings = make_settings(tmp_path, webhook_bearer_tokens=f"alertmanager={AM_TOKEN}")
    with TestClient(real_app(store, settings)) as c:
        assert post(c, am(), ADMIN).status_code == 401


@pytest.mark.parametrize("value,fragment", [
    ("alertmanager", "not 'name=token'"),
    ("am=short", "fewer than 16"),
    ("a m=0123456789abcdef0", "is not 1-64"),
    ("am=0123456789abcdef0,am=0123456789abcdef1", "given twice"),
    ("am=0123456789abcdef0,gr=0123456789abcdef0", "share one bearer token"),
])
def test_bad_sender_lists_are_refused_naming_the_problem(value, fragment):
    with pytest.raises(SettingsError, match=fragment):
        load_settings(webhook_bearer_tokens=value)


def test_sender_list_from_the_environment(monkeypatch):
    monkeypatch.setenv("LIVESTEP_WEBHOOK_BEARER_TOKENS", f" alertmanager={AM_TOKEN} , grafana={GRAFANA_TOKEN}")
    assert load_settings().webhook_bearer_tokens == {"alertmanager": AM_TOKEN, "grafana": GRAFANA_TOKEN}
