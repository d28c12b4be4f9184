"""FP8 GEMM + all-reduce: the GEMM and the tile-reduction protocol (ranks emulated as separate buffers
in one process; TRITON_INTERPRET=1 on CPU, compiled on the GPU); the registry: tests/worker/test_buffers.py."""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton

import kernels.gemm_allreduce as ga  # interpreted on CPU: tests/conftest.py set TRITON_INTERPRET first

DEV = "cuda" if CUDA else "cpu"
# the interpreter's fp8/bf16 rounding differs from the GPU's: compare loosely there, tightly on the GPU
REL = 2.0**-8 if CUDA else 2.0**-6
SMALL = ga.TileConfig(16, 16, 32, group_m=2, num_warps=4, num_stages=1) if not CUDA else None
SMALL_TMA = ga.TileConfig(16, 16, 32, group_m=2, num_warps=4, num_stages=1, tma=True) if not CUDA else None
# what bench/gemm_allreduce.py --sweep times on the GPU: every one must compute the same product
GPU_CONFIGS = (ga.DEFAULT_CONFIG, ga.FUSED_CONFIG, ga.TileConfig(128, 128, 128, 8, 4, 3, tma=True),
               ga.TileConfig(128, 256, 128, 8, 8, 3, tma=True), ga.TileConfig(64, 128, 128, 16, 4, 4))


def _operands(m, n, k, rowwise=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(m, k, generator=g) * 2).to(ga.FP8).to(DEV)
    w = (torch.randn(n, k, generator=g) * 2).to(ga.FP8).to(DEV)  # nn.Linear layout [N, K]
    if rowwise:
        sa = (torch.rand(m, generator=g) + 0.5).to(DEV)
        sb = (torch.rand(n, generator=g) + 0.5).to(DEV) / 8
    else:
        sa = torch.tensor(0.75, device=DEV)
        sb = torch.tensor(0.125, device=DEV)
    return a, w, sa, sb


def _exact(a, w, sa, sb) -> torch.Tensor:
    """fp64 truth of (a @ w.T) * scales."""
    sa = sa.double().reshape(-1, 1) if sa.numel() > 1 else sa.double()
    sb = sb.double().reshape(1, -1) if sb.numel() > 1 else sb.double()
    return (a.double() @ w.double().t()) * sa * sb


def _assert_close_to(out, truth, partials_abs=None):
    """Within the bf16 roundings of the path: each partial rounded once (relative to its own size,
    `partials_abs` = sum of |partial|), the sum once, and the fp8 product's own rounding."""
    partials_abs = truth.abs() if partials_abs is None else partials_abs
    bound = REL * (truth.abs() + partials_abs) + 1e-2
    err = (out.double() - truth).abs()
    assert (err <= bound).all(), f"max err {err.max().item():.4g}, worst excess {(err - bound).max().item():.4g}"


@pytest.mark.parametrize("m,n,k,rowwise", [(37, 48, 64, False), (29, 40, 80, True)])
def test_fp8_gemm_matches_reference(m, n, k, rowwise):
    a, w, sa, sb = _operands(m, n, k, rowwise)
    out = ga.fp8_gemm(a, w, sa, sb, config=SMALL)  # [N, K] weight: transposed view inside
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    _assert_close_to(out, _exact(a, w, sa, sb))
    ref = ga.gemm_allreduce_ref(a, w.t(), sa, sb)  # [K, N] view: same result
    _assert_close_to(ref, _exact(a, w, sa, sb))


@pytest.mark.skipif(CUDA, reason="interpreter-sized tiles; the GPU tests below run the real configs")
@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("m,n,k,rowwise", [(37, 48, 80, False), (29, 40, 64, True), (8, 16, 32, False)])
def test_tma_loads_compute_what_pointer_loads_compute(fast, m, n, k, rowwise):
    """M and N not multiples of the tile, K not a multiple of BLOCK_K (80 = 2.5 blocks), rowwise scales,
    a single tile: the same products in the same fp32 order either way, so identical results."""
    a, w, sa, sb = _operands(m, n, k, rowwise, seed=m + k)
    out = ga.fp8_gemm(a, w.t(), sa, sb, config=SMALL_TMA, fast_accum=fast)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    _assert_close_to(out, _exact(a, w, sa, sb))
    assert torch.equal(out, ga.fp8_gemm(a, w.t(), sa, sb, config=SMALL, fast_accum=fast))


def test_configs_are_well_formed():
    for cfg in (*GPU_CONFIGS, ga.FUSED_CONFIG):
        assert cfg.block_m >= ga._MIN_TILE and cfg.block_n >= ga._MIN_TILE  # the flags' sizing
    assert len({c.label() for c in GPU_CONFIGS}) == len(GPU_CONFIGS)  # a sweep row names one config


def test_tma_falls_back_to_pointer_loads_for_other_layouts():
    a, w, sa, sb = _operands(29, 40, 64)
    assert ga._tma_ok(a, w.t())
    b_n_major = w.t().contiguous()  # [K, N] row-major: not K-major, so pointer loads
    assert not ga._tma_ok(a, b_n_major)
    cfg = SMALL_TMA if not CUDA else ga.TileConfig(64, 64, 64, tma=True)
    _assert_close_to(ga.fp8_gemm(a, b_n_major, sa, sb, config=cfg), _exact(a, w, sa, sb))


def test_operand_errors_list_what_is_valid():
    a, w, sa, sb = _operands(8, 16, 32)
    with pytest.raises(ga.GemmAllReduceError, match=r"\[K, N\] or \[N, K\] with K=32"):
        ga.fp8_gemm(a, w[:, :16], sa, sb)
    with pytest.raises(ga.GemmAllReduceError, match="float8_e4m3fn"):
        ga.fp8_gemm(a.float(), w, sa, sb)
    with pytest.raises(ga.GemmAllReduceError, match="1 or M=8"):
        ga.fp8_gemm(a, w, torch.ones(3, device=DEV), sb)


def _emulated_call(wss, ops, config=None):
    """One all-reduce call across emulated ranks: every rank pushes, then every rank reduces."""
    cfg = None
    for ws, (a, w, sa, sb) in zip(wss, ops):
        cfg = ga.push_partials(ws, a, w, sa, sb, config=config)
    return [ga.reduce_tiles(ws, cfg) for ws in wss], cfg


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("tma", [False, True])
def test_tile_reduction_across_emulated_ranks(world, tma):
    """The push epilogue with pointer loads and with TMA loads (same tile ids)."""
    config = (SMALL_TMA if tma else SMALL) if not CUDA else ga.TileConfig(64, 64, 64, tma=tma)
    m, n, k = 37, 48, 64
    wss = ga.emulated_workspaces(world, m, n, device=DEV)
    for call in range(3):  # parity 1, 0, 1: both slot sets, and a set reused after the other
        ops = [_operands(m, n, k, rowwise=(r == 1), seed=100 * call + r) for r in range(world)]
        truth = sum(_exact(*op) for op in ops)
        total_abs = sum(_exact(*op).abs() for op in ops)
        epoch = int(wss[0].epoch[0])
        parity = epoch % 2
        # poison the other parity's slots: a reduction must read only this call's set
        for ws in wss:
            ws.slots[1 - parity].fill_(float("nan"))
        outs, cfg = _emulated_call(wss, ops, config)
        n_tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
        for r, (ws, out) in enumerate(zip(wss, outs)):
            _assert_close_to(out, truth, total_abs)
            # every source rank raised every tile's flag on this rank, with this call's epoch
            assert (ws.flags[parity, :, :n_tiles] == epoch).all()
            # and its partial landed in slot [parity, src] of this rank
            for src in range(world):
                _assert_close_to(ws.slots[parity, src], _exact(*ops[src]))
            assert int(ws.epoch[0]) == epoch + 1
        assert all(torch.equal(outs[0], o) for o in outs[1:])  # every rank holds the same sum


def test_workspace_shape_mismatch_is_refused():
    (ws,) = ga.emulated_workspaces(1, 16, 16, device=DEV)
    a, w, sa, sb = _operands(8, 16, 32)
    with pytest.raises(ga.GemmAllReduceError, match=r"\(M, N\)=\(16, 16\)"):
        ga.push_partials(ws, a, w, sa, sb, config=SMALL)


# ----------------------------------------------------------------------------------------------------
# GPU: the compiled kernels at the rank shapes, and the reduction under CUDA graphs

RANK_SHAPES = [(757, 3 * 2560, 7680), (757, 7680, 2560), (757, 10240, 7680), (757, 7680, 10240)]


def _scaled_mm_err(a, w, sa, sb, truth) -> float:
    """cuBLAS's own error at this problem: the yardstick for ours (err <= 2 * err_ref + atol)."""
    mm = torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    return (mm.double() - truth).abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", RANK_SHAPES)
def test_gpu_world1_matches_reference_at_rank_shapes(m, n, k):
    a, w, sa, sb = _operands(m, n, k, seed=k)
    truth = _exact(a, w, sa, sb)
    bound = 2 * _scaled_mm_err(a, w, sa, sb, truth) + 1e-3
    out = ga.fp8_gemm(a, w.t(), sa, sb)  # what worker.parallel.gemm_allreduce runs at world size 1
    ref = ga.gemm_allreduce_ref(a, w.t(), sa, sb)
    assert (out.double() - truth).abs().max().item() <= bound
    ref_err = (ref.double() - truth).abs().max().item()
    assert (out.double() - ref.double()).abs().max().item() <= bound + ref_err


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", GPU_CONFIGS, ids=lambda c: c.label().replace(" ", "-"))
def test_gpu_configs_at_a_rank_shape(cfg):
    m, n, k = 757, 7680, 2560
    a, w, sa, sb = _operands(m, n, k, seed=k)
    truth = _exact(a, w, sa, sb)
    bound = 2 * _scaled_mm_err(a, w, sa, sb, truth) + 1e-3
    try:
        out = ga.fp8_gemm(a, w.t(), sa, sb, config=cfg)
    except triton.runtime.errors.OutOfResources:
        pytest.skip("does not fit this GPU")
    assert (out.double() - truth).abs().max().item() <= bound
    assert torch.equal(out, ga.fp8_gemm(a, w.t(), sa, sb, config=cfg))  # repeatable


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", GPU_CONFIGS, ids=lambda c: c.label().replace(" ", "-"))
@pytest.mark.parametrize("fast", [False, True])
def test_gpu_configs_at_awkward_shapes(cfg, fast):
    """M, N not multiples of the tile, K = 2.5 K-blocks (TMA still aligned), rowwise scales."""
    m, n, k = 157, 320, 336
    a, w, sa, sb = _operands(m, n, k, rowwise=True, seed=7)
    truth = _exact(a, w, sa, sb)
    bound = 2 * _scaled_mm_err(a, w, sa.reshape(-1, 1), sb.reshape(1, -1), truth) + 1e-3
    out = ga.fp8_gemm(a, w.t(), sa, sb, config=cfg, fast_accum=fast)
    assert (out.double() - truth).abs().max().item() <= bound


@pytest.mark.gpu
def test_gpu_emulated_ranks_chain_under_cuda_graphs():
    m, n, k, world = 757, 7680, 2560, 3
    wss = ga.emulated_workspaces(world, m, n, device="cuda", min_tile=64)
    ops = [_operands(m, n, k, seed=r) for r in range(world)]
    static_a = [op[0].clone() for op in ops]

    def check(outs, a_list):
        truths = [_exact(a, *op[1:]) for a, op in zip(a_list, ops)]
        truth = sum(truths)
        # each partial is rounded to bf16 once and the sum once: the yardstick's error per rank,
        # plus one rounding of the sum
        bound = sum(2 * _scaled_mm_err(a, *op[1:], t) for a, op, t in zip(a_list, ops, truths))
        bound += 2.0**-8 * truth.abs().max().item() + 1e-3
        for out in outs:
            assert (out.double() - truth).abs().max().item() <= bound

    eager, _ = _emulated_call(wss, ops)
    check(eager, [op[0] for op in ops])
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        outs, _ = _emulated_call(wss, [(a, *op[1:]) for a, op in zip(static_a, ops)])
    for call in range(3):  # the epoch lives in device memory: each replay is a new call
        new = [_operands(m, n, k, seed=50 + 10 * call + r) for r in range(world)]
        for dst, op in zip(static_a, new):
            dst.copy_(op[0])
        graph.replay()
        torch.cuda.synchronize()
        check(outs, static_a)
