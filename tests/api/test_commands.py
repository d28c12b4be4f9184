"""The ``livestep`` command as a user meets it: every subcommand's --help works (whoever registered it),
every option says what it does, --version, and the papercuts: a CPU build asked for CUDA, a port in
use, a collector that is down, an unknown argument."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from api import cli
from collector.version import __version__

REPO = Path(__file__).resolve().parents[2]


def walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(path, parser) of the top parser and of every subcommand under it, nested ones included."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from walk(sub, (*path, name))


PATHS = [p for p, _ in walk(cli.build_parser()) if p]


def test_every_command_registers():
    parser = cli.build_parser()
    top = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(top.choices) == set(cli.COMMANDS)
    unavailable = [c.dest for c in top._choices_actions if "(unavailable" in (c.help or "")]
    assert unavailable == [], f"subcommands whose module failed to import: {unavailable}"
    assert ("worker", "bench") in PATHS and ("migrate",) in PATHS


@pytest.mark.parametrize("path", PATHS, ids=[" ".join(p) for p in PATHS])
def test_help_works(path, capsys):
    try:
        rc = cli.main([*path, "--help"])
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "usage:" in out.out and "--" in out.out, out.out[:300]


def test_worker_bench_help_is_the_bench_scripts():
    out = subprocess.run([sys.executable, "-m", "api.cli", "worker", "bench", "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert "worker_step.py" in out.stdout and "--preset" in out.stdout


def test_every_option_has_help():
    missing = []
    for path, parser in walk(cli.build_parser()):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                missing += [(*path, c.dest) for c in action._choices_actions if not c.help]
            elif not action.help:
                missing.append((*path, action.option_strings[-1] if action.option_strings else action.dest))
    assert missing == [], f"options without a help text: {missing}"


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"livestep {__version__}"


def test_unknown_argument_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--bogus"])
    assert e.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["worker", "run", "--steps", "1"], ["worker", "bench", "--steps", "1"],
                                     ["evaluate", "--steps", "2"]], ids=["worker run", "worker bench", "evaluate"])
def test_cuda_on_a_machine_without_it_is_one_line(command, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert cli.main([*command, "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    found = "a CPU build" if torch.version.cuda is None else "sees no GPU"
    assert err.startswith(f"livestep {command[0]}: --device cuda asked") and found in err and torch.__version__ in err


def test_a_bad_device_name_names_the_valid_ones(capsys):
    assert cli.main(["worker", "run", "--device", "tpu:0", "--steps", "1"]) == 2
    assert "cpu, cuda or cuda:N" in capsys.readouterr().err


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO))


def test_a_port_in_use_fails_before_the_store_or_spool_is_touched(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "api.cli", "serve", "--port", str(port), "--dsn", f"chdb://{tmp_path / 'db'}",
             "--spool-dir", str(tmp_path / "spool")], cwd=tmp_path, env=_env(), capture_output=True, text=True,
            timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == (f"livestep serve: cannot listen on 127.0.0.1:{port}: in use by another process; "
                                  "stop the other server or pick another --port (0 = any free port)")
    assert not (tmp_path / "db").exists() and not (tmp_path / "spool").exists()  # no store opened, nothing migrated


@pytest.mark.parametrize("peer", ["refused", "silent"])
def test_simulate_reports_a_collector_that_is_down(peer, tmp_path):
    """Nothing listening (refused), or a socket that accepts and never answers (silent): one line
    saying so, long before the client's minute of retries (the subprocess limit is the bound)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        if peer == "silent":
            s.listen(8)
        else:
            s.close()
        out = subprocess.run([sys.executable, "-m", "api.cli", "simulate", "--url", f"http://127.0.0.1:{port}",
                              "--weeks", "0.1", "--no-progress"], cwd=tmp_path, env=_env(), capture_output=True,
                             text=True, timeout=30)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith(f"livestep simulate: no collector answers at http://127.0.0.1:{port}")
    assert "--direct" in out.stderr and out.stderr.count("\n") == 1
