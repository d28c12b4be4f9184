"""Findings published to an Alertmanager as alerts, when one is configured (``LIVESTEP_ALERTMANAGER_URL``).

    publisher = install(settings, store)   # api/app.py, instead of the incident hand-off, when the URL is set
    publisher(rows)                        # a findings listener: called after every detector run

With an Alertmanager, grouping, silences, inhibition and notification timing are its job, not
api/incidents.py's: after every detector run the open warning and critical findings (read through
``analytics.findings.read_findings``) are posted to ``POST /api/v2/alerts`` as ``LivestepFinding``
alerts, one per finding, with the finding's kind, metric, severity and scope (``release``,
``gpu_kind``, ``worker_id``) as labels and ``incident=<kind>/<release>/<gpu_kind>`` (what the shipped
routing groups by, as the Prometheus rules' alerts do). A critical finding with a switch to blame also
carries ``switch``: the shipped routing sends those back to livestep's ``/v1/alerts``, which keeps the
flip (audit, scope, precedence: api/alerts.py), so a silence in Alertmanager holds the flip too.
A finding that is no longer open is posted once more with ``endsAt`` now (resolved). Firing alerts are
re-posted after every run with ``endsAt`` ``ttl_s`` ahead (longer than the daily jobs' period): a server
that stops publishing lets them expire rather than fire forever. A post that fails is logged and
retried by the next run (never raised into the job).
"""

from __future__ import annotations

import logging
import threading
from datetime import UTC, datetime, timedelta
from typing import Any

from api import findings_listeners

log = logging.getLogger("livestep.api.alertmanager")

ALERTNAME = "LivestepFinding"
SEVERITIES = ("warning", "critical")
SCOPE_KEYS = ("release", "gpu_kind", "worker_id")
DEFAULT_TTL_S = 26 * 3600.0


def _iso(t: datetime) -> str:
    return (t if t.tzinfo else t.replace(tzinfo=UTC)).astimezone(UTC).isoformat().replace("+00:00", "Z")


def alert_for(row: dict[str, Any], ends_at: datetime) -> tuple[str, dict[str, Any]]:
    """(identity, Alertmanager v2 alert) of one finding row."""
    from analytics.describe import describe

    scope = dict(p.split("=", 1) for p in (row.get("scope") or "").split(",") if "=" in p)
    labels = {"alertname": ALERTNAME, "kind": row["kind"], "metric": row["metric"], "severity": row["severity"],
              **{k: scope[k] for k in SCOPE_KEYS if scope.get(k)},
              "incident": f"{row['kind']}/{scope.get('release', '')}/{scope.get('gpu_kind', '')}"}
    if row["severity"] == "critical" and row.get("attribution"):
        labels["switch"] = row["attribution"]  # the webhook flips it (api/alerts.py): critical only, as incidents
    ident = "|".join((row["kind"], row.get("scope") or "", row["metric"], str(row["window_start"])))
    started = row.get("first_seen") or row["window_start"]
    return ident, {"labels": labels, "annotations": {"summary": describe(row)[:500], "scope": row.get("scope") or ""},
                   "startsAt": _iso(started), "endsAt": _iso(ends_at)}


class Publisher:
    """A findings listener that keeps the Alertmanager's alerts equal to the open findings."""

    def __init__(self, store, url: str, ttl_s: float = DEFAULT_TTL_S, timeout_s: float = 10.0):
        self.store, self.endpoint = store, url.rstrip("/").removesuffix("/api/v2/alerts") + "/api/v2/alerts"
        self.ttl_s, self.timeout_s = ttl_s, timeout_s
        self.firing: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self.last_error: str | None = None

    def open_findings(self) -> list[dict[str, Any]]:
        from analytics.findings import read_findings

        df = read_findings(self.store, status="open")
        return [r for r in df.iter_rows(named=True) if r["severity"] in SEVERITIES]

    def publish(self, now: datetime | None = None) -> list[dict[str, Any]]:
        """Post the open findings as firing and the ones closed since as resolved; returns what was posted."""
        import httpx

        now = now or datetime.now(UTC)
        with self._lock:
            current = dict(alert_for(r, now + timedelta(seconds=self.ttl_s)) for r in self.open_findings())
            resolved = [{**a, "endsAt": _iso(now)} for k, a in self.firing.items() if k not in current]
            body = [*current.values(), *resolved]
            if not body:
                return []
            try:
                r = httpx.post(self.endpoint, json=body, timeout=self.timeout_s)
                r.raise_for_status()
            except httpx.HTTPError as e:  # the next run posts again
                self.last_error = f"{type(e).__name__}: {e}"[:300]
                log.warning("findings not published to Alertmanager %s: %s", self.endpoint, self.last_error)
                return []
            self.firing, self.last_error = current, None
            return body

    def __call__(self, rows: list[dict[str, Any]]) -> None:
        try:
            self.publish()
        except Exception:  # a publishing failure never breaks the job that wrote the findings
            log.exception("findings not published to Alertmanager")


def install(settings, store) -> Publisher | None:
    """Register the publisher with analytics.jobs (None when the analytics are not importable)."""
    return findings_listeners.register(lambda: Publisher(store, settings.alertmanager_url), "published")


def uninstall(p: Publisher | None) -> None:
    findings_listeners.unregister(p)
