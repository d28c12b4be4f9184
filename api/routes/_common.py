"""Query-parameter dependencies shared by the api's routers (no router here): time ranges, paging, labels.

``TimeRangeDep``/``OptionalRangeDep``/``PageDep`` validate the common query parameters with clear 4xx
messages; ``Label`` bounds a record label. The store, the settings and auth are api/deps.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Annotated

from fastapi import Depends, HTTPException, Query

MAX_RANGE = timedelta(days=400)


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
