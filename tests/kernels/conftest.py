"""Kernel tests: on a machine without CUDA, run Triton through its interpreter (TRITON_INTERPRET=1).

The variable must be set before triton is imported: tests/conftest.py sets it, ahead of every test
module's import (this folder's own setting covers running it alone). GPU runs leave it unset. ``rng`` gives each test
a fresh seed (printed in failure messages) so no fixed seed hides a bug.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def rng(device) -> tuple[torch.Generator, int]:
    """A generator on ``device`` seeded freshly each run; the seed goes into assertion messages."""
    seed = random.SystemRandom().randrange(2**31)
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g, seed
