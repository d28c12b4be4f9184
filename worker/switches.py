"""Where a running worker reads its switches from, between steps.

    src = make_source("http://127.0.0.1:8000", worker_id="w1", release="v7", gpu_kind="cpu", token=T)
    src = make_source("/path/switches.json")            # a file: {"ring_cache": true, ...}
    src = make_source(lambda step: {...} or None)       # a callable (tests, scripted demos)
    flip = ScriptedFlip(worker, {"fp8_cache": False}, at=5, after=24)   # benches and tests of a flip
    worker.run_session(..., switch_source=flip.poll, stop_when=flip.stop)
    new = src.poll(step)   # -> dict of switch values, or None when nothing changed; never blocks

The HTTP source implements contract 3 (its URL is the control plane's base, ``http://host:port``, or
the full ``.../v1/switches``: both are accepted): a background thread GETs ``/v1/switches`` with
``If-None-Match`` (304 = unchanged) every ``interval_s``; ``poll`` only hands over what the thread
already has, so the step loop never waits on the network. The body's ``switches`` names only what a
rule in the worker's scope decides; every other switch keeps the worker's current value (the one it
started with, unless an earlier rule changed it: the session merges the mapping over its switches). The session validates the mapping
(``Switches.from_mapping``) and applies it at the next step boundary.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("livestep.worker.switches")


class SwitchSourceError(ValueError):
    """A switch source that cannot be used (bad URL or path)."""


class SwitchSource:
    """No control plane: the switches given at start stay.

    ``full_state``: each poll answers the whole set of switches the source decides (a name it stops
    naming goes back to the session's start value), rather than a change to apply on top of the
    current switches."""

    full_state = False

    def poll(self, step: int) -> dict[str, Any] | None:
        return None

    def close(self) -> None:
        pass


class CallableSource(SwitchSource):
    def __init__(self, fn: Callable[[int], dict[str, Any] | None]):
        self.fn = fn

    def poll(self, step: int) -> dict[str, Any] | None:
        return self.fn(step)


class ScriptedFlip:
    """A control plane in one object (benches and tests of a flip): ``poll`` hands over ``change`` at step
    ``at``; ``stop`` (the session's ``stop_when``) is true ``after`` steps past the step at which the worker's
    model became the target's view (``swapped``), or from step ``max_steps`` on (None: never)."""

    def __init__(self, worker, change: dict[str, Any], at: int = 3, after: int = 4, max_steps: int | None = None):
        self.w, self.change, self.at, self.after, self.max_steps = worker, change, at, after, max_steps
        self.model0, self.step, self.swapped = worker.model, -1, None

    def poll(self, step: int) -> dict[str, Any] | None:
        self.step = step
        return self.change if step == self.at else None

    def stop(self) -> bool:
        if self.swapped is None and self.w.model is not self.model0:
            self.swapped = self.step
        done = self.swapped is not None and self.step >= self.swapped + self.after
        return done or (self.max_steps is not None and self.step >= self.max_steps)


class FileSource(SwitchSource):
    """A JSON object of switch values, re-read when the file's mtime changes (a stat per poll)."""

    def __init__(self, path: str):
        self.path = path
        self._mtime: float | None = None

    def poll(self, step: int) -> dict[str, Any] | None:
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except OSError:
            return None
        if mtime == self._mtime:
            return None
        self._mtime = mtime
        try:
            with open(self.path) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            log.warning("switch file %s unreadable: %s", self.path, e)
            return None
        return data.get("switches", data) if isinstance(data, dict) else None


class HttpSource(SwitchSource):
    """Contract 3: ``GET /v1/switches?worker_id=&release=&gpu_kind=`` with ETag, from a thread.

    ``poll`` hands over the decided switches only (a partial mapping; ``{}`` when no rule applies):
    a name left out keeps the session's start value, so a cleared rule gives the switch back."""

    full_state = True  # every poll returns the switches the control plane's rules decide

    def __init__(self, url: str, worker_id: str, release: str, gpu_kind: str, token: str | None = None,
                 interval_s: float = 1.0):
        import httpx

        self.endpoint = switches_endpoint(url)
        self.params = {"worker_id": worker_id, "release": release, "gpu_kind": gpu_kind}
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = httpx.Client(headers=headers, timeout=5.0)
        self.interval_s = interval_s
        self._etag: str | None = None
        self._pending: dict[str, Any] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.errors = 0
        self.failing: str | None = None  # why the latest poll failed; None while polls succeed
        self.version: int | None = None
        self._thread = threading.Thread(target=self._run, name="livestep-switches", daemon=True)
        self._thread.start()

    def _fetch(self) -> None:
        headers = {"If-None-Match": self._etag} if self._etag else {}
        r = self._client.get(self.endpoint, params=self.params, headers=headers)
        if r.status_code == 304:
            self._recovered()
            return
        if r.status_code != 200:
            self._failed(f"HTTP {r.status_code} {r.text[:120].strip()}")
            return
        body = r.json()
        self._recovered()
        self._etag = r.headers.get("ETag")
        with self._lock:
            self._pending = dict(body.get("switches", {}))
            self.version = body.get("version")

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._fetch()
            except Exception as e:  # noqa: BLE001 - the control plane being down never touches the session
                self._failed(f"{type(e).__name__}: {e}")
            self._stop.wait(self.interval_s)

    def _failed(self, why: str) -> None:
        """Count a failed poll; log once when polls start failing (not once per poll)."""
        self.errors += 1
        if self.failing is None:
            log.warning("switch polls failing: GET %s: %s (the session keeps its switches; retrying every %g s)",
                        self.endpoint, why, self.interval_s)
        self.failing = why

    def _recovered(self) -> None:
        if self.failing is not None:
            log.warning("switch polls recovered: GET %s answers again after %d failed polls", self.endpoint,
                        self.errors)
        self.failing = None

    def poll(self, step: int) -> dict[str, Any] | None:
        with self._lock:
            pending, self._pending = self._pending, None
        return pending

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._client.close()


def switches_endpoint(url: str) -> str:
    """The ``/v1/switches`` endpoint of a control plane given by its base URL or by that endpoint."""
    if not url.startswith(("http://", "https://")):
        raise SwitchSourceError(f"switch source URL {url!r} is not valid; valid: http(s)://host:port "
                                "(or http(s)://host:port/v1/switches)")
    base = url.split("?")[0].rstrip("/")
    return base if base.endswith("/v1/switches") else base + "/v1/switches"


def make_source(spec, worker_id: str = "w0", release: str = "dev", gpu_kind: str = "cpu",
                token: str | None = None) -> SwitchSource:
    """None -> static; a callable; an http(s) URL -> HttpSource; else a file path."""
    if spec is None:
        return SwitchSource()
    if isinstance(spec, SwitchSource):
        return spec
    if callable(spec):
        return CallableSource(spec)
    if isinstance(spec, str) and spec.startswith(("http://", "https://")):
        return HttpSource(spec, worker_id, release, gpu_kind, token)
    if isinstance(spec, str):
        return FileSource(spec)
    raise SwitchSourceError(f"switch source {spec!r} not understood; valid: an http(s) URL, a file path, a callable")
