"""Alert webhook payloads, their HMAC signature and bearer senders (api/routes/alerts.py; ``sign`` also api/notify.py).

    headers = sign(secret, body)                      # X-Livestep-Timestamp, X-Livestep-Signature
    verify(secret, body, headers_ts, headers_sig, window_s=300, now=time.time())   # raises SignatureError
    sender = bearer_sender(authorization, settings.webhook_bearer_tokens)         # raises SignatureError
    fmt, alerts = parse_payload(body)                 # livestep findings | Alertmanager v4 | Grafana

The signature is HMAC-SHA256 over ``f"{timestamp}.".encode() + body`` (hex, ``sha256=`` prefix
optional); a timestamp outside the replay window is refused. Grafana's native signing is accepted too:
its signature header (``X-Grafana-Alerting-Signature``, Grafana's default, or ``X-Grafana-Alert-Signature``)
is HMAC-SHA256 hex of ``'<timestamp>:<body>'`` when the contact point names a timestamp header
(``X-Grafana-Alerting-Timestamp`` or ``X-Grafana-Alert-Timestamp``), else of the body alone. A body-only
signature has no replay window; such a delivery is still acted on at most once per alert, because every
alert's dedup key is remembered (a replayed body's alerts are recorded duplicates): set the timestamp
header in Grafana to get the window as well.

Senders that cannot sign (Alertmanager's ``http_config.authorization``) send ``Authorization: Bearer
<token>`` instead, one token per named sender (``LIVESTEP_WEBHOOK_BEARER_TOKENS``); the alert dedup keys
are their replay protection too.

Every format becomes a list of ``Alert``: a dedup key (the same alert delivered again has the same key;
a firing and a resolved notification of one alert have different keys, so a resolved that arrives first
does not use up its firing's), firing or not, the switch it names (label ``switch``/``attribution`` or
the finding's ``attribution``) and its scope (labels ``release``/``gpu_kind``/``worker_id`` or
``scope``, or the finding's ``scope``).
"""

from __future__ import annotations

import hashlib
import hmac
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from analytics import queries as aq

TS_HEADER = "X-Livestep-Timestamp"
SIG_HEADER = "X-Livestep-Signature"
# Grafana's own webhook signing (contact point ``hmacConfig``): hex HMAC-SHA256 of '<timestamp>:<body>'
# when its timestampHeader is set (to one of GRAFANA_TS_HEADERS), else of the body. The first of each
# tuple is Grafana's default name (signature) or its documented example (timestamp).
GRAFANA_SIG_HEADERS = ("X-Grafana-Alerting-Signature", "X-Grafana-Alert-Signature")
GRAFANA_TS_HEADERS = ("X-Grafana-Alerting-Timestamp", "X-Grafana-Alert-Timestamp")
GRAFANA_SIG_HEADER, GRAFANA_TS_HEADER = GRAFANA_SIG_HEADERS[0], GRAFANA_TS_HEADERS[0]
RESOLVED_KEY_SUFFIX = "|resolved"  # a resolved notification's dedup key: its firing's key + this
FORMATS = ("livestep", "alertmanager", "grafana")


class SignatureError(Exception):
    """Missing, malformed, stale or wrong signature; the message says which."""


class PayloadError(ValueError):
    """A body that is none of the accepted formats; the message says what was wrong and what is valid."""


def signature(secret: str, body: bytes, ts: int, sep: str = ".") -> str:
    return hmac.new(secret.encode(), f"{ts}{sep}".encode() + body, hashlib.sha256).hexdigest()


def sign(secret: str, body: bytes, ts: int | None = None) -> dict[str, str]:
    """Headers that sign ``body`` now (or at ``ts``, unix seconds)."""
    ts = int(time.time()) if ts is None else ts
    return {TS_HEADER: str(ts), SIG_HEADER: f"sha256={signature(secret, body, ts)}"}


def sign_grafana(secret: str, body: bytes, ts: int | None = None, *, with_timestamp: bool = True,
                 sig_header: str = GRAFANA_SIG_HEADER, ts_header: str = GRAFANA_TS_HEADER) -> dict[str, str]:
    """The headers Grafana's HMAC webhook signing sends (for tests and tools); ``with_timestamp=False``
    is a contact point without a timestamp header (the body alone is signed)."""
    if not with_timestamp:
        return {sig_header: hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()}
    ts = int(time.time()) if ts is None else ts
    return {ts_header: str(ts), sig_header: signature(secret, body, ts, ":")}


def verify_body_only(secret: str, body: bytes, sig_header: str) -> str:
    """Grafana's signing without a timestamp header: HMAC-SHA256 hex of the body; the digest or SignatureError."""
    got = sig_header.strip().removeprefix("sha256=").lower()
    want = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    if not hmac.compare_digest(got.encode(), want.encode()):
        raise SignatureError("bad signature: HMAC-SHA256 of the body (Grafana signing without a timestamp "
                             "header) with the webhook secret does not match")
    return want


def bearer_sender(authorization: str | None, senders: dict[str, str]) -> str:
    """The name of the sender whose token ``Authorization: Bearer <token>`` carries, else SignatureError
    (never echoing the token). ``senders`` is ``Settings.webhook_bearer_tokens``."""
    from collector.auth import bearer_token

    token = bearer_token(authorization)
    if token is None:
        raise SignatureError("the Authorization header is not 'Bearer <token>'")
    if not senders:
        raise SignatureError("bearer tokens are not accepted here: no sender is configured "
                             "(LIVESTEP_WEBHOOK_BEARER_TOKENS='name=token,...'); or sign the body "
                             f"({TS_HEADER}, {SIG_HEADER})")
    for name, want in senders.items():
        if hmac.compare_digest(token.encode(), want.encode()):
            return name
    raise SignatureError("the bearer token is not one of LIVESTEP_WEBHOOK_BEARER_TOKENS")


def verify(secret: str, body: bytes, ts_header: str | None, sig_header: str | None, *, window_s: int,
           now: float | None = None, sep: str = ".") -> str:
    """Check a delivery's signature; return the hex digest (the replay key) or raise SignatureError."""
    if not ts_header or not sig_header:
        raise SignatureError(f"missing signature: send {TS_HEADER} (unix seconds) and {SIG_HEADER} "
                             "(sha256=HMAC-SHA256 hex of '<timestamp>.<body>')")
    try:
        ts = int(ts_header.strip())
    except ValueError:
        raise SignatureError(f"{TS_HEADER} {ts_header[:40]!r} is not unix seconds (an integer)") from None
    now = time.time() if now is None else now
    if abs(now - ts) > window_s:
        raise SignatureError(f"stale timestamp: {TS_HEADER} is {int(now - ts)} s from the server's clock; "
                             f"the replay window is {window_s} s")
    got = sig_header.strip().removeprefix("sha256=").lower()
    want = signature(secret, body, ts, sep)
    if not hmac.compare_digest(got.encode(), want.encode()):
        raise SignatureError(f"bad signature: HMAC-SHA256 of '<timestamp>{sep}<body>' with the webhook secret "
                             "does not match")
    return want


@dataclass
class Alert:
    fmt: str
    key: str
    firing: bool
    switch: str | None
    scope: dict[str, str] | str
    summary: str
    severity: str = ""
    labels: dict[str, Any] = field(default_factory=dict)


class _AmAlert(BaseModel):
    model_config = ConfigDict(extra="allow")

    status: Literal["firing", "resolved"]
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    startsAt: str = ""
    endsAt: str = ""
    fingerprint: str = ""


class _Alertmanager(BaseModel):
    model_config = ConfigDict(extra="allow")

    version: Literal["4"]
    status: Literal["firing", "resolved"]
    receiver: str = ""
    groupKey: str = ""
    alerts: list[_AmAlert] = Field(max_length=1000)


class _Grafana(BaseModel):
    model_config = ConfigDict(extra="allow")

    status: Literal["firing", "resolved"]
    orgId: int | None = None
    receiver: str = ""
    alerts: list[_AmAlert] = Field(max_length=1000)


class _Finding(BaseModel):
    model_config = ConfigDict(extra="allow")

    kind: str = Field(min_length=1, max_length=64)
    scope: str = Field(default="", max_length=400)
    metric: str = Field(default="", max_length=128)
    window_start: str | int | float = ""
    severity: str = ""
    status: str = "open"
    attribution: str = Field(default="", max_length=64)


class _Livestep(BaseModel):
    model_config = ConfigDict(extra="allow")

    findings: list[_Finding] = Field(max_length=1000)


def _finding_summary(f: _Finding) -> str:
    """The audit reason of a switch change the finding causes: its kind and metric, then the sentence the
    analytics wrote (``summary``, analytics/describe.py) when the body carries one; without one, the
    scope too (the change's own scope is beside the reason in the audit)."""
    said = (f.model_extra or {}).get("summary")
    if isinstance(said, str) and said.strip():
        return f"{f.kind} {f.metric}: {said.strip()}"[:500]
    return f"{f.kind} {f.metric} {f.scope}".strip()


def _label_scope(labels: dict[str, str]) -> dict[str, str] | str:
    if labels.get("scope"):
        return labels["scope"]
    return {k: labels[k] for k in ("gpu_kind", "release", "worker_id") if labels.get(k)}


def _from_am(fmt: str, alerts: list[_AmAlert]) -> list[Alert]:
    out = []
    for a in alerts:
        ident = a.fingerprint or hashlib.sha256(orjson.dumps(a.labels, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]
        summary = a.annotations.get("summary") or a.annotations.get("description") or a.labels.get("alertname", "")
        key = f"{fmt}:{ident}:{a.startsAt}" + ("" if a.status == "firing" else RESOLVED_KEY_SUFFIX)
        out.append(Alert(fmt, key, a.status == "firing",
                         a.labels.get("switch") or a.labels.get("attribution") or None, _label_scope(a.labels),
                         summary[:500], a.labels.get("severity", ""), dict(a.labels)))
    return out


def _errors(e: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}" for err in e.errors()[:5])


def parse_payload(body: bytes) -> tuple[str, list[Alert]]:
    """Recognise the format and return its alerts; PayloadError names the format and the problem."""
    valid = ("valid bodies: our findings {'findings': [...]}, Alertmanager v4 {'version': '4', 'alerts': [...]}, "
             "Grafana unified alerting {'orgId': ..., 'alerts': [...]}")
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise PayloadError(f"body is not JSON ({e}); {valid}") from None
    if not isinstance(doc, dict):
        raise PayloadError(f"body must be a JSON object; {valid}")
    try:
        if "findings" in doc:
            fs = _Livestep.model_validate(doc).findings
            return "livestep", [
                Alert("livestep", f"livestep:{f.kind}|{f.scope}|{f.metric}|{f.window_start}"
                      + ("" if f.status == "open" else RESOLVED_KEY_SUFFIX),
                      f.status == "open", f.attribution or None, f.scope,
                      _finding_summary(f), f.severity, f.model_dump())
                for f in fs
            ]
        if doc.get("version") == "4":
            return "alertmanager", _from_am("alertmanager", _Alertmanager.model_validate(doc).alerts)
        if "orgId" in doc or ("alerts" in doc and ("state" in doc or "title" in doc)):
            return "grafana", _from_am("grafana", _Grafana.model_validate(doc).alerts)
    except ValidationError as e:
        fmt = "findings" if "findings" in doc else ("Alertmanager v4" if doc.get("version") == "4" else "Grafana")
        raise PayloadError(f"malformed {fmt} payload: {_errors(e)}") from None
    raise PayloadError(f"unrecognised payload (keys {sorted(doc)[:10]}); {valid}")


# -- acting on alerts --------------------------------------------------------------------------------

def seen(store, key: str) -> bool:
    return aq.alert_delivered(store, key)


def remember(store, key: str, fmt: str, decision: str) -> None:
    from datetime import UTC, datetime

    store.client().insert("alert_deliveries", [[key, fmt, datetime.now(UTC), decision, 1]],
                          column_names=["dedup_key", "fmt", "first_seen", "decision", "deliveries"])


def unknown_switches(alerts: list[Alert]) -> list[str]:
    from collector.records import SWITCH_NAMES

    return sorted({a.switch for a in alerts if a.firing and a.switch and a.switch not in SWITCH_NAMES})


def handle_alerts(store, board, fmt: str, alerts: list[Alert], sender: str = "") -> list[dict[str, Any]]:
    """Flip the named switch off for each new firing alert; every other case is a recorded no-op.
    ``sender``: the bearer sender's name (in the actor, ``alert:<fmt>@<sender>``), '' for signed ones.

    Holds the board's lock so that concurrent deliveries of one alert flip once.
    """
    from api.switchboard import Decision, SwitchError, canonical_scope

    out = []
    with board.lock:
        for a in alerts:
            ev = {"format": a.fmt, "alert_key": a.key, "severity": a.severity, "labels": a.labels}
            actor = f"alert:{a.fmt}" + (f"@{sender}" if sender else "")
            scope_s = ""
            try:
                scope_s = canonical_scope(a.scope)
                reason = None
            except SwitchError as e:
                reason = f"scope not mappable: {e}"
            if seen(store, a.key):
                action, reason = "alert_duplicate", "the same alert was delivered before"
            elif not a.firing:
                action, reason = "alert_resolved", "resolved alerts change nothing"
            elif not a.switch:
                action, reason = "alert_unmapped", "the alert names no switch (label 'switch' or attribution)"
            elif reason is not None:
                action = "alert_unmapped"
            else:
                d = board.set(a.switch, False, scope_s, actor=actor, reason=a.summary or a.key, source="alert",
                              ref=a.key, evidence=ev)
                remember(store, a.key, a.fmt, d.action)
                out.append({"alert": a.key, **d.to_dict()})
                continue
            if action != "alert_duplicate":
                remember(store, a.key, a.fmt, action)
            _, version = board.snapshot()
            d = board.record(Decision(a.switch or "", scope_s, "", None, None, False, version, action, "alert",
                                      actor, reason, a.key, ev))
            out.append({"alert": a.key, **d.to_dict()})
    return out
