"""``GET /metrics``: this process's Prometheus metrics (api/metrics.py), on every role.

OpenMetrics when the scraper's ``Accept`` asks for it (Prometheus does), else the text format 0.0.4.
The same rule as the other reads: a read, ingest or admin bearer token (open on loopback without
read tokens); in Prometheus, ``authorization: {credentials_file: ...}`` in the scrape config.
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.concurrency import run_in_threadpool

from api.deps import ReaderDep
from api.metrics import exposition, registry_for

router = APIRouter(tags=["metrics"])


@router.get("/metrics", response_class=Response, summary="Prometheus metrics of this process (OpenMetrics)")
async def metrics(request: Request, _reader: ReaderDep) -> Response:
    reg = registry_for(request.app.state)
    body, content_type = await run_in_threadpool(exposition, reg, request.headers.get("accept", ""))
    return Response(body, media_type=content_type)
