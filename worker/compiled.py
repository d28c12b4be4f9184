"""torch.compile once per function per process: what a long-lived worker must not redo per session.

    write = compiled(write_pair_torch)      # the same compiled callable every time it is asked for

Each ``torch.compile(fn)`` call makes a new wrapper with its own backend; made per session (a cache
rebuilt, the model's quantizer re-installed at session start) they recompile and pile up dynamo
cache entries until ``cache_size_limit``, after which the function silently runs eagerly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_COMPILED: dict[tuple[Callable, tuple], Callable] = {}


def compiled(fn: Callable, **options) -> Callable:
    """``torch.compile(fn, **options)``, made once per (fn, options) in this process."""
    key = (fn, tuple(sorted(options.items())))
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(fn, **options)
    return _COMPILED[key]
