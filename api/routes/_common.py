"""Query-parameter dependencies shared by the api's routers (no router here): time ranges, paging, labels.

``TimeRangeDep``/``OptionalRangeDep``/``PageDep`` validate the common query parameters with clear 4xx
messages; ``Label`` bounds a record label. The store, the settings and auth are api/deps.py's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Annotated

from fastapi import Depends, HTTPException, Query

MAX_RANGE = timedelta(days=400)
# every time a query or path parameter names lies in [MIN_TIME, MAX_TIME): what the store's DateTime64
# and the date arithmetic of the queries can hold (a year-1 or year-9999 value was a 500)
MIN_TIME = datetime(2000, 1, 1, tzinfo=UTC)
MAX_TIME = datetime(2200, 1, 1, tzinfo=UTC)
_VALID_TIME = "an ISO 8601 time from 2000-01-01 to 2200-01-01 (UTC unless it names its offset)"
ISO_WEEK = r"^(20\d\d|21\d\d)-W(0[1-9]|[1-4]\d|5[0-3])$"  # the weeks of [MIN_TIME, MAX_TIME)


def utc_in_range(name: str, v: datetime | None) -> datetime | None:
    """``v`` as an aware UTC time, or a 422 naming ``name`` unless it lies in [MIN_TIME, MAX_TIME)."""
    if v is None:
        return None
    try:
        u = v.replace(tzinfo=UTC) if v.tzinfo is None else v.astimezone(UTC)
    except (OverflowError, ValueError):  # year 1 at +01:00, year 9999 at -01:00
        u = None
    if u is None or not MIN_TIME <= u < MAX_TIME:
        raise HTTPException(422, detail=f"{name} ({v.isoformat()}) is out of range; valid: {_VALID_TIME}")
    return u


def iso_week_range(week: str) -> tuple[datetime, datetime]:
    """'2026-W47' -> (its Monday, the next Monday), UTC; a 422 for a week that does not exist (2026-W53)
    or lies outside [MIN_TIME, MAX_TIME)."""
    if not re.match(ISO_WEEK, week):
        raise HTTPException(422, detail=f"ISO week {week!r} is not valid; valid: YYYY-Www of the years 2000 "
                                        "to 2199, e.g. 2026-W47")
    year, w = week.split("-W")
    try:
        monday = datetime.fromisocalendar(int(year), int(w), 1).replace(tzinfo=UTC)
    except ValueError as e:
        raise HTTPException(422, detail=f"ISO week {week!r} does not exist ({year} has no week {w}); valid: "
                                        "YYYY-Www, e.g. 2026-W47") from e
    return monday, monday + timedelta(days=7)


@dataclass
class TimeRange:
    start: datetime
    end: datetime


def time_range(
    start: Annotated[datetime | None, Query(description="ISO 8601, inclusive; default end - 56 days; "
                                                        "from 2000-01-01")] = None,
    end: Annotated[datetime | None, Query(description="ISO 8601, exclusive; default now; "
                                                      "before 2200-01-01")] = None,
) -> TimeRange:
    end_ = utc_in_range("end", end) or datetime.now(UTC) + timedelta(minutes=5)
    start_ = utc_in_range("start", start) or max(MIN_TIME, end_ - timedelta(days=56))
    if start_ >= end_:
        raise HTTPException(422, detail=f"start ({start_.isoformat()}) must be before end ({end_.isoformat()})")
    if end_ - start_ > MAX_RANGE:
        raise HTTPException(422, detail=f"time range is longer than the maximum of {MAX_RANGE.days} days")
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
    s, e = utc_in_range("start", start), utc_in_range("end", end)
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
