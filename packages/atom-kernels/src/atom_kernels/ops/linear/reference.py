"""Reference dense linear."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atom_kernels.ops.linear.checks import check_linear


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` (``torch.nn.functional.linear``).

    Args:
        x: ``[..., K]`` float32, bf16 or fp16 (any leading dims).
        weight: ``[N, K]`` in x.dtype.
        bias: ``[N]`` in x.dtype, or None.

    Returns:
        ``[..., N]`` in x.dtype (bf16 / fp16: float32 accumulation, rounded once).
    """
    check_linear(x, weight, bias)
    return F.linear(x, weight, bias)
