"""``GET /metrics`` of every role: one registry per app, the store's state read at scrape time.

    registry = registry_for(app.state)          # built once per app, cached on app.state.metrics_registry
    body, content_type = exposition(registry, request.headers.get("accept", ""))   # OpenMetrics or text 0.0.4

The collector role exposes collector/metrics.py (ingest counters, spool, writer, fleet counters); the
api and scheduler roles expose ``StoreState``: open findings and incidents (where api/incidents.py's
table exists) by kind and severity, the critical ones with the switch and scope they blame, analytics job runs and
failures by job, active switch rules by switch, alert-webhook decisions by outcome, and per release
its rollout time and the switches it turned on against the release before it (by rollout time).
Store queries run at most once per ``cache_s`` whatever the scrape rate; a store that cannot answer
reads ``livestep_store_up 0`` and the families it could not read are left out (never a 5xx).
Every role also exposes ``livestep_build_info{version}`` and its HTTP requests
(``livestep_http_requests_total``, ``livestep_http_request_duration_seconds``, ... by handler, method and
status), counted by prometheus-fastapi-instrumentator (``instrument(app)``; the collector's ingest
fast lane passes by it and has its own counters). The analytics job's label is ``analytics_job``: a
``job`` label would collide with the one Prometheus attaches to every scraped series.
"""

from __future__ import annotations

import logging
import threading
import time

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from analytics import queries as aq
from collector.build_info import build_info

log = logging.getLogger("livestep.api.metrics")
JOB_LABEL = "analytics_job"  # not "job": Prometheus sets that one on every series it scrapes
SCOPE_LABELS = ("release", "gpu_kind", "worker_id")  # the scope keys the alert webhook maps back (api/alerts.py)

def _scope_labels(scope: str) -> list[str]:
    kv = dict(p.split("=", 1) for p in scope.split(",") if "=" in p)
    return [kv.get(k, "") for k in SCOPE_LABELS]


def suspects(releases: list[tuple]) -> dict[str, set[str]]:
    """Per release, the switches on in some of its sessions and in none of the previous release's
    (by rollout time): what a regression that came with the release would be blamed on first.
    ``releases``: (release, rollout time, switch states of its sessions, ...)."""
    out: dict[str, set[str]] = {}
    ordered = sorted(releases, key=lambda r: r[1])
    prev: set[str] | None = None
    for release, _, states, *_ in ordered:
        on = {s for state in states for s in state.split(",") if s}
        out[release] = on - prev if prev is not None else set()
        prev = on
    return out


class StoreState(Collector):
    """The api/scheduler families, read from the store (cached ``cache_s`` seconds)."""

    def __init__(self, state, cache_s: float = 5.0):
        self.state = state
        self.cache_s = cache_s
        self._lock = threading.Lock()
        self._at = 0.0
        self._rows: dict[str, list] = {}
        self._up = 0

    def _read(self) -> tuple[int, dict[str, list]]:
        with self._lock:
            if time.monotonic() - self._at < self.cache_s:
                return self._up, self._rows
            store = getattr(self.state, "store", None)
            rows: dict[str, list] = {}
            up = 0
            if store is not None:
                try:
                    tables = aq.tables(store)
                    up = 1
                    for name, table in aq.STATE_TABLES.items():
                        if table in tables:
                            rows[name] = aq.state_rows(store, name)
                except Exception as e:  # noqa: BLE001 - a store down reads as livestep_store_up 0
                    log.warning("metrics: store not readable: %s", e)
                    up = 0 if not rows else up
            self._at, self._up, self._rows = time.monotonic(), up, rows
            return up, rows

    def collect(self):
        up, rows = self._read()
        yield build_info()
        yield GaugeMetricFamily("livestep_store_up", "1 when the store answered the last metrics read", value=up)
        if "findings" in rows:
            f = GaugeMetricFamily("livestep_findings_open", "Open findings by kind and severity",
                                  labels=["kind", "severity"])
            for kind, sev, n in rows["findings"]:
                f.add_metric([kind, sev], n)
            yield f
        if "incidents" in rows:
            yield GaugeMetricFamily("livestep_incidents_tracked",
                                    "1: this server groups findings into incidents (the rules alert on those)", value=1)
            f = GaugeMetricFamily("livestep_incidents_open", "Incidents not resolved, by kind, severity and state",
                                  labels=["kind", "severity", "state"])
            for kind, sev, state, n in rows["incidents"]:
                f.add_metric([kind, sev, state], n)
            yield f
        if "incidents_critical" in rows:
            f = GaugeMetricFamily("livestep_incidents_open_critical",
                                  "Critical incidents not resolved, with the switch they blame and their scope",
                                  labels=["kind", "switch", "release", "gpu_kind"])
            for kind, switch, release, gpu_kind, n in rows["incidents_critical"]:
                f.add_metric([kind, switch, release, gpu_kind], n)
            yield f
        if "critical" in rows:
            f = GaugeMetricFamily("livestep_findings_open_critical",
                                  "Open critical findings with the switch they blame and their scope",
                                  labels=["kind", "switch", *SCOPE_LABELS])
            for kind, switch, scope, n in rows["critical"]:
                f.add_metric([kind, switch, *_scope_labels(scope)], n)
            yield f
        if "jobs" in rows:
            runs = CounterMetricFamily("livestep_job_runs", "Analytics job runs (attempts)", labels=[JOB_LABEL])
            fails = CounterMetricFamily("livestep_job_failures", "Analytics job runs that failed", labels=[JOB_LABEL])
            last = GaugeMetricFamily("livestep_job_last_success_timestamp_seconds",
                                     "Unix time of the job's last successful run", labels=[JOB_LABEL])
            for job, n, failed, ok_at in rows["jobs"]:
                runs.add_metric([job], n)
                fails.add_metric([job], failed)
                if ok_at and ok_at > 0:
                    last.add_metric([job], float(ok_at))
            yield from (runs, fails, last)
        if "rules" in rows:
            f = GaugeMetricFamily("livestep_switch_rules", "Active switch rules by switch and the value they set",
                                  labels=["switch", "value"])
            for name, value, n in rows["rules"]:
                f.add_metric([name, "on" if value else "off"], n)
            yield f
        if "webhook" in rows:
            f = CounterMetricFamily("livestep_webhook_decisions",
                                    "Alert webhook decisions by outcome (set: a switch turned off; alert_resolved, "
                                    "alert_duplicate, alert_unmapped, noop: recorded no-ops)", labels=["outcome"])
            for action, n in rows["webhook"]:
                f.add_metric([action], n)
            yield f
        if "releases" in rows:
            roll = GaugeMetricFamily("livestep_release_rollout_timestamp_seconds",
                                     "Unix time of a release's first session", labels=["release"])
            sus = InfoMetricFamily("livestep_release_new_switch",
                                   "A switch on in the release's sessions and in none of the release before it "
                                   "(one series per GPU kind the release runs on)",
                                   labels=["release", "gpu_kind", "switch"])
            kinds = {r[0]: sorted(r[3]) for r in rows["releases"]}
            for release, at, *_ in rows["releases"]:
                roll.add_metric([release], float(at))
            for release, new in sorted(suspects(rows["releases"]).items()):
                for switch in sorted(new):
                    for kind in kinds[release]:
                        sus.add_metric([release, kind, switch], {})
            yield from (roll, sus)


def registry_for(state) -> CollectorRegistry:
    """The app's registry (built on first use): the families of the roles it serves, and the process's."""
    reg = getattr(state, "metrics_registry", None)
    if reg is not None:
        return reg
    reg = CollectorRegistry(auto_describe=False)
    roles = state.settings.roles
    if "collector" in roles:
        from collector.metrics import CollectorState

        reg.register(CollectorState(state))
    if roles & {"api", "scheduler"}:
        reg.register(StoreState(state))
    else:  # the collector role alone: its build_info here (StoreState carries it otherwise)
        reg.register(_BuildInfo())
    ProcessCollector(registry=reg)
    state.metrics_registry = reg
    return reg


class _BuildInfo(Collector):
    def collect(self):
        yield build_info()


def instrument(app) -> None:
    """Count the app's HTTP requests into its registry (prometheus-fastapi-instrumentator: the
    maintained instrumentation of FastAPI, not a middleware of our own). Call once, before it starts."""
    from prometheus_fastapi_instrumentator import Instrumentator

    Instrumentator(registry=registry_for(app.state), should_group_status_codes=False,
                   excluded_handlers=["/metrics"]).instrument(app, metric_namespace="livestep")


def exposition(registry: CollectorRegistry, accept: str) -> tuple[bytes, str]:
    """The registry in the format the scraper asked for (OpenMetrics when its Accept names it)."""
    encoder, content_type = choose_encoder(accept or "")
    return encoder(registry), content_type
