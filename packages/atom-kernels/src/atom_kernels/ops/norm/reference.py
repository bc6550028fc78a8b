"""Reference RMS norms (plain torch; statistics and scaling in float32, output in x.dtype)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atom_kernels.ops.norm.checks import check_gated_rms_norm, check_rms_norm


def _normalize(x32: torch.Tensor, eps: float) -> torch.Tensor:
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Zero-centred RMS norm: ``y = x_hat * (1 + weight)`` with ``x_hat = x / sqrt(mean(x^2) + eps)``.

    Args:
        x: ``[..., H]`` float32/bf16/fp16.
        weight: ``[H]`` (the checkpoint's zero-centred weight).
        eps: variance epsilon.
        residual: optional ``[..., H]`` in x.dtype or float32 (a float32 residual stream).

    Returns:
        ``y [..., H]`` in x.dtype; with ``residual``: ``(y, h)`` where ``h = x + residual`` rounded to
        residual.dtype and ``y`` the norm of the float32 sum, before that rounding (as stock vLLM's
        ``fused_add_rms_norm``: the normalised input is rounded once less).
    """
    check_rms_norm(x, weight, eps, residual)
    h32 = x.float() if residual is None else x.float() + residual.float()
    y = (_normalize(h32, eps) * (1.0 + weight.float())).to(x.dtype)
    return y if residual is None else (y, h32.to(residual.dtype))


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GDN output norm, NOT zero-centred: ``weight * x_hat * silu(z)`` (HF ``Qwen3NextRMSNormGated``).

    Args:
        x: ``[T, Hv, Dv]`` (any leading dims ``[..., Dv]``) float32/bf16/fp16.
        z: the gate, same shape as ``x``.
        weight: ``[Dv]``.
        eps: variance epsilon.

    Returns:
        ``[..., Dv]`` in x.dtype (all math in float32).
    """
    check_gated_rms_norm(x, z, weight, eps)
    y = _normalize(x.float(), eps) * weight.float() * F.silu(z.float())
    return y.to(x.dtype)
