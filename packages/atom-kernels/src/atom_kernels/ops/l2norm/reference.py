"""Reference L2 norm (the FLA formula)."""

from __future__ import annotations

import torch

from atom_kernels.ops.l2norm.checks import DEFAULT_EPS, check_l2norm


def l2norm_f32(x32: torch.Tensor, eps: float = DEFAULT_EPS) -> torch.Tensor:
    """The math on a float32 tensor, no validation (shared with the gated delta rule references)."""
    return x32 * torch.rsqrt((x32 * x32).sum(-1, keepdim=True) + eps)


def l2norm(x: torch.Tensor, eps: float = DEFAULT_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x^2, -1) + eps)``.

    Args:
        x: ``[..., D]`` float32/bf16/fp16.
        eps: added under the square root.

    Returns:
        ``[..., D]`` in x.dtype (math in float32).
    """
    check_l2norm(x, eps)
    return l2norm_f32(x.float(), eps).to(x.dtype)
