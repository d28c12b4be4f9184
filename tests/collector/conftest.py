"""Fixtures of the collector tests: a collector app (real spool, writer and chDB) behind TestClient."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tests.collector.helpers import chdb_dsn, make_settings

TOKEN = "test-ingest-token"


@pytest.fixture
def collector(tmp_path, chdb_dir):
    """``collector(**settings) -> TestClient`` of a fresh app (own database, own spool) with a token."""
    clients = []

    def make(**over) -> TestClient:
        over.setdefault("ingest_tokens", [TOKEN])
        settings = make_settings(chdb_dsn(chdb_dir), tmp_path / f"app{len(clients)}", **over)
        from api.app import create_app

        c = TestClient(create_app(settings), headers={"Authorization": f"Bearer {TOKEN}"})
        c.__enter__()
        clients.append(c)
        return c

    yield make
    for c in clients:
        c.__exit__(None, None, None)
        store = c.app.state.store
        if store is not None:
            store.command(f"DROP DATABASE IF EXISTS {store.database}")
