"""The causal video DiT of the paper's step, gpt-fast style: one chunk = 4 passes x blocks.

    model = DiT(shape, device)                       # seeded random weights (no public weights)
    cond_kv = model.first_forward(cond, cache)       # conditioning [L, d]: cross K/V + window prefill
    cond_kv = model.cross_kv(new_cond, cache)        # a turn: the cross K/V alone, for the next chunks
    latents = model.denoise_chunk(noise, cache, cond_kv)   # noise [new_tokens, C] -> latents

A block: timestep modulation (adaLN-single: a per-block table plus the shared timestep
embedding), self-attention with RoPE over the KV window + the chunk's new tokens, cross-attention
to the session's conditioning (its length varies per session), and an MLP. Every pass writes the
chunk's K/V into the step's slots (overwriting the previous pass's) and attends over the window.

Tensor parallel without editing this file: column-parallel weights (QKV, cross Q/KV, FFN up) and
row-parallel weights (attention out, cross out, FFN down) are sized by the rank's view of the shape
(``config.tp_rank_of``), and every row-parallel output goes through ``Block.row_parallel`` ->
``self.allreduce`` (identity at world size 1; ``DiT.set_allreduce(fn)`` installs a real one, and
``worker/parallel.py`` may override ``row_parallel`` per block for the fused GEMM + all-reduce).
Weights are generated per head (and per FFN chunk of ffn/n_heads) from a seed of (block, name,
index), so a rank's shard equals the slice of the single-process model's weights.

GEMMs are FP8 (``torch._scaled_mm``, per-tensor weight scales) when the shape says ``fp8_weights`` on
CUDA, bf16 otherwise on CUDA, fp32 on CPU. Activations are quantized on the fly, per tensor or per row
(``DiT.act_scales``: "row" needs no global amax, so a compiled chain quantizes in the same pass), or
with static per-tensor scales ("static", the DiT's default; a session sets it from the ``static_scales``
switch: each linear's input scale calibrated on a
session's first forward and chunk, then fixed; no reduction at all, and the GEMM takes the faster
per-tensor scaling; under tensor parallel the row-parallel inputs still quantize dynamically in
``worker/parallel.py``'s fused GEMM + all-reduce).

With FP8 GEMMs on CUDA and the compile switch, or the triton_kernels switch with static scales,
``DiT.set_compile`` also installs a ``BlockFusion`` (``fusion_kind`` says which): the elementwise chains
around the GEMMs as few kernels: residual + LayerNorm/modulation + the FP8 activation quantization (a
block's last residual added in the next block's first such kernel); GELU + quantization of the FFN-down
input (when the block's ``row_parallel`` is not overridden). With static scales and triton_kernels the
chains are Triton kernels (``BlockFusion.triton``: ``kernels/norm_fp8.py``, ``kernels/gelu_fp8.py``, one
pass each, compile switch or not); otherwise inductor compiles them (``BlockFusion.compiled``, at their
first call: a switch flipped mid-session compiles what this process never ran, on the next step). The
query's RoPE runs inside the FP8 attention kernel when it runs (``CacheOps.attention``), which with
static scales also stores its output (self- and cross-attention) as the FP8 input of the output
projection. Same math as the unfused path (``BlockFusion.eager(act_scales)`` is that path with the
chains grouped; the tests compare both on CPU). ``DiT.fuse_blocks = False`` keeps the unfused path
under compile (the bench measures both).
Over 450 lines: the DiT reads like the paper's step (gpt-fast style); the Linear and its FP8 matmul, the
block fusion, ``Block`` and ``DiT`` are one forward pass.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.cache import KVCache
from worker.compiled import compiled
from worker.config import ModelShape
from worker.fp8 import (
    SaturationProbe,
    StaticScale,
    col_scale,
    quantize_act,
    quantize_act_rows,
    quantize_act_static,
    quantize_weight,
    scaled_mm,
)
from worker.rope import apply_rope_tables


class _NullSpan:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class NullTimer:
    """The timer the model calls around cache upkeep / attention / all-reduce (telemetry swaps it)."""

    def span(self, kind: str) -> _NullSpan:
        return _NULL_SPAN


_NULL_SPAN = _NullSpan()


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


@dataclass
class Linear:
    """y = x @ w.T; w: [out, in] (FP8 with a per-tensor scale, or the compute dtype)."""

    w: torch.Tensor
    scale: torch.Tensor | None = None
    quant: Callable = quantize_act  # the activation quantizer (compiled under the compile switch)
    col_scale: torch.Tensor | None = None  # the scale as a [1, N] row, for per-row activation scales
    site: StaticScale | None = None  # the input's static scale (act_scales "static"; also self.quant)
    probe: SaturationProbe | None = None  # counts the quantized input's saturation (DiT.set_probe)

    def __post_init__(self):
        if self.scale is not None:
            self.col_scale = col_scale(self.scale, self.w.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale is None:
            return x @ self.w.t()
        return _mm(*self.quant(x), self)

    @property
    def in_scale(self) -> torch.Tensor | None:
        """The static input scale the fused chains quantize with (None: dynamic scales)."""
        return None if self.site is None else self.site.scale

    @property
    def nbytes(self) -> int:
        return self.w.numel() * self.w.element_size()


def _mm(xq: torch.Tensor, xs: torch.Tensor, lin: Linear) -> torch.Tensor:
    """FP8 GEMM on an activation already quantized (x_fp8 [M, K], scale [] or [M, 1]) -> bf16 [M, N]."""
    if lin.probe is not None:
        lin.probe.add(xq)
    return scaled_mm(xq, xs, lin.w, lin.scale, lin.col_scale)


def _chains(act_scales: str) -> tuple[Callable, Callable, Callable]:
    """The block's elementwise chains ending in the activation quantizer of ``act_scales``; each takes the
    consuming linear's static scale ``s`` last (``Linear.in_scale``: None unless act_scales is "static")."""
    if act_scales == "static":
        quant = quantize_act_static
    else:
        dynamic = ACT_QUANT[act_scales]

        def quant(h, s):
            return dynamic(h)

    def ln_quant(x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None, s: torch.Tensor | None):
        """LayerNorm (modulated when w/b are given) then FP8: (h_fp8, scale)."""
        return quant(F.layer_norm(x, (x.shape[-1],), w, b), s)

    def res_ln_quant(x: torch.Tensor, g: torch.Tensor | None, y: torch.Tensor, w: torch.Tensor | None,
                     b: torch.Tensor | None, s: torch.Tensor | None):
        """Residual (x + g*y, or x + y) then its LayerNorm and FP8: (x_new, h_fp8, scale)."""
        x = torch.addcmul(x, g, y) if g is not None else x + y
        hq, hs = quant(F.layer_norm(x, (x.shape[-1],), w, b), s)
        return x, hq, hs

    def gelu_quant(u: torch.Tensor, s: torch.Tensor | None):
        return quant(F.gelu(u, approximate="tanh"), s)

    return ln_quant, res_ln_quant, gelu_quant


ACT_QUANT = {"tensor": quantize_act, "row": quantize_act_rows}  # DiT.act_scales -> dynamic quantizer
# tests of compile-time behaviour on CPU set this (inductor compiles for CPU too): set_compile as on CUDA
COMPILE_ON_CPU = False
ACT_SCALES = (*ACT_QUANT, "static")  # "static": one StaticScale per linear's input (DiT.set_compile)


def fusion_kind(fusable: bool, compile: bool, triton: bool, act_scales: str) -> str | None:
    """Which chains ``DiT.set_compile`` installs: "triton" (``BlockFusion.triton``: static scales only),
    the act_scales name (``BlockFusion.compiled``), or None (the unfused blocks). ``fusable``: CUDA, FP8
    weights and ``fuse_blocks``; ``triton``: the triton_kernels switch and ``DiT.triton_chains``."""
    if not fusable:
        return None
    if triton and act_scales == "static":
        return "triton"
    return act_scales if compile else None


@dataclass
class BlockFusion:
    """The block's elementwise chains as functions: torch ops (``eager``), compiled, or Triton kernels."""

    ln_quant: Callable
    res_ln_quant: Callable
    rope: Callable
    gelu_quant: Callable
    act_scales: str | None = None  # the scaling its chains quantize with (None: not checked)

    @classmethod
    def eager(cls, act_scales: str) -> BlockFusion:
        ln, res, gelu = _chains(act_scales)
        return cls(ln, res, apply_rope_tables, gelu, act_scales)

    @classmethod
    def compiled(cls, act_scales: str) -> BlockFusion:
        ln, res, gelu = _chains(act_scales)
        return cls(*(torch.compile(f) for f in (ln, res, apply_rope_tables, gelu)), act_scales)  # once per model and kind (DiT._fusions)

    @classmethod
    def triton(cls) -> BlockFusion:
        """The static-scale chains as Triton kernels, one pass each (``kernels/norm_fp8.py``,
        ``kernels/gelu_fp8.py``): CUDA, or Triton's interpreter in the kernel tests."""
        from kernels.gelu_fp8 import gelu_fp8
        from kernels.norm_fp8 import res_ln_fp8

        def ln_quant(x, w, b, s):
            return res_ln_fp8(x, s, w=w, b=b)[1], s

        def res_ln_quant(x, g, y, w, b, s):
            x, hq = res_ln_fp8(x, s, y=y, g=g, w=w, b=b)
            return x, hq, s

        def gelu_quant(u, s):
            return gelu_fp8(u, s), s

        return cls(ln_quant, res_ln_quant, apply_rope_tables, gelu_quant, "static")


class WeightMaker:
    """Seeded weights built from per-index chunks: any rank's shard is the slice of the full weight."""

    def __init__(self, seed: int, device: torch.device, dtype: torch.dtype, fp8: bool):
        self.seed, self.device, self.dtype, self.fp8 = seed, device, dtype, fp8
        self.gen = torch.Generator(device=device)

    def chunk(self, shape: tuple[int, int], std: float, *key) -> torch.Tensor:
        self.gen.manual_seed(_seed(self.seed, *key))
        return torch.randn(shape, generator=self.gen, device=self.device, dtype=self.dtype) * std

    def linear(self, rows: list[torch.Tensor] | None = None, cols: list[torch.Tensor] | None = None) -> Linear:
        w = torch.cat(rows, 0) if rows is not None else torch.cat(cols, 1)
        if self.fp8:
            wq, s = quantize_weight(w)
            return Linear(wq.contiguous(), s)
        return Linear(w.contiguous())


class Block:
    """One DiT block of this rank: self-attention over the window, cross-attention, MLP."""

    def __init__(self, shape: ModelShape, idx: int, wm: WeightMaker):
        self.shape, self.idx = shape, idx
        d, hd, H, r = shape.d_model, shape.head_dim, shape.heads, shape.tp_rank
        heads = range(r * H, (r + 1) * H)  # this rank's heads (= its FFN chunks, ffn/n_heads each)
        fc = shape.ffn // shape.n_heads
        sd, sf = 1 / math.sqrt(d), 1 / math.sqrt(shape.ffn)
        # column-parallel: output rows per head / FFN chunk
        self.qkv = wm.linear(rows=[wm.chunk((hd, d), sd, idx, "qkv", j, h) for j in range(3) for h in heads])
        self.cq = wm.linear(rows=[wm.chunk((hd, d), sd, idx, "cq", h) for h in heads])
        self.ckv = wm.linear(rows=[wm.chunk((hd, d), sd, idx, "ckv", j, h) for j in range(2) for h in heads])
        self.up = wm.linear(rows=[wm.chunk((fc, d), sd, idx, "up", h) for h in heads])
        # row-parallel: input columns per head / FFN chunk; outputs summed over ranks
        self.o = wm.linear(cols=[wm.chunk((d, hd), sd, idx, "o", h) for h in heads])
        self.co = wm.linear(cols=[wm.chunk((d, hd), sd, idx, "co", h) for h in heads])
        self.down = wm.linear(cols=[wm.chunk((d, fc), sf, idx, "down", h) for h in heads])
        g = torch.Generator(device=wm.device).manual_seed(_seed(wm.seed, idx, "mod"))
        self.table = torch.randn((6, d), generator=g, device=wm.device, dtype=torch.float32) * 0.1
        self.table[2] += 0.5  # gates start open by half
        self.table[5] += 0.5
        self.table = self.table.to(wm.dtype)
        self.allreduce: Callable[[torch.Tensor], torch.Tensor] = _identity
        self.timer = NullTimer()
        self.mods: dict[float, tuple[torch.Tensor, ...]] = {}
        self.fusion: BlockFusion | None = None  # set by DiT.set_compile (FP8 weights only)

    def prepare(self, temb: dict[float, torch.Tensor]) -> None:
        """Modulation per timestep, once: (shift1, 1+scale1, gate1, shift2, 1+scale2, gate2), so a
        block's LayerNorm + modulation is one ``layer_norm`` call with weight and bias."""
        for t, e in temb.items():
            sh1, sc1, g1, sh2, sc2, g2 = (self.table + e).unbind(0)
            self.mods[t] = (sh1, 1 + sc1, g1, sh2, 1 + sc2, g2)

    @property
    def linears(self) -> tuple[Linear, ...]:
        return (self.qkv, self.cq, self.ckv, self.up, self.o, self.co, self.down)

    @property
    def nbytes(self) -> int:
        return sum(lin.nbytes for lin in self.linears) + self.table.numel() * self.table.element_size()

    def row_parallel(self, x: torch.Tensor, lin: Linear) -> torch.Tensor:
        """A row-parallel linear: the rank's partial product, then the all-reduce over the group."""
        return self._reduce(lin(x))

    @property
    def _own_row_parallel(self) -> bool:
        """``row_parallel`` overridden on this block (worker/parallel.py): it quantizes its input itself."""
        return "row_parallel" in self.__dict__

    def _out_scale(self, lin: Linear) -> torch.Tensor | None:
        """The static scale an attention output is stored with for ``lin`` (None: bf16 out)."""
        return None if self._own_row_parallel else lin.in_scale

    def _project(self, o: torch.Tensor, lin: Linear, out_scale: torch.Tensor | None) -> torch.Tensor:
        """An attention output through its row-parallel projection: o is FP8 [T, H*D] already when the
        attention stored it with the static ``out_scale``, else [H, T, D]."""
        if out_scale is not None:
            return self._reduce(_mm(o, out_scale, lin))
        return self.row_parallel(o.transpose(0, 1).reshape(o.shape[1], -1), lin)

    def _reduce(self, y: torch.Tensor) -> torch.Tensor:
        """A row-parallel partial product summed over the group (identity at world size 1)."""
        if self.allreduce is _identity:
            return y
        with self.timer.span("allreduce"):
            return self.allreduce(y)

    def cross_kv(self, cond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Conditioning [L, d] -> cross-attention K, V [heads, L, head_dim] (first forward, and each turn)."""
        L, H, hd = cond.shape[0], self.shape.heads, self.shape.head_dim
        kv = self.ckv(cond).view(L, 2, H, hd).permute(1, 2, 0, 3)
        return kv[0].contiguous(), kv[1].contiguous()

    def fused(self, x, pending, t: float, cache: KVCache, ckv, b: int):
        """``__call__`` with the elementwise chains fused (``self.fusion``); FP8 weights only.

        The block's last residual (x + gate * mlp) is returned unapplied as ``pending = (gate, y)``:
        the next block adds it in the kernel of its first LayerNorm + quantization (``res_ln_quant``),
        so x is read once there instead of once more by a residual kernel; the caller applies the
        last block's. Returns (x, pending)."""
        fu = self.fusion
        T, _ = x.shape
        H, hd = self.shape.heads, self.shape.head_dim
        sh1, sc1, g1, sh2, sc2, g2 = self.mods[t]
        if pending is None:
            hq, hs = fu.ln_quant(x, sc1, sh1, self.qkv.in_scale)
        else:
            x, hq, hs = fu.res_ln_quant(x, pending[0], pending[1], sc1, sh1, self.qkv.in_scale)
        q, k, v = _mm(hq, hs, self.qkv).view(T, 3, H, hd).permute(1, 2, 0, 3).unbind(0)
        with self.timer.span("upkeep"):
            win = cache.update(b, k, v)
        os_ = self._out_scale(self.o)  # static: attention stores the FP8 GEMM input itself
        with self.timer.span("attention"):  # the queries' RoPE inside the FP8 kernel, else fu.rope
            o = cache.ops.attention(q, win, cache.cos, cache.sin, fu.rope, out_scale=os_)
        y = self._project(o, self.o, os_)
        x, hq, hs = fu.res_ln_quant(x, g1, y, None, None, self.cq.in_scale)
        cq = _mm(hq, hs, self.cq).view(T, H, hd).transpose(0, 1)
        os_ = self._out_scale(self.co)
        y = self._project(cache.ops.attention(cq, ckv, out_scale=os_), self.co, os_)
        x, hq, hs = fu.res_ln_quant(x, None, y, sc2, sh2, self.up.in_scale)
        u = _mm(hq, hs, self.up)
        if self._own_row_parallel:
            y = self.row_parallel(F.gelu(u, approximate="tanh"), self.down)
        else:
            y = self._reduce(_mm(*fu.gelu_quant(u, self.down.in_scale), self.down))
        return x, (g2, y)

    def __call__(self, x, t: float, cache: KVCache, ckv, b: int) -> torch.Tensor:
        """The unfused block (any weights): x -> x after self-attention, cross-attention and MLP."""
        T, d = x.shape
        H, hd = self.shape.heads, self.shape.head_dim
        sh1, sc1, g1, sh2, sc2, g2 = self.mods[t]  # timestep modulation (scales already 1 + scale)
        # self-attention over the window + this chunk's tokens
        h = F.layer_norm(x, (d,), sc1, sh1)
        q, k, v = self.qkv(h).view(T, 3, H, hd).permute(1, 2, 0, 3).unbind(0)  # [H, T, hd] each
        with self.timer.span("upkeep"):
            win = cache.update(b, k, v)
        with self.timer.span("attention"):  # queries RoPE'd with the step's tables (built in begin_step)
            o = cache.ops.attention(q, win, cache.cos, cache.sin)  # [H, T, hd]
        x = torch.addcmul(x, g1, self.row_parallel(o.transpose(0, 1).reshape(T, H * hd), self.o))
        # cross-attention to the conditioning
        cq = self.cq(F.layer_norm(x, (d,))).view(T, H, hd).transpose(0, 1)
        o = cache.ops.attention(cq, ckv)  # over the conditioning's window (cache.cross_window)
        x = x + self.row_parallel(o.transpose(0, 1).reshape(T, H * hd), self.co)
        # MLP
        h = F.layer_norm(x, (d,), sc2, sh2)
        return torch.addcmul(x, g2, self.row_parallel(F.gelu(self.up(h), approximate="tanh"), self.down))


class DiT:
    """The rank's model: timestep embedding, patch in/out, blocks; four Euler passes per chunk."""

    def __init__(self, shape: ModelShape, device="cpu", dtype: torch.dtype | None = None, fp8: bool | None = None):
        self.shape = shape
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
        fp8 = (shape.fp8_weights and cuda) if fp8 is None else fp8  # fp8=True on CPU: tests of the FP8 path
        self.fp8 = fp8
        self.fuse_blocks = True  # BlockFusion under the compile or triton_kernels switch (CUDA, FP8 weights)
        # with static scales and the triton_kernels switch, the fused chains are Triton kernels
        # (BlockFusion.triton; bench/worker_step.py +triton_chains); False: the compiled chains
        self.triton_chains = True
        # FP8 activation scales: "static" (per-tensor scales calibrated on the session's first forward +
        # chunk, then fixed: no reduction, saturating beyond 2x the calibrated amax; the fastest on the
        # H200, bench/worker_step.py +static_scales, latents 2.7% from "row" on the tiny model, as close
        # as "tensor"), "row" (a row amax in the same pass) or "tensor" (a global amax first: two passes)
        self.act_scales = "static"
        wm = WeightMaker(shape.seed, self.device, self.dtype, fp8)
        d, c = shape.d_model, shape.latent_channels
        self.t_embed = wm.chunk((d, 256), 1 / 16, "t_embed")
        self.patch_in = wm.chunk((d, c), 1 / math.sqrt(c), "patch_in")
        self.patch_out = wm.chunk((c, d), 1 / math.sqrt(d), "patch_out")
        self.blocks = [Block(shape, i, wm) for i in range(shape.n_blocks)]
        self.timesteps = [1.0 - i / shape.passes for i in range(shape.passes)]
        self._temb = {t: self._time_embedding(t) for t in [*self.timesteps, 0.0]}
        for blk in self.blocks:
            blk.prepare(self._temb)
        self.timer = NullTimer()
        self._fusions: dict[str, BlockFusion] = {}  # chains per act_scales, and "triton" (set_compile)
        self.set_compile(False)  # every linear quantizes with ``act_scales`` from the start

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.blocks)

    def set_allreduce(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for b in self.blocks:
            b.allreduce = fn

    def _linears(self) -> list[Linear]:
        return [lin for b in self.blocks for lin in b.linears]

    def set_compile(self, on: bool, triton: bool = False) -> None:
        """The compile and triton_kernels switches' share in the model (CUDA only): the FP8 activation
        quantizer compiled, and with FP8 weights and ``fuse_blocks`` the blocks' elementwise chains
        (``BlockFusion``): Triton kernels when ``triton`` is on, the scales are static and
        ``triton_chains`` is set (compile switch or not), else compiled under ``on``. Both use
        ``act_scales``; set it before calling this. "static" keeps the linears' ``StaticScale`` sites
        (their calibration) and swaps only their quantizer; the first call makes them
        (``reset_act_scales``)."""
        if self.act_scales not in ACT_SCALES:
            raise ValueError(f"act_scales {self.act_scales!r}; valid: {list(ACT_SCALES)}")
        cuda = self.device.type == "cuda" or COMPILE_ON_CPU
        use = on and cuda
        if self.act_scales == "static" and self.fp8:
            quant = compiled(quantize_act_static) if use else quantize_act_static
            if any(lin.site is None for lin in self._linears()):
                self.reset_act_scales()
            for lin in self._linears():
                lin.site.quant = quant
                lin.quant = lin.site
        else:  # dynamic scales ("static" with bf16/fp32 weights: nothing is quantized)
            quant = ACT_QUANT.get(self.act_scales, quantize_act)
            quant = compiled(quant) if use else quant
            for lin in self._linears():
                lin.site, lin.quant = None, quant
        fusable = cuda and self.fp8 and self.fuse_blocks
        key = fusion_kind(fusable, on, triton and self.triton_chains, self.act_scales)
        if key == "triton" and key not in self._fusions:
            try:
                self._fusions[key] = BlockFusion.triton()
            except ImportError:  # no Triton here: the compiled chains or none, as the cache ops fall back
                key = fusion_kind(fusable, on, False, self.act_scales)
        if key is not None and key not in self._fusions:  # once per kind: a switch flipped back reuses
            self._fusions[key] = BlockFusion.compiled(key)  # its compiles (inductor's, at a chain's first call)
        self.set_fusion(self._fusions.get(key))

    def reset_act_scales(self) -> None:
        """Static scales: fresh sites for every linear (same quantizer), calibrated over the next
        1 + passes uses -- a session's first forward and first chunk, during which the blocks run
        unfused. Existing sites restart in place (their scale tensors are what graphs read). Nothing
        without static scales."""
        if self.act_scales != "static" or not self.fp8:
            return
        for lin in self._linears():
            if lin.site is not None:  # in place: graphs captured in an earlier session read its scale
                lin.site.restart(1 + self.shape.passes)
                continue
            lin.site = StaticScale(self.device, 1 + self.shape.passes, quant=quantize_act_static)
            lin.quant = lin.site

    def set_fusion(self, fusion: BlockFusion | None) -> None:
        """Install (or remove) the fused block path; ``BlockFusion.eager(act_scales)`` on CPU for tests."""
        if fusion is not None and not self.fp8:
            raise ValueError("BlockFusion needs FP8 weights (DiT(..., fp8=True) or a shape with fp8_weights on CUDA)")
        if fusion is not None and fusion.act_scales not in (None, self.act_scales):
            raise ValueError(f"BlockFusion for act_scales {fusion.act_scales!r} on a model with act_scales "
                             f"{self.act_scales!r}; valid: BlockFusion.eager({self.act_scales!r})")
        for b in self.blocks:
            b.fusion = fusion

    @property
    def probe_ready(self) -> bool:
        """Static activation scales in use and calibrated: their saturation can be probed."""
        return self.act_scales == "static" and self.fp8 and not self.calibrating

    def set_probe(self, probe: SaturationProbe | None) -> None:
        """Route every static-scale GEMM input of the next forwards through ``probe`` (None: stop).
        Tensor parallel's fused GEMM + all-reduce quantizes its input dynamically: not counted."""
        for lin in self._linears():
            lin.probe = probe if lin.site is not None else None

    def set_timer(self, timer) -> None:
        self.timer = timer
        for b in self.blocks:
            b.timer = timer

    def _time_embedding(self, t: float) -> torch.Tensor:
        half = 128
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=self.device) / half)
        ang = t * 1000.0 * freqs
        emb = torch.cat([ang.cos(), ang.sin()]).to(self.dtype)
        return F.silu(self.t_embed @ emb)  # [d]

    def _sites(self, step_only: bool) -> list[StaticScale]:
        """The linears' static-scale sites; ``step_only``: without the cross K/V input's, which a chunk
        never uses (the first forward and a turn's recompute do)."""
        return [lin.site for b in self.blocks for lin in b.linears
                if lin.site is not None and not (step_only and lin is b.ckv)]

    def calibration_state(self, step_only: bool = False) -> tuple[int, ...]:
        """The static scales' calibration counters (uses left per site; () without static sites): the
        host state a CUDA graph of a forward depends on (worker/graphs.py keys and restores it)."""
        return tuple(site.left for site in self._sites(step_only))

    def set_calibration_state(self, state: tuple[int, ...], step_only: bool = False) -> None:
        sites = self._sites(step_only)
        assert len(sites) == len(state), (len(sites), len(state))
        for site, left in zip(sites, state, strict=True):
            site.left = left

    @property
    def calibrating(self) -> bool:
        """Static activation scales still calibrating (block 0's QKV input stands for all: every block's
        steady-path sites count their uses alike; the cross K/V input is used once per session and the
        row-parallel inputs under tensor parallel quantize dynamically, so those may never finish)."""
        site = self.blocks[0].qkv.site if self.blocks else None
        return site is not None and site.calibrating

    def forward_tokens(self, x: torch.Tensor, t: float, cache: KVCache, cond_kv, fused: bool = True) -> torch.Tensor:
        if fused and self.blocks and self.blocks[0].fusion is not None and not self.calibrating:
            pending = None
            for b, blk in enumerate(self.blocks):
                x, pending = blk.fused(x, pending, t, cache, cond_kv[b], b)
            return torch.addcmul(x, *pending)
        for b, blk in enumerate(self.blocks):
            x = blk(x, t, cache, cond_kv[b], b)
        return x

    def first_forward(self, cond: torch.Tensor, cache: KVCache):
        """Conditioning [L, d]: cross-attention K/V per block, and the window prefilled with it."""
        cache.begin_step(cond.shape[0])
        cond_kv = self.prefill(cond, cache)
        cache.end_step()
        return cond_kv

    def prefill(self, cond: torch.Tensor, cache: KVCache):
        """The first forward inside the step ``cache.begin_step(L)`` opened (what a graph of it holds)."""
        cond = cond.to(self.dtype)
        cond_kv = self.cross_kv(cond, cache)
        # unfused: once per session, and its token count varies per session (the compiled chains
        # then see one shape only, the chunk's, and never recompile)
        self.forward_tokens(cond, 0.0, cache, cond_kv, fused=False)
        return cond_kv

    def cross_kv(self, cond: torch.Tensor, cache: KVCache) -> list:
        """Conditioning [L, d] -> every block's cross-attention K/V window (the first forward's, and a
        turn's recompute: worker/turns.py). Column-parallel only: no all-reduce, no buffer registry."""
        cond = cond.to(self.dtype)
        return [cache.cross_window(*blk.cross_kv(cond)) for blk in self.blocks]

    def denoise_chunk(self, noise: torch.Tensor, cache: KVCache, cond_kv) -> torch.Tensor:
        """noise [new_tokens, C] -> clean latents; ``cache.begin_step`` was called by the caller."""
        x = noise.to(self.dtype)
        dt = 1.0 / self.shape.passes
        for t in self.timesteps:
            h = self.forward_tokens(x @ self.patch_in.t(), t, cache, cond_kv)
            x = x - dt * (F.layer_norm(h, (h.shape[-1],)) @ self.patch_out.t())
        return x
