"""Fixtures of the end-to-end tests."""

from __future__ import annotations

import pytest

from tests.api.live import serve_app
from tests.collector.helpers import INGEST_TOKEN, chdb_dsn, make_settings


@pytest.fixture
def app_server(tmp_path, chdb_dir):
    """The whole app (role all: collector, api, scheduler; ingest token ``INGEST_TOKEN``) on a real uvicorn
    in this process, on a fresh database: (app, base URL)."""
    with serve_app(make_settings(chdb_dsn(chdb_dir), tmp_path, role="all", ingest_tokens=[INGEST_TOKEN],
                                 port=0)) as served:
        yield served
