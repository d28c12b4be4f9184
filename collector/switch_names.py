"""The switch names of the wire contract (and the names of an evaluation of the numeric ones' decoded-frame
view), importable with no dependency at all.

The worker imports this (its GPU machine has no pydantic); ``collector.records`` re-exports it.
Each name is an optimization of the paper with its plain path kept; ``buffer_per_shape`` is the fault
switch that reproduces the August leak (off by default). The ``turn_*`` switches are the playout
policies of a conversational turn (worker/turns.py): at most one is on, none is the plain ``keep``.
``attention_fp8_dots`` picks the FP8 attention kernel's precision (kernels/fp8_attention.py ``FAST`` over
its band-safe ``DEFAULT``); it acts where that kernel runs (``triton_kernels`` on CUDA, an FP8 window).
New names go last: a TP group's switch bitmask (worker/parallel.py) keeps every older name's bit.
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
    "attention_fp8_dots",
)

# switch -> the playout policy it turns on (worker/turns.py; records.PLAYOUT_POLICIES); all off: keep
PLAYOUT_SWITCHES: dict[str, str] = {"turn_drop_unplayed": "drop_unplayed", "turn_trim": "trim",
                                    "turn_cover": "cover"}
# Off in the production configuration (``Switches.all_on``, the control plane's DEFAULTS): the fault
# switch, the playout policies other than the production one (``turn_cover``: the lowest turn latency
# without a late chunk by design, docs/PERFORMANCE.md "Issue 20"), and ``attention_fp8_dots`` (the FP8
# attention kernel's all-FP8 precision pair: ~1.9x faster than the default pair on the H200 sweep, but
# 10x SDPA's error, outside the quality band; docs/PERFORMANCE.md "Issue 27")
PRODUCTION_OFF: tuple[str, ...] = ("buffer_per_shape", "turn_drop_unplayed", "turn_trim", "attention_fp8_dots")

# The switches that change the model's numerics (the latents, not only the time): each is a production
# default for a GPU kind only with a passing evaluation of that kind and release (``livestep evaluate``,
# api/evaluation_gate.py). Every switch but these, which move no number: decoder_own_gpu and cuda_graphs
# (the same kernels), buffer_per_shape (a fault) and the playout policies. A new switch is numeric (gated)
# unless it is named here.
MOVES_NO_NUMBER: tuple[str, ...] = ("decoder_own_gpu", "cuda_graphs", "buffer_per_shape", *PLAYOUT_SWITCHES)
NUMERIC_SWITCHES: tuple[str, ...] = tuple(n for n in SWITCH_NAMES if n not in MOVES_NO_NUMBER)
assert set(MOVES_NO_NUMBER) <= set(SWITCH_NAMES)
assert set(PLAYOUT_SWITCHES) <= set(SWITCH_NAMES) and set(PRODUCTION_OFF) <= set(SWITCH_NAMES)

# ``livestep evaluate``'s view of the decoded frames beside the latents (worker/evaluation_frames.py): the
# evaluation records' metric names for PSNR, SSIM and temporal flicker against the truth's frames
FRAME_METRICS: tuple[str, ...] = ("frame_psnr", "frame_ssim", "flicker")
