"""``livestep_build_info{version}``: which livestep a process runs, one declaration for every
``/metrics`` (the server's roles, api/metrics.py, and the worker's, worker/metrics.py)."""

from __future__ import annotations

from prometheus_client.core import InfoMetricFamily

from collector.version import __version__


def build_info() -> InfoMetricFamily:
    return InfoMetricFamily("livestep_build", "The livestep version this process runs", value={"version": __version__})
