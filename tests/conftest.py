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
import torch

# Triton runs through its interpreter on a machine without CUDA, and it must be set before anything
# imports triton: any test module may import the worker (worker.session -> kernels -> triton) while
# pytest collects, before tests/kernels/conftest.py is reached; a triton imported without it makes
# every interpreted kernel fail with "Cannot call @triton.jit'd outside of the scope of a kernel".
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_CHDB_ROOT = os.path.join(tempfile.gettempdir(), "livestep-test-chdb")


def _sweep_dead(root: str) -> None:
    """Remove the directories of test processes that are gone. A directory holds a few hundred MB once
    the suite has run; the exit hook below can lose a race with chDB's background merges (or never run
    when a worker is killed), and a thousand leftovers once filled the disk and failed CI's install."""
    for name in os.listdir(root):
        pid = name.split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        except PermissionError:  # alive, another user's
            pass


os.makedirs(_CHDB_ROOT, exist_ok=True)
_sweep_dead(_CHDB_ROOT)
_CHDB_DIR = tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=_CHDB_ROOT)
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


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item, settings):
    """pytest-timeout's limit (``timeout`` in pyproject.toml, or a test's marker) is a budget for an
    idle machine: scaled here by how loaded this one is when the test starts (tests/machine.py), so
    a busy machine slows the suite instead of failing it, while a hang is still caught. Under load
    average 10-37 on 2 cores, CPU-bound fixtures (tests/worker/test_evaluate.py) ran past 300 s."""
    from pytest_timeout import pytest_timeout_set_timer as set_timer

    from tests.machine import slowdown

    factor = slowdown()
    return set_timer(item, settings._replace(timeout=settings.timeout * factor)) if factor > 1.0 else None


@pytest.fixture(scope="module")
def torch_chains_only():
    """For a module of CPU evaluations: they run the block's torch chains, with TRITON_INTERPRET unset
    for the module (the Triton chains under the interpreter are tests/kernels' subject, and a worker's
    interpreter another test left patched is not the evaluations' concern)."""
    old = os.environ.pop("TRITON_INTERPRET", None)
    yield
    if old is not None:
        os.environ["TRITON_INTERPRET"] = old


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
