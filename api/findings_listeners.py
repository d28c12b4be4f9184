"""Where the analytics jobs' findings go in this process: a listener (api/incidents.py's hand-off, or
api/alertmanager_publisher.py's publisher) registered with ``analytics.jobs``, and removed at shutdown;
where the analytics are not importable (a collector-only install) there is nothing to listen to."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger("livestep.findings")
L = TypeVar("L")


def register(make: Callable[[], L], what: str) -> L | None:
    """``make()`` registered as a findings listener; None (and logged: findings are not ``what``) when
    analytics.jobs is not importable."""
    try:
        from analytics.jobs import add_findings_listener
    except ImportError as e:
        log.info("findings are not %s: analytics.jobs unavailable (%s)", what, e)
        return None
    listener = make()
    add_findings_listener(listener)
    return listener


def unregister(listener) -> None:
    """Remove a listener ``register`` returned (None: nothing to do)."""
    if listener is None:
        return
    try:
        from analytics.jobs import remove_findings_listener
    except ImportError:
        return
    remove_findings_listener(listener)
