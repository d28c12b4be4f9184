"""Tensor parallel for the DiT, gpt-fast ``tp.py`` style: small, and world size 1 is a no-op.

    rank = maybe_init_dist()                     # None below 2 ranks (torchrun: RANK, WORLD_SIZE, LOCAL_RANK)
    place = placement(world, rank, decoder_own_gpu=True)   # TP ranks 0..N-1 denoise, GPU N decodes
    group = tp_group(place)                      # the denoising group (None when tp == 1)
    model = DiT(shard_shape(shape, place), device)          # this rank's heads / FFN chunks
    tp = TensorParallel(group, steady_tokens=shape.new_tokens); tp.apply_switches(sw); tp.install(model)
    worker = TPWorker(shape, place, group)       # the session loop (worker/session.py) on a TP group

After every row-parallel linear (attention out, cross out, FFN down) the block's partial output is
summed over the group: with ``fused_allreduce`` off by ``torch.distributed.all_reduce`` (NCCL on GPU,
gloo on CPU); on, by the fused FP8 GEMM + peer-to-peer all-reduce (`kernels.gemm_allreduce`) for the
steady-state shape only, NCCL for first forwards (their token count varies per session). The
registry of fused buffers is `tp.registry`; ``tp.buffers_registered`` feeds the step records.
The decoder's own-GPU placement generalised: N denoising ranks hold GPUs 0..N-1 and the decoder runs
on GPU N (the last visible one), driven by rank 0, which alone decodes and ships telemetry; rank 0
also polls the switch control plane and hands each change to the other ranks at the same step
boundary (a host-side gloo broadcast: no GPU sync), and takes the conversational turns (worker/turns.py)
and hands each, with its conditioning, to the other ranks at the step boundary it applies at (another
gloo broadcast, once rank 0 has waited for room: every rank recomputes the cross K/V before the same
step; the other ranks follow rank 0's pacing through it). ``livestep worker run --tp N`` launches the N
ranks through torchrun (`launch_command`; under torchrun, `run_cli` is the per-rank entry point).
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from kernels.gemm_allreduce import _operands, fp8_gemm, fused_gemm_allreduce
from worker.buffers import BufferRegistry, registry_for
from worker.config import SWITCH_NAMES, ModelShape, Switches, tp_rank_of
from worker.decoder import DecodeJob
from worker.fp8 import FP8_MAX
from worker.run_args import client_kwargs, turns_of, warm_up
from worker.session import Session, Worker
from worker.turns import POLICIES, TurnInbox, TurnRequest


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
    """Which rank does what: ``tp`` denoising ranks 0..tp-1; rank 0 also drives the decoder, on GPU
    ``decoder_gpu`` (= tp, its own) when one is free, else on its own stream (``None``)."""

    world: int
    rank: int
    tp: int
    decoder_gpu: int | None

    @property
    def tp_rank(self) -> int:
        return self.rank

    @property
    def decodes(self) -> bool:
        """Rank 0 hands each chunk to the decoder (and ships the session's telemetry)."""
        return self.rank == 0


def placement(world: int, rank: int, decoder_own_gpu: bool, gpus: int | None = None) -> Placement:
    """TP ranks 0..N-1 denoise on GPUs 0..N-1; with ``decoder_own_gpu`` the decoder gets GPU N when the
    machine has more GPUs than ranks (worker.decoder puts it on the last visible GPU), else a stream."""
    if world < 1 or not 0 <= rank < world:
        raise ParallelError(f"rank {rank} of world {world}: need world >= 1 and 0 <= rank < world")
    gpus = torch.cuda.device_count() if gpus is None else gpus
    decoder_gpu = gpus - 1 if decoder_own_gpu and gpus > world else None
    return Placement(world, rank, world, decoder_gpu)


def gpus_needed(tp: int, decoder_own_gpu: bool) -> int:
    """GPUs for ``--tp N``: N denoising ranks, plus one for the decoder with ``decoder_own_gpu``."""
    if tp < 1:
        raise ParallelError(f"--tp must be >= 1, got {tp}")
    return tp + (1 if decoder_own_gpu else 0)


def tp_group(place: Placement):
    """The denoising ranks' group (the default one: NCCL on GPU, gloo on CPU); None when tp == 1."""
    return dist.group.WORLD if place.tp > 1 else None


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
            ws = self.registry.fused_workspace(x.shape[0], lin.w.shape[0], x.device, self.world)
            if ws is not None and lin.scale is not None:
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


class _BoundRowParallel:
    """``block.row_parallel`` replacement: calls ``tp.row_parallel(block, x, lin)``."""

    __slots__ = ("block", "tp")

    def __init__(self, tp: TensorParallel, block):
        self.tp, self.block = tp, block

    def __call__(self, x: torch.Tensor, lin) -> torch.Tensor:
        return self.tp.row_parallel(self.block, x, lin)


def gemm_allreduce(
    a_fp8: torch.Tensor, b_fp8: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor, group=None,
    *, registry: BufferRegistry | None = None, fast_accum: bool = False,
) -> torch.Tensor:  # fmt: skip
    """bf16 [M, N] = sum over `group` of ``(a @ b) * a_scale * b_scale`` for pre-quantized operands
    (the benches and kernel tests; the model's linears go through ``TensorParallel.row_parallel``).

    a_fp8: [M, K] e4m3; b_fp8: [K, N] (or an [N, K] weight, transposed when unambiguous; pass
    ``w.t()`` for a square weight); scales fp32, per tensor or a_scale [M] / b_scale [N].
    Steady-state shapes with peer memory take the fused path; other shapes GEMM + NCCL all_reduce.
    """
    world = dist.get_world_size(group) if group is not None else 1
    if world == 1:
        return fp8_gemm(a_fp8, b_fp8, a_scale, b_scale, fast_accum=fast_accum)
    reg = registry if registry is not None else registry_for(group)
    a, b, sa, sb, m, n, _ = _operands(a_fp8, b_fp8, a_scale, b_scale)
    ws = reg.fused_workspace(m, n, a.device, world)
    if ws is not None:
        return fused_gemm_allreduce(ws, a, b, sa, sb, fast_accum=fast_accum)
    out = fp8_gemm(a, b, sa, sb, fast_accum=fast_accum)
    dist.all_reduce(out, group=group)
    return out


# ----------------------------------------------------------------------------------------------------
# The session loop (worker/session.py) on a TP group


def switch_bits(sw: Switches) -> int:
    """Switches as a bitmask over SWITCH_NAMES (what rank 0 broadcasts at each step boundary)."""
    return sum(1 << i for i, name in enumerate(SWITCH_NAMES) if getattr(sw, name))


def switches_from_bits(bits: int) -> Switches:
    return Switches.from_mapping({name: bool(bits >> i & 1) for i, name in enumerate(SWITCH_NAMES)})


class _NoDecoder:
    """Ranks other than 0 hand nothing to the decoder: rank 0 does, once per chunk."""

    placement = "rank0"

    def __init__(self, device):
        self.device = device

    def submit(self, latents: torch.Tensor, step: int, after=None) -> DecodeJob:
        return DecodeJob(step)


class TPSession(Session):
    """A session on one TP rank: every rank runs the same steps from the same seed; rank 0 polls the
    switch source, decodes and ships telemetry (its saturation probe counts its own shard's GEMM inputs;
    the other ranks replay their graphs meanwhile); switch changes reach all ranks at the same step."""

    @property
    def decoder(self):
        return self.__dict__.get("_decoder")

    @decoder.setter
    def decoder(self, dec) -> None:  # Session.run / _apply assign it; ranks > 0 never decode
        self.__dict__["_decoder"] = dec if dec is None or self.w.place.decodes else _NoDecoder(dec.device)

    def _poll_switches(self, step: int) -> None:
        w = self.w
        if w.place.decodes:
            super()._poll_switches(step)
        if w.control is None:
            return
        state = torch.tensor([switch_bits(self.switches)], dtype=torch.int64)
        dist.broadcast(state, 0, group=w.control)  # host-side (gloo): no GPU sync
        if not w.place.decodes:
            new = switches_from_bits(int(state[0]))
            if new != self.switches:
                self._apply(new, step)

    def _apply(self, new: Switches, step: int) -> None:
        super()._apply(new, step)
        self.w.tp.apply_switches(self.switches)

    def _take_turn(self):
        """Rank 0's turn (if any) at this step boundary, on every rank: a header [turn?, tokens, speaking,
        superseded, policy, conditioning given?] and the conditioning itself when given, host tensors
        broadcast on the gloo control group (no GPU sync). A conditioning left to the session's seeded
        generator is drawn alike on every rank (the same seed, the same turns in the same order)."""
        w = self.w
        if w.control is None:
            return super()._take_turn()
        req, superseded = super()._take_turn() if w.place.decodes else (None, 0)
        head = torch.zeros(6, dtype=torch.int64)
        if req is not None:
            has_cond = req.cond is not None
            policy = POLICIES.index(req.policy) + 1 if req.policy else 0
            head[:] = torch.tensor([1, req.tokens, req.speaking, superseded, policy, has_cond])
        dist.broadcast(head, 0, group=w.control)
        if not head[0]:
            return None, 0
        _, tokens, speaking, superseded, policy, has_cond = (int(x) for x in head)
        cond = None
        if has_cond:
            cond = req.cond.float() if w.place.decodes else torch.empty(tokens, self.w.shape.d_model)
            dist.broadcast(cond, 0, group=w.control)
        if w.place.decodes:
            return req, superseded
        return TurnRequest(tokens, bool(speaking), cond, time.perf_counter(),
                           POLICIES[policy - 1] if policy else None), superseded

    def run(self):
        self.w.tp.apply_switches(self.switches)
        return super().run()


class TPWorker(Worker):
    """`worker.session.Worker` holding this rank's shard, its row-parallel outputs summed over `group`."""

    def __init__(self, shape, place: Placement, group, device=None, control=None, **kw):
        base = ModelShape.from_name(shape) if isinstance(shape, str) else shape
        super().__init__(base, device=device, tp=place.tp, rank=place.tp_rank, **kw)
        self.place, self.control = place, control
        self.tp = TensorParallel(group, steady_tokens=self.shape.new_tokens)
        self.tp.install(self.model)

    @property
    def registry(self) -> BufferRegistry:
        """The group's registry (``tp.registry``: bench/multigpu.py may swap it between phases)."""
        return self.tp.registry

    def register_forward(self, tokens: int, sw: Switches) -> None:
        """Nothing here: ``TensorParallel.row_parallel`` looks the real buffers up per call."""

    def run_session(self, **kw):
        if self.control is not None:  # one session id (hence seed, prompt length) for every rank, and
            # whether it takes turns (rank 0's inbox; the others get theirs through _take_turn)
            box = [kw.get("session_id") or uuid.uuid4().hex[:16], kw.get("turns") is not None]
            dist.broadcast_object_list(box, 0, group=self.control)
            kw["session_id"] = box[0]
            if not self.place.decodes:
                kw["turns"] = TurnInbox() if box[1] else None
                if box[1]:  # rank 0's player paces the group: the others follow it at each turn broadcast
                    kw["realtime"] = False
        if not self.place.decodes:
            kw.update(collector_url=None, client_kwargs=None, switch_source=None, telemetry=False)
        # every rank ends on the same switches (broadcast): all re-warm alike (Worker.settle, in the session's end)
        return self.observed(TPSession(self, **kw))


# ----------------------------------------------------------------------------------------------------
# Launch


def launched_by_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def wants_group(tp: int) -> bool:
    """``--tp N`` starts a real group under torchrun or with >= N GPUs; otherwise (CPU, one GPU) the
    worker runs one rank's shard alone (the single-GPU emulation of a rank)."""
    return tp > 1 and (launched_by_torchrun() or (torch.cuda.is_available() and torch.cuda.device_count() >= tp))


def launch_command(tp: int, argv: list[str]) -> list[str]:
    """The torchrun command line that runs ``livestep <argv>`` on ``tp`` ranks of this host."""
    if tp < 1:
        raise ParallelError(f"--tp must be >= 1, got {tp}")
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}",
            "-m", "api.cli", *argv]  # fmt: skip


def init_group(decoder_own_gpu: bool) -> tuple[Placement, object, object, torch.device]:
    """Under torchrun (or alone): (placement, TP group, control group, this rank's device)."""
    rank = maybe_init_dist()
    world = dist.get_world_size() if rank is not None else 1
    place = placement(world, rank or 0, decoder_own_gpu)
    control = dist.new_group(backend="gloo") if world > 1 else None
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return place, tp_group(place), control, device


def run_cli(args) -> int:
    """``livestep worker run --tp N``: re-executes itself under torchrun, then runs each rank."""
    if not launched_by_torchrun():
        cmd = launch_command(args.tp, sys.argv[1:])
        os.execv(cmd[0], cmd)
    from worker.config import parse_switch_args

    sw = parse_switch_args(args.switch)
    place, group, control, device = init_group(sw.decoder_own_gpu)
    if place.tp != args.tp:
        raise ParallelError(f"--tp {args.tp} but torchrun started {place.tp} ranks; start --nproc-per-node={args.tp}")
    w = TPWorker(args.preset, place, group, device=device, control=control, worker_id=args.worker_id,
                 release=args.release)  # fmt: skip
    if getattr(args, "metrics_port", None) is not None and place.decodes:  # the rank whose telemetry ships
        from worker.metrics import WorkerMetrics, serve

        server = serve(WorkerMetrics(w).registry, args.metrics_host, args.metrics_port, args.metrics_token)
        print(f"metrics: http://{args.metrics_host}:{server.server_port}/metrics (tp rank {place.tp_rank})", flush=True)
    try:
        warm_up(w, sw, args, say=place.decodes)  # every rank alike: its sessions run the same forwards
        for _ in range(args.sessions):
            s = w.run_session(seconds=args.seconds, steps=args.steps, collector_url=args.collector,
                              token=args.token, switches=sw, switch_source=args.switch_source,
                              cond_tokens=args.cond_tokens, realtime=not args.no_realtime,
                              client_kwargs=client_kwargs(args), preroll=args.preroll,
                              turns=turns_of(args, w) if place.decodes else None,
                              playout_policy=args.playout_policy)  # fmt: skip
            if place.decodes:
                print(f"session {s.session_id} tp={place.tp}: {s.steps} steps, {s.frames} frames, "
                      f"avg_fps {s.avg_fps}, late {s.late_chunks}, diffusion {s.mean_diffusion_ms} ms/step, "
                      f"buffers_registered {s.buffers_registered}, fused calls {w.tp.calls['fused']}, "
                      f"nccl calls {w.tp.calls['nccl']}", flush=True)
            sw = switches_from_bits(switch_bits(Switches.decode(s.switches)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
