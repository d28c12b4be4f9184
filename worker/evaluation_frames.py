"""The task-shaped view of ``livestep evaluate``: decoded frames against the truth's, next to the latents.

    view = FrameView(shape, device)                # the worker's decoder (worker/decoder.py)
    got = view.compare(latents, truth_latents, prev)   # {"psnr": dB, "ssim": 0..1, "flicker": 8-bit levels}

Per step, both latents go through the same decoder; then
- PSNR and SSIM of the frames against the truth's frames (torchmetrics' implementations:
  ``peak_signal_noise_ratio``, ``structural_similarity_index_measure``, data range 255; the SSIM
  window shrinks to the frame on tiny presets, whose frames are a few pixels);
- flicker: the mean absolute difference, in 8-bit levels, between the frame-to-frame change of the
  candidate and that of the truth (consecutive frames of the chunk, and the previous chunk's last frame
  to this chunk's first): 0 when the candidate moves as the truth does, whatever its offset; a change that
  jitters from frame to frame shows here before it shows in a per-frame score.

A task scorer plugs into the latent metric instead (``--metric package.module:function``, a callable on
two latents [tokens, channels] returning a distance, bigger = worse): decode inside it with
``FrameView(shape, device).decode`` and score the frames -- README "Numeric switches" has the lip-sync
example.
"""

from __future__ import annotations

import torch

from worker.config import ModelShape
from worker.decoder import Decoder

PSNR_CAP = 99.0  # dB: identical frames (PSNR infinite) are recorded as this


class FrameView:
    def __init__(self, shape: ModelShape, device):
        self.decoder = Decoder(shape, device)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """latents [new_tokens, C] -> frames [F, 3, H, W] float (0-255)."""
        return self.decoder.decode(latents).float()

    def compare(self, x: torch.Tensor, ref: torch.Tensor, prev: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[dict[str, float], tuple[torch.Tensor, torch.Tensor]]:
        """The three scores of ``x``'s frames against ``ref``'s; ``prev``: the last frames (x, ref) of the
        previous step, returned for the next call."""
        from torchmetrics.functional.image import peak_signal_noise_ratio, structural_similarity_index_measure

        fx, fr = self.decode(x), self.decode(ref)
        side = min(fx.shape[-2:])
        kernel = min(11, side if side % 2 else side - 1)
        psnr = min(PSNR_CAP, float(peak_signal_noise_ratio(fx, fr, data_range=255.0)))  # identical: inf
        ssim = float(structural_similarity_index_measure(fx, fr, data_range=255.0, kernel_size=kernel,
                                                         sigma=1.5 * kernel / 11))
        sx, sr = (fx, fr) if prev is None else (torch.cat([prev[0], fx]), torch.cat([prev[1], fr]))
        flicker = float(((sx[1:] - sx[:-1]) - (sr[1:] - sr[:-1])).abs().mean()) if sx.shape[0] > 1 else 0.0
        return {"psnr": psnr, "ssim": ssim, "flicker": flicker}, (fx[-1:], fr[-1:])
