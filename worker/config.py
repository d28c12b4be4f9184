"""Model shapes and switches: the two pieces of configuration the worker runs from.

    shape = ModelShape.from_name("tiny")          # tiny | small | prod57b
    rank = tp_rank_of(ModelShape.from_name("prod57b"), tp=3)   # 20 heads, FFN 10240
    sw = Switches(ring_cache=True, rope_at_write=True)        # validated once, here

Presets follow gpt-fast's ``ModelArgs``: named configurations with derived fields computed in
``__post_init__``. ``Switches`` field names are exactly ``collector.switch_names.SWITCH_NAMES`` (the
wire contract, a module with no dependencies, so the GPU machine needs no pydantic).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from collector.switch_names import (  # dependency-free: the GPU machine has no pydantic
    PLAYOUT_SWITCHES,
    PRODUCTION_OFF,
    SWITCH_NAMES,
)


class ShapeError(ValueError):
    """An unknown preset or an impossible shape / tensor-parallel split."""


class SwitchError(ValueError):
    """An unknown switch name, a bad value, or an invalid combination of switches."""


# Chunks the player buffers before it starts playing (Session's ``preroll``, ``--preroll``): each is
# about one step of time to first frame, and slack against a slow step (a position reset) before the
# first late chunk; 1..the playout buffer's capacity (4).
PREROLL = 2


@dataclass(frozen=True)
class ModelShape:
    """One model size. ``n_heads``/``ffn`` are the full model's; a TP rank sees ``heads``/``ffn_local``."""

    name: str
    n_blocks: int
    d_model: int
    n_heads: int
    head_dim: int
    ffn: int
    window: int  # KV slots per attention call (cache + the step's new tokens)
    passes: int = 4  # denoising passes per chunk
    reset_every: int = 42  # steps between position resets
    frames_per_chunk: int = 4
    grid_h: int = 11  # latent tokens per frame = grid_h * grid_w
    grid_w: int = 17
    extra_tokens: int = 9  # non-video tokens of a chunk (audio/state), not decoded
    latent_channels: int = 16
    upsample: int = 64  # decoder upsampling factor per side (frame = grid * upsample)
    decoder_channels: int = 64
    cond_tokens: tuple[int, int] = (256, 2048)  # conditioning length range (varies per session)
    fp8_weights: bool = False  # FP8 GEMMs on CUDA (bf16 otherwise; fp32 on CPU)
    fp8_attention: bool = False  # attention reads an FP8 window (the plain path re-quantizes per read)
    rope_base: float = 10000.0
    seed: int = 0
    tp_size: int = 1
    tp_rank: int = 0
    # derived in __post_init__
    new_tokens: int = field(init=False)
    heads: int = field(init=False)  # this rank's heads
    ffn_local: int = field(init=False)
    frame_h: int = field(init=False)
    frame_w: int = field(init=False)
    params: int = field(init=False)  # the full model's parameter count

    def __post_init__(self) -> None:
        d = self.d_model
        if self.n_heads * self.head_dim != d:
            raise ShapeError(f"{self.name}: n_heads*head_dim = {self.n_heads * self.head_dim} != d_model {d}")
        if self.head_dim % 2:
            raise ShapeError(f"{self.name}: head_dim must be even for RoPE, got {self.head_dim}")
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ShapeError(f"tp_rank {self.tp_rank} not in [0, {self.tp_size})")
        if self.n_heads % self.tp_size or self.ffn % self.tp_size:
            raise ShapeError(
                f"{self.name}: tp={self.tp_size} must divide heads ({self.n_heads}) and ffn ({self.ffn}); "
                f"valid tp sizes: {', '.join(str(t) for t in valid_tp_sizes(self))}"
            )
        set_ = object.__setattr__
        set_(self, "new_tokens", self.frames_per_chunk * self.grid_h * self.grid_w + self.extra_tokens)
        set_(self, "heads", self.n_heads // self.tp_size)
        set_(self, "ffn_local", self.ffn // self.tp_size)
        set_(self, "frame_h", self.grid_h * self.upsample)
        set_(self, "frame_w", self.grid_w * self.upsample)
        set_(self, "params", param_count(self))
        if self.window <= self.new_tokens:
            raise ShapeError(f"{self.name}: window {self.window} must exceed new tokens {self.new_tokens}")
        lo, hi = self.cond_tokens
        if not 1 <= lo <= hi or hi + self.new_tokens > self.window:
            raise ShapeError(f"{self.name}: cond_tokens {self.cond_tokens} must fit the window with a chunk")

    @property
    def attention_calls_per_step(self) -> int:
        return self.n_blocks * self.passes

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> ModelShape:
        if name not in PRESETS:
            raise ShapeError(f"unknown preset {name!r}; valid presets: {', '.join(PRESETS)}")
        return replace(PRESETS[name], **overrides) if overrides else PRESETS[name]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def param_count(s: ModelShape) -> int:
    """Parameters of the full model (all heads): blocks + timestep embedding + in/out projections."""
    d = s.d_model
    per_block = (
        3 * d * d + d * d  # self-attention QKV + out
        + d * d + 2 * d * d + d * d  # cross-attention Q, KV (conditioning is d wide), out
        + 2 * d * s.ffn  # MLP up + down
        + 6 * d  # adaLN-single modulation table (shift/scale/gate x 2)
    )
    t_embed = 256 * d  # sinusoidal(256) -> d, shared by all blocks (adaLN-single)
    io = s.latent_channels * d + d * s.latent_channels + 2 * d
    return s.n_blocks * per_block + t_embed + io


def valid_tp_sizes(s: ModelShape) -> list[int]:
    return [t for t in range(1, s.n_heads + 1) if s.n_heads % t == 0 and s.ffn % t == 0]


def tp_rank_of(shape: ModelShape, tp: int, rank: int = 0) -> ModelShape:
    """The view one tensor-parallel rank has of ``shape`` (heads and FFN split ``tp`` ways)."""
    if tp < 1 or not 0 <= rank < tp:
        raise ShapeError(f"rank {rank} of tp={tp}: need tp >= 1 and 0 <= rank < tp")
    return replace(shape, tp_size=tp, tp_rank=rank)


PRESETS: dict[str, ModelShape] = {
    # CPU tests: runs in milliseconds per step; the window wraps every few steps.
    "tiny": ModelShape(
        name="tiny", n_blocks=2, d_model=64, n_heads=4, head_dim=16, ffn=256, window=40,
        reset_every=7, grid_h=1, grid_w=2, extra_tokens=1, latent_channels=4, upsample=4,
        decoder_channels=8, cond_tokens=(4, 16),
    ),
    # one GPU, fast: the production token counts and window with a narrow, shallow model.
    "small": ModelShape(
        name="small", n_blocks=4, d_model=1024, n_heads=8, head_dim=128, ffn=4096, window=5788,
        cond_tokens=(256, 2048), fp8_weights=True, fp8_attention=True, decoder_channels=32,
    ),
    # the paper's 57B-class shape: 60 blocks, 240 attention calls per step.
    "prod57b": ModelShape(
        name="prod57b", n_blocks=60, d_model=7680, n_heads=60, head_dim=128, ffn=30720, window=5788,
        cond_tokens=(256, 2048), fp8_weights=True, fp8_attention=True,
    ),
}

assert PRESETS["prod57b"].new_tokens == 757
assert 56.55e9 < PRESETS["prod57b"].params < 56.65e9, PRESETS["prod57b"].params


# ---------------------------------------------------------------------------------------------
# Switches


def _cache_combos() -> list[str]:
    """Every valid combination of the cache switches, as 'a+b' strings (for error messages)."""
    names = ("ring_cache", "rope_at_write", "fp8_cache", "delta_rotation")
    out = []
    for bits in range(16):
        on = {n for i, n in enumerate(names) if bits >> i & 1}
        if _cache_problem(on) is None:
            out.append("+".join(n for n in names if n in on) or "plain (all off)")
    return out


def _cache_problem(on: set[str]) -> str | None:
    if "ring_cache" in on and "rope_at_write" not in on:
        return (
            "ring_cache needs rope_at_write: positions by slot order are wrong once the ring wraps "
            "(slot order is no longer time order)"
        )
    if "fp8_cache" in on and "rope_at_write" not in on:
        return "fp8_cache needs rope_at_write: an FP8 window cannot be re-rotated at every read"
    if "delta_rotation" in on and "ring_cache" not in on:
        return "delta_rotation needs ring_cache: only the ring keeps rotated keys across a position reset"
    return None


@dataclass(frozen=True)
class Switches:
    """The paper's optimizations, each with its plain path kept; all off is the launch behaviour."""

    ring_cache: bool = False
    rope_at_write: bool = False
    fp8_cache: bool = False
    delta_rotation: bool = False
    triton_kernels: bool = False
    fused_allreduce: bool = False
    decoder_own_gpu: bool = False
    cuda_graphs: bool = False
    compile: bool = False
    static_scales: bool = False  # FP8 activations: static per-tensor scales (off: per-token dynamic scales)
    buffer_per_shape: bool = False  # fault switch: reproduces the August leak
    # a turn's playout policy (worker/turns.py): at most one on; none on is the plain path, keep
    turn_drop_unplayed: bool = False
    turn_trim: bool = False
    turn_cover: bool = False
    # the FP8 attention kernel's all-FP8 precision pair (kernels/fp8_attention.py FAST) over its
    # band-safe DEFAULT: faster, outside the quality band (off in production); acts with triton_kernels
    attention_fp8_dots: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            if not isinstance(getattr(self, f.name), bool):
                raise SwitchError(f"switch {f.name} must be a bool, got {getattr(self, f.name)!r}")
        problem = _cache_problem(self.on())
        if problem:
            raise SwitchError(f"{problem}. Valid cache combinations: {'; '.join(_cache_combos())}")
        policies = sorted(self.on() & PLAYOUT_SWITCHES.keys())
        if len(policies) > 1:
            raise SwitchError(f"playout policies {policies} are on together; valid: at most one of "
                              f"{', '.join(PLAYOUT_SWITCHES)} (none: keep)")

    @property
    def playout_policy(self) -> str:
        """The turn playout policy these switches pick (worker/turns.py): keep when none is on."""
        return next((p for n, p in PLAYOUT_SWITCHES.items() if getattr(self, n)), "keep")

    def with_policy(self, policy: str) -> Switches:
        """These switches with ``policy`` as the playout policy (keep: every turn_* switch off)."""
        valid = ("keep", *PLAYOUT_SWITCHES.values())
        if policy not in valid:
            raise SwitchError(f"playout policy {policy!r}; valid policies: {', '.join(valid)}")
        return self.with_(**{n: p == policy for n, p in PLAYOUT_SWITCHES.items()})

    def model_switches(self) -> Switches:
        """The switches that shape the step's work (the playout policies cleared): what a warm worker's
        cache and graphs were made for."""
        return self.with_policy("keep")

    def on(self) -> set[str]:
        return {f.name for f in fields(self) if getattr(self, f.name)}

    def encode(self) -> str:
        """The compact state string of the wire contract: names that are on, sorted, comma-separated."""
        return ",".join(sorted(self.on()))

    def as_dict(self) -> dict[str, bool]:
        return asdict(self)

    def with_(self, **changes: bool) -> Switches:
        return Switches.from_mapping({**self.as_dict(), **changes})

    def changes_to(self, new: Switches) -> dict[str, bool]:
        """The switches ``new`` sets otherwise than these, with ``new``'s values (a flip's ``changed``)."""
        mine = self.as_dict()
        return {k: v for k, v in new.as_dict().items() if mine[k] != v}

    @classmethod
    def from_mapping(cls, m: dict[str, Any]) -> Switches:
        unknown = sorted(set(m) - set(SWITCH_NAMES))
        if unknown:
            raise SwitchError(f"unknown switch(es) {unknown}; valid switches: {', '.join(SWITCH_NAMES)}")
        return cls(**{k: _switch_value(k, v) for k, v in m.items()})

    @classmethod
    def decode(cls, state: str) -> Switches:
        return cls.from_mapping({n: True for n in state.split(",") if n})

    @classmethod
    def all_on(cls, **off: bool) -> Switches:
        """Every optimization on: the production configuration (the fault switch and the playout
        policies other than the production one stay off: ``PRODUCTION_OFF``)."""
        m = {n: n not in PRODUCTION_OFF for n in SWITCH_NAMES}
        return cls.from_mapping({**m, **off})


_VALUES = {"on": True, "true": True, "1": True, "off": False, "false": False, "0": False}


def _switch_value(name: str, v: Any) -> bool:
    """A switch value from a file, a control-plane payload or a flag: a bool, or on/off/true/false/1/0."""
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.lower() in _VALUES:
        return _VALUES[v.lower()]
    raise SwitchError(f"switch {name}: bad value {v!r}; valid values: true/false, on/off, 1/0")


def parse_switch_args(items: list[str], base: Switches | None = None) -> Switches:
    """``['ring_cache=on', 'fp8_cache=off']`` -> Switches (validated once at the end)."""
    m = (base or Switches()).as_dict()
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or value.lower() not in _VALUES:
            raise SwitchError(f"bad switch {item!r}: write name=on|off; valid switches: {', '.join(SWITCH_NAMES)}")
        if name not in SWITCH_NAMES:
            raise SwitchError(f"unknown switch {name!r}; valid switches: {', '.join(SWITCH_NAMES)}")
        m[name] = _VALUES[value.lower()]
    return Switches.from_mapping(m)


assert tuple(f.name for f in fields(Switches)) == SWITCH_NAMES
