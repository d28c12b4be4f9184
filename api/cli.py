"""The ``livestep`` command: one entry point, a subcommand per role.

    livestep demo                 the README's main job on the embedded store
    livestep init [DIR]           write the deployment files (Prometheus, Alertmanager, Grafana) to DIR/deploy
    livestep serve [--role ...]   collector + api + scheduler (one process on chDB)
    livestep worker run|bench     the serving worker
    livestep migrate [--cluster]  apply the schema (sql/, or its cluster form) to the store
    livestep simulate|analyze     the fleet simulator and on-demand analytics jobs
    livestep --version

A subcommand is one line of ``COMMANDS`` (name -> the module whose ``register(subparsers)`` adds its
parser and sets ``func``); the module is imported only when its subcommand runs, so the server's
commands never import torch. tests/api/test_commands.py walks every subcommand's ``--help``, so every
option needs a help text. A parser that hands its arguments on untouched (``worker bench``) sets
``passthrough=True``: what it does not know arrives as ``args.passthrough_args``. Typed errors are
caught here, once, and printed as one line with exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module that owns it (module.register(sub) adds the parser, sets func=...)
COMMANDS: dict[str, str] = {
    "demo": "api.demo",
    "init": "api.init",
    "serve": "api.serve",
    "worker": "worker.cli",
    "simulate": "analytics.cli",
    "analyze": "analytics.cli",
    "evaluate": "worker.evaluate",
    "migrate": "api.migrate",
    "replay": "collector.replay",
    "spool": "collector.requeue",
    "evaluate-detectors": "analytics.detector_eval",
}


class UsageError(Exception):
    """A command-line or configuration error: printed as one line, exit status 2."""


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    from collector.version import __version__

    parser = argparse.ArgumentParser(prog="livestep", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"livestep {__version__}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    registered: set[str] = set()
    for name, module in COMMANDS.items():
        if module in registered or (only is not None and name != only):
            continue
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            if only is not None:
                raise
            sub.add_parser(name, help=f"(unavailable: {e})")
            continue
        mod.register(sub)
        registered.add(module)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    first = argv[0] if argv and not argv[0].startswith("-") else None
    if first is not None and first not in COMMANDS:
        print(f"livestep: unknown command {first!r}; valid commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    try:
        if first in ("analyze", "demo"):  # the analytics' weekly report is the api's (api/report.py)
            from api.report import install

            install()
        if first == "evaluate-detectors":  # incidents per cause are counted by the api's own incident logic
            from api.incidents import install_evaluation

            install_evaluation()
        parser = build_parser(only=first)
    except ModuleNotFoundError as e:
        return _missing_extra(first, e)
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.passthrough_args = extra
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] in EXTRA_OF:
            return _missing_extra(first, e)
        raise
    except Exception as e:  # domain errors: one clear line
        if type(e).__name__.endswith("Error") and type(e).__module__.split(".")[0] in COMMANDS_PACKAGES:
            print(f"livestep {first}: {e}", file=sys.stderr)
            return 2
        raise


COMMANDS_PACKAGES = {"api", "worker", "collector", "analytics", "kernels"}

# a third-party module a command needs -> the extra that installs it (pyproject.toml)
EXTRA_OF = {**dict.fromkeys(("torch", "triton", "pynvml"), "worker"),
            **dict.fromkeys(("fastapi", "starlette", "uvicorn", "chdb", "clickhouse_connect", "polars", "plotly",
                             "apscheduler", "pydantic_settings", "scipy", "statsmodels", "fastapi_offline",
                             "itsdangerous"), "server")}


def _missing_extra(command: str | None, e: ModuleNotFoundError) -> int:
    """One line for a command whose role is not installed here (a server box asked to run the worker)."""
    name = (e.name or "").split(".")[0]
    extra = EXTRA_OF.get(name)
    if extra is None:
        raise e
    print(f"livestep {command}: {name} is not installed, and this command needs it: "
          f"pip install 'livestep[{extra}]'", file=sys.stderr)
    return 2

if __name__ == "__main__":
    sys.exit(main())
