"""How far the FP8 activation scalings move the model's latents: "tensor" and "static" against "row".

    python bench/act_scales.py [--preset tiny] [--device cpu] [--steps 4]

Runs the same chunks (same seeds: a first forward, then ``--steps`` chunks with a reset, ring + FP8 cache)
with each ``DiT.act_scales`` from fresh scales, FP8 weights, and prints the relative L2 distance of the
latents to the per-row path's; last, the ratio static / tensor (how much further static moves them than
the per-tensor dynamic path does; < 1: closer).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from worker.cache import make_cache
from worker.config import ModelShape, Switches
from worker.model import DiT


def latents(model: DiT, act_scales: str, steps: int) -> torch.Tensor:
    model.act_scales = act_scales
    model.set_compile(False)  # this scaling's quantizers
    model.reset_act_scales()  # static: calibrate again on these inputs
    shape, dev = model.shape, model.device
    sw = Switches(ring_cache=True, rope_at_write=True, fp8_cache=True)
    cache = make_cache(shape, sw, dev, model.dtype)
    g = torch.Generator(device=dev).manual_seed(3)
    cond_kv = model.first_forward(torch.randn(9, shape.d_model, generator=g, device=dev), cache)
    out = []
    for i in range(steps):
        cache.begin_step(shape.new_tokens, reset=i == 2)
        noise = torch.randn(shape.new_tokens, shape.latent_channels, generator=g, device=dev)
        out.append(model.denoise_chunk(noise, cache, cond_kv).float())
        cache.end_step()
    return torch.stack(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    model = DiT(ModelShape.from_name(args.preset), args.device, dtype=torch.bfloat16, fp8=True)
    ref = latents(model, "row", args.steps)
    print(f"{'act_scales':<12}{'rel. L2 distance to row':>26}")
    dist = {}
    for name in ("tensor", "static"):
        dist[name] = ((latents(model, name, args.steps) - ref).norm() / ref.norm()).item()
        print(f"{name:<12}{dist[name]:>26.4f}")
    print(f"static / tensor = {dist['static'] / dist['tensor']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
