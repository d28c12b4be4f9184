"""Deliver incident notifications to external receivers, HMAC-signed like any delivery (api/alerts.py ``sign``).

    n = Notifier(["https://hooks.example/livestep"], secret)
    results = n.post(body)        # one result per URL: {"url", "ok", "status" | "error", "attempts"}

api/incidents.py builds the body (``version: livestep-incident/1``, ``status`` firing | resolved, the
incident and its transition) and decides when to send (state changes and repeats only). The receivers
are ``LIVESTEP_WEBHOOK_URLS``; this server's own ``/v1/alerts`` is never one of them by default: the
scheduler hands findings to the incident logic in process. A delivery is retried a few times on 5xx,
429 and network errors, logged when it fails, and never raises into the job that caused it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import httpx

from api.alerts import sign

log = logging.getLogger("livestep.notify")


class Notifier:
    """Posts bodies, signed with the webhook secret (a fresh timestamp per try), to each receiver."""

    def __init__(self, urls: list[str], secret: str, *, attempts: int = 3, timeout_s: float = 5.0):
        self.urls, self.secret, self.attempts, self.timeout_s = list(urls), secret, attempts, timeout_s

    def post(self, body: bytes) -> list[dict[str, Any]]:
        out = []
        for url in self.urls:
            result: dict[str, Any] = {"url": url, "ok": False}
            for attempt in range(1, self.attempts + 1):
                try:
                    r = httpx.post(url, content=body, timeout=self.timeout_s,
                                   headers={"Content-Type": "application/json", **sign(self.secret, body)})
                    result.update(status=r.status_code, ok=r.status_code < 300, attempts=attempt)
                    result.pop("error", None)
                    if r.status_code < 500 and r.status_code != 429:
                        break
                except httpx.HTTPError as e:
                    result.update(error=f"{type(e).__name__}: {e}"[:300], attempts=attempt)
                if attempt < self.attempts:
                    time.sleep(min(2.0, 0.2 * 2 ** attempt))
            if not result["ok"]:
                log.warning("notification not delivered to %s: %s", url, result)
            out.append(result)
        return out
