"""A worker whose configuration can never work says so and exits non-zero (worker/preflight.py), and
a worker whose switch polls fail says so once per change of state (worker/switches.py).

Against a real ``livestep serve`` (subprocess, own chDB and spool, ingest and read tokens set)."""

from __future__ import annotations

import logging
import sys
import time

import pytest

from api.cli import main
from tests.serving import Serve, free_port
from worker.switches import HttpSource, switches_endpoint

pytestmark = [pytest.mark.e2e]
INGEST, READ = "ingest-token-for-tests", "read-token-for-tests"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    serve = Serve(tmp_path_factory.mktemp("preflight"), free_port(), LIVESTEP_INGEST_TOKENS=INGEST,
                  LIVESTEP_READ_TOKENS=READ).start(timeout_s=90)
    yield serve.url
    serve.stop()


def run_worker(capsys, *args) -> tuple[int, str]:
    rc = main(["worker", "run", "--preset", "tiny", "--steps", "2", "--no-realtime", "--no-warm", *args])
    return rc, capsys.readouterr().err


def test_switch_source_takes_the_base_or_the_full_url():
    assert switches_endpoint("http://h:8000") == "http://h:8000/v1/switches"
    assert switches_endpoint("http://h:8000/v1/switches") == "http://h:8000/v1/switches"
    assert switches_endpoint("https://h/prefix/v1/switches/") == "https://h/prefix/v1/switches"


def test_full_switches_url_polls_successfully(server):
    src = HttpSource(server + "/v1/switches", "w-full", "v1", "cpu", token=INGEST, interval_s=0.05)
    try:
        deadline = time.monotonic() + 20
        while src.version is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert src.version is not None and src.errors == 0 and src.failing is None
    finally:
        src.close()


def test_failing_polls_log_once_per_state_change(server, caplog):
    caplog.set_level(logging.WARNING, logger="livestep.worker.switches")
    src = HttpSource(server, "w-bad", "v1", "cpu", token="not-a-token", interval_s=0.02)
    try:
        deadline = time.monotonic() + 20
        while src.errors < 5 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        src.close()
    assert src.errors >= 5 and "HTTP 403" in src.failing
    lines = [r.getMessage() for r in caplog.records if "switch polls" in r.getMessage()]
    assert len(lines) == 1 and "403" in lines[0] and "/v1/switches" in lines[0], lines


def test_wrong_ingest_token_exits_non_zero_saying_why(server, capsys):
    rc, err = run_worker(capsys, "--collector", server, "--token", "wrong-token-123")
    assert rc == 2
    assert "401" in err or "403" in err
    assert "token" in err and len(err.strip().splitlines()) == 1, err


def test_switch_source_that_names_no_endpoint_exits_non_zero(server, capsys):
    rc, err = run_worker(capsys, "--switch-source", server + "/nope", "--token", INGEST)
    assert rc == 2 and "404" in err and "base URL" in err, err


def test_switch_source_with_a_wrong_token_exits_non_zero(server, capsys):
    rc, err = run_worker(capsys, "--switch-source", server, "--token", "wrong-token-123")
    assert rc == 2 and "403" in err, err


def test_token_from_the_environment_and_from_a_file(server, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("LIVESTEP_INGEST_TOKEN", INGEST)
    rc, err = run_worker(capsys, "--collector", server)
    assert rc == 0, err
    monkeypatch.delenv("LIVESTEP_INGEST_TOKEN")
    f = tmp_path / "token"
    f.write_text(INGEST + "\n")
    rc, err = run_worker(capsys, "--collector", server, "--token-file", str(f))
    assert rc == 0, err
    rc, err = run_worker(capsys, "--collector", server, "--token-file", str(tmp_path / "absent"))
    assert rc == 2 and "--token-file" in err


def test_missing_client_dependency_refuses_to_start(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "orjson", None)  # import orjson -> ImportError, as on a bare machine
    rc, err = run_worker(capsys, "--telemetry-file", str(tmp_path / "t.arrows"))
    assert rc == 2 and "orjson" in err and "pip install" in err, err
