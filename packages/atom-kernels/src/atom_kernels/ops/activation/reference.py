"""Reference SwiGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atom_kernels.ops.activation.checks import check_silu_and_mul


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :I]) * x[..., I:]``.

    Args:
        x: ``[T, 2I]`` (any leading dims), the fused ``[gate | up]`` projection.

    Returns:
        ``[T, I]`` in x.dtype (math in float32).
    """
    check_silu_and_mul(x)
    half = x.shape[-1] // 2
    x32 = x.float()
    return (F.silu(x32[..., :half]) * x32[..., half:]).to(x.dtype)
