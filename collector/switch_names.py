"""The switch names of the wire contract (and the names of an evaluation of the numeric ones' decoded-frame
view), importable with no dependency at all.

The worker imports this (its GPU machine has no pydantic); ``collector.records`` re-exports it.
Each name is an optimization of the paper with its plain path kept; ``buffer_per_shape`` is the fault
switch that reproduces the August leak (off by default). The ``turn_*`` switches are the playout
policies of a conversational turn (worker/turns.py): at most one is on, none is the plain ``keep``.
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
    "turn_drop_unplayed",
    "turn_trim",
    "turn_cover",
)

# switch -> the playout policy it turns on (worker/turns.py; records.PLAYOUT_POLICIES); all off: keep
PLAYOUT_SWITCHES: dict[str, str] = {"turn_drop_unplayed": "drop_unplayed", "turn_trim": "trim",
                                    "turn_cover": "cover"}
# Off in the production configuration (``Switches.all_on``, the control plane's DEFAULTS): the fault
# switch, and the playout policies other than the production one (``turn_cover``: the lowest turn
# latency without a late chunk by design, docs/PERFORMANCE.md "Issue 20")
PRODUCTION_OFF: tuple[str, ...] = ("buffer_per_shape", "turn_drop_unplayed", "turn_trim")

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
assert set(PLAYOUT_SWITCHES) <= set(SWITCH_NAMES) and set(PRODUCTION_OFF) <= set(SWITCH_NAMES)

# ``livestep evaluate``'s view of the decoded frames beside the latents (worker/evaluation_frames.py): the
# evaluation records' metric names for PSNR, SSIM and temporal flicker against the truth's frames
FRAME_METRICS: tuple[str, ...] = ("frame_psnr", "frame_ssim", "flicker")
