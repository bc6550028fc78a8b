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
        ``[T, I]`` in x.dtype: ``silu`` (computed in float32) rounded to x.dtype, then the product rounded
        again (stock vLLM's ``SiluAndMul``, which rounds at the same two points on CPU and GPU).
    """
    check_silu_and_mul(x)
    half = x.shape[-1] // 2
    act = F.silu(x[..., :half].float()).to(x.dtype)
    return (act.float() * x[..., half:].float()).to(x.dtype)
