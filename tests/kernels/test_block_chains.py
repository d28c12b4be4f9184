"""kernels/block_chains.py against the worker's torch chains (``worker.model._chains(quantize_act_rows)``).

Residuals are bit-identical (bf16). The LayerNorm's fp32 statistics are summed in another order than
torch's, so a LayerNorm output can round the other way in bf16 (about 1 in 10^5 values): then its FP8
code moves by one e4m3 step, or, when it was a row's amax, that row's scale by one bf16 ulp. The bound
asserted (``check_rows_quant``): every FP8 value within one e4m3 step of torch's, at most 1e-3 of the codes
(2 at the CPU shapes) different in rows whose scale matches, at most 1% of the scales (1 row at the CPU
shapes) one bf16 ulp off, the rest equal. The plain row quantization is bit-identical. CPU: Triton's
interpreter at small awkward shapes; ``gpu``: the prod rank's shapes (757 tokens; K 7680, 10240, 2560).
"""

from __future__ import annotations

import pytest
import torch

from kernels import block_chains as bc
from kernels.block_chains import gelu_quant_rows, ln_quant_rows, quant_rows, res_ln_quant_rows
from tests.kernels.helpers import NAN_FP8, fp8_bytes
from worker.fp8 import quantize_act_rows
from worker.model import _chains

LN, RES, GELU = _chains(quantize_act_rows)  # what the worker's fused block path runs
FP8 = torch.float8_e4m3fn
CPU_SHAPES = [(5, 96), (5, 200), (3, 33), (4, 3)]  # + K = 1 for GELU / quant (a LayerNorm of 1 is noise)


def e4m3_step(v: torch.Tensor) -> torch.Tensor:
    """The e4m3 spacing at |v| (3 mantissa bits; subnormal spacing 2**-9 below 2**-6)."""
    return torch.exp2(torch.floor(torch.log2(v.abs().clamp_min(2.0**-6))) - 3)


def check_rows_quant(q, s, q_ref, s_ref, what: str, max_flips: float = 1e-3) -> dict:
    """(q, s) vs the torch chain's (q_ref, s_ref) with the module docstring's bound; returns the counts."""
    M, K = q_ref.shape
    assert q.dtype == FP8 and q.shape == (M, K), f"{what}: q {q.dtype} {tuple(q.shape)}"
    assert s.dtype == torch.float32 and s.shape == (M, 1), f"{what}: scale {s.dtype} {tuple(s.shape)}"
    assert torch.isfinite(q.float()).all() and torch.isfinite(s).all(), f"{what}: non-finite output"
    off = s[:, 0] != s_ref[:, 0]
    rel = ((s - s_ref).abs() / s_ref).max().item()
    assert rel <= 2.0**-7, f"{what}: scale off by {rel:.3g} (> one bf16 ulp)"
    assert off.sum().item() <= max(1, M // 100), f"{what}: {off.sum().item()} of {M} scales differ"
    a, b = q.float(), q_ref.float()
    step = (a - b).abs() / e4m3_step(torch.maximum(a.abs(), b.abs()))
    assert step.max().item() <= 1, f"{what}: an FP8 value {step.max().item()} e4m3 steps from torch's"
    flips = (fp8_bytes(q) != fp8_bytes(q_ref))[~off].sum().item()
    assert flips <= max(2, max_flips * M * K), f"{what}: {flips} of {M * K} FP8 codes differ"
    return {"flips": flips, "scales_off": off.sum().item()}


def _rows(M: int, K: int, g, device, spread: bool = True) -> torch.Tensor:
    """bf16 [M, K] ~ N(0, 1), rows scaled 10**-3 .. 10**3 apart (huge and tiny rows), the last row 0."""
    x = torch.randn(M, K, generator=g, device=device)
    if spread:
        x = x * torch.logspace(-3, 3, M, device=device)[:, None]
    x[-1] = 0
    return x.bfloat16()


def _vec(K, g, device, mean: float, std: float) -> torch.Tensor:
    return (mean + std * torch.randn(K, generator=g, device=device)).bfloat16()


def _poisoned(M, K, device, residual: bool):
    x_new = torch.full((M, K), float("nan"), device=device).bfloat16() if residual else None
    q = torch.full((M, K), NAN_FP8, dtype=torch.uint8, device=device).view(FP8)
    return x_new, q, torch.full((M, 1), float("nan"), device=device)


def _run_res(M, K, gate, affine, rng, device, max_flips=1e-3):
    g_, seed = rng
    x, y = _rows(M, K, g_, device), _rows(M, K, g_, device)
    g = _vec(K, g_, device, 0.5, 0.3) if gate else None
    w, b = (_vec(K, g_, device, 1.0, 0.2), _vec(K, g_, device, 0.0, 0.3)) if affine else (None, None)
    x_ref, q_ref, s_ref = RES(x, g, y, w, b)
    outs = _poisoned(M, K, device, True)
    x_new, q, s = bc._launch(x, g, y, w, b, True, True, False, outs=outs)  # the wrapper's launch, poisoned outputs
    assert all(o is p for o, p in zip((x_new, q, s), outs, strict=True))
    what = f"res_ln_quant M={M} K={K} gate={gate} affine={affine} seed={seed}"
    assert torch.equal(x_new, x_ref), what
    counts = check_rows_quant(q, s, q_ref, s_ref, what, max_flips)
    x2, q2, s2 = res_ln_quant_rows(x, g, y, w, b)  # the public wrapper: the same bytes
    assert torch.equal(x2, x_new) and torch.equal(fp8_bytes(q2), fp8_bytes(q)) and torch.equal(s2, s), what
    return counts


@pytest.mark.parametrize("M,K", CPU_SHAPES)
@pytest.mark.parametrize("gate", [True, False], ids=["g", "no_g"])
@pytest.mark.parametrize("affine", [True, False], ids=["wb", "plain"])
def test_res_ln_quant_matches_the_torch_chain(M, K, gate, affine, rng, device):
    _run_res(M, K, gate, affine, rng, device)


@pytest.mark.parametrize("M,K", CPU_SHAPES)
@pytest.mark.parametrize("affine", [True, False], ids=["wb", "plain"])
def test_ln_quant_matches_the_torch_chain(M, K, affine, rng, device):
    g_, seed = rng
    x = _rows(M, K, g_, device)
    w, b = (_vec(K, g_, device, 1.0, 0.2), _vec(K, g_, device, 0.0, 0.3)) if affine else (None, None)
    outs = _poisoned(M, K, device, False)
    _, q, s = bc._launch(x, None, None, w, b, False, True, False, outs=outs)
    check_rows_quant(q, s, *LN(x, w, b), f"ln_quant M={M} K={K} affine={affine} seed={seed}")
    q2, s2 = ln_quant_rows(x, w, b)
    assert torch.equal(fp8_bytes(q2), fp8_bytes(q)) and torch.equal(s2, s)


@pytest.mark.parametrize("M,K", [*CPU_SHAPES, (4, 1)])
def test_gelu_quant_matches_the_torch_chain(M, K, rng, device):
    g_, seed = rng
    u = _rows(M, K, g_, device) * 4  # GELU's negative tail (-0 and tiny values) and its linear side
    _, q, s = bc._launch(u, None, None, None, None, False, False, True, outs=_poisoned(M, K, device, False))
    check_rows_quant(q, s, *GELU(u), f"gelu_quant M={M} K={K} seed={seed}")
    q2, s2 = gelu_quant_rows(u)
    assert torch.equal(fp8_bytes(q2), fp8_bytes(q)) and torch.equal(s2, s)


@pytest.mark.parametrize("M,K", [*CPU_SHAPES, (4, 1), (6, 2560 // 16)])
def test_quant_rows_is_bit_identical_to_quantize_act_rows(M, K, rng, device):
    g_, seed = rng
    x = _rows(M, K, g_, device)
    x[0, :3] = torch.tensor([-0.0, 3e4, -3e4])[: min(3, K)]  # -0 keeps its sign; the amax maps to +-448
    _, q, s = bc._launch(x, None, None, None, None, False, False, False, outs=_poisoned(M, K, device, False))
    q_ref, s_ref = quantize_act_rows(x)
    assert torch.equal(fp8_bytes(q), fp8_bytes(q_ref)), f"seed={seed}"
    assert torch.equal(s, s_ref), f"seed={seed}"
    q2, s2 = quant_rows(x)
    assert torch.equal(fp8_bytes(q2), fp8_bytes(q)) and torch.equal(s2, s)


def test_an_all_zero_row_gets_the_floor_scale_and_zero_codes(device):
    M, K = 3, 40
    x = torch.zeros(M, K, device=device).bfloat16()
    floor = torch.tensor(1e-12, dtype=torch.float32) * (1.0 / 448.0)  # the torch chain's fp32 arithmetic
    for name, (q, s) in {"quant": quant_rows(x), "gelu": gelu_quant_rows(x), "ln": ln_quant_rows(x, None, None),
                         "res_ln": res_ln_quant_rows(x, None, x, None, None)[1:]}.items():
        assert torch.equal(s.cpu(), floor.expand(M, 1)), name
        assert torch.equal(fp8_bytes(q), torch.zeros(M, K, dtype=torch.uint8, device=device)), name


def test_strided_rows_and_launch_configs_give_the_same_bytes(rng, device):
    """Rows of a wider tensor (row stride > K), and every rows-per-program / warps choice."""
    g_, seed = rng
    M, K = 7, 72
    wide = _rows(M, 2 * K, g_, device, spread=False)
    x, y = wide[:, :K], _rows(M, K, g_, device)
    g, w, b = (_vec(K, g_, device, 0.5, 0.2) for _ in range(3))
    base = res_ln_quant_rows(x.contiguous(), g, y, w, b)
    for cfg in [{"ROWS": 1}, {"ROWS": 4, "num_warps": 2}, {"ROWS": 8}]:
        out = res_ln_quant_rows(x, g, y, w, b, cfg=cfg)
        for o, r in zip(out, base, strict=True):
            assert torch.equal(o.view(torch.uint8) if o.dtype == FP8 else o,
                               r.view(torch.uint8) if r.dtype == FP8 else r), f"cfg={cfg} seed={seed}"


def test_the_custom_ops_return_what_the_wrappers_return(rng, device):
    """The torch.compile path dispatches to ``torch.ops.livestep.*``: same outputs, new tensors."""
    g_, _ = rng
    M, K = 4, 48
    x, y = _rows(M, K, g_, device), _rows(M, K, g_, device)
    g, w, b = (_vec(K, g_, device, 0.5, 0.2) for _ in range(3))
    op = torch.ops.livestep.res_ln_quant_rows(x, g, y, w, b, 0, 0)
    for o, r in zip(op, res_ln_quant_rows(x, g, y, w, b), strict=True):
        assert torch.equal(o.view(torch.uint8) if o.dtype == FP8 else o, r.view(torch.uint8) if r.dtype == FP8 else r)
    q, s = torch.ops.livestep.rows_quant(y, None, None, False, True, 0, 0)
    q2, s2 = gelu_quant_rows(y)
    assert torch.equal(fp8_bytes(q), fp8_bytes(q2)) and torch.equal(s, s2)


def test_the_references_are_the_worker_chains(rng, device):
    g_, _ = rng
    M, K = 5, 64
    x, y = _rows(M, K, g_, device), _rows(M, K, g_, device)
    g, w, b = (_vec(K, g_, device, 0.5, 0.2) for _ in range(3))
    pairs = [(bc.res_ln_quant_rows_ref(x, g, y, w, b), RES(x, g, y, w, b)), (bc.ln_quant_rows_ref(x, w, b), LN(x, w, b)),
             (bc.gelu_quant_rows_ref(x), GELU(x)), (bc.quant_rows_ref(x), quantize_act_rows(x))]
    for got, want in pairs:
        for o, r in zip(got, want, strict=True):
            assert torch.equal(o.view(torch.uint8) if o.dtype == FP8 else o, r.view(torch.uint8) if r.dtype == FP8 else r)


def test_wrong_inputs_are_refused_with_the_valid_choice(device):
    x = torch.zeros(3, 8, device=device).bfloat16()
    v = torch.zeros(8, device=device).bfloat16()
    cases = [
        (lambda: quant_rows(x.float()), "dtype torch.float32, valid: torch.bfloat16"),
        (lambda: quant_rows(x[0]), r"shape \(8,\), valid: \[M, K\]"),
        (lambda: quant_rows(x.t()), "the last dim must be contiguous"),
        (lambda: quant_rows(torch.zeros(2, bc.MAX_K + 1, device=device).bfloat16()), "valid: 1..32768"),
        (lambda: res_ln_quant_rows(x, v, x[:2], None, None), r"y: shape \(2, 8\), valid: \(3, 8\)"),
        (lambda: res_ln_quant_rows(x, v[:4], x, None, None), r"g: .*valid: contiguous torch.bfloat16 \[8\] or None"),
        (lambda: ln_quant_rows(x, v, None), "both given .* or both None"),
        (lambda: ln_quant_rows(x, v.float(), v), r"w: torch.float32 \(8,\), valid"),
        (lambda: gelu_quant_rows(x, cfg={"BLOCK": 64}), r"cfg keys \['BLOCK'\]; valid: \['ROWS', 'num_warps'\]"),
    ]
    for call, msg in cases:
        with pytest.raises(ValueError, match=msg):
            call()


# ---- the GPU at the prod rank's shapes (757 tokens of prod57b at TP=3) ----

M_PROD, D_PROD, FFN_PROD, ATTN_PROD = 757, 7680, 10240, 2560


@pytest.mark.gpu
@pytest.mark.parametrize("gate,affine", [(True, True), (True, False), (False, True)], ids=["g_wb", "g", "wb"])
def test_gpu_res_ln_quant_prod_shape(gate, affine, rng, device):
    _run_res(M_PROD, D_PROD, gate, affine, rng, device)


@pytest.mark.gpu
@pytest.mark.parametrize("affine", [True, False], ids=["wb", "plain"])
def test_gpu_ln_quant_prod_shape(affine, rng, device):
    g_, seed = rng
    x = _rows(M_PROD, D_PROD, g_, device)
    w, b = (_vec(D_PROD, g_, device, 1.0, 0.2), _vec(D_PROD, g_, device, 0.0, 0.3)) if affine else (None, None)
    check_rows_quant(*ln_quant_rows(x, w, b), *LN(x, w, b), f"ln_quant prod seed={seed}")


@pytest.mark.gpu
def test_gpu_gelu_quant_prod_shape(rng, device):
    g_, seed = rng
    u = _rows(M_PROD, FFN_PROD, g_, device) * 4
    check_rows_quant(*gelu_quant_rows(u), *GELU(u), f"gelu_quant prod seed={seed}")


@pytest.mark.gpu
def test_gpu_quant_rows_prod_shape(rng, device):
    g_, seed = rng
    x = _rows(M_PROD, ATTN_PROD, g_, device)
    q, s = quant_rows(x)
    q_ref, s_ref = quantize_act_rows(x)
    assert torch.equal(fp8_bytes(q), fp8_bytes(q_ref)) and torch.equal(s, s_ref), f"seed={seed}"


@pytest.mark.gpu
def test_gpu_compiled_and_graphed_chain_equals_eager_kernels(rng, device):
    """torch.compile (the triton_ops) and a CUDA graph replay give the eager kernels' bytes."""
    g_, _ = rng
    x, y = _rows(M_PROD, D_PROD, g_, device), _rows(M_PROD, D_PROD, g_, device)
    g, w, b = (_vec(D_PROD, g_, device, 0.5, 0.2) for _ in range(3))
    u = _rows(M_PROD, FFN_PROD, g_, device)

    def chain(x, y, u):
        x1, hq, hs = res_ln_quant_rows(x, g, y, w, b)
        x2, hq2, hs2 = res_ln_quant_rows(x1, None, y, None, None)
        return x2, hq, hs, hq2, hs2, *ln_quant_rows(x2, w, b), *gelu_quant_rows(u), *quant_rows(y[:, :ATTN_PROD])

    def same(a, b_):
        return all(torch.equal(o.view(torch.uint8) if o.dtype == FP8 else o, r.view(torch.uint8) if r.dtype == FP8 else r)
                   for o, r in zip(a, b_, strict=True))

    eager = chain(x, y, u)
    compiled = torch.compile(chain, fullgraph=True)
    assert same(compiled(x, y, u), eager)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        compiled(x, y, u)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = compiled(x, y, u)
    graph.replay()
    torch.cuda.synchronize()
    assert same(out, eager)
