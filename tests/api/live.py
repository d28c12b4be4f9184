"""A real uvicorn on an ephemeral loopback port, in a thread of the test process (tests only).

    with serve(app) as base_url:
        httpx.get(f"{base_url}/v1/switches")
    with serve_app(settings) as (app, base_url):   # the whole app, its lifespan on; its database dropped after
        ...

In-process so the app shares the test's chDB directory (one directory per process). ``lifespan='on'``
runs the app's lifespan (store, spool, writer, scheduler, the webhook notifier).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import uvicorn


def bound_socket() -> socket.socket:
    """A socket bound to an ephemeral loopback port (know the port before the app is built)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextlib.contextmanager
def serve(app, timeout_s: float = 20.0, sock: socket.socket | None = None, lifespan: str = "off"):
    if sock is None:
        sock = bound_socket()
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan=lifespan))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout_s)
        sock.close()


@contextlib.contextmanager
def serve_app(settings, timeout_s: float = 60.0):
    """The app of ``settings`` with its lifespan on a real uvicorn: yields (app, base URL); once the server
    stopped, the app's database is dropped."""
    from api.app import create_app

    app = create_app(settings)
    try:
        with serve(app, timeout_s=timeout_s, lifespan="on") as url:
            yield app, url
    finally:
        store = getattr(app.state, "store", None)
        if store is not None:
            store.command(f"DROP DATABASE IF EXISTS {store.database}")
