"""Alert webhook ``POST /v1/alerts``: signed findings, Alertmanager v4 or Grafana payloads -> switch off.

Sign the body with HMAC-SHA256 over ``'<timestamp>.<body>'`` (api/alerts.py ``sign``): headers
``X-Livestep-Timestamp`` and ``X-Livestep-Signature``; or Grafana's contact-point HMAC signing
(``X-Grafana-Alert-Signature``, timestamp header set to ``X-Grafana-Alert-Timestamp``). Unsigned, badly signed or stale deliveries
are 401, a replayed signature 409 (a signature counts as accepted once its decisions are stored, so
a delivery that failed can be retried as is), a malformed body 422, an unknown switch 422 (the message lists
the valid ones); resolved, duplicate and unmapped alerts are answered 200 with recorded no-ops.
Where the app runs the analytics scheduler, api/notify.py posts their critical findings here (wired by
api/app.py's lifespan; ``_act`` is also its in-process delivery).
"""

from __future__ import annotations

import threading
from typing import Annotated, Any

from fastapi import APIRouter, Header, HTTPException, Request
from fastapi.concurrency import run_in_threadpool

from api.alerts import (
    GRAFANA_SIG_HEADER,
    GRAFANA_TS_HEADER,
    SIG_HEADER,
    TS_HEADER,
    PayloadError,
    SignatureError,
    handle_alerts,
    parse_payload,
    remember,
    seen,
    unknown_switches,
    verify,
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


def _handle_once(store, board, digest: str, fmt: str, alerts) -> list[dict[str, Any]]:
    """Handle a signed delivery unless its signature was accepted before (409). The signature is
    recorded only once the decisions are stored: a delivery that failed half-way (store down) can be
    retried with the same signature, and the alert-key dedup of ``handle_alerts`` keeps the flip single.
    The lock makes check, handling and record one step for concurrent copies in this process."""
    key = f"sig:{digest}"
    with _replay_lock:
        if seen(store, key):
            raise HTTPException(409, detail="replayed delivery: this signature was accepted before; "
                                            "sign each delivery with a fresh timestamp")
        decisions = handle_alerts(store, board, fmt, alerts)
        remember(store, key, "signature", "accepted")
    return decisions


def _act(store, settings, body: bytes, ts: str | None, sig: str | None, sep: str = ".") -> dict[str, Any]:
    try:
        digest = verify(settings.webhook_secret or "", body, ts, sig, window_s=settings.webhook_window_s, sep=sep)
    except SignatureError as e:
        raise HTTPException(401, detail=str(e)) from e
    try:
        fmt, alerts = parse_payload(body)
    except PayloadError as e:
        raise HTTPException(422, detail=str(e)) from e
    bad = unknown_switches(alerts)
    if bad:
        raise HTTPException(422, detail=f"unknown switch(es) {bad}; valid switches: {', '.join(SWITCH_NAMES)}")
    board = get_switchboard(store, settings.switch_cache_s)
    decisions = _handle_once(store, board, digest, fmt, alerts)
    return {"format": fmt, "alerts": len(alerts), "flipped": sum(1 for d in decisions if d["changed"]),
            "decisions": decisions}


@router.post("", openapi_extra=_BODY_DOC, responses={401: {"description": "missing, bad or stale signature"},
                                                     409: {"description": "replayed delivery"},
                                                     422: {"description": "malformed payload or unknown switch"}})
async def post_alerts(
    request: Request,
    store: StoreDep,
    settings: SettingsDep,
    x_livestep_timestamp: Annotated[str | None, Header(alias=TS_HEADER, max_length=64)] = None,
    x_livestep_signature: Annotated[str | None, Header(alias=SIG_HEADER, max_length=200)] = None,
    x_grafana_alert_timestamp: Annotated[str | None, Header(alias=GRAFANA_TS_HEADER, max_length=64)] = None,
    x_grafana_alert_signature: Annotated[str | None, Header(alias=GRAFANA_SIG_HEADER, max_length=200)] = None,
) -> dict[str, Any]:
    body = await request.body()
    if len(body) > MAX_BODY:
        raise HTTPException(413, detail=f"body of {len(body)} bytes is over the {MAX_BODY}-byte limit")
    if x_livestep_signature is None and x_grafana_alert_signature is not None:  # Grafana's own signing
        return await run_in_threadpool(_act, store, settings, body, x_grafana_alert_timestamp,
                                       x_grafana_alert_signature, ":")
    return await run_in_threadpool(_act, store, settings, body, x_livestep_timestamp, x_livestep_signature)
