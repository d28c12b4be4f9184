"""KV caches of the self-attention window: one interface, the launch behaviour and the ring.

    cache = make_cache(shape, switches, device, dtype)
    cache.begin_step(T, reset=...)          # once per step: advance / delta-rotate; returns reset done
    win = cache.update(block, k_new, v_new)  # every pass: write the step's K/V, return the window
    out = cache.ops.attention(q, win, cache.cos, cache.sin)  # queries RoPE'd at the new tokens'
                                             # positions (tables of cache.positions), slots [0, win.n)
    cache.end_step()                         # commit the step's slots

``PlainCache`` (all switches off): raw keys in time order, positions by slot order, every read
re-applies RoPE to the whole window and re-quantizes it to FP8 (when the shape's attention reads
FP8), and the window advances by copying. ``RingCache``: RoPE (and FP8 with per-head scales
calibrated once per session) applied once at write, advance by index, one delta rotation of the
window at each position reset. Bookkeeping lives in ``CacheBook``, apart from the tensors (vLLM's
KVCacheBlocks habit). Tensors follow contract 6: ``k: [heads, slots, head_dim]`` per block.
Over 450 lines: one cache interface with both implementations (plain and ring) and their torch ops, so the
invalid combination (a ring cache with positions by slot order) is visible in one file.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.compiled import compiled
from worker.config import ModelShape, Switches
from worker.fp8 import FP8, dequantize, head_scale, quantize, quantize_act_static
from worker.rope import apply_rope, apply_rope_tables, rope_tables, rotate_by

# Calibration margin: rotation can grow a component by sqrt(2); later tokens get 25% headroom.
CALIBRATION_MARGIN = math.sqrt(2.0) * 1.25


@dataclass
class CacheBook:
    """Where the window stands: no tensors, host integers only."""

    slots: int
    head: int = 0  # next ring slot to write
    n_valid: int = 0  # committed tokens in the window
    next_pos: int = 0  # absolute position of the next token
    step_tokens: int = 0  # tokens of the open step (0 = none open)
    wraps: int = 0
    resets: int = 0

    @property
    def kept(self) -> int:
        """Committed tokens still in the window once the open step's tokens are in."""
        return min(self.n_valid, self.slots - self.step_tokens)

    @property
    def window_after(self) -> int:
        return min(self.n_valid + self.step_tokens, self.slots)

    def open(self, tokens: int) -> None:
        assert self.step_tokens == 0, "a step is already open"
        assert 0 < tokens <= self.slots, (tokens, self.slots)
        self.step_tokens = tokens

    def commit(self) -> None:
        t = self.step_tokens
        assert t > 0, "no step open"
        if self.head + t >= self.slots:
            self.wraps += 1
        self.head = (self.head + t) % self.slots
        self.n_valid = min(self.n_valid + t, self.slots)
        self.next_pos += t
        self.step_tokens = 0

    def reset_delta(self) -> int:
        """Position shift of a reset: the oldest valid token goes back to position 0."""
        return self.next_pos - self.n_valid


@dataclass
class Window:
    """What attention reads: K/V over slots [0, n) (FP8 with per-head scales, or plain dtype)."""

    k: torch.Tensor  # [heads, slots, head_dim]
    v: torch.Tensor
    k_scale: torch.Tensor | None  # [heads] when k/v are FP8
    v_scale: torch.Tensor | None
    n: int


# ---------------------------------------------------------------------------------------------
# The ops, torch first; Triton kernels (kernels/*) behind the triton_kernels switch on CUDA.


def rope_write_torch(x, cos, sin, slots, scale, cache, apply_rope_: bool = True):
    """x: [H, T, D] -> RoPE (the step's tables [T, D]) -> FP8 (if cache is FP8) -> cache[:, slots] in place."""
    y = apply_rope_tables(x, cos, sin) if apply_rope_ else x
    # an indexed store (index_put_), which torch.compile fuses with RoPE + quantization; the uint8
    # view + index_copy_ it replaces took 12.9 ms/step of GPU time compiled in the worker, against
    # 3.9 ms/step for this form in bench/kernels.py (H200, docs/PERFORMANCE.md)
    cache[:, slots] = quantize(y, scale) if cache.dtype == FP8 else y.to(cache.dtype)


def write_pair_torch(k, v, cos, sin, slots, k_scale, v_scale, k_cache, v_cache, rope_k: bool = True):
    """K (RoPE'd when rope_k) and V of the new tokens into their slots: the upkeep of one attention call."""
    rope_write_torch(k, cos, sin, slots, k_scale, k_cache, rope_k)
    rope_write_torch(v, cos, sin, slots, v_scale, v_cache, False)


def reread_torch(k, v, n, cos, sin, fp8: bool, rope: bool):
    """The plain path's read: RoPE over the whole window (slot order) and a fresh FP8 quantization."""
    k = k[:, :n]
    v = v[:, :n]
    if rope:
        k = apply_rope_tables(k, cos, sin)
    if not fp8:
        return k, v, None, None
    ks, vs = head_scale(k), head_scale(v)
    return quantize(k, ks), quantize(v, vs), ks, vs


def attention_torch(q, win: Window) -> torch.Tensor:
    """q: [H, Tq, D] over the window's slots [0, n): dequantize (if FP8) then SDPA."""
    k, v = win.k[:, : win.n], win.v[:, : win.n]
    if win.k_scale is not None:
        k, v = dequantize(k, win.k_scale, q.dtype), dequantize(v, win.v_scale, q.dtype)
    return F.scaled_dot_product_attention(q[None], k[None], v[None])[0]


def delta_rotate_torch(cache, scale, delta: int) -> None:
    """Every cached key re-rotated as if its position were pos - delta, in place (one pass)."""
    if cache.dtype == FP8:
        cache.copy_(quantize(rotate_by(dequantize(cache, scale, torch.float32), delta), scale))
    else:
        cache.copy_(rotate_by(cache, delta))


def rerotate_from_raw_torch(cache, scale, old_pos, new_pos) -> None:
    """The plain reset: un-rotate every slot at its own position, rotate again at the new one."""
    x = dequantize(cache, scale, torch.float32) if cache.dtype == FP8 else cache.float()
    x = apply_rope(apply_rope(x, -old_pos), new_pos)
    cache.copy_(quantize(x, scale) if cache.dtype == FP8 else x.to(cache.dtype))


def _kernels():
    try:
        import kernels.delta_rotate as dr
        import kernels.fp8_attention as fa
        import kernels.rope_fp8_write as rw
    except ImportError:
        return None
    return rw, dr, fa


class CacheOps:
    """The cache's three ops, dispatched once per switch change (never per call).

    ``kernels``: run the Triton ops (None: with ``triton_kernels`` on CUDA; True: also on the CPU, for
    tests under ``TRITON_INTERPRET=1``). ``attention_pair``: the FP8 attention kernel's (qk, pv)
    precision when it runs -- ``FAST`` with ``attention_fp8_dots``, else its band-safe ``DEFAULT``."""

    def __init__(self, switches: Switches, device: torch.device, kernels: bool | None = None):
        cuda = device.type == "cuda"
        use = (switches.triton_kernels and cuda) if kernels is None else kernels
        k = _kernels() if use else None
        self.triton = k is not None
        self.attention_pair: tuple[str, str] | None = None
        self.write_pair = write_pair_torch
        self.reread = reread_torch
        self._attention = attention_torch
        self._rw = self._rwkv = self._fa = self._dr = None
        self._v_layout = None  # FP8 V storage keys-contiguous (the FP8 P@V MMA's layout) when set
        if k is not None:
            self._rw, self._dr, self._fa = k[0].rope_fp8_write, k[1].delta_rotate, k[2].fp8_attention
            self._rwkv = k[0].rope_fp8_write_kv
            self._v_layout = k[2].v_layout
            self._to_keys = k[2].to_keys_contiguous
            self._fa_dims = k[2].SUPPORTED_HEAD_DIMS
            self.attention_pair = k[2].FAST if switches.attention_fp8_dots else k[2].DEFAULT
        if switches.compile and cuda:
            self.write_pair = compiled(write_pair_torch)  # once per process: a cache is made per session
            self.reread = compiled(reread_torch)

    @property
    def v_keys_contiguous(self) -> bool:
        """True when an FP8 V cache should be stored keys-contiguous (the Triton ops write and read it)."""
        return self._v_layout is not None

    def v_buffer(self, h: int, s: int, d: int, dtype: torch.dtype, device) -> torch.Tensor:
        """Zeros [h, s, d] for V: keys-contiguous storage for an FP8 store read by the kernels, else plain."""
        if dtype == FP8 and self.v_keys_contiguous:
            return self._v_layout(h, s, d, dtype, device)
        return torch.zeros(h, s, d, dtype=dtype, device=device)

    def write_kv(self, k, v, positions, cos, sin, slots, k_scale, v_scale, k_cache, v_cache, rope_k: bool) -> None:
        """Write the new K and V (one fused launch with the kernels when the cache is FP8)."""
        if self._rw is not None and k_cache.dtype == FP8:
            if self._rwkv is not None and rope_k:
                self._rwkv(k, v, positions, slots, k_scale, v_scale, k_cache, v_cache)
            else:
                self._rw(k, positions, slots, k_scale, k_cache, apply_rope=rope_k)
                self._rw(v, positions, slots, v_scale, v_cache, apply_rope=False)
        else:
            self.write_pair(k, v, cos, sin, slots, k_scale, v_scale, k_cache, v_cache, rope_k)

    def cross_window(self, k: torch.Tensor, v: torch.Tensor, fp8: bool) -> Window:
        """The conditioning's cross-attention K/V [H, L, D] (once per session) as a window ``attention``
        reads: FP8 with per-head scales (V keys-contiguous) when attention reads FP8 (``fp8``) and the
        kernels run, so the cross-attention runs the FP8 kernel too; else as given (SDPA). A session keeps
        its windows when a switch flips: FP8 ones are then read by the torch path (dequantized)."""
        if self._fa is None or not fp8 or k.dtype != torch.bfloat16 or k.shape[-1] not in self._fa_dims:
            return Window(k, v, None, None, k.shape[1])
        ks, vs = head_scale(k), head_scale(v)
        return Window(quantize(k, ks), self._to_keys(quantize(v, vs)), ks, vs, k.shape[1])

    def attention(self, q, win: Window, cos=None, sin=None, rope=apply_rope_tables, out_scale=None) -> torch.Tensor:
        """q [H, Tq, D] over the window -> [H, Tq, D]; with the step's RoPE tables (cos, sin) the queries
        are rotated first: inside the FP8 kernel as they load when it runs, else by ``rope`` (the caller's,
        maybe compiled). ``out_scale`` (a static activation scale []): FP8 [Tq, H*D] instead, the output
        projection's input (stored so by the kernel; quantized after the torch path)."""
        if self._fa is not None and win.k_scale is not None:
            qk, pv = self.attention_pair
            return self._fa(q, win.k, win.v, win.k_scale, win.v_scale, win.n, qk=qk, pv=pv, q_cos=cos,
                            q_sin=sin, out_scale=out_scale)
        if cos is not None:
            q = rope(q, cos, sin)
        o = attention_torch(q, win)
        if out_scale is None:
            return o
        return quantize_act_static(o.transpose(0, 1).reshape(o.shape[1], -1), out_scale)[0]

    def delta_rotate(self, cache, scale, delta: int) -> None:
        if self._dr is not None and cache.dtype == FP8:
            self._dr(cache, scale, delta)
        else:
            delta_rotate_torch(cache, scale, delta)


# ---------------------------------------------------------------------------------------------


class KVCache:
    """State shared by both caches: K/V storage per block, FP8 scales, the book."""

    ring = False

    def __init__(self, shape: ModelShape, switches: Switches, device, dtype: torch.dtype):
        self.shape, self.switches = shape, switches
        self.device, self.dtype = torch.device(device), dtype
        self.ops = CacheOps(switches, self.device)
        nb, h, s, d = shape.n_blocks, shape.heads, shape.window, shape.head_dim
        self.book = CacheBook(s)
        self.fp8_store = switches.fp8_cache
        self.fp8_read = shape.fp8_attention or switches.fp8_cache
        self.rope_at_write = switches.rope_at_write
        store = FP8 if self.fp8_store else dtype
        # one [heads, slots, head_dim] tensor per block (not views of one tensor: compiled ops and
        # kernels see the same tensor layout for every block); an FP8 V read by the kernels is stored
        # keys-contiguous (same logical shape, slot stride 1: CacheOps.v_buffer)
        self.k = [torch.zeros(h, s, d, dtype=store, device=self.device) for _ in range(nb)]
        self.v = [self.ops.v_buffer(h, s, d, store, self.device) for _ in range(nb)]
        self.k_scale = torch.ones(nb, h, dtype=torch.float32, device=self.device)
        self.v_scale = torch.ones(nb, h, dtype=torch.float32, device=self.device)
        self.calibrated = [False] * nb
        self._bufs: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}  # _keep's per-shape buffers
        self.positions = torch.zeros(0, dtype=torch.int64, device=self.device)  # new tokens' positions [T]
        self.cos = self.sin = torch.zeros(0, d, device=self.device)  # their RoPE tables [T, head_dim]

    @property
    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in (*self.k, *self.v, self.k_scale, self.v_scale))

    def _keep(self, name: str, value: torch.Tensor) -> None:
        """Set a per-step index buffer, in place in the one buffer kept per (name, shape): CUDA graphs
        read it, and a worker's graphs of a first forward ([L]) and of a chunk ([new_tokens]) each find
        theirs in every session (worker/graphs.py)."""
        key = (name, tuple(value.shape))
        buf = self._bufs.get(key)
        if buf is None:
            self._bufs[key] = buf = value
        else:
            buf.copy_(value)
        setattr(self, name, buf)

    def restart(self) -> None:
        """An empty window for the next session, in the same tensors (a warm worker's graphs read
        them): the book from scratch, the FP8 scales to calibrate again at the first write."""
        self.book = CacheBook(self.shape.window)
        self.calibrated = [False] * self.shape.n_blocks
        self.k_scale.fill_(1.0)
        self.v_scale.fill_(1.0)

    def _set_positions(self, positions: torch.Tensor) -> None:
        """The step's positions and their RoPE tables, once per step (every block and pass reuses them)."""
        self._keep("positions", positions)
        cos, sin = rope_tables(positions, self.shape.head_dim, self.shape.rope_base)
        self._keep("cos", cos)
        self._keep("sin", sin)

    def _arange(self, start: int, n: int) -> torch.Tensor:
        return torch.arange(start, start + n, dtype=torch.int64, device=self.device)

    def calibrate(self, b: int, k_raw: torch.Tensor, v: torch.Tensor) -> None:
        """Per-head FP8 scales of block b, once per session, from the first tokens written."""
        if self.fp8_store and not self.calibrated[b]:
            self.k_scale[b] = head_scale(k_raw, CALIBRATION_MARGIN)
            self.v_scale[b] = head_scale(v, 1.25)
            self.calibrated[b] = True

    def cross_window(self, k: torch.Tensor, v: torch.Tensor) -> Window:
        """The conditioning's cross-attention K/V as a window, FP8 when this cache's attention reads FP8."""
        return self.ops.cross_window(k, v, self.fp8_read)

    def slot_positions(self) -> torch.Tensor:
        """Absolute position of the token in every slot [slots] (committed tokens)."""
        raise NotImplementedError

    def begin_step(self, tokens: int, reset: bool = False) -> bool:
        raise NotImplementedError

    def update(self, b: int, k_new: torch.Tensor, v_new: torch.Tensor) -> Window:
        raise NotImplementedError

    def _write(self, b: int, k_new: torch.Tensor, v_new: torch.Tensor, rope: bool):
        """Block b's new K (RoPE'd when ``rope``) and V into the step's slots, the scales calibrated on
        first use: (window size after the step, k_scale, v_scale) for the caller's Window."""
        self.calibrate(b, k_new, v_new)
        ks, vs = self.k_scale[b], self.v_scale[b]
        self.ops.write_kv(k_new, v_new, self.positions, self.cos, self.sin, self._slots, ks, vs, self.k[b], self.v[b],
                          rope)
        return self.book.window_after, ks, vs

    def end_step(self) -> None:
        self.book.commit()

    def _reset_window(self, n_slots: int) -> None:
        """Rotate the stored (rotated) keys of the whole window by -delta; the book moves back."""
        delta = self.book.reset_delta()
        if delta == 0:
            return
        if self.switches.delta_rotation:
            for b in range(self.shape.n_blocks):
                self.ops.delta_rotate(self.k[b][:, :n_slots], self.k_scale[b], delta)
        else:
            old = self.slot_positions()[:n_slots]
            for b in range(self.shape.n_blocks):
                rerotate_from_raw_torch(self.k[b][:, :n_slots], self.k_scale[b], old, old - delta)
        self.book.next_pos -= delta
        self.book.resets += 1

    # -- moving a session between caches when a switch flips -----------------------------------

    def export_blocks(self) -> tuple[Callable[[int], tuple[torch.Tensor, torch.Tensor]], int, int]:
        """The committed window a block at a time: ``(block, n, next_pos)``, ``block(b)`` block b's
        (k_raw, v [H,n,D]) in time order, un-rotated and dequantized. The order, positions and scales are
        read now, so this cache may be restarted and rewritten block by block, each block read before it
        is written (``carry_cache(c, c)``). A block at a time, a carry's transient memory is one block's:
        the whole window at once (``export_tokens``) took ~4x the cache in fp32 copies at the live swap."""
        n, next_pos = self.book.n_valid, self.book.next_pos
        order = self._time_order()
        ks, vs = (self.k_scale.clone(), self.v_scale.clone()) if self.fp8_store else (None, None)
        pos = next_pos - n + torch.arange(n, device=self.device) if self.rope_at_write else None

        def block(b: int) -> tuple[torch.Tensor, torch.Tensor]:
            k, v = self.k[b][:, order], self.v[b][:, order]
            if ks is not None:
                k = (k.float() * ks[b][:, None, None]).to(self.dtype)
                v = (v.float() * vs[b][:, None, None]).to(self.dtype)
            if pos is not None:
                k = apply_rope(k, -pos)
            return k, v

        return block, n, next_pos

    def export_tokens(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Committed window in time order, un-rotated and dequantized: (k_raw, v [nb,H,n,D], next_pos)."""
        block, _, next_pos = self.export_blocks()
        ks, vs = zip(*(block(b) for b in range(self.shape.n_blocks)), strict=True)
        return torch.stack(ks), torch.stack(vs), next_pos

    def load_blocks(self, block: Callable[[int], tuple[torch.Tensor, torch.Tensor]], n: int, next_pos: int) -> None:
        """The window from ``block(b)`` (k_raw, v [H,n,D]: RoPE'd and quantized as this cache stores them),
        asked once per block in order, ending at ``next_pos``."""
        self.book = CacheBook(self.shape.window, next_pos=next_pos - n)
        if n == 0:
            self.book.next_pos = next_pos
            return
        self.begin_step(n)
        for b in range(self.shape.n_blocks):
            self.update(b, *block(b))
        self.end_step()

    def load_tokens(self, k_raw: torch.Tensor, v: torch.Tensor, next_pos: int) -> None:
        self.load_blocks(lambda b: (k_raw[b], v[b]), k_raw.shape[2], next_pos)

    def _time_order(self) -> torch.Tensor:
        raise NotImplementedError


class PlainCache(KVCache):
    """The launch behaviour: time-ordered slots, advance by copying, whole-window upkeep per read."""

    def slot_positions(self) -> torch.Tensor:
        return self.book.next_pos - self.book.n_valid + self._arange(0, self.shape.window)

    def _time_order(self) -> torch.Tensor:
        return self._arange(0, self.book.n_valid)

    def begin_step(self, tokens: int, reset: bool = False) -> bool:
        book = self.book
        did_reset = False
        if reset and book.n_valid:
            if self.rope_at_write:
                self._reset_window(book.n_valid)
            else:  # positions by slot order: nothing is stored rotated
                book.next_pos -= book.reset_delta()
                book.resets += 1
            did_reset = True
        book.open(tokens)
        over = book.n_valid - book.kept
        if over > 0:  # advance by copying: shift the kept tokens to the front
            keep = book.kept
            for buf in (*self.k, *self.v):
                buf[:, :keep] = buf[:, over : over + keep].clone()
            book.n_valid = keep
        if self.rope_at_write:
            self._set_positions(self._arange(book.next_pos, tokens))
        else:
            self._set_positions(self._arange(book.kept, tokens))  # slot order
            wcos, wsin = rope_tables(self._arange(0, book.window_after), self.shape.head_dim, self.shape.rope_base)
            self._keep("_win_cos", wcos)
            self._keep("_win_sin", wsin)
        self._keep("_slots", self._arange(book.kept, tokens))
        return did_reset

    def update(self, b: int, k_new: torch.Tensor, v_new: torch.Tensor) -> Window:
        n, ks, vs = self._write(b, k_new, v_new, self.rope_at_write)
        if self.fp8_store:
            return Window(self.k[b], self.v[b], ks, vs, n)
        rope = not self.rope_at_write
        k, v, ks, vs = self.ops.reread(self.k[b], self.v[b], n, self._win_cos if rope else None,
                                       self._win_sin if rope else None, self.fp8_read, rope)
        return Window(k, v, ks, vs, n)


class RingCache(KVCache):
    """Write-time RoPE (+FP8), advance by index, delta rotation at each position reset."""

    ring = True

    def slot_positions(self) -> torch.Tensor:
        # the latest token (next_pos - 1) sits in slot head - 1
        s = self._arange(0, self.shape.window)
        return self.book.next_pos - 1 - torch.remainder(self.book.head - 1 - s, self.shape.window)

    def _time_order(self) -> torch.Tensor:
        n, s = self.book.n_valid, self.shape.window
        return torch.remainder(self._arange(self.book.head - n, n), s)

    def begin_step(self, tokens: int, reset: bool = False) -> bool:
        book = self.book
        did_reset = False
        if reset and book.n_valid:
            self._reset_window(self.shape.window if book.wraps else book.n_valid)
            did_reset = True
        book.open(tokens)
        self._set_positions(self._arange(book.next_pos, tokens))
        self._keep("_slots", torch.remainder(self._arange(book.head, tokens), self.shape.window))
        return did_reset

    def update(self, b: int, k_new: torch.Tensor, v_new: torch.Tensor) -> Window:
        n, ks, vs = self._write(b, k_new, v_new, rope=True)
        if self.fp8_store or not self.fp8_read:
            return Window(self.k[b], self.v[b], ks if self.fp8_store else None, vs if self.fp8_store else None, n)
        k, v, ks, vs = self.ops.reread(self.k[b], self.v[b], n, None, None, True, False)  # re-quantize per read
        return Window(k, v, ks, vs, n)


def make_cache(shape: ModelShape, switches: Switches, device, dtype: torch.dtype) -> KVCache:
    cls = RingCache if switches.ring_cache else PlainCache
    return cls(shape, switches, device, dtype)


CACHE_SWITCHES = ("ring_cache", "rope_at_write", "fp8_cache", "delta_rotation", "triton_kernels", "compile",
                  "attention_fp8_dots")


def rebuild_cache(old: KVCache, switches: Switches) -> KVCache:
    """A cache for new switches holding the same window (a switch flipped between steps)."""
    new = make_cache(old.shape, switches, old.device, old.dtype)
    new.load_blocks(*old.export_blocks())
    new.book.wraps, new.book.resets = old.book.wraps, old.book.resets
    return new
