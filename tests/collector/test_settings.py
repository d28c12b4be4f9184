"""Server and collector settings: bounded fields, token lists from the env, no open server off loopback."""

from __future__ import annotations

import pytest

from api.settings import Settings, SettingsError, load_settings


def test_token_lists_from_env_comma_or_json(monkeypatch):
    monkeypatch.setenv("LIVESTEP_INGEST_TOKENS", "a, b,,c")
    monkeypatch.setenv("LIVESTEP_READ_TOKENS", '["r1", "r2"]')
    s = Settings()
    assert s.ingest_tokens == ["a", "b", "c"] and s.read_tokens == ["r1", "r2"] and s.admin_tokens == []


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost", "127.0.0.2"])
def test_loopback_needs_no_tokens(host):
    assert Settings(host=host).ingest_tokens == []


def test_non_loopback_bind_lists_what_is_missing():
    with pytest.raises(SettingsError) as e:
        load_settings(host="0.0.0.0")
    msg = str(e.value)
    for name in ("LIVESTEP_INGEST_TOKENS", "LIVESTEP_READ_TOKENS", "LIVESTEP_ADMIN_TOKENS", "LIVESTEP_WEBHOOK_SECRET",
                 "127.0.0.1"):
        assert name in msg


def test_non_loopback_needs_only_what_the_role_serves():
    s = Settings(host="10.0.0.5", role="collector", ingest_tokens=["t"])
    assert s.roles == {"collector"}
    with pytest.raises(SettingsError, match="LIVESTEP_INGEST_TOKENS"):
        load_settings(host="10.0.0.5", role="collector")
    full = Settings(host="10.0.0.5", ingest_tokens=["t"], read_tokens=["r"], admin_tokens=["a"],
                    webhook_secret="s" * 32)
    assert full.roles == {"collector", "api", "scheduler"}


@pytest.mark.parametrize("field,value,words", [
    ("spool_max_bytes", 10, "greater than or equal"),
    ("max_body_bytes", 0, "greater than or equal"),
    ("flush_interval_s", 0, "greater than 0"),
    ("role", "worker", "'all', 'collector', 'api' or 'scheduler'"),
    ("port", 70000, "less than or equal to 65535"),
])
def test_out_of_range_settings_say_what_is_valid(field, value, words):
    with pytest.raises(SettingsError, match=field) as e:
        load_settings(**{field: value})
    assert words in str(e.value)
