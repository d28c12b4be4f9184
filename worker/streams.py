"""CUDA streams of our own: a stream one owner alone launches on.

    s = own_stream(device)          # a build thread's capture stream, a decoder's stream

``torch.cuda.Stream()`` hands out the next stream of a pool of 32 per device and priority, round robin
(c10's ``getStreamFromPool``), so after 32 calls anywhere in the process two owners share one stream. That
is harmless for plain work (it serializes) but not for a CUDA-graph capture: a stream that a flip's build
captures on (worker/readiness.py) must be the build thread's alone, or the live session's launch onto it
joins the capture, and its event query or sync fails "operation not permitted when stream is capturing" —
what the H200 flip bench of 2026-12-02 08:41 showed (the build's capture failed in cuBLAS, the live session
died on its next step). So a stream we hand to one owner is created for it, not taken from the pool.

PyTorch 2.11 has no Python call that creates a stream outside the pool, hence the CUDA runtime's
``cudaStreamCreateWithPriority`` through ctypes on the libcudart PyTorch has loaded, wrapped in
``torch.cuda.ExternalStream``. Where that library cannot be found, a pool stream (with a warning).
"""

from __future__ import annotations

import ctypes
import logging

import torch

log = logging.getLogger("livestep.worker.streams")

_NON_BLOCKING = 0x01  # cudaStreamNonBlocking: no implicit sync with the legacy default stream


def _cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library this process loaded with PyTorch (its path from /proc/self/maps)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart.so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def own_stream(device: torch.device | int | str, priority: int = 0) -> torch.cuda.Stream:
    """A new non-blocking CUDA stream on ``device`` that no ``torch.cuda.Stream()`` call will hand out again.
    ``priority`` as torch's (0: the default, lowest; negative: higher)."""
    device = torch.device(device)
    torch.cuda.init()
    lib = _cudart()
    if lib is not None:
        with torch.cuda.device(device):
            handle = ctypes.c_void_p()
            rc = lib.cudaStreamCreateWithPriority(ctypes.byref(handle), ctypes.c_uint(_NON_BLOCKING),
                                                  ctypes.c_int(priority))
        if rc == 0 and handle.value:
            return torch.cuda.ExternalStream(handle.value, device=device)  # never destroyed: lives with the process
        log.warning("cudaStreamCreateWithPriority returned %s: a pool stream instead", rc)
    else:
        log.warning("libcudart not found in this process: a pool stream instead (it may be shared)")
    return torch.cuda.Stream(device=device, priority=priority)
