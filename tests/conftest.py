"""Shared fixtures: one chDB directory per pytest process, a fresh database per test.

chDB allows one data directory per OS process (DESIGN.md), so every test in a process uses the
same directory and isolation comes from a new database per test (``store`` fixture). Tests that
start a separate ``livestep serve`` process give it its own directory (``tmp_path``).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import uuid

import pytest

_CHDB_DIR = tempfile.mkdtemp(prefix=f"livestep-chdb-{os.getpid()}-")
# a few hundred MB per process once the suite has run: left behind, a thousand runs filled the disk
atexit.register(shutil.rmtree, _CHDB_DIR, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on the H200: see docs/PERFORMANCE.md)")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def chdb_dir() -> str:
    return _CHDB_DIR


def new_dsn() -> str:
    """A DSN for a fresh database in this process's chDB directory."""
    return f"chdb://{_CHDB_DIR}?database=t_{uuid.uuid4().hex[:12]}"


@pytest.fixture
def store():
    """A migrated store on a fresh database; dropped afterwards."""
    from collector.store import open_store

    s = open_store(new_dsn())
    s.migrate()
    yield s
    s.command(f"DROP DATABASE IF EXISTS {s.database}")
