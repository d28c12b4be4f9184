"""The switch names of the wire contract, importable with no dependency at all.

The worker imports this (its GPU machine has no pydantic); ``collector.records`` re-exports it.
Each name is an optimization of the paper with its plain path kept; ``buffer_per_shape`` is the fault
switch that reproduces the August leak (off by default).
"""

SWITCH_NAMES: tuple[str, ...] = (
    "ring_cache",
    "rope_at_write",
    "fp8_cache",
    "delta_rotation",
    "triton_kernels",
    "fused_allreduce",
    "decoder_own_gpu",
    "cuda_graphs",
    "compile",
    "static_scales",
    "buffer_per_shape",
)

# The switches that change the model's numerics (the latents, not only the time): each is a production
# default for a GPU kind only with a passing evaluation of that kind and release (``livestep evaluate``,
# api/evaluation_gate.py). The others (decoder_own_gpu, cuda_graphs: the same kernels; buffer_per_shape:
# a fault) move no number.
NUMERIC_SWITCHES: tuple[str, ...] = (
    "ring_cache",
    "rope_at_write",
    "fp8_cache",
    "delta_rotation",
    "triton_kernels",
    "fused_allreduce",
    "compile",
    "static_scales",
)
assert set(NUMERIC_SWITCHES) <= set(SWITCH_NAMES)
