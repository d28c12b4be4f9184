"""A bound method held weakly, for callbacks that must not keep their object alive (standard library only:
the worker and its shipping client both use it).

What an object hands to longer- or equally-lived helpers (a sampler thread, a poster, a telemetry callback)
must not point back at it: the cycle would keep it (a session's tensors, a client) alive until the cyclic
collector runs (tests/worker/test_lifetime.py)."""

from __future__ import annotations

import weakref


def weak_method(bound, default=None):
    """A callable that calls ``bound`` (a bound method) while its object lives, else returns ``default``."""
    ref = weakref.WeakMethod(bound)

    def call(*args, **kw):
        fn = ref()
        return default if fn is None else fn(*args, **kw)

    return call
