"""What ``livestep worker run`` checks before its first session: a setting that can never work stops
the worker with one line naming the fix, instead of a worker that streams and ships nothing.

    token = ingest_token(args.token, args.token_file)   # --token, --token-file, or LIVESTEP_INGEST_TOKEN
    client_dependencies()                                # orjson / pydantic present for the shipping client
    collector(url, token)                                # 401/403/404 from POST /v1/telemetry -> PreflightError
    switch_source(url, token, worker_id, release, gpu_kind)   # 401/403/404 from GET /v1/switches

An endpoint that cannot be reached (connection refused, 5xx) only warns: it may come up later, and the
shipping client and the switch poller retry it. Refusals that no retry can change (a token the server
does not know, a URL that names no such endpoint) raise ``PreflightError``, which api/cli.py prints as
one line with exit status 2. Each probe is one request: the collector's is an empty JSON batch (``{}``,
acknowledged and storing nothing), the switch source's is the worker's own first poll.
"""

from __future__ import annotations

import importlib
import logging
import os
from pathlib import Path

log = logging.getLogger("livestep.worker.preflight")

TOKEN_ENV = "LIVESTEP_INGEST_TOKEN"
CLIENT_MODULES = ("orjson", "pydantic")  # collector/records.py and collector/client.py need them
NEVER_WORKS = {401: "the token is missing or unknown to the server",
               403: "the token is not an ingest token",
               404: "no such endpoint at this URL (give the server's base URL, http(s)://host:port)"}


class PreflightError(Exception):
    """The worker cannot do what it was asked (the message says why and what to change)."""


def ingest_token(token: str | None, token_file: str | None) -> str | None:
    """The ingest token from ``--token``, else ``--token-file`` (first line), else ``LIVESTEP_INGEST_TOKEN``."""
    if token and token_file:
        raise PreflightError("give the ingest token once: --token or --token-file, not both")
    if token_file:
        try:
            text = Path(token_file).read_text().strip()
        except OSError as e:
            raise PreflightError(f"--token-file {token_file}: {e.strerror}") from None
        if not text:
            raise PreflightError(f"--token-file {token_file} is empty; write the ingest token in it")
        return text.splitlines()[0].strip()
    return token or os.environ.get(TOKEN_ENV) or None


def client_dependencies() -> None:
    """Every module the shipping client imports is here (else each batch would fail and be dropped)."""
    for name in (*CLIENT_MODULES, "collector.records", "collector.client"):
        try:
            importlib.import_module(name)
        except ImportError as e:
            missing = (e.name or name).split(".")[0]
            raise PreflightError(f"the telemetry client needs {missing}, which is not installed here: "
                                 f"pip install {' '.join(CLIENT_MODULES)} (or pip install livestep)") from None


def _refusal(what: str, url: str, status: int, text: str) -> PreflightError:
    return PreflightError(f"{what} {url} answered HTTP {status}: {NEVER_WORKS[status]}; "
                          f"server says: {text[:160].strip() or '(nothing)'}")


def collector(url: str, token: str | None, timeout_s: float = 5.0) -> None:
    """One empty batch to ``POST /v1/telemetry``: a refusal of the token or the URL stops the worker."""
    import httpx

    from collector.client import ingest_url

    endpoint = ingest_url(url)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    try:
        r = httpx.post(endpoint, content=b"{}", headers=headers, timeout=timeout_s)
    except httpx.HTTPError as e:
        log.warning("collector %s not reachable now (%s): sessions run, their records retried, then dropped",
                    endpoint, e)
        return
    if r.status_code in NEVER_WORKS:
        raise _refusal("collector", endpoint, r.status_code, r.text)


def switch_source(url: str, token: str | None, worker_id: str, release: str, gpu_kind: str,
                  timeout_s: float = 5.0) -> None:
    """The worker's first switch poll, synchronously: a token or URL that is refused stops the worker."""
    import httpx

    from worker.switches import switches_endpoint

    endpoint = switches_endpoint(url)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    params = {"worker_id": worker_id, "release": release, "gpu_kind": gpu_kind}
    try:
        r = httpx.get(endpoint, params=params, headers=headers, timeout=timeout_s)
    except httpx.HTTPError as e:
        log.warning("switch source %s not reachable now (%s): polling goes on, the switches stay", endpoint, e)
        return
    if r.status_code in NEVER_WORKS:
        raise _refusal("switch source", endpoint, r.status_code, r.text)
