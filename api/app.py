"""The server app: ``create_app(settings=None) -> FastAPI`` (collector + api routes + scheduler).

    app = create_app()                 # settings read once from LIVESTEP_* (see api/settings.py)
    uvicorn.Server(uvicorn.Config(app)).run(sockets=[sock])   # what ``livestep serve`` does (api/serve.py)

The app is FastAPI through fastapi-offline: ``/docs`` and ``/redoc`` load Swagger UI and ReDoc from
the server itself. The lifespan opens the store and makes its schema current once
(``collector.migrations.ensure_current``: single-node files applied, a cluster's only checked; a schema
that is not current stops the server), opens the spool and starts its block writer
(role collector), starts the analytics scheduler (role scheduler, if ``analytics.jobs`` imports)
and, with it, the canary evaluation job (``api.canary.schedule``) and the incident hand-off
(``api.incidents.install``: every job's findings to the incident logic, in process) -- once per app,
whatever else the role serves -- and shuts them down in reverse order. Every module of ``api/routes/`` that defines ``router`` is
included (role api; ``health`` and ``metrics`` on every role), plus ``collector.routes.router`` (role
collector); the collector's metrics (``app.state.ingest_metrics``, ``fleet_counters``) are collector/metrics.py.
The store is ``app.state.store``, the settings ``app.state.settings`` (read once here; routes get it
through api/deps.py, the hand-off is built from it), the spool ``app.state.spool``,
the scheduler ``app.state.scheduler`` and the hand-off ``app.state.incidents`` (None where not run).
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
import threading
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from fastapi_offline import FastAPIOffline

import api.routes
from api import errors, findings_listeners, openapi_limits
from api.settings import Settings, load_settings
from collector.migrations import SchemaError, ensure_current
from collector.store import Store, open_store
from collector.version import __version__

log = logging.getLogger("livestep.api")


_CORE_ROUTES = ("health", "sessions")  # included first: on a path clash, the core route answers
_EVERY_ROLE = ("health", "metrics")  # route modules every role serves


def _route_modules() -> list[str]:
    found = sorted(m.name for m in pkgutil.iter_modules(api.routes.__path__) if not m.name.startswith("_"))
    return [m for m in _CORE_ROUTES if m in found] + [m for m in found if m not in _CORE_ROUTES]


def _wire_scheduler(settings: Settings, scheduler, store: Store):
    """What runs beside the analytics jobs: the canary evaluation job and the incident hand-off.
    Returns the hand-off (None if it could not be installed; logged, the server still starts)."""
    from api import canary, incidents

    try:
        canary.schedule(scheduler, store)
    except Exception:  # a missing side job must not take the scheduler down
        log.exception("canary evaluation job not scheduled")
    try:
        if settings.alertmanager_url:  # its grouping, silences, inhibition instead (livestep keeps the flip)
            from api import alertmanager_publisher

            return alertmanager_publisher.install(settings, store)
        return incidents.install(settings, store)
    except Exception:  # a hand-off that cannot be installed must not take the scheduler down
        log.exception("findings will not be handed to the incident logic")
        return None


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or load_settings()  # once per app; a SettingsError names what is missing
    store_lock = threading.Lock()

    def get_store() -> Store:
        """The store; (re)opened on demand when it was unreachable at start (a server DSN)."""
        with store_lock:
            if app.state.store is None:
                s = open_store(settings.clickhouse_dsn)
                ensure_current(s, settings.cluster, apply=settings.migrate_on_start)
                app.state.store, app.state.store_error = s, None
            return app.state.store

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.store, app.state.store_error = None, None
        try:
            get_store()
        except Exception as e:
            if settings.clickhouse_dsn.startswith("chdb:") or isinstance(e, SchemaError):
                raise  # the embedded store cannot be "down", and a stale schema is never served
            app.state.store_error = f"{type(e).__name__}: {e}"[:300]
            log.warning("store unreachable at start, collector keeps spooling: %s", app.state.store_error)
        spool = writer = scheduler = handoff = None
        if "collector" in settings.roles:
            from collector.spool import Spool
            from collector.writer import BlockWriter

            spool = Spool(settings.spool_dir, settings.spool_max_bytes, settings.spool_segment_bytes,
                          settings.idempotency_keys)
            writer = BlockWriter(spool, get_store, settings.flush_rows, settings.flush_interval_s,
                                 settings.retry_max_s, settings.fault_store_down_file,
                                 settings.poison_after_failures,
                                 fault_refuse_writes_file=settings.fault_refuse_writes_file,
                                 fault_pause_before_commit_file=settings.fault_pause_before_commit_file)
            from collector.metrics import FleetCounters, IngestMetrics

            app.state.ingest_metrics, app.state.fleet_counters = IngestMetrics(), FleetCounters()
            writer.observe_block = app.state.fleet_counters.observe
            writer.start()
        app.state.spool, app.state.writer = spool, writer
        if "scheduler" in settings.roles and app.state.store is not None:
            try:
                from analytics.jobs import start_scheduler
            except ImportError as e:
                log.info("analytics scheduler not started (analytics.jobs unavailable: %s)", e)
            else:
                from api.report import build_weekly_report  # the report's HTML lives with the api

                scheduler = start_scheduler(app.state.store, reports_dir=Path(settings.reports_dir),
                                            report_writer=build_weekly_report)
                handoff = _wire_scheduler(settings, scheduler, app.state.store)
        app.state.scheduler, app.state.incidents = scheduler, handoff
        try:
            yield
        finally:
            findings_listeners.unregister(handoff)  # the incident hand-off or the Alertmanager publisher
            if scheduler is not None:
                scheduler.shutdown(wait=False)
            if writer is not None:
                writer.stop()
            if spool is not None:
                left = spool.stats()["batches"]
                spool.close()
                log.info("stopped cleanly: writer stopped, spool closed with %d batch(es) left for the next start", left)

    app = FastAPIOffline(  # /docs and /redoc with Swagger UI / ReDoc served from the package: no CDN
        title="livestep",
        version=__version__,
        summary="Telemetry in (collector) and out (api) of the livestep serving fleet.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.store = app.state.store_error = app.state.spool = app.state.writer = None
    app.state.scheduler = app.state.incidents = None
    app.state.ingest_metrics = app.state.fleet_counters = app.state.metrics_registry = None

    from api.metrics import instrument

    instrument(app)  # HTTP request metrics into the app's /metrics registry (api/metrics.py)
    errors.install(app)  # every 4xx body is {"detail": str}, in the OpenAPI too (api/errors.py)
    openapi_limits.document(app)  # the server's limits and every status, in the OpenAPI (api/openapi_limits.py)
    from api import openapi_docs

    openapi_docs.install(app)  # the HTTPBearer scheme (Swagger's Authorize), /redoc with no CDN logo

    if "collector" in settings.roles:
        from collector.routes import router as collector_router

        app.include_router(collector_router)
    for name in _route_modules():
        if name not in _EVERY_ROLE and "api" not in settings.roles:
            continue
        try:
            mod = importlib.import_module(f"api.routes.{name}")
        except Exception:  # one broken route module must not take the collector down with it
            log.exception("route module api.routes.%s failed to import; its routes are not served", name)
            continue
        router = getattr(mod, "router", None)
        if router is not None:
            app.include_router(router)
    return app
