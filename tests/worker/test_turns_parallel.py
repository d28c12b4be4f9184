"""A turn under tensor parallel: rank 0 takes it and every rank applies it at the same step boundary,
with the same conditioning (given or drawn from the session's seed): the group's chunks are the
single-process model's, turn for turn (2 gloo ranks, torch.multiprocessing spawn)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.worker.test_turns import _Outputs
from worker import parallel
from worker.config import ModelShape
from worker.session import Worker
from worker.telemetry import ListSink
from worker.turns import TurnInbox, TurnRequest

SHAPE = ModelShape.from_name("tiny", d_model=96, n_heads=6, ffn=384, reset_every=5)
STEPS = 8
SESSION = "tp-turns"


class _AtSteps(TurnInbox):
    """Turns handed over at given step boundaries (the k-th take is step k's): step 2 a given 7-token
    conditioning, step 5 an 11-token one left to the session's generator."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        cond = torch.randn(7, SHAPE.d_model, generator=torch.Generator().manual_seed(11))
        self.at = {2: TurnRequest(7, True, cond), 5: TurnRequest(11, False)}

    def take(self, now):
        req = self.at.get(self.calls)
        self.calls += 1
        if req is None:
            return []
        req.arrived = now
        return [req]

    def due(self, now):
        return False


def _session(worker, turns, sink):
    return worker.run_session(steps=STEPS, realtime=False, cond_tokens=5, session_id=SESSION, turns=turns,
                              sink=sink, switches=["turn_cover=on"])


def _rank_main(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        place = parallel.placement(world, rank, decoder_own_gpu=False)
        control = dist.new_group(backend="gloo")
        w = parallel.TPWorker(SHAPE, place, parallel.tp_group(place), device="cpu", control=control)
        spy = _Outputs(w.model)
        sink = ListSink()
        s = _session(w, _AtSteps() if rank == 0 else None, sink)  # the other ranks have no inbox
        torch.save({"latents": spy.latents, "cond": spy.cond, "turns": s.turns,
                    "rows": [(r["turn"], r["step"], r["cond_tokens"], r["policy"]) for r in sink.rows["turn"]]},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
    os._exit(0)  # gloo's exit path aborts now and then (tests/worker/test_parallel.py)


def test_a_turn_applies_at_the_same_step_on_every_rank_with_the_same_conditioning(tmp_path):
    world = 2
    mp.spawn(_rank_main, args=(world, str(tmp_path / "pg"), str(tmp_path)), nprocs=world, join=True)
    w = Worker(SHAPE)
    spy = _Outputs(w.model)
    sink = ListSink()
    assert _session(w, _AtSteps(), sink).turns == 2
    expect = [5, 5, 7, 7, 7, 11, 11, 11]
    assert spy.cond == expect
    for rank in range(world):
        res = torch.load(tmp_path / f"rank{rank}.pt")
        assert res["turns"] == 2 and res["cond"] == expect  # both turns, at steps 2 and 5, on this rank
        for got, want in zip(res["latents"], spy.latents, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    rank0 = torch.load(tmp_path / "rank0.pt")
    assert rank0["rows"] == [(0, 2, 7, "cover"), (1, 5, 11, "cover")]
    assert torch.load(tmp_path / "rank1.pt")["rows"] == []  # rank 0 alone ships the turn records
