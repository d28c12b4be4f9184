"""The device a worker was asked for, checked before any model is built: ``check_device("cuda:1")``.

A CPU build of torch, a CUDA build that sees no GPU, or an index past the GPUs it sees is a
``DeviceError`` whose one line names what was asked and what this machine has (api/cli.py prints it).
"""

from __future__ import annotations

import os


class DeviceError(Exception):
    """The requested device does not exist here; the message names what was found."""


def check_device(requested: str | None) -> None:
    """Return when ``requested`` (None, cpu, cuda, cuda:N) can be used; else raise ``DeviceError``."""
    import torch

    if requested is None:
        return
    try:
        dev = torch.device(requested)
    except (RuntimeError, ValueError) as e:
        raise DeviceError(f"--device {requested!r} is not a device: use cpu, cuda or cuda:N ({e})") from None
    if dev.type == "cpu":
        return
    if dev.type != "cuda":
        raise DeviceError(f"--device {requested!r}: livestep's worker runs on cpu or cuda[:N]")
    if torch.version.cuda is None:
        raise DeviceError(f"--device {requested} asked, but this torch {torch.__version__} is a CPU build "
                          "(no CUDA): install a CUDA build of torch (livestep[gpu]) or use --device cpu")
    count = torch.cuda.device_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    seen = f"CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "CUDA_VISIBLE_DEVICES unset"
    if count == 0:
        raise DeviceError(f"--device {requested} asked, but torch {torch.__version__} (CUDA {torch.version.cuda}) "
                          f"sees no GPU ({seen}); use --device cpu")
    if dev.index is not None and dev.index >= count:
        raise DeviceError(f"--device {requested} asked, but torch sees {count} GPU(s) "
                          f"(cuda:0..cuda:{count - 1}; {seen})")
