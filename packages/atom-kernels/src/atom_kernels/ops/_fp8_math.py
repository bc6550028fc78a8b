"""FP8 helpers shared by the paged-attention and fp8 reference ops."""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def scale_tensor(scale: float | torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """A per-tensor scale (None -> 1.0, a number, or a one-element tensor) as a 0-d float32 tensor."""
    if scale is None:
        return torch.ones((), dtype=torch.float32, device=device)
    if isinstance(scale, torch.Tensor):
        return scale.reshape(()).float()
    return torch.tensor(float(scale), dtype=torch.float32, device=device)
