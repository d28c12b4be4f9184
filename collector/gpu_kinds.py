"""GPU kinds, canonical: the one function that turns a device name into the kind the store keys on.

The real worker labels its GPU with ``torch.cuda.get_device_name()`` (``NVIDIA H200``, ``NVIDIA H100
80GB HBM3``, ``NVIDIA A100-SXM4-80GB``); rules, detectors and evaluations key on the short kind (``h200``).
``canonical_gpu_kind`` maps the first to the second, at ingest (collector/records.py) and wherever else a
kind is compared (the evaluation gate, the simulator): ``canonical_gpu_kind("NVIDIA H200") == "h200"``.

A name whose chip is not recognised is never dropped: it becomes a stable slug of its words (lower case,
vendor words removed, ``-`` between words), so two workers with the same unknown GPU share one kind.
Canonical kinds map to themselves (the function is idempotent). Written by hand: NVML and torch give the
marketing name only, and no maintained library maps it to a chip (DCGM reports the same string).
"""

from __future__ import annotations

import hashlib
import re

MAX_LEN = 128  # records.label's bound
# words that name a vendor or a product line, not the chip
_VENDOR_WORDS = frozenset({"nvidia", "tesla", "amd", "instinct", "intel", "corporation", "graphics"})
# a chip: NVIDIA's letter + 2-3 digits (+ a suffix letter: l40s, a10g), Grace superchips (gh200, gb200),
# AMD's mi300x; words after it (memory size, form factor: 80gb, hbm3, sxm4, pcie, nvl) are variants of one kind
_CHIP = re.compile(r"^(g[hb]\d{3}|[abhlvtkp]\d{1,3}[a-z]?|mi\d{3}[a-z]?)$")
_SPLIT = re.compile(r"[\s\-_/,()]+")
_UNSAFE = re.compile(r"[^a-z0-9.+]")


def canonical_gpu_kind(name: str) -> str:
    """The canonical kind of a GPU device name (``NVIDIA H200`` -> ``h200``); an unknown name -> a slug."""
    words = [_UNSAFE.sub("", w) for w in _SPLIT.split(name.strip().lower())]
    words = [w for w in words if w and w not in _VENDOR_WORDS]
    for w in words:
        if _CHIP.match(w):
            return w
    slug = "-".join(words)[:MAX_LEN].strip("-")
    if slug:
        return slug
    # nothing left to read (e.g. only symbols or non-Latin letters): a stable name, not a drop
    return "gpu-" + hashlib.sha1(name.encode()).hexdigest()[:12] if name.strip() else name
