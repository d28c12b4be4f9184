"""The demo's moving parts (``livestep demo``, api/demo.py): the app on a uvicorn thread in this process,
a fresh ``demo`` database and spool each run, and a stdlib receiver standing in for the on-call's webhook."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any


class DemoError(Exception):
    """The demo could not run; the message says why and what to do."""


# -- step 1: the server --------------------------------------------------------------------------
@dataclass
class DemoServer:
    """The app on a uvicorn thread in this process; ``store`` is the app's own store."""

    app: Any
    server: Any
    thread: threading.Thread
    url: str

    @property
    def store(self):
        return self.app.state.store

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)


def start_server(
    dsn: str | None = None, port: int | None = None, spool_dir: str | None = None, timeout_s: float = 30.0,
    webhook_urls: str | None = None,
) -> DemoServer:
    import uvicorn

    from api.app import create_app
    from api.settings import load_settings

    settings = load_settings(clickhouse_dsn=dsn, host="127.0.0.1", port=port, spool_dir=spool_dir,
                             webhook_urls=webhook_urls)
    app = create_app(settings)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="livestep-demo-server", daemon=True)
    thread.start()
    end = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive():
            raise DemoError(
                f"the server did not start on 127.0.0.1:{settings.port} (port in use? try --port 0; "
                f"store locked by another livestep process? use another --dsn)"
            )
        if time.monotonic() > end:
            server.should_exit = True
            raise DemoError(f"the server did not start within {timeout_s:.0f} s")
        time.sleep(0.05)
    bound = server.servers[0].sockets[0].getsockname()[1]
    return DemoServer(app, server, thread, f"http://127.0.0.1:{bound}")


class Receiver:
    """A stdlib HTTP endpoint on 127.0.0.1 that records the incident notifications posted to it."""

    def __init__(self, httpd, thread):
        self.httpd, self.thread, self.got = httpd, thread, []
        self.url = f"http://127.0.0.1:{httpd.server_address[1]}/hook"

    @classmethod
    def start(cls) -> Receiver:
        import json
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        box: list[Receiver] = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                box[0].got.append({"signed": bool(self.headers.get("X-Livestep-Signature")), **json.loads(body)})
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):  # quiet
                pass

        httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        thread = threading.Thread(target=httpd.serve_forever, name="demo-receiver", daemon=True)
        thread.start()
        box.append(cls(httpd, thread))
        return box[0]

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def fresh_demo_store(dsn: str | None, spool_dir: str | None) -> tuple[str, str]:
    """The demo's own database and spool, emptied first, so every run tells the same story."""
    import shutil

    from collector.migrations import recreate_database
    from collector.settings import data_home
    from collector.store import open_store, parse_dsn

    root = data_home()
    dsn = dsn or f"chdb://{root / 'chdb'}?database=demo"
    spool_dir = spool_dir or str(root / "demo-spool")
    shutil.rmtree(spool_dir, ignore_errors=True)
    store = open_store(dsn)  # the server reuses this store object (one chDB directory per process)
    database = parse_dsn(dsn).database
    recreate_database(store, database)
    return dsn, spool_dir


def ingest_token(server: DemoServer) -> str | None:
    tokens = getattr(server.app.state.settings, "ingest_tokens", None) or []
    return tokens[0] if tokens else None
