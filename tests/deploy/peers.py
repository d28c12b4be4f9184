"""The real Prometheus programs the deploy tests run: Debian's packages, found on PATH or skipped.

    promtool = binary("promtool")        # pytest.skip with the install line when it is missing
    with prometheus(config_text, tmp_path) as url: ...     # a real Prometheus on a loopback port
    with alertmanager(config_text, tmp_path) as url: ...   # a real Alertmanager on a loopback port
    alertmanager_config(livestep_port, token_file)          # the shipped routing, posting to livestep

``./dev test`` installs them as root (apt-get install prometheus prometheus-alertmanager), as it
installs chromium; elsewhere the tests that need them are skipped with that line as the reason.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

PACKAGES = {"promtool": "prometheus", "prometheus": "prometheus", "amtool": "prometheus-alertmanager",
            "prometheus-alertmanager": "prometheus-alertmanager", "alertmanager": "prometheus-alertmanager"}
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def binary(name: str) -> str:
    """The program's path; skips the test when it is not installed."""
    for candidate in ((name, "prometheus-alertmanager") if name == "alertmanager" else (name,)):
        path = shutil.which(candidate)
        if path:
            return path
    pytest.skip(f"{name} is not installed: apt-get install {PACKAGES.get(name, name)} "
                "(./dev test installs it when run as root)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, check=False)


@contextlib.contextmanager
def _process(args: list[str], ready_url: str, log: Path, timeout_s: float = 30):
    with open(log, "w") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{args[0]} exited {proc.returncode}: {log.read_text()[-2000:]}")
            try:
                if httpx.get(ready_url, timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{args[0]} not ready after {timeout_s} s: {log.read_text()[-2000:]}")
            time.sleep(0.1)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def _serving(program: str, config: str, tmp: Path, *flags: str):
    """``program`` with ``config`` (written to ``tmp/<program>.yml``) on a free loopback port: its URL."""
    exe = binary(program)
    port = free_port()
    cfg = tmp / f"{program}.yml"
    cfg.write_text(config)
    url = f"http://127.0.0.1:{port}"
    with _process([exe, f"--config.file={cfg}", *flags, f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                  f"{url}/-/ready", tmp / f"{program}.log"):
        yield url


def prometheus(config: str, tmp: Path):
    """A real Prometheus with ``config`` (rule files relative to ``tmp``), on a free loopback port."""
    return _serving("prometheus", config, tmp, f"--storage.tsdb.path={tmp / 'tsdb'}")


def alertmanager(config: str, tmp: Path):
    """A real Alertmanager with ``config``, on a free loopback port (clustering off)."""
    return _serving("alertmanager", config, tmp, f"--storage.path={tmp / 'am'}", "--cluster.listen-address=")


def alertmanager_config(livestep_port: int, token_file: Path) -> str:
    """The shipped Alertmanager routing with group intervals of a second, its ``livestep`` receiver posting
    to ``/v1/alerts`` on ``livestep_port`` with the bearer token in ``token_file``."""
    cfg = yaml.safe_load((DEPLOY / "alertmanager" / "alertmanager.yml").read_text())
    cfg["route"].update(group_wait="1s", group_interval="1s", repeat_interval="1h")
    hook = next(r for r in cfg["receivers"] if r["name"] == "livestep")["webhook_configs"][0]
    hook["url"] = f"http://127.0.0.1:{livestep_port}/v1/alerts"
    hook["http_config"]["authorization"]["credentials_file"] = str(token_file)
    return yaml.safe_dump(cfg)
