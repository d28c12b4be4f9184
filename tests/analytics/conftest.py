"""Fixtures of the analytics tests: small simulated fleets written through the bulk path."""

from __future__ import annotations

import pytest

from analytics.simulate import pinned_end

# A fleet small enough for CI (a few hundred thousand step rows), big enough for the statistics.
SMALL = {"workers": 9, "sessions_per_day": 48, "session_median_s": 10.0, "progress": False}


@pytest.fixture
def small():
    """SMALL, ending at a pinned hour and weekday: a detector's verdict on it is the same at any hour."""
    return dict(SMALL, end=pinned_end())
