"""Tensor parallel for the DiT, gpt-fast ``tp.py`` style: small, and world size 1 is a no-op.

    rank = maybe_init_dist()                     # None below 2 ranks (torchrun: RANK, WORLD_SIZE, LOCAL_RANK)
    place = placement(world, rank, decoder_own_gpu=True)   # TP ranks 0..N-1 denoise, rank N decodes
    group = tp_group(place)                      # collective: every rank calls it
    model = DiT(shard_shape(shape, place), device)          # this rank's heads / FFN chunks
    tp = TensorParallel(group, steady_tokens=shape.new_tokens); tp.apply_switches(sw); tp.install(model)

After every row-parallel linear (attention out, cross out, FFN down) the block's partial output is
summed over the group: with ``fused_allreduce`` off by ``torch.distributed.all_reduce`` (NCCL on GPU,
gloo on CPU); on, by the fused FP8 GEMM + peer-to-peer all-reduce (`kernels.gemm_allreduce`) for the
steady-state shape only, NCCL for first forwards (their token count varies per session). The
registry of fused buffers is `tp.registry`; ``tp.buffers_registered`` feeds the step records.
``livestep worker run --tp N`` launches N denoising ranks (+1 decoder rank with ``decoder_own_gpu``)
through torchrun (`launch_command`); `run_decoder_rank` is the decoder rank's loop.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from kernels.gemm_allreduce import BufferRegistry, fused_gemm_allreduce
from worker.config import ModelShape, Switches, tp_rank_of

FP8_MAX = 448.0


class ParallelError(ValueError):
    """An impossible rank layout; the message lists the valid ones."""


# ----------------------------------------------------------------------------------------------------
# Process group and placement


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def keep_multicast_off() -> None:
    """NVLink multicast (NVLS) stays off on our machines: for NCCL and for symmetric memory."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"


def maybe_init_dist(backend: str | None = None) -> int | None:
    """Join the torchrun group (RANK, WORLD_SIZE, LOCAL_RANK); None below 2 ranks (single process)."""
    world = _env_int("WORLD_SIZE", 1)
    if world < 2:
        return None
    rank = _env_int("RANK", 0)
    keep_multicast_off()
    cuda = torch.cuda.is_available() and backend != "gloo"
    if cuda:
        torch.cuda.set_device(_env_int("LOCAL_RANK", rank) % torch.cuda.device_count())
    if not dist.is_initialized():
        dist.init_process_group(backend or ("nccl" if cuda else "gloo"), rank=rank, world_size=world)
    return rank


@dataclass(frozen=True)
class Placement:
    """Which rank does what: ``tp`` denoising ranks 0..tp-1, and the decoder on rank tp (if any)."""

    world: int
    rank: int
    tp: int
    decoder_rank: int | None

    @property
    def role(self) -> str:
        return "decode" if self.rank == self.decoder_rank else "denoise"

    @property
    def tp_rank(self) -> int:
        return self.rank if self.role == "denoise" else 0

    @property
    def decodes_inline(self) -> bool:
        """No decoder rank: the denoising rank 0 decodes (own stream / own device per worker.decoder)."""
        return self.decoder_rank is None


def placement(world: int, rank: int, decoder_own_gpu: bool) -> Placement:
    """TP ranks 0..N-1 denoise, rank N decodes, when ``decoder_own_gpu`` and there are >= 2 ranks."""
    if world < 1 or not 0 <= rank < world:
        raise ParallelError(f"rank {rank} of world {world}: need world >= 1 and 0 <= rank < world")
    if decoder_own_gpu and world >= 2:
        return Placement(world, rank, world - 1, world - 1)
    return Placement(world, rank, world, None)


def launch_world(tp: int, decoder_own_gpu: bool) -> int:
    """Processes to start for ``--tp N``: N denoising ranks, plus one decoder rank with its own GPU."""
    if tp < 1:
        raise ParallelError(f"--tp must be >= 1, got {tp}")
    return tp + (1 if decoder_own_gpu and tp >= 1 else 0)


def tp_group(place: Placement):
    """The denoising ranks' group (NCCL on GPU, gloo on CPU); None when tp == 1. Collective."""
    if place.world < 2:
        return None
    group = dist.new_group(list(range(place.tp)))  # every rank must call new_group
    return group if place.tp > 1 and place.role == "denoise" else None


def shard_shape(shape: ModelShape, place: Placement) -> ModelShape:
    """The model shape one denoising rank holds (heads and FFN split ``tp`` ways)."""
    return tp_rank_of(shape, place.tp, place.tp_rank)


# ----------------------------------------------------------------------------------------------------
# Sharding weights (what each rank's model holds; worker.model builds its shard directly from seeds)


def shard_rows(w: torch.Tensor, tp: int, rank: int, groups: int = 1) -> torch.Tensor:
    """Column-parallel weight [out, in]: this rank's output rows. ``groups`` splits out first (QKV: 3,
    each split by heads), so the rank keeps its heads of every group."""
    parts = w.chunk(groups, dim=0)
    return torch.cat([p.chunk(tp, dim=0)[rank] for p in parts], dim=0)


def shard_cols(w: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """Row-parallel weight [out, in]: this rank's input columns (its outputs are summed over ranks)."""
    return w.chunk(tp, dim=1)[rank]


COLUMN_PARALLEL = {"qkv": 3, "cq": 1, "ckv": 2, "up": 1}  # name -> groups of output rows
ROW_PARALLEL = ("o", "co", "down")


def shard_block_weights(full_block, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """A full (tp=1) block's dequantized weights sliced for ``rank``: what the rank's block must hold."""
    out = {}
    for name, groups in COLUMN_PARALLEL.items():
        out[name] = shard_rows(_dense(getattr(full_block, name)), tp, rank, groups)
    for name in ROW_PARALLEL:
        out[name] = shard_cols(_dense(getattr(full_block, name)), tp, rank)
    return out


def _dense(lin) -> torch.Tensor:
    return lin.w.float() * lin.scale if lin.scale is not None else lin.w


# ----------------------------------------------------------------------------------------------------
# The all-reduce after each row-parallel output


def _quantize_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor dynamic FP8 of an activation [M, K] (scale stays on the device: no sync)."""
    scale = (x.abs().amax().float().clamp(min=1e-12) / FP8_MAX).reshape(())
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


@dataclass
class TensorParallel:
    """The group's all-reduce for the blocks, behind the ``fused_allreduce`` switch."""

    group: object = None
    steady_tokens: int | None = None
    registry: BufferRegistry | None = None
    fused: bool = False
    calls: dict = field(default_factory=lambda: {"fused": 0, "nccl": 0})  # host counters, no sync

    def __post_init__(self) -> None:
        self.world = dist.get_world_size(self.group) if self.group is not None else 1
        if self.registry is None:
            self.registry = BufferRegistry(group=self.group, steady_m=self.steady_tokens)

    @property
    def buffers_registered(self) -> int:
        return len(self.registry)

    def apply_switches(self, sw: Switches) -> None:
        """Between steps only: ``fused_allreduce`` picks the path, ``buffer_per_shape`` the leak."""
        self.fused = sw.fused_allreduce
        self.registry.buffer_per_shape = sw.buffer_per_shape

    def allreduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group in place (identity at world size 1)."""
        if self.world > 1:
            dist.all_reduce(x, group=self.group)
            self.calls["nccl"] += 1
        return x

    def row_parallel(self, block, x: torch.Tensor, lin) -> torch.Tensor:
        """``Block.row_parallel`` for this group: partial product of the rank's columns, summed."""
        if self.world == 1:
            return lin(x)
        if self.fused:
            # steady shape -> a registered symmetric workspace; first forwards (other M) -> None
            ws = self.registry.lookup(x.shape[0], lin.w.shape[0], torch.bfloat16, x.device)
            if ws is not None and x.is_cuda and lin.scale is not None and ws.world == self.world:
                with block.timer.span("allreduce"):
                    xq, xs = _quantize_act(x)
                    self.calls["fused"] += 1
                    return fused_gemm_allreduce(ws, xq, lin.w.t(), xs, lin.scale)
        y = lin(x)
        with block.timer.span("allreduce"):
            return self.allreduce(y)

    def install(self, model) -> None:
        """Route every block's row-parallel outputs through this group (no edit of worker/model.py)."""
        model.set_allreduce(self.allreduce)
        for blk in model.blocks:
            blk.row_parallel = _BoundRowParallel(self, blk)

    def warmup(self, shape: ModelShape, device) -> None:
        """Tune the fused GEMM's tiles for the steady shapes (CUDA, before the step loop: it syncs)."""
        if torch.device(device).type != "cuda" or not self.fused:
            return
        from kernels.gemm_allreduce import tune

        m, d = shape.new_tokens, shape.d_model
        for k in (shape.heads * shape.head_dim, shape.ffn_local):
            tune(m, d, k)


class _BoundRowParallel:
    """``block.row_parallel`` replacement: calls ``tp.row_parallel(block, x, lin)``."""

    __slots__ = ("block", "tp")

    def __init__(self, tp: TensorParallel, block):
        self.tp, self.block = tp, block

    def __call__(self, x: torch.Tensor, lin) -> torch.Tensor:
        return self.tp.row_parallel(self.block, x, lin)


# ----------------------------------------------------------------------------------------------------
# The decoder rank: latents from TP rank 0, frames decoded on its own GPU


@dataclass
class DecoderLink:
    """TP rank 0 -> decoder rank: a control word [step] (-1 = stop) then the latents, per step."""

    place: Placement
    shape: ModelShape
    device: torch.device
    _pending: list = field(default_factory=list)

    def send(self, latents: torch.Tensor, step: int) -> None:
        """On TP rank 0: enqueue the chunk for the decoder rank (returns at once)."""
        if self.place.decoder_rank is None or self.place.rank != 0:
            return
        ctrl = torch.tensor([step], dtype=torch.int64, device=latents.device)
        lat = latents.contiguous()
        works = [dist.isend(ctrl, self.place.decoder_rank), dist.isend(lat, self.place.decoder_rank)]
        self._pending.append((ctrl, lat, works))
        while len(self._pending) > 2:  # keep the tensors alive until their sends completed
            for w in self._pending.pop(0)[2]:
                w.wait()

    def close(self) -> None:
        if self.place.decoder_rank is None or self.place.rank != 0:
            return
        for _, _, works in self._pending:
            for w in works:
                w.wait()
        self._pending.clear()
        stop = torch.tensor([-1], dtype=torch.int64, device=self.device)
        dist.send(stop, self.place.decoder_rank)


def run_decoder_rank(place: Placement, shape: ModelShape, device, dtype=None) -> list[dict]:
    """The decoder rank's loop: receive each chunk's latents from rank 0, decode it on this rank's
    device. Returns per step {step, decode_ms, done_s} (CUDA events read after the loop)."""
    from worker.decoder import Decoder

    device = torch.device(device)
    dec = Decoder(shape, device, own_gpu=False)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    ctrl = torch.empty(1, dtype=torch.int64, device=device)
    lat = torch.empty(shape.new_tokens, shape.latent_channels, dtype=dtype, device=device)
    jobs = []
    while True:
        dist.recv(ctrl, src=0)
        step = int(ctrl[0])  # the decoder rank's own loop: a host read per chunk is its pacing
        if step < 0:
            break
        dist.recv(lat, src=0)
        job = dec.submit(lat, step)
        if job.done_event is not None:
            job.done_event.synchronize()
            jobs.append({"step": step, "decode_ms": job.start_event.elapsed_time(job.done_event),
                         "done_s": time.perf_counter()})  # fmt: skip
        else:
            jobs.append({"step": step, "decode_ms": job.cpu_ms, "done_s": job.done_wall})
    return jobs


# ----------------------------------------------------------------------------------------------------
# Launch


def launch_command(tp: int, decoder_own_gpu: bool, argv: list[str]) -> list[str]:
    """The torchrun command line that starts ``livestep worker run`` with ``--tp N`` (+ decoder)."""
    nproc = launch_world(tp, decoder_own_gpu)
    return ["torchrun", "--standalone", f"--nproc-per-node={nproc}", "-m", "api.cli", *argv]


def launched_by_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ
