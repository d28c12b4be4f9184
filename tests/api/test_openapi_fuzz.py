"""Schemathesis over EVERY operation of the OpenAPI spec: no input gives a 5xx, every answer matches the spec.

Generated from /openapi.json (JSON bodies from their schemas, Arrow bodies from random bytes and
mangled valid streams, query/path parameters), a bounded number of examples per operation so the
whole run stays well under two minutes on two cores; each answer is checked for a server error, for a
status the operation does not document (api/openapi_limits.py states the server-wide ones) and against
the response schema documented for its status (every 422 is ``ErrorBody``: api/errors.py).
The app is the real one (role all: spool, writer, scheduler, chDB) on a fresh database with a few
sessions, its roles open (loopback, no tokens) so the generated requests reach the handlers, served by
a real uvicorn and fuzzed over HTTP. (Not in process: schemathesis's ASGI transport starts the app's
lifespan a second time, keeps it until the process exits and shuts every one down when another fuzz
module's does -- two spools and writers on one directory, then none running.)
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance, status_code_conformance

from api.app import create_app
from collector import records
from tests.api.live import serve
from tests.collector.helpers import arrow_body, chdb_dsn, drained, make_settings, step_rows, wait_for

_VALID = arrow_body("step", step_rows(3))
_ARROW_BODIES = st.one_of(
    st.binary(max_size=512),
    st.just(_VALID),
    st.builds(lambda n: _VALID[:n], st.integers(0, len(_VALID))),  # truncated
    st.builds(lambda i, b: _VALID[:i] + bytes([b]) + _VALID[i + 1:], st.integers(0, len(_VALID) - 1),
              st.integers(0, 255)),  # one byte flipped
    st.builds(lambda r: arrow_body("step", r), st.lists(st.builds(
        lambda s, d, t: step_rows(1, step=s, diffusion_ms=d, switches=t)[0],
        st.one_of(st.integers(-(2**63), 2**63 - 1), st.integers(0, 2**32)),
        st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(0, 1e308)),
        st.sampled_from(["", "ring_cache", "bogus", ",", "ring_cache,ring_cache"])), max_size=3)),
)
schemathesis.openapi.media_type("application/vnd.apache.arrow.stream", _ARROW_BODIES)


@pytest.fixture(scope="module")
def fuzz_app(tmp_path_factory, chdb_dir):
    from collector.store import open_store

    dsn = chdb_dsn(chdb_dir)
    store = open_store(dsn)
    store.migrate()
    store.insert_arrow("steps", records.to_arrow("step", step_rows(5, session_id="s1")), dedup_token="seed")
    tmp = tmp_path_factory.mktemp("fuzz")
    app = create_app(make_settings(dsn, tmp, role="all", reports_dir=tmp / "reports"))
    with serve(app, lifespan="on") as url:  # the lifespan: store, spool, writer
        yield app, url
        # every batch the fuzzer got accepted was also insertable: nothing stuck in the spool
        wait_for(lambda: drained(app), what="spool drained")
        assert app.state.writer.last_error is None and app.state.writer.failures == 0
    store.command(f"DROP DATABASE IF EXISTS {store.database}")


def _operations() -> list[tuple[str, str]]:
    from tests.collector.helpers import make_settings

    app = create_app(make_settings("chdb:///nonexistent", Path("/nonexistent"), role="all"))  # routes only
    return sorted((m.upper(), p) for p, item in app.openapi()["paths"].items() for m in item)


# examples per operation: the ingest route gets more (its bodies are the untrusted input);
# LIVESTEP_FUZZ_SCALE=N multiplies them for a longer hunt (docs/PERFORMANCE.md records one)
EXAMPLES = {("POST", "/v1/telemetry"): 60}
SCALE = int(os.environ.get("LIVESTEP_FUZZ_SCALE", "1"))
OPERATIONS = _operations()


def test_every_operation_is_fuzzed():
    assert len(OPERATIONS) >= 40 and ("POST", "/v1/reports/{week}") in OPERATIONS


@pytest.mark.parametrize("method,path", OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_no_input_gives_a_server_error_or_an_answer_off_the_schema(fuzz_app, method, path):
    _, url = fuzz_app
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    op = schema[path][method]

    @given(case=op.as_strategy())
    @settings(max_examples=EXAMPLES.get((method, path), 8) * SCALE, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def check(case):
        response = case.call()
        case.validate_response(response, checks=[not_a_server_error, status_code_conformance, response_schema_conformance])

    check()
