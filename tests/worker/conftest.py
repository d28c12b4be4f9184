"""Worker tests run tiny models: one torch thread per process (two threads contend per small op).

``cpu_graphs``: the CUDA-graph bookkeeping on CPU (worker/graphs.py), torch.cuda's graph and stream
API replaced by stand-ins whose capture runs the body eagerly (so the forward's host-side effects,
such as the probe's total and the calibration counters, happen as in a capture) and whose replay does
nothing. The GPU tests (test_gpu.py) replay real graphs.
"""

import contextlib

import pytest
import torch

torch.set_num_threads(1)


class _RecordingGraph:
    made = 0
    replays = 0

    def __init__(self):
        type(self).made += 1

    def replay(self):
        type(self).replays += 1

    def capture_begin(self, pool=None, capture_error_mode="global"):  # worker/graphs.py _ThreadLocalCapture
        pass

    def capture_end(self):
        pass


@pytest.fixture
def cpu_graphs(monkeypatch):
    import worker.graphs

    class Stream:
        made = 0  # one per warm-up (ChunkRunner warms up on a new side stream)

        def __init__(self, counted=True):
            type(self).made += counted

        def wait_stream(self, other):
            pass

    _RecordingGraph.made = _RecordingGraph.replays = 0
    _RecordingGraph.warmups = Stream
    monkeypatch.setattr(worker.graphs, "GRAPHS_ON_CPU", True)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _RecordingGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g, pool=None, **kw: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream(counted=False))
    return _RecordingGraph


def spy_on_decoder(monkeypatch, keep=lambda latents: latents.float().cpu()) -> list:
    """What ``keep`` makes of every chunk's latents as the decoder receives them from now on (default: a host
    copy; the test may sync)."""
    from worker.decoder import Decoder

    seen: list = []
    submit = Decoder.submit

    def spy(self, latents, step, after=None):
        seen.append(keep(latents))
        return submit(self, latents, step, after=after)

    monkeypatch.setattr(Decoder, "submit", spy)
    return seen
