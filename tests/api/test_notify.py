"""notify: only open, critical, attributed findings are posted, signed; the webhook acts on them;
with the port unknown (0) the signed body goes to this process's handler."""

from __future__ import annotations

from datetime import UTC, datetime

from api import notify
from api.settings import Settings
from tests.api.conftest import SECRET
from tests.api.live import serve


def finding(severity="critical", status="open", attribution="fused_allreduce", scope="release=v7"):
    now = datetime(2026, 11, 20, tzinfo=UTC)
    return {"kind": "memory_growth", "scope": scope, "metric": "reserved_bytes_per_shape", "window_start": now,
            "window_end": now, "value": 1.0, "severity": severity, "status": status, "attribution": attribution,
            "evidence": "{}"}


def test_actionable_keeps_open_critical_attributed():
    rows = [finding(), finding(severity="warning"), finding(status="resolved"), finding(attribution="")]
    assert notify.actionable(rows) == [rows[0]]


def test_notifier_posts_signed_findings_that_flip_the_switch(app, client):
    with serve(app) as base:
        n = notify.Notifier([f"{base}/v1/alerts"], SECRET)
        n([finding(), finding(severity="info", scope="release=v6")])
        n([finding()])  # the same finding again (a job re-run): a duplicate (or, within the same second, a
        assert [r["ok"] for r in n.sent] == [True, True]  # replayed signature: 409), no second flip
        wrong = notify.post_findings([finding(scope="release=v8")], [f"{base}/v1/alerts"], "not-the-secret",
                                     attempts=1)
        assert wrong[0]["status"] == 401 and not wrong[0]["ok"]
    assert client.get("/v1/switches", params={"release": "v7"}).json()["switches"]["fused_allreduce"] is False
    assert "fused_allreduce" not in client.get("/v1/switches", params={"release": "v6"}).json()["switches"]
    assert "fused_allreduce" not in client.get("/v1/switches", params={"release": "v8"}).json()["switches"]
    hist = client.get("/v1/switches/history", params={"source": "alert"}).json()["decisions"]
    assert [d["action"] for d in hist][-1] == "set" and sum(d["changed"] for d in hist) == 1
    # the audit says why in words: the finding's one-sentence summary
    changed = next(d for d in hist if d["changed"])
    assert changed["reason"].startswith("memory_growth reserved_bytes_per_shape: ")
    assert "reserved per new prompt shape" in changed["reason"], changed["reason"]


def test_unreachable_url_never_raises():
    n = notify.Notifier(["http://127.0.0.1:9/v1/alerts"], SECRET)
    n([finding()])
    assert n.sent[0]["ok"] is False and "error" in n.sent[0]


def test_port_zero_delivers_to_the_local_handler(store):
    from api.routes.alerts import _act

    settings = Settings(host="127.0.0.1", port=0, webhook_secret=SECRET, switch_cache_s=0)
    n = notify.install(settings, lambda body, h: _act(store, settings, body, h))
    try:
        assert n is not None and n.local is not None
        n([finding()])
        assert n.sent == [{"url": "local", "ok": True, "status": 200, "flipped": 1}]
    finally:
        notify.uninstall(n)
