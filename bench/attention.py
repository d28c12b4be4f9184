"""FP8 attention at the prod57b TP=3 rank shape (20 heads x 128, 757 queries, 5,788 slots): every precision pair
and the default's tiles against bf16 SDPA, measured in one process.

    python3 bench/attention.py [--budget-s 200] [--json OUT.json]
    python3 bench/attention.py --pairs split+bf16,bf16+bf16,fp8+fp8 --tiles 128x128   # the short sweep

``--model`` (the CPU box): only the precision model's error per pair, no kernel, no GPU.
``--pairs`` (QK+PV, each in ``QK_MODES`` x ``GPU_PV_MODES``; ``PAIR@TILES`` pins one pair's tiles) and
``--tiles`` (``BMxBN``, comma-separated; warps 8 for 128-row tiles, else 4; 3 stages; TMA; ``tuned``:
each pair's launch tiles, ``TUNED``/``TUNED_PAIRS``): only those candidates against SDPA, at the rank
shape, in the same run (~5 s per candidate with its compile); the fastest inside the band is the
default to choose, printed as the ``DEFAULT``/``TUNED`` lines to set and, last, its ratio to SDPA.

Per variant: µs per call as GPU time (10 calls in one CUDA graph, SDPA too, so host launch cost and TMA
descriptor building are not the kernel's), TFLOP/s (4*H*T*S*D), the ratio to SDPA, and the relative L2 error
vs the fp64 truth on fresh random inputs drawn for that variant (SDPA's own error on the same inputs
beside it, and the precision model's, ``fp8_attention_lowp_ref``). A variant is "in the band" when its
error is at most 2x SDPA's (the kernel tests' factor). Then the default with queries rotated on load (the
worker's call) and with 4 input sets rotated (120 MB of FP8 K/V: out of L2, as the worker's 60 blocks'
caches are). Prints a table; the fastest in-band variant's ``TUNED``/``DEFAULT`` lines; LAST the chosen
(default) variant's ratio to SDPA.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.graph_timing import graph_ms
from kernels import fp8_attention as attn
from kernels.rope import dequantize_fp8
from worker.rope import rope_tables

H, D, T, S = 20, 128, 757, 5788
FLOPS = 4.0 * H * T * S * D
BAND = 2.0  # in the band: relative error <= BAND x SDPA's on the same inputs


def graph_us(fn, calls: int = 10) -> float:
    """GPU µs per call: ``calls`` invocations fn(i) captured in one CUDA graph, median replay / calls."""
    return graph_ms(fn, calls) * 1e3 / calls


def inputs(dev):
    """Fresh random q [H,T,D] bf16, FP8 K and keys-contiguous V with per-head scales, their bf16 dequant."""
    q = torch.randn(H, T, D, device=dev).bfloat16()
    ks = torch.rand(H, device=dev) * 0.02 + 0.01
    vs = torch.rand(H, device=dev) * 0.02 + 0.01
    kc = torch.clamp(torch.randn(H, S, D, device=dev) / ks[:, None, None], -448, 448).to(torch.float8_e4m3fn)
    vc = torch.clamp(torch.randn(H, S, D, device=dev) / vs[:, None, None], -448, 448).to(torch.float8_e4m3fn)
    return q, kc, attn.to_keys_contiguous(vc), ks, vs


def rel_err(o: torch.Tensor, truth: torch.Tensor) -> float:
    return ((o.double() - truth).norm() / truth.norm()).item()


def sdpa(q, kc, vk, ks, vs):
    """bf16 SDPA over the dequantized window (dequantized here, once: the returned call is SDPA alone)."""
    kb, vb = dequantize_fp8(kc, ks).bfloat16(), dequantize_fp8(vk.contiguous(), vs).bfloat16()
    return lambda: F.scaled_dot_product_attention(q[None], kb[None], vb[None])[0]


def errors(dev, qk, pv, cfg) -> dict:
    """The variant's, SDPA's and the precision model's relative errors vs fp64 on fresh inputs."""
    q, kc, vk, ks, vs = inputs(dev)
    truth = attn.fp8_attention_ref(q, kc, vk, ks, vs, S, compute_dtype=torch.float64).double()
    o = attn.launch(q, kc, vk, ks, vs, S, None, qk, pv, cfg=cfg)
    lowp = attn.fp8_attention_lowp_ref(q, kc, vk, ks, vs, S, qk=qk, pv=pv)
    return {
        "err": rel_err(o, truth) if torch.isfinite(o).all() else float("inf"),
        "sdpa_err": rel_err(sdpa(q, kc, vk, ks, vs)(), truth),
        "model_err": rel_err(lowp, truth),
    }


def cfg_of(bm, bn, w, st, tma=True) -> dict:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": st, "TMA": tma}


def cfg_name(cfg: dict) -> str:
    return f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']} w{cfg['num_warps']} s{cfg['num_stages']}" + (
        " TMA" if cfg["TMA"] else " ptr"
    )


def tile_cfg(spec: str, pair: tuple[str, str]) -> dict:
    """'128x128' -> its launch (8 warps for 128-row tiles, else 4; 3 stages; TMA); 'tuned': the pair's."""
    if spec == "tuned":
        return dict(attn.TUNED_PAIRS.get(pair, {}).get("keys") or attn.TUNED["keys"])
    try:
        bm, bn = (int(x) for x in spec.split("x"))
    except ValueError:
        raise SystemExit(f"tiles {spec!r}: write BMxBN (e.g. 128x128) or tuned") from None
    return cfg_of(bm, bn, 8 if bm >= 128 else 4, 3)


def candidates(pairs: str, tiles: str) -> list[tuple[str, str, dict]]:
    """``--pairs``/``--tiles`` -> (qk, pv, cfg) to time; an unknown mode names the valid ones."""
    out = []
    for item in (p.strip() for p in pairs.split(",") if p.strip()):
        pair_s, _, own = item.partition("@")
        qk, _, pv = pair_s.partition("+")
        if qk not in attn.QK_MODES or pv not in attn.GPU_PV_MODES:
            raise SystemExit(
                f"pair {item!r}: write QK+PV with QK in {list(attn.QK_MODES)}, PV in "
                f"{list(attn.GPU_PV_MODES)} (the GPU's), optionally @BMxBN"
            )
        for t in [own] if own else tiles.split(","):
            c = (qk, pv, tile_cfg(t.strip(), (qk, pv)))
            if c not in out:
                out.append(c)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-s", type=float, default=150.0, help="stop timing new variants after this")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--pairs",
        default=None,
        help="only these precision pairs, QK+PV comma-separated (e.g. split+bf16,bf16+bf16,fp8+fp8@64x128)",
    )
    ap.add_argument("--tiles", default="tuned", help="with --pairs: BMxBN tiles, comma-separated, or tuned")
    ap.add_argument(
        "--model",
        action="store_true",
        help="CPU: only the precision model's error per pair (--pairs; all by default), no kernel",
    )
    args = ap.parse_args()
    if args.model:
        return model_errors(args)
    if args.pairs:
        return short(args)
    dev = torch.device("cuda")
    print(f"# {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC  {torch.cuda.get_device_name()}  torch {torch.__version__}"
          f"  triton {triton.__version__}  H={H} D={D} T={T} S={S}  DEFAULT={attn.DEFAULT}", flush=True)  # fmt: skip
    q, kc, vk, ks, vs = inputs(dev)  # the timing set (errors come from fresh sets per variant)
    sdpa_call = sdpa(q, kc, vk, ks, vs)
    sdpa_us = graph_us(lambda i: sdpa_call())
    rows = []

    def add(name, qk, pv, cfg, us, e):
        r = {"name": name, "qk": qk, "pv": pv, "cfg": cfg, "us": us, **e}
        r["band"] = e.get("err", math.inf) <= BAND * e.get("sdpa_err", 0.0)
        rows.append(r)
        tf = FLOPS / us / 1e6 if us else float("nan")
        print(f"{name:52s} {us:8.1f} us {tf:7.1f} TFLOP/s  x{us / sdpa_us:.3f} SDPA  err {e.get('err', 0):.2e}"
              f"  (sdpa {e.get('sdpa_err', 0):.2e}, model {e.get('model_err', 0):.2e})  band {r['band']}",
              flush=True)  # fmt: skip

    e = errors(dev, "bf16", "bf16", None)
    add("bf16 SDPA (baseline)", "-", "-", None, sdpa_us, {"err": e["sdpa_err"], "sdpa_err": e["sdpa_err"]})
    tuned = attn.TUNED["keys"]
    variants = [(qk, pv, dict(tuned)) for qk in attn.QK_MODES for pv in attn.PV_MODES]
    tiles = [cfg_of(64, 128, 4, 3), cfg_of(128, 128, 8, 3), cfg_of(128, 128, 8, 2), cfg_of(64, 128, 4, 2),
             cfg_of(64, 64, 4, 3), cfg_of(128, 64, 8, 3), cfg_of(64, 128, 4, 3, tma=False),
             cfg_of(128, 128, 8, 3, tma=False)]  # fmt: skip
    variants += [(*attn.DEFAULT, c) for c in tiles if c != tuned]
    variants += [(qk, pv, cfg_of(64, 128, 4, 3)) for qk, pv in (("fp8", "fp8"), ("bf16", "bf16"))]
    variants = [v for i, v in enumerate(variants) if v not in variants[:i]]
    t0 = time.monotonic()
    for qk, pv, cfg in variants:
        name = f"{qk:5s} QK + {pv:5s} PV  {cfg_name(cfg)}"
        if time.monotonic() - t0 > args.budget_s:
            print(f"{name:52s} skipped: the {args.budget_s:.0f} s budget is spent", flush=True)
            continue
        if pv not in attn.GPU_PV_MODES:
            q1, k1, v1, ks1, vs1 = inputs(dev)
            truth = attn.fp8_attention_ref(q1, k1, v1, ks1, vs1, S, compute_dtype=torch.float64).double()
            model = rel_err(attn.fp8_attention_lowp_ref(q1, k1, v1, ks1, vs1, S, qk=qk, pv=pv), truth)
            print(
                f"{name:52s} not run on the GPU (GPU_PV_MODES); its precision model's error {model:.2e}",
                flush=True,
            )
            continue
        try:
            e = errors(dev, qk, pv, cfg)
            us = graph_us(
                lambda i, qk=qk, pv=pv, cfg=cfg: attn.launch(q, kc, vk, ks, vs, S, None, qk, pv, cfg=cfg)
            )
            add(name, qk, pv, cfg, us, e)
        except Exception as ex:  # noqa: BLE001 - report and keep sweeping
            print(f"{name:52s} failed: {repr(ex)[:300]}", flush=True)

    # the worker's call: queries rotated on load, default precision and tiles; then out of L2
    cos, sin = rope_tables(torch.arange(20_000, 20_000 + T, device=dev), D)
    rot_us = graph_us(lambda i: attn.fp8_attention(q, kc, vk, ks, vs, S, q_cos=cos, q_sin=sin))
    add("default, queries rotated on load (the worker's call)", *attn.DEFAULT, tuned, rot_us, {})
    sets = [inputs(dev) for _ in range(4)]
    cold_sdpa = [sdpa(*s) for s in sets]
    cold_sdpa_us = graph_us(lambda i: cold_sdpa[i % 4](), calls=12)
    cold_us = graph_us(lambda i: attn.fp8_attention(*sets[i % 4], S), calls=12)
    print(f"out of L2 (4 input sets rotated): SDPA {cold_sdpa_us:.1f} us, default {cold_us:.1f} us:"
          f" x{cold_us / cold_sdpa_us:.3f}", flush=True)  # fmt: skip

    print("\n| variant | µs/call | TFLOP/s | / SDPA | rel.err vs fp64 | SDPA's | model's | in band |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['us']:.1f} | {FLOPS / r['us'] / 1e6:.0f} | {r['us'] / sdpa_us:.3f} | "
              f"{r.get('err', math.nan):.2e} | {r.get('sdpa_err', math.nan):.2e} | {r.get('model_err', math.nan):.2e} "
              f"| {'yes' if r['band'] else 'no'} |")  # fmt: skip
    print(f"| out of L2, default (4 sets) | {cold_us:.1f} | {FLOPS / cold_us / 1e6:.0f} | {cold_us / cold_sdpa_us:.3f}"
          f" (SDPA {cold_sdpa_us:.1f}) | | | | |")  # fmt: skip
    fast = [
        r
        for r in rows
        if r["band"] and r["qk"] != "-" and r["cfg"] is not None and "rotated" not in r["name"]
    ]
    if fast:
        best = min(fast, key=lambda r: r["us"])
        print(
            f"\nfastest in the band: {best['name']}: {best['us']:.1f} us = {best['us'] / sdpa_us:.3f}x SDPA"
        )
        print(
            f'  kernels/fp8_attention.py: DEFAULT = {(best["qk"], best["pv"])!r}; TUNED "keys": {best["cfg"]!r}'
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sdpa_us": sdpa_us, "rows": rows, "rotated_us": rot_us, "cold": [cold_sdpa_us, cold_us]}, f,
                      indent=1, default=str)  # fmt: skip
    chosen = next((r for r in rows if (r["qk"], r["pv"]) == attn.DEFAULT and r["cfg"] == tuned), None)
    if chosen is None:
        print(f"chosen {attn.DEFAULT} {cfg_name(tuned)}: failed (see above)")
        return
    print(
        f"chosen {attn.DEFAULT} {cfg_name(tuned)}: {chosen['us']:.1f} us / SDPA {sdpa_us:.1f} us = "
        f"{chosen['us'] / sdpa_us:.3f}x (goal <= 0.55), rel.err {chosen['err']:.2e} vs SDPA's {chosen['sdpa_err']:.2e}"
    )


def model_errors(args, heads: int = 2, queries: int = 128, seeds: int = 4) -> None:
    """``--model`` (any device, the CPU box): each pair's precision model (``fp8_attention_lowp_ref`` in fp64)
    vs the fp64 truth at ``heads`` x ``queries`` of the rank's window, over ``seeds`` input sets, with bf16
    SDPA's on the same inputs; last, bf16+bf16's error over the default's (the pair that may replace it)."""
    global H, T
    H, T = heads, queries
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    pairs = [(c[0], c[1]) for c in candidates(args.pairs, "tuned")] if args.pairs else [
        (qk, pv) for qk in attn.QK_MODES for pv in attn.PV_MODES]  # fmt: skip
    errs: dict = {p: [] for p in [("-", "-"), *pairs]}
    for seed in range(seeds):
        torch.manual_seed(seed)
        q, kc, vk, ks, vs = inputs(dev)
        truth = attn.fp8_attention_ref(q, kc, vk, ks, vs, S, compute_dtype=torch.float64).double()
        errs[("-", "-")].append(rel_err(sdpa(q, kc, vk, ks, vs)(), truth))
        for qk, pv in pairs:
            o = attn.fp8_attention_lowp_ref(q, kc, vk, ks, vs, S, qk=qk, pv=pv, compute_dtype=torch.float64)
            errs[(qk, pv)].append(rel_err(o, truth))
    print(f"# precision model, {dev.type}: H={H} T={T} S={S} D={D}, {seeds} seeds; DEFAULT={attn.DEFAULT}")
    print("| QK+PV | rel.err vs fp64 (min-max over seeds) | / SDPA's |")
    print("|---|---|---|")
    sd = statistics.mean(errs[("-", "-")])
    for (qk, pv), e in errs.items():
        name = "bf16 SDPA" if qk == "-" else f"{qk}+{pv}"
        print(f"| {name} | {min(e):.2e}-{max(e):.2e} | {statistics.mean(e) / sd:.2f} |")
    if ("bf16", "bf16") in errs and attn.DEFAULT in errs:
        r = statistics.mean(errs[("bf16", "bf16")]) / statistics.mean(errs[attn.DEFAULT])
        print(f"bf16+bf16's error / DEFAULT {attn.DEFAULT}'s: {r:.3f}")


def short(args, dev=None) -> None:
    """``--pairs``: those candidates and SDPA in one process; the fastest inside the band, then its ratio."""
    dev = dev or torch.device("cuda")
    cands = candidates(args.pairs, args.tiles)
    print(f"# {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC  {torch.cuda.get_device_name()}  torch {torch.__version__}"
          f"  triton {triton.__version__}  H={H} D={D} T={T} S={S}  DEFAULT={attn.DEFAULT} FAST={attn.FAST}",
          flush=True)  # fmt: skip
    q, kc, vk, ks, vs = inputs(dev)
    sdpa_call = sdpa(q, kc, vk, ks, vs)
    sdpa_us = graph_us(lambda i: sdpa_call())
    e = errors(dev, "bf16", "bf16", None)
    rows = [
        {
            "name": "bf16 SDPA (baseline)",
            "qk": "-",
            "pv": "-",
            "cfg": None,
            "us": sdpa_us,
            "err": e["sdpa_err"],
            "sdpa_err": e["sdpa_err"],
            "model_err": math.nan,
            "band": True,
        }
    ]
    for qk, pv, cfg in cands:
        name = f"{qk}+{pv} {cfg_name(cfg)}"
        try:
            e = errors(dev, qk, pv, cfg)
            us = graph_us(
                lambda i, qk=qk, pv=pv, cfg=cfg: attn.launch(q, kc, vk, ks, vs, S, None, qk, pv, cfg=cfg)
            )
        except Exception as ex:  # noqa: BLE001 - report and time the others
            print(f"{name}: failed: {repr(ex)[:300]}", flush=True)
            continue
        rows.append(
            {
                "name": name,
                "qk": qk,
                "pv": pv,
                "cfg": cfg,
                "us": us,
                **e,
                "band": e["err"] <= BAND * e["sdpa_err"],
            }
        )
        print(f"{name}: {us:.1f} us, err {e['err']:.2e} (SDPA {e['sdpa_err']:.2e})", flush=True)
    print("\n| QK+PV, tiles | µs/call | TFLOP/s | / SDPA | rel.err vs fp64 | SDPA's | model's | in band |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['name']} | {r['us']:.1f} | {FLOPS / r['us'] / 1e6:.0f} | {r['us'] / sdpa_us:.3f} | "
            f"{r['err']:.2e} | {r['sdpa_err']:.2e} | {r['model_err']:.2e} | {'yes' if r['band'] else 'no'} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sdpa_us": sdpa_us, "rows": rows}, f, indent=1, default=str)
    fast = next((r for r in rows if (r["qk"], r["pv"]) == attn.FAST), None)
    if fast is not None:
        print(
            f"FAST {attn.FAST} (switch attention_fp8_dots) {cfg_name(fast['cfg'])}: {fast['us']:.1f} us = "
            f"{fast['us'] / sdpa_us:.3f}x SDPA, in band: {'yes' if fast['band'] else 'no'}"
        )
    inband = [r for r in rows[1:] if r["band"]]
    if not inband:
        print(f"no candidate inside the band (error <= {BAND:g}x SDPA's); SDPA {sdpa_us:.1f} us")
        return
    best = min(inband, key=lambda r: r["us"])
    cur = next(
        (r for r in inband if (r["qk"], r["pv"]) == attn.DEFAULT and r["cfg"] == attn.TUNED["keys"]), None
    )
    verdict = (
        "keep DEFAULT"
        if cur is best
        else f'set kernels/fp8_attention.py DEFAULT = {(best["qk"], best["pv"])!r}; TUNED "keys": {best["cfg"]!r}'
    )
    print(
        f"choice: {verdict}"
        + (f" ({best['us']:.1f} us vs DEFAULT's {cur['us']:.1f} us)" if cur and cur is not best else "")
    )
    print(
        f"fastest in the band: {best['name']}: {best['us']:.1f} us / SDPA {sdpa_us:.1f} us = {best['us'] / sdpa_us:.3f}x"
        f" (goal <= 0.55), rel.err {best['err']:.2e} vs SDPA's {best['sdpa_err']:.2e}"
    )


if __name__ == "__main__":
    main()
