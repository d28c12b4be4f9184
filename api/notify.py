"""Post critical findings to the alert webhook(s), signed like any delivery (api/alerts.py ``sign``).

    notifier = install(settings)    # registers with analytics.jobs.add_findings_listener (if importable)
    notifier = install_for_server(settings, store)   # what api/app.py's lifespan does, once, for any
                                                      # role that runs the analytics scheduler
    uninstall(notifier)
    post_findings(rows, urls, secret)   # or by hand

Only open, critical findings that blame a switch (``attribution``) are posted: those are the ones
the webhook acts on. The default URL is this server's own ``/v1/alerts``; when its port is 0 (chosen
by the OS, unknown here), or this process does not serve the webhook (role scheduler, no URL
configured), the signed body goes to this process's webhook handler directly (same checks, same
store). A failed
post is retried a few times and logged; it never raises into the job that wrote the findings.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import httpx
import orjson

from analytics.describe import describe
from api.alerts import sign

log = logging.getLogger("livestep.notify")


def actionable(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r.get("severity") == "critical" and r.get("status", "open") == "open"
            and r.get("attribution")]


def _jsonable(row: dict[str, Any]) -> dict[str, Any]:
    """The finding as JSON values, with its one-sentence ``summary`` (the audit reason the webhook writes)."""
    out = {}
    for k, v in row.items():
        out[k] = v.isoformat() if hasattr(v, "isoformat") else v
    out.setdefault("summary", describe(row))
    return out


def post_findings(rows: list[dict[str, Any]], urls: list[str], secret: str, *, attempts: int = 3,
                  timeout_s: float = 5.0) -> list[dict[str, Any]]:
    """POST ``{"source": "livestep", "findings": rows}`` to each URL; one result per URL."""
    if not rows:
        return []
    body = orjson.dumps({"source": "livestep", "findings": [_jsonable(r) for r in rows]}, default=str)
    results = []
    for url in urls:
        result: dict[str, Any] = {"url": url, "ok": False}
        for attempt in range(1, attempts + 1):
            try:
                headers = {"Content-Type": "application/json", **sign(secret, body)}  # fresh timestamp per try
                r = httpx.post(url, content=body, headers=headers, timeout=timeout_s)
                # 409: this exact signed body was accepted already (same body within the same second)
                result.update(status=r.status_code, ok=r.status_code < 300 or r.status_code == 409, attempts=attempt)
                if r.status_code < 500 and r.status_code != 429:
                    if not result["ok"]:
                        log.warning("webhook %s refused %d findings: %s %s", url, len(rows), r.status_code,
                                    r.text[:200])
                    break
            except httpx.HTTPError as e:
                result.update(error=f"{type(e).__name__}: {e}", attempts=attempt)
            time.sleep(min(2.0, 0.2 * 2**attempt))
        if not result["ok"]:
            log.warning("webhook %s: findings not delivered (%s)", url, result)
        results.append(result)
    return results


def deliver_locally(deliver: Callable[[bytes, dict[str, str]], Any], rows: list[dict[str, Any]],
                    secret: str) -> dict[str, Any]:
    """The same signed body handed to this process's webhook handler (no network: when the server's
    port is only known to the OS, e.g. ``--port 0``)."""
    body = orjson.dumps({"source": "livestep", "findings": [_jsonable(r) for r in rows]}, default=str)
    try:
        out = deliver(body, sign(secret, body))
        return {"url": "local", "ok": True, "status": 200, "flipped": out.get("flipped")}
    except Exception as e:  # noqa: BLE001 - refused (HTTPException) or failed: never into the job
        log.warning("local webhook delivery refused: %s", e)
        return {"url": "local", "ok": False, "error": f"{type(e).__name__}: {e}"}


class Notifier:
    """The findings listener: posts actionable findings to the configured URLs (or hands them to
    ``local``, this process's own webhook handler, when no URL can be known)."""

    def __init__(self, urls: list[str], secret: str, local: Callable[[bytes, dict[str, str]], Any] | None = None):
        self.urls, self.secret, self.local = urls, secret, local
        self.sent: list[dict[str, Any]] = []

    def __call__(self, rows: list[dict[str, Any]]) -> None:
        todo = actionable(rows)
        if not todo:
            return
        if self.local is not None:
            self.sent.append(deliver_locally(self.local, todo, self.secret))
        else:
            self.sent.extend(post_findings(todo, self.urls, self.secret))


def install(settings, local: Callable[[bytes, dict[str, str]], Any] | None = None, *,
            serves_webhook: bool = True) -> Notifier | None:
    """Register a Notifier with analytics.jobs (None when the analytics are not importable);
    ``settings`` is api/settings.py's ``Settings`` (webhook URLs, secret, port).

    ``local`` is used instead of HTTP when no webhook URL is configured and either the port is 0
    (unknown) or this process does not serve ``/v1/alerts`` (``serves_webhook=False``)."""
    try:
        from analytics.jobs import add_findings_listener
    except ImportError as e:
        log.info("findings are not posted to the webhook: analytics.jobs unavailable (%s)", e)
        return None
    use_local = local is not None and not settings.webhook_urls.strip() and (settings.port == 0 or not serves_webhook)
    n = Notifier(settings.webhook_url_list, settings.webhook_secret or "", local if use_local else None)
    add_findings_listener(n)
    return n


def install_for_server(settings, store) -> Notifier | None:
    """The server's notifier, from the app's ``Settings``; in-process delivery through the webhook's
    own handler (api/routes/alerts.py ``_act``) where HTTP to ourselves cannot work."""
    from api.routes.alerts import _act

    def local(body: bytes, headers: dict[str, str]):
        return _act(store, settings, body, headers)

    return install(settings, local, serves_webhook="api" in settings.roles)


def uninstall(n: Notifier | None) -> None:
    if n is None:
        return
    try:
        from analytics.jobs import remove_findings_listener
    except ImportError:
        return
    remove_findings_listener(n)
