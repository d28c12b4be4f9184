"""Worker tests run tiny models: one torch thread per process (two threads contend per small op)."""

import torch

torch.set_num_threads(1)
