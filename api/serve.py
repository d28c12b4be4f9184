"""``livestep serve``: the server in one process, one uvicorn worker (chDB: one process per directory).

    livestep serve                                   # 127.0.0.1:8000, role all, embedded chDB in $LIVESTEP_HOME or ./var
    livestep serve --host 0.0.0.0 --port 8000 --role collector --dsn https://u:p@ch:8443/livestep

Options override the ``LIVESTEP_*`` environment (see api/settings.py); a non-loopback bind needs
the tokens and secret its role requires, else the command stops with one line saying which.
With the collector role, ``POST /v1/telemetry`` takes a fast lane past the app's middleware and
routing (``collector.routes.with_ingest_fast_lane``: the same handler, same answers); uvicorn runs
on uvloop + httptools (its "auto" choice when they are installed, as with ``uvicorn[standard]``).

Every connection is bounded (api/http_limits.py, env only): its head in bytes, and in time a fresh or
idle connection, a request's head and its body; beyond ``LIVESTEP_MAX_CONNECTIONS`` a request gets
503. The bounds in force are listed at the end of ``livestep serve --help``.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import logging
import os
import socket
from pathlib import Path

from api.settings import ROLES, load_settings
from collector.settings import default_paths


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="run the collector + api + scheduler server (one process)",
                              description=__doc__, epilog=_limits_help(),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", help="bind address (default LIVESTEP_HOST or 127.0.0.1)")
    p.add_argument("--port", type=int, help="bind port (default LIVESTEP_PORT or 8000)")
    p.add_argument("--role", choices=ROLES, help="which parts this process runs (default LIVESTEP_ROLE or all)")
    paths = default_paths()
    p.add_argument("--dsn", help=f"store DSN (default LIVESTEP_CLICKHOUSE_DSN, else chdb://<home>/chdb: here "
                   f"{paths['dsn']}; <home> is LIVESTEP_HOME, else ./var of the working directory)")
    p.add_argument("--spool-dir", help=f"spool directory (default LIVESTEP_SPOOL_DIR, else <home>/spool: here "
                   f"{paths['spool']}); weekly reports go to LIVESTEP_REPORTS_DIR, else <home>/reports: here "
                   f"{paths['reports']}")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                   help="server log level (debug also logs every request)")
    p.set_defaults(func=run)


def _limits_help() -> str:
    from api.http_limits import HttpLimits

    try:
        rows = HttpLimits().table()
    except ValueError as e:  # a bad LIVESTEP_* value: serve itself reports it; --help still prints
        return f"connection bounds: not readable from the environment ({e})"
    lines = ["connection bounds (environment; the values in force now):"]
    lines += [f"  {var:<28} {value:<14} {what}" for var, value, what in rows]
    return "\n".join(lines)


def _raise_fd_limit(wanted: int) -> None:
    """The soft open-files limit raised toward ``wanted`` (each connection is a descriptor), as far as
    the hard limit allows; a warning when it stays below (beyond it accept() fails, not a 503)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        new = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        if new < wanted:
            logging.getLogger("livestep.serve").warning(
                "open-files limit %d is below LIVESTEP_MAX_CONNECTIONS + 256 = %d: raise `ulimit -n`", new, wanted)


def _http_limits():
    from pydantic import ValidationError

    from api.http_limits import HttpLimits
    from api.settings import SettingsError

    try:
        return HttpLimits()
    except ValidationError as e:
        raise SettingsError("; ".join(f"LIVESTEP_{'.'.join(map(str, err['loc'])).upper()}: {err['msg']}"
                                      for err in e.errors())) from e


class ServeError(Exception):
    """The server cannot start; the message says why (printed as one line by api/cli.py)."""


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before anything else starts (a port in use fails before any
    migration, spool or job); a ``ServeError`` naming the address when it cannot be bound."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is no conflict
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as e:
        sock.close()
        why = "in use by another process" if e.errno == errno.EADDRINUSE else e.strerror
        raise ServeError(f"cannot listen on {host}:{port}: {why}; stop the other server or pick "
                         f"another --port (0 = any free port)") from None
    sock.listen(2048)
    return sock


def check_store(dsn: str) -> None:
    """Refuse, with one line, a DSN that cannot work before anything starts: a malformed one (an
    unknown engine, a relative chDB path) or a chDB directory another process holds (chDB allows one
    process per directory: its ``status`` file is ``flock``ed while open, so a trial lock tells)."""
    from collector.store import StoreError, parse_dsn

    try:
        d = parse_dsn(dsn)
    except StoreError as e:
        raise ServeError(str(e)) from None
    if not d.embedded:
        return
    status = Path(d.path) / "status"
    try:
        fd = os.open(status, os.O_RDONLY)
    except OSError:  # a new directory (or none yet): nobody holds it
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lines = status.read_text(errors="replace").splitlines()
        holder = next((ln for ln in lines if ln.startswith("PID")), "its status file is locked")
        raise ServeError(f"chDB directory {d.path} is in use by another process ({holder}); chDB allows one process per directory: stop it, or give another "
                         "--dsn chdb:///dir") from None
    finally:
        os.close(fd)  # closing releases a trial lock that succeeded


def run(args: argparse.Namespace) -> int:
    import uvicorn

    settings = load_settings(host=args.host, port=args.port, role=args.role, clickhouse_dsn=args.dsn,
                             spool_dir=args.spool_dir)
    check_store(settings.clickhouse_dsn)
    limits = _http_limits()
    sock = bind(settings.host, settings.port)  # before the app: the lifespan migrates and starts jobs
    from api.app import create_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(settings)
    if "collector" in settings.roles:
        from collector.routes import with_ingest_fast_lane

        app = with_ingest_fast_lane(app)
    port = sock.getsockname()[1]
    print(f"livestep serve: http://{settings.host}:{port} role={settings.role} "
          f"store={settings.clickhouse_dsn.split('@')[-1]} spool={settings.spool_dir}", flush=True)
    from api.http_limits import server_limits

    _raise_fd_limit(limits.max_connections + 256)  # + the store's, spool's and log's descriptors
    config = uvicorn.Config(app, workers=1, log_level=args.log_level, access_log=args.log_level == "debug",
                            **server_limits(limits))  # head size, deadlines, connection bound
    uvicorn.Server(config).run(sockets=[sock])
    return 0
