"""Alert webhook ``POST /v1/alerts``: signed findings, Alertmanager v4 or Grafana payloads -> switch off.

Three ways to authenticate a delivery (api/alerts.py says each in full):
- our HMAC-SHA256 over ``'<timestamp>.<body>'`` (api/alerts.py ``sign``): ``X-Livestep-Timestamp`` and
  ``X-Livestep-Signature``;
- Grafana's contact-point HMAC signing: ``X-Grafana-Alerting-Signature`` (Grafana's default name) or
  ``X-Grafana-Alert-Signature``, over ``'<timestamp>:<body>'`` with a timestamp header
  (``X-Grafana-Alerting-Timestamp`` / ``X-Grafana-Alert-Timestamp``), else over the body alone;
- ``Authorization: Bearer <token>`` of a sender named in ``LIVESTEP_WEBHOOK_BEARER_TOKENS``
  (Alertmanager's ``http_config.authorization``); a signature, when sent, is what is checked.
Unauthenticated, badly signed or stale deliveries are 401, a replayed timestamped signature 409 (a
signature counts as accepted once its decisions are stored, so a delivery that failed can be retried as
is; body-only signatures and bearer deliveries have no signature to replay, and the alert dedup keys
keep each alert's effect single), a malformed body 422, an unknown switch 422 (the message lists the
valid ones); resolved, duplicate and unmapped alerts are answered 200 with recorded no-ops.
This route is for external senders: the server's own findings go to api/incidents.py by a function
call (the scheduler's hand-off), never through here.
"""

from __future__ import annotations

import threading
from typing import Annotated, Any

from fastapi import APIRouter, Header, HTTPException, Request
from fastapi.concurrency import run_in_threadpool

from api.alerts import (
    GRAFANA_SIG_HEADERS,
    GRAFANA_TS_HEADERS,
    SIG_HEADER,
    TS_HEADER,
    PayloadError,
    SignatureError,
    bearer_sender,
    handle_alerts,
    parse_payload,
    remember,
    seen,
    unknown_switches,
    verify,
    verify_body_only,
)
from api.deps import SettingsDep, StoreDep
from api.switchboard import get_switchboard
from collector.records import SWITCH_NAMES

router = APIRouter(prefix="/v1/alerts", tags=["alerts"])
MAX_BODY = 1 << 20
_replay_lock = threading.Lock()

_BODY_DOC = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {
            "type": "object",
            "description": "our findings {'findings': [...]}, Alertmanager v4 or Grafana unified alerting",
        }}},
    }
}


def _handle_once(store, board, digest: str | None, fmt: str, alerts, sender: str = "") -> list[dict[str, Any]]:
    """Handle a delivery unless its timestamped signature was accepted before (409). The signature is
    recorded only once the decisions are stored: a delivery that failed half-way (store down) can be
    retried with the same signature, and the alert-key dedup of ``handle_alerts`` keeps the flip single.
    The lock makes check, handling and record one step for concurrent copies in this process.
    ``digest`` None (bearer, body-only signature): no signature to replay, the alert keys dedup."""
    key = f"sig:{digest}" if digest else None
    with _replay_lock:
        if key and seen(store, key):
            raise HTTPException(409, detail="replayed delivery: this signature was accepted before; "
                                            "sign each delivery with a fresh timestamp")
        decisions = handle_alerts(store, board, fmt, alerts, sender=sender)
        if key:
            remember(store, key, "signature", "accepted")
    return decisions


def _authenticate(settings, body: bytes, headers) -> tuple[str | None, str]:
    """(the replay digest or None, the bearer sender's name or ''), else 401 naming what was wrong."""
    try:
        if headers.get(SIG_HEADER) is not None:
            return verify(settings.webhook_secret or "", body, headers.get(TS_HEADER), headers.get(SIG_HEADER),
                          window_s=settings.webhook_window_s), ""
        gsig = next((headers[h] for h in GRAFANA_SIG_HEADERS if headers.get(h) is not None), None)
        if gsig is not None:
            gts = next((headers[h] for h in GRAFANA_TS_HEADERS if headers.get(h) is not None), None)
            if gts is None:  # a contact point without a timestamp header signs the body alone
                verify_body_only(settings.webhook_secret or "", body, gsig)
                return None, ""
            return verify(settings.webhook_secret or "", body, gts, gsig, window_s=settings.webhook_window_s,
                          sep=":"), ""
        if headers.get("Authorization") is not None:
            return None, bearer_sender(headers.get("Authorization"), settings.webhook_bearer_tokens)
        verify(settings.webhook_secret or "", body, None, None, window_s=settings.webhook_window_s)
    except SignatureError as e:
        raise HTTPException(401, detail=str(e), headers={"WWW-Authenticate": "Bearer"}) from e
    raise AssertionError("verify raises without a signature")  # pragma: no cover


def _act(store, settings, body: bytes, headers) -> dict[str, Any]:
    """Authenticate, parse and act on one delivery; ``headers`` is a case-insensitive mapping (Starlette's
    ``request.headers``, or an ``httpx.Headers`` for the in-process delivery)."""
    digest, sender = _authenticate(settings, body, headers)
    try:
        fmt, alerts = parse_payload(body)
    except PayloadError as e:
        raise HTTPException(422, detail=str(e)) from e
    bad = unknown_switches(alerts)
    if bad:
        raise HTTPException(422, detail=f"unknown switch(es) {bad}; valid switches: {', '.join(SWITCH_NAMES)}")
    board = get_switchboard(store, settings.switch_cache_s)
    decisions = _handle_once(store, board, digest, fmt, alerts, sender)
    return {"format": fmt, "alerts": len(alerts), "flipped": sum(1 for d in decisions if d["changed"]),
            **({"sender": sender} if sender else {}), "decisions": decisions}


@router.post("", openapi_extra=_BODY_DOC,
             responses={401: {"description": "missing, bad or stale signature, or an unknown bearer token"},
                        409: {"description": "replayed delivery"},
                        422: {"description": "malformed payload or unknown switch"}})
async def post_alerts(
    request: Request,
    store: StoreDep,
    settings: SettingsDep,
    x_livestep_timestamp: Annotated[str | None, Header(alias=TS_HEADER, max_length=64)] = None,
    x_livestep_signature: Annotated[str | None, Header(alias=SIG_HEADER, max_length=200)] = None,
    x_grafana_alerting_timestamp: Annotated[str | None, Header(alias=GRAFANA_TS_HEADERS[0], max_length=64)] = None,
    x_grafana_alerting_signature: Annotated[str | None, Header(alias=GRAFANA_SIG_HEADERS[0], max_length=200)] = None,
    x_grafana_alert_timestamp: Annotated[str | None, Header(alias=GRAFANA_TS_HEADERS[1], max_length=64)] = None,
    x_grafana_alert_signature: Annotated[str | None, Header(alias=GRAFANA_SIG_HEADERS[1], max_length=200)] = None,
    authorization: Annotated[str | None, Header(max_length=4200, description="Bearer <sender token>, "
                                                "where the sender does not sign")] = None,
) -> dict[str, Any]:
    # The header parameters bound their lengths and document them; _act reads them off request.headers.
    body = await request.body()
    if len(body) > MAX_BODY:
        raise HTTPException(413, detail=f"body of {len(body)} bytes is over the {MAX_BODY}-byte limit")
    return await run_in_threadpool(_act, store, settings, body, request.headers)
