"""The flip mode a worker runs unless told: background only where it is proven (docs/PERFORMANCE.md, issue 26)."""

from worker.cli import default_flip


def test_cuda_workers_flip_inline_until_the_background_build_runs_on_the_gpu():
    assert default_flip("cuda") == "inline"
    assert default_flip("cuda:0") == "inline"


def test_cpu_workers_flip_in_the_background():
    assert default_flip("cpu") == "background"
