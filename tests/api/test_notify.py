"""notify: a body is posted, signed with a fresh timestamp, to each external receiver; failures are
reported, retried on 5xx, and never raise."""

from __future__ import annotations

import hmac

from fastapi import FastAPI, Request, Response

from api.alerts import SIG_HEADER, TS_HEADER, signature
from api.notify import Notifier
from tests.api.conftest import SECRET
from tests.api.live import serve


def receiver(statuses: list[int]):
    app, got = FastAPI(), []

    @app.post("/hook")
    async def hook(request: Request):
        body = await request.body()
        ok = hmac.compare_digest(request.headers[SIG_HEADER].removeprefix("sha256="),
                                 signature(SECRET, body, int(request.headers[TS_HEADER])))
        got.append((ok, body))
        return Response(status_code=statuses.pop(0) if statuses else 200)

    return app, got


def test_posts_signed_bodies_to_every_receiver():
    app, got = receiver([])
    with serve(app) as base:
        out = Notifier([f"{base}/hook", f"{base}/hook"], SECRET).post(b'{"x": 1}')
    assert [r["ok"] for r in out] == [True, True] and got == [(True, b'{"x": 1}')] * 2


def test_a_5xx_is_retried_and_a_4xx_is_not():
    app, got = receiver([503, 200])
    with serve(app) as base:
        assert Notifier([f"{base}/hook"], SECRET).post(b"{}") == [{"url": f"{base}/hook", "ok": True, "status": 200,
                                                                  "attempts": 2}]
    app, got = receiver([422])
    with serve(app) as base:
        out = Notifier([f"{base}/hook"], SECRET).post(b"{}")
    assert out[0]["ok"] is False and out[0]["status"] == 422 and out[0]["attempts"] == 1 and len(got) == 1


def test_unreachable_url_never_raises():
    out = Notifier(["http://127.0.0.1:9/hook"], SECRET, attempts=1).post(b"{}")
    assert out[0]["ok"] is False and "error" in out[0]
