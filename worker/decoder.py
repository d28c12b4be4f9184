"""Latents -> RGB frames: a small convolutional upsampling decoder and where it runs.

    dec = Decoder(shape, main_device, own_gpu=switches.decoder_own_gpu)
    job = dec.submit(latents, after=diffusion_done_event)   # returns at once on CUDA
    job.done_event / job.frames                              # [4, 3, H, W] uint8 on dec.device

Placement: on CPU the decoder runs inline. On CUDA with ``decoder_own_gpu``: its own device (the
last GPU) when there are two or more, else its own CUDA stream on the main GPU; either way the
decode of step i-1 runs while step i denoises (the submit only enqueues). Without the switch it
runs on the main stream after the diffusion (serialised, the plain path). The latents of a chunk
are its video tokens (``frames_per_chunk * grid_h * grid_w``); the extra tokens are not decoded.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from worker.config import ModelShape
from worker.streams import own_stream


@dataclass
class DecodeJob:
    step: int
    frames: torch.Tensor | None = None
    start_event: torch.cuda.Event | None = None
    done_event: torch.cuda.Event | None = None
    cpu_ms: float | None = None  # measured inline on CPU
    done_wall: float | None = None  # perf_counter when done (CPU)
    overlapped: bool = False  # decoded on its own stream/GPU, in parallel with the next diffusion
    latents: torch.Tensor | None = None  # the decoder's private copy, alive until the job is emitted
    extra: dict = field(default_factory=dict)


class Decoder:
    """Conv decoder: [4, C, gh, gw] -> log2(upsample) x (nearest 2x, conv3x3, SiLU) -> RGB."""

    def __init__(self, shape: ModelShape, main_device, own_gpu: bool = False, seed: int = 1):
        self.shape = shape
        main = torch.device(main_device)
        self.placement = "inline"
        self.device = main
        self.stream = None
        if main.type == "cuda" and own_gpu:
            n = torch.cuda.device_count()
            if n >= 2:
                self.device = torch.device("cuda", n - 1)
                self.placement = "own_gpu"
            else:
                self.placement = "own_stream"
            self.stream = own_stream(self.device)  # not a pool stream: a build may capture on one (worker/streams.py)
        elif main.type == "cuda":
            self.placement = "main_stream"
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        stages = int(math.log2(shape.upsample))
        assert 2**stages == shape.upsample, "upsample must be a power of two"
        g = torch.Generator().manual_seed(seed)
        ch = [shape.latent_channels] + [max(8, shape.decoder_channels >> (i // 2)) for i in range(stages + 1)]
        self.convs = []
        for cin, cout in itertools.pairwise(ch):
            w = torch.randn(cout, cin, 3, 3, generator=g) / math.sqrt(cin * 9)
            self.convs.append(w.to(self.device, self.dtype))
        self.rgb = (torch.randn(3, ch[-1], 1, 1, generator=g) / math.sqrt(ch[-1])).to(self.device, self.dtype)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """latents [new_tokens, C] -> frames [4, 3, H, W] uint8."""
        s = self.shape
        n_video = s.frames_per_chunk * s.grid_h * s.grid_w
        x = latents[:n_video].to(self.device, self.dtype, non_blocking=True)
        x = x.view(s.frames_per_chunk, s.grid_h, s.grid_w, -1).permute(0, 3, 1, 2)
        x = F.silu(F.conv2d(x, self.convs[0], padding=1))
        for w in self.convs[1:]:
            x = F.interpolate(x, scale_factor=2.0, mode="nearest")
            x = F.silu(F.conv2d(x, w, padding=1))
        rgb = torch.tanh(F.conv2d(x, self.rgb))
        return ((rgb + 1) * 127.5).to(torch.uint8)

    def submit(self, latents: torch.Tensor, step: int, after: torch.cuda.Event | None = None) -> DecodeJob:
        job = DecodeJob(step)
        if self.device.type != "cuda":
            t0 = time.perf_counter()
            job.frames = self.decode(latents)
            job.done_wall = time.perf_counter()
            job.cpu_ms = (job.done_wall - t0) * 1e3
            return job
        job.start_event = torch.cuda.Event(enable_timing=True)
        job.done_event = torch.cuda.Event(enable_timing=True)
        if self.stream is None:  # main stream, serialised after the diffusion
            job.start_event.record()
            job.frames = self.decode(latents)
            job.done_event.record()
            return job
        # A private copy, taken on the main stream: under CUDA graphs ``latents`` is the graph's static
        # output, overwritten by the next replay while this decode may still read it. The job keeps the
        # copy alive until telemetry emits it (after done_event), which also covers the read from
        # another device, where record_stream cannot help.
        job.latents = latents = latents.clone()
        job.overlapped = True
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            if self.device == latents.device:
                latents.record_stream(self.stream)  # the allocator must not reuse it early
            job.start_event.record(self.stream)
            job.frames = self.decode(latents)
            job.done_event.record(self.stream)
        return job
