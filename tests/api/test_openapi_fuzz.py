"""Schemathesis over the OpenAPI spec of the collector, session and health routes: no input gives a 5xx.

Generated from /openapi.json (JSON bodies from the TelemetryBatch schema, Arrow bodies from random
bytes and mangled valid streams, query/path parameters), a bounded number of examples per operation
so it stays fast. The app is the real one (spool, writer, chDB) on a fresh database with a few sessions.
"""

from __future__ import annotations

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api.app import create_app
from collector import records
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
    app = create_app(make_settings(dsn, tmp_path_factory.mktemp("fuzz"), role="all"))
    with TestClient(app):  # runs the lifespan: store, spool, writer
        yield app
        # every batch the fuzzer got accepted was also insertable: nothing stuck in the spool
        wait_for(lambda: drained(app), what="spool drained")
        assert app.state.writer.last_error is None and app.state.writer.failures == 0
    store.command(f"DROP DATABASE IF EXISTS {store.database}")


OPERATIONS = [("POST", "/v1/telemetry"), ("GET", "/v1/sessions"), ("GET", "/v1/sessions/{session_id}/steps"),
              ("GET", "/v1/health")]


@pytest.mark.parametrize("method,path", OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_no_input_gives_a_server_error(fuzz_app, method, path):
    schema = schemathesis.openapi.from_asgi("/openapi.json", fuzz_app)
    op = schema[path][method]

    @given(case=op.as_strategy())
    @settings(max_examples=25, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def check(case):
        response = case.call()
        assert response.status_code < 500, (case.method, case.path, response.status_code, response.text[:500])

    check()
