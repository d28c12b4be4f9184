"""What a flip's window moves cost in memory (issue 26: memory held for readiness): the live swap's carry of
the window into the target's cache, and a quick build's stand-in window, each the whole window at once (the
code before 2026-12-02 14:00, still spelled by ``export_tokens`` / ``load_tokens``) against a block at a time
(``carry_cache``, ``load_blocks``), on one TP rank's cache of a preset. Prints a table, and last the ratios
(block at a time / whole window) measured in the same run.

    python bench/carry_memory.py                              # prod57b, TP=3 rank, CPU: ~2 min, ~10 GB RAM
    python bench/carry_memory.py --preset small --tp 1        # smaller
    python bench/carry_memory.py --device cuda                # the caching allocator's peak (H200)

Peak memory above the two caches, each variant in a fresh process: on CUDA ``torch.cuda.max_memory_allocated``
(what the caching allocator must reserve), on the CPU the resident set's high-water mark (``VmHWM``, reset
through ``/proc/self/clear_refs`` after the set-up). The caches: production's (ring, RoPE at write, FP8
store, delta rotation) carried into the same configuration (a flip such as ``static_scales`` that keeps the
cache's layout), window full.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("carry_whole", "carry_blocks", "fill_whole", "fill_blocks")


def _status_bytes(field: str) -> int:
    """A memory figure of this process from ``/proc/self/status`` (``VmRSS``, ``VmHWM``), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(variant: str, preset: str, tp: int, device: str) -> dict:
    sys.path.insert(0, str(REPO))
    import torch

    from worker.cache import make_cache
    from worker.config import ModelShape, Switches, tp_rank_of
    from worker.flips import carry_cache

    shape = tp_rank_of(ModelShape.from_name(preset), tp=tp) if tp > 1 else ModelShape.from_name(preset)
    sw = Switches(ring_cache=True, rope_at_write=True, fp8_cache=True, delta_rotation=True)
    dtype = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    size = (shape.heads, shape.window, shape.head_dim)

    def stand_in(b):
        return (torch.randn(size, generator=gen, device=device, dtype=dtype),
                torch.randn(size, generator=gen, device=device, dtype=dtype))

    src, dst = make_cache(shape, sw, device, dtype), make_cache(shape, sw, device, dtype)
    if variant.startswith("carry"):
        src.load_blocks(stand_in, shape.window, shape.window)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = _status_bytes("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts at the current RSS
    t0 = time.perf_counter()
    if variant == "carry_whole":
        k, v, next_pos = src.export_tokens()
        dst.restart()
        dst.load_tokens(k, v, next_pos)
        del k, v
    elif variant == "carry_blocks":
        carry_cache(src, dst)
    elif variant == "fill_whole":  # build_quick's stand-in window as it was
        k = torch.randn(shape.n_blocks, *size, generator=gen, device=device).to(dtype)
        dst.load_tokens(k, torch.randn_like(k), shape.window)
        del k
    else:
        dst.load_blocks(stand_in, shape.window, shape.window)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() if cuda else _status_bytes("VmHWM")) - base
    return {"variant": variant, "peak_above_caches": peak, "cache_bytes": src.nbytes, "seconds": seconds,
            "tokens": shape.window, "blocks": shape.n_blocks}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="prod57b")
    ap.add_argument("--tp", type=int, default=None, help="tensor-parallel ranks (default 3 on prod57b, else 1)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    tp = a.tp if a.tp is not None else (3 if a.preset == "prod57b" else 1)
    if a.child:
        print(json.dumps(child(a.child, a.preset, tp, a.device)))
        return 0
    rows = {}
    for v in VARIANTS:  # a fresh process each: no peak, allocator cache or page left by another
        out = subprocess.run([sys.executable, __file__, "--child", v, "--preset", a.preset, "--tp", str(tp),
                              "--device", a.device], capture_output=True, text=True, check=False)
        if out.returncode != 0:
            print(out.stderr[-3000:], file=sys.stderr)
            return 1
        rows[v] = json.loads(out.stdout.strip().splitlines()[-1])
    gib = 2**30
    first = rows[VARIANTS[0]]
    print(f"{a.preset}, TP={tp} rank, {a.device}: {first['blocks']} blocks, {first['tokens']} tokens, one cache "
          f"{first['cache_bytes'] / gib:.2f} GiB")
    print(f"{'variant':<14}{'peak above the caches (GiB)':>30}{'x one cache':>14}{'seconds':>10}")
    for v, r in rows.items():
        print(f"{v:<14}{r['peak_above_caches'] / gib:>30.3f}{r['peak_above_caches'] / r['cache_bytes']:>14.3f}"
              f"{r['seconds']:>10.2f}")
    for op in ("carry", "fill"):
        whole, blocks = rows[f"{op}_whole"]["peak_above_caches"], rows[f"{op}_blocks"]["peak_above_caches"]
        print(f"ratio {op} (a block at a time / the whole window): {blocks / whole:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
