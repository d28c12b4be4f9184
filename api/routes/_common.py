"""Shared dependencies of the api's query, switch, alert, canary and report routes (no router here).

``StoreDep`` is api/deps.py's (``app.state.store``, 503 + Retry-After while unreachable);
``SwitchSettingsDep`` the switch settings (override ``get_switch_settings`` in tests); ``AdminDep`` requires the admin
bearer token; ``TimeRange``/``Page`` validate the common query parameters with clear 4xx messages.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Annotated

from fastapi import Depends, Header, HTTPException, Query

from api.deps import StoreDep, get_store  # noqa: F401 - the server's store dependency, re-exported
from api.switch_settings import SwitchSettings, get_switch_settings, is_loopback

MAX_RANGE = timedelta(days=400)
SwitchSettingsDep = Annotated[SwitchSettings, Depends(get_switch_settings)]


def _bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _token_ok(token: str | None, valid: list[str]) -> bool:
    return token is not None and any(t and hmac.compare_digest(token.encode(), t.encode()) for t in valid)


def require_admin(
    settings: SwitchSettingsDep,
    authorization: Annotated[str | None, Header(description="Bearer <admin token>")] = None,
) -> None:
    """Switch and canary writes: an admin token (open on loopback when no admin tokens are set)."""
    if not settings.admin_tokens and is_loopback(settings.host):
        return
    token = _bearer(authorization)
    if token is None:
        raise HTTPException(401, detail="switch and canary writes need 'Authorization: Bearer <admin token>'",
                            headers={"WWW-Authenticate": "Bearer"})
    if not _token_ok(token, settings.admin_tokens):
        raise HTTPException(403, detail="the bearer token is not an admin token (LIVESTEP_ADMIN_TOKENS)")


AdminDep = Annotated[None, Depends(require_admin)]


def require_reader(
    settings: SwitchSettingsDep,
    authorization: Annotated[str | None, Header(description="Bearer token (optional when reads are open)")] = None,
) -> None:
    """Reads and workers' switch polls: open when no read tokens are set (loopback only), else a
    read, ingest or admin token."""
    if not settings.read_tokens and is_loopback(settings.host):
        return
    if not _token_ok(_bearer(authorization), settings.read_tokens + settings.ingest_tokens + settings.admin_tokens):
        raise HTTPException(401, detail="this read needs 'Authorization: Bearer <read, ingest or admin token>'",
                            headers={"WWW-Authenticate": "Bearer"})


ReaderDep = Annotated[None, Depends(require_reader)]


def _utc(v: datetime | None) -> datetime | None:
    if v is None:
        return None
    return v.replace(tzinfo=UTC) if v.tzinfo is None else v.astimezone(UTC)


@dataclass
class TimeRange:
    start: datetime
    end: datetime


def time_range(
    start: Annotated[datetime | None, Query(description="ISO 8601, inclusive; default end - 56 days")] = None,
    end: Annotated[datetime | None, Query(description="ISO 8601, exclusive; default now")] = None,
) -> TimeRange:
    end_ = _utc(end) or datetime.now(UTC) + timedelta(minutes=5)
    start_ = _utc(start) or end_ - timedelta(days=56)
    if start_ >= end_:
        raise HTTPException(422, detail=f"start ({start_.isoformat()}) must be before end ({end_.isoformat()})")
    if end_ - start_ > MAX_RANGE:
        raise HTTPException(422, detail=f"time range is longer than the maximum of {MAX_RANGE.days} days")
    if start_.year < 2000 or end_.year > 2200:
        raise HTTPException(422, detail="start and end must lie between the years 2000 and 2200")
    return TimeRange(start_, end_)


TimeRangeDep = Annotated[TimeRange, Depends(time_range)]


@dataclass
class OptionalRange:
    start: datetime | None
    end: datetime | None


def optional_range(
    start: Annotated[datetime | None, Query(description="ISO 8601, inclusive")] = None,
    end: Annotated[datetime | None, Query(description="ISO 8601, exclusive")] = None,
) -> OptionalRange:
    s, e = _utc(start), _utc(end)
    for name, v in (("start", s), ("end", e)):
        if v is not None and not (2000 <= v.year <= 2200):
            raise HTTPException(422, detail=f"{name} must lie between the years 2000 and 2200")
    if s and e and s >= e:
        raise HTTPException(422, detail=f"start ({s.isoformat()}) must be before end ({e.isoformat()})")
    return OptionalRange(s, e)


OptionalRangeDep = Annotated[OptionalRange, Depends(optional_range)]


@dataclass
class Page:
    limit: int
    offset: int


def page(
    limit: Annotated[int, Query(ge=1, le=1000, description="rows per page (1-1000)")] = 100,
    offset: Annotated[int, Query(ge=0, le=1_000_000, description="rows to skip")] = 0,
) -> Page:
    return Page(limit, offset)


PageDep = Annotated[Page, Depends(page)]

# a record label (worker_id, release, gpu_kind): as collector/records.py, 1-128 characters, any text
# (CUDA names a GPU kind "NVIDIA H200", with a space)
Label = Annotated[str | None, Query(min_length=1, max_length=128)]
