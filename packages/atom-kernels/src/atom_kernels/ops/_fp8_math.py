"""FP8 helpers shared by the paged-attention (reference and triton) and fp8 reference ops."""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def scale_tensor(scale: float | torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """A per-tensor scale (None -> 1.0, a number, or a one-element tensor) as a 0-d float32 tensor on
    ``device``. Numbers go through ``torch.full`` (a fill kernel, no host-to-device copy), so this is
    safe during CUDA graph capture; a tensor is viewed as is (the checks put it on the op's device)."""
    if scale is None:
        return torch.ones((), dtype=torch.float32, device=device)
    if isinstance(scale, torch.Tensor):
        return scale.reshape(()).float()
    return torch.full((), float(scale), dtype=torch.float32, device=device)
