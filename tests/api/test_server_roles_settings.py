"""Server settings per role off loopback: a process that runs the analytics scheduler refuses to start
without what its findings notifier needs (automatic rollback must not be lost to a log line), and the
public development webhook secret is never used off loopback."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from api.settings import DEV_WEBHOOK_SECRET, Settings, SettingsError, load_settings
from tests.api.conftest import SECRET

OFF = "10.0.0.5"


def test_scheduler_role_off_loopback_needs_the_webhook_secret_only():
    with pytest.raises(SettingsError) as e:
        load_settings(host=OFF, role="scheduler")
    msg = str(e.value)
    assert "LIVESTEP_WEBHOOK_SECRET" in msg and "127.0.0.1" in msg
    for other in ("LIVESTEP_INGEST_TOKENS", "LIVESTEP_READ_TOKENS", "LIVESTEP_ADMIN_TOKENS"):
        assert other not in msg  # it serves no route that needs them
    assert load_settings(host=OFF, role="scheduler", webhook_secret="s" * 32).roles == {"scheduler"}
    assert load_settings(host="127.0.0.1", role="scheduler").roles == {"scheduler"}  # development


def test_the_public_development_secret_is_refused_off_loopback():
    with pytest.raises(SettingsError, match="LIVESTEP_WEBHOOK_SECRET"):
        load_settings(host=OFF, role="scheduler", admin_tokens="a", webhook_secret=DEV_WEBHOOK_SECRET)
    with pytest.raises(SettingsError, match="LIVESTEP_WEBHOOK_SECRET"):
        load_settings(host=OFF, role="api", read_tokens="r", admin_tokens="a", webhook_secret=DEV_WEBHOOK_SECRET)
    # a collector off loopback has no secret of its own, and does not borrow the development one
    assert Settings(host=OFF, role="collector", ingest_tokens=["t"]).webhook_secret is None


def test_loopback_falls_back_to_the_development_secret_only_when_unset():
    assert load_settings(host="127.0.0.1").webhook_secret == DEV_WEBHOOK_SECRET
    assert load_settings(host="::1", webhook_secret=SECRET).webhook_secret == SECRET


def test_a_scheduler_only_process_off_loopback_signs_its_notifications_with_its_secret(store, tmp_path):
    from api.app import create_app

    s = Settings(clickhouse_dsn=store.dsn.redacted(), role="scheduler", host=OFF, admin_tokens=["a"],
                 webhook_secret=SECRET, spool_dir=tmp_path / "spool", reports_dir=tmp_path / "reports",
                 webhook_urls="https://hooks.example/livestep")
    app = create_app(s)
    with TestClient(app):
        assert app.state.incidents is not None and app.state.incidents.notifier.secret == SECRET
