"""Kernel figures on one GPU at the prod57b TP=3 rank shape (20 heads x 128, 757 new tokens, 5,788 slots).

    python bench/kernels.py [--calls 240] [--blocks 60] [--json OUT.json] [--only upkeep,delta,attention]

(a) cache upkeep per step (240 calls, K and V): plain whole-window path (shift copy + re-RoPE + re-quantize,
torch ops), the write-time torch ops (``rope_fp8_write_ref``) eager and under ``torch.compile``, and the
Triton ``rope_fp8_write``; each per call (do_bench median x calls) and as one CUDA graph of all calls;
then the write kernel's tiles in both V layouts (the default first: V keys-contiguous is the worker's).
(b) delta rotation of the K window of every block (60) at a reset: Triton vs eager torch.
(c) ``--only attention`` runs bench/attention.py (every precision pair and the default's tiles against bf16
SDPA, with errors vs fp64; it prints its own table and ratio).
Prints a table, then LAST the ratios against the baselines measured in this run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.graph_timing import graph_ms, median_ms
from kernels import delta_rotate as delta_rotate_mod
from kernels import fp8_attention as attn
from kernels import rope_fp8_write as rfw
from kernels.delta_rotate import delta_rotate, delta_rotate_ref
from kernels.rope import quantize_fp8, rope_at
from kernels.rope_fp8_write import rope_fp8_write, rope_fp8_write_kv, rope_fp8_write_ref

H, D, T, S = 20, 128, 757, 5788
ROWS: list[tuple[str, str, float | None, str]] = []  # (section, what, value, unit/note)


def row(section: str, what: str, value: float | None, note: str = "") -> None:
    ROWS.append((section, what, value, note))
    v = "failed" if value is None else f"{value:10.4f}"
    print(f"{section:10s} {what:58s} {v} {note}", flush=True)


def bench_upkeep(calls: int, blocks: int, dev) -> dict:
    ks = torch.rand(H, device=dev) * 0.02 + 0.01
    vs = torch.rand(H, device=dev) * 0.02 + 0.01
    n_inputs = 8  # rotate new-token inputs so they do not sit in L2
    k_new = [torch.randn(H, T, D, device=dev).bfloat16() for _ in range(n_inputs)]
    v_new = [torch.randn(H, T, D, device=dev).bfloat16() for _ in range(n_inputs)]
    pos = torch.arange(20_000, 20_000 + T, device=dev)
    slots = (S - 300 + torch.arange(T, device=dev)) % S  # a wrapping write
    kc = [torch.zeros(H, S, D, device=dev, dtype=torch.float8_e4m3fn) for _ in range(blocks)]
    vc = [torch.zeros(H, S, D, device=dev, dtype=torch.float8_e4m3fn) for _ in range(blocks)]

    # plain launch path for one call: shift the raw window, re-RoPE and re-quantize all of it
    kwin = torch.randn(H, S, D, device=dev).bfloat16()
    vwin = torch.randn(H, S, D, device=dev).bfloat16()
    win_pos = torch.arange(S, device=dev)
    k8, v8 = torch.empty_like(kc[0]), torch.empty_like(vc[0])

    def plain(i):
        kwin[:, :-T] = kwin[:, T:].clone()
        kwin[:, -T:] = k_new[i % n_inputs]
        vwin[:, :-T] = vwin[:, T:].clone()
        vwin[:, -T:] = v_new[i % n_inputs]
        k8.copy_(quantize_fp8(rope_at(kwin.float(), win_pos), ks))
        v8.copy_(quantize_fp8(vwin.float(), vs))

    def ref_ops(k, v, kcache, vcache):
        rope_fp8_write_ref(k, pos, slots, ks, kcache)
        rope_fp8_write_ref(v, pos, slots, vs, vcache, apply_rope=False)

    compiled_ops = torch.compile(ref_ops)

    def eager(i):
        ref_ops(k_new[i % n_inputs], v_new[i % n_inputs], kc[i % blocks], vc[i % blocks])

    def compiled(i):
        compiled_ops(k_new[i % n_inputs], v_new[i % n_inputs], kc[i % blocks], vc[i % blocks])

    def fused(i):
        rope_fp8_write(k_new[i % n_inputs], pos, slots, ks, kc[i % blocks])
        rope_fp8_write(v_new[i % n_inputs], pos, slots, vs, vc[i % blocks], apply_rope=False)

    # correctness at the bench shape: the fused write equals the torch ops (up to rare 1-step rounding flips)
    fused(0)
    kr, vr = torch.zeros_like(kc[0]), torch.zeros_like(vc[0])
    ref_ops(k_new[0], v_new[0], kr, vr)
    mism = (kc[0].view(torch.uint8) != kr.view(torch.uint8)).float().mean().item()
    row("upkeep", "check: fused K bytes differing from torch ops (fraction)", mism)

    out = {}

    def fused_kv(i):
        rope_fp8_write_kv(
            k_new[i % n_inputs], v_new[i % n_inputs], pos, slots, ks, vs, kc[i % blocks], vc[i % blocks]
        )

    per_call = {
        "plain": plain,
        "eager torch (write-time _ref)": eager,
        "torch.compile (same ops)": compiled,
        "triton rope_fp8_write": fused,
        "triton rope_fp8_write_kv (one launch)": fused_kv,
    }
    for name, fn in per_call.items():
        try:
            ms = median_ms(lambda fn=fn: fn(0)) * calls
            out[f"{name} per-call"] = ms
            row("upkeep", f"{name}: do_bench median x {calls} [ms/step]", ms)
        except Exception as e:  # noqa: BLE001 - report and keep measuring the rest
            row("upkeep", f"{name} per-call", None, repr(e)[:120])
    for name, fn in list(per_call.items())[1:]:
        try:
            ms = graph_ms(fn, calls)
            out[f"{name} graph"] = ms
            row("upkeep", f"{name}: one CUDA graph of {calls} calls [ms/step]", ms)
        except Exception as e:  # noqa: BLE001
            row("upkeep", f"{name} graph", None, repr(e)[:120])
    # the write kernel's tiles (BLOCK_T tokens x HEADS heads, warps), both V layouts; the default first.
    # V keys-contiguous is the worker's layout with the Triton kernels (fp8_attention.v_layout)
    vk = [attn.v_layout(H, S, D, device=dev) for _ in range(blocks)]
    rope_fp8_write_kv(k_new[0], v_new[0], pos, slots, ks, vs, kc[0], vk[0])
    rope_fp8_write(v_new[0], pos, slots, vs, vr, apply_rope=False)
    mism = (vk[0].view(torch.uint8) != vr.view(torch.uint8)).float().mean().item()
    row("upkeep", "check: keys-contiguous V bytes differing from the [H,S,D] write", mism)
    d = rfw._config(T, D)
    default = (d["BLOCK_T"], d["HEADS"], d["num_warps"])
    tiles = [default] + [
        t for t in ((16, 1, 4), (8, 1, 4), (8, 2, 4), (16, 1, 2), (16, 2, 4), (32, 1, 4)) if t != default
    ]
    for layout, vcaches in (("V [H,S,D]", vc), ("V keys-contiguous", vk)):
        for bt, hh, w in tiles:
            cfg = {"BLOCK_T": bt, "HEADS": hh, "num_warps": w}

            def launch(i, cfg=cfg, vcaches=vcaches):
                j = i % n_inputs
                rfw._launch(
                    k_new[j],
                    pos,
                    slots,
                    ks,
                    kc[i % blocks],
                    True,
                    1e4,
                    v_new[j],
                    vs,
                    vcaches[i % blocks],
                    cfg=cfg,
                )

            what = f"triton kv one launch, {layout}, {bt} tokens x {hh} heads w{w}"
            try:
                ms = graph_ms(launch, calls)
                out[f"kv {layout} tiles {bt}x{hh}w{w} graph"] = ms
                if (bt, hh, w) == default and vcaches is vk:
                    out["worker layout graph"] = ms
                row("upkeep", f"{what}: graph [ms/step]", ms)
            except Exception as e:  # noqa: BLE001
                row("upkeep", what, None, repr(e)[:120])
    return out


def bench_delta(blocks: int, dev) -> dict:
    ks = torch.rand(H, device=dev) * 0.02 + 0.01
    caches = [
        torch.clamp(torch.randn(H, S, D, device=dev) / ks[:, None, None], -448, 448).to(torch.float8_e4m3fn)
        for _ in range(blocks)
    ]
    delta = 42 * T

    def fused():
        for c in caches:
            delta_rotate(c, ks, delta)

    def eager():
        for c in caches:
            delta_rotate_ref(c, ks, delta)

    a = caches[0].clone()
    b = caches[0].clone()
    delta_rotate(a, ks, delta)
    delta_rotate_ref(b, ks, delta)
    row(
        "delta",
        "check: bytes differing from torch ops (fraction)",
        (a.view(torch.uint8) != b.view(torch.uint8)).float().mean().item(),
    )
    out = {"triton": median_ms(fused), "eager": median_ms(eager)}
    for bs, w in ((128, 4), (256, 8), (32, 4)):  # other tiles than the default (64 rows, 4 warps)
        cfg = {"BLOCK_S": bs, "num_warps": w}

        def tiles(cfg=cfg):
            for c in caches:
                delta_rotate_mod._launch(c, delta, 1e4, cfg=cfg)

        out[f"tiles {bs} w{w}"] = median_ms(tiles)
        row("delta", f"triton delta_rotate, {bs} rows w{w} [ms/reset step]", out[f"tiles {bs} w{w}"])
    row("delta", f"triton delta_rotate, {blocks} blocks (K) [ms/reset step]", out["triton"])
    row("delta", f"eager torch delta_rotate_ref, {blocks} blocks [ms/reset step]", out["eager"])
    return out


def bench_attention(dev) -> dict:
    """The attention sweep is bench/attention.py (every precision pair vs SDPA in one process): run it here
    so that ``--only attention`` and bench/h200.sh keep printing it."""
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    subprocess.run([sys.executable, os.path.join(here, "attention.py")], check=False)
    return {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=240, help="attention calls per step (4 passes x 60 blocks)")
    ap.add_argument("--blocks", type=int, default=60, help="blocks (caches) per model")
    ap.add_argument("--json", default=None, help="also write the figures here")
    ap.add_argument("--only", default="upkeep,delta,attention")
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(
        f"# {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC  {torch.cuda.get_device_name()}  torch {torch.__version__}"
        f"  triton {triton.__version__}  shape H={H} D={D} T={T} S={S}",
        flush=True,
    )
    res = {}
    only = args.only.split(",")
    if "upkeep" in only:
        res["upkeep"] = bench_upkeep(args.calls, args.blocks, dev)
    if "delta" in only:
        res["delta"] = bench_delta(args.blocks, dev)
    if "attention" in only:
        res["attention"] = bench_attention(dev)

    print("\n| section | what | value | note |\n|---|---|---|---|")
    for sec, what, v, note in ROWS:
        print(f"| {sec} | {what} | {'failed' if v is None else f'{v:.4f}'} | {note} |")
    print("\nratios vs baselines measured in this run:")
    up = res.get("upkeep", {})
    kv = up.get("triton rope_fp8_write_kv (one launch) graph")
    sep = up.get("triton rope_fp8_write graph")
    plain, comp = up.get("plain per-call"), up.get("torch.compile (same ops) graph")
    worker = up.get("worker layout graph")
    for name, fused in (
        ("K+V in one launch, V keys-contiguous (the worker's layout)", worker),
        ("K+V in one launch, V [H,S,D] (rope_fp8_write_kv)", kv),
        ("K and V launched apart, V [H,S,D]", sep),
    ):
        if fused:
            print(
                f"  upkeep, {name}: {fused:.3f} ms/step (goal <= 2)"
                + (f"; plain / triton = {plain / fused:.1f}x (goal >= 35)" if plain else "")
                + (f"; compile / triton = {comp / fused:.2f}x (goal > 1)" if comp else "")
            )
    de = res.get("delta", {})
    if de:
        print(
            f"  delta: triton {de['triton']:.3f} ms per reset step (goal <= 5); eager / triton = "
            f"{de['eager'] / de['triton']:.1f}x"
        )
    at = res.get("attention", {})
    if "sdpa" in at:
        for name, ms in at.items():
            if name not in ("sdpa", "best"):
                print(f"  attention: {name} / sdpa = {ms / at['sdpa']:.3f} (goal <= 0.75)")
        for layout, b in at.get("best", {}).items():
            print(f"  attention best, V {layout}: {b['name']}: {b['ms'] * 1e3:.1f} us")
            print(f'    kernels/fp8_attention.py, the TUNED line:    "{layout}": {b["tuned"]!r},')
        if "keys" in at.get("best", {}):
            print(f"attention best / sdpa = {at['best']['keys']['ms'] / at['sdpa']:.3f} (goal <= 0.75)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": ROWS, "results": res}, f, indent=1)


if __name__ == "__main__":
    main()
