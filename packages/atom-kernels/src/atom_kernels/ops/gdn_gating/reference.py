"""Reference GDN gating (float32)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atom_kernels.ops.gdn_gating.checks import check_gdn_gating


def gdn_gating(
    A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token decay (log space) and write strength of the gated delta rule.

    Args:
        A_log: ``[Hv]``; a: ``[T, Hv]``; dt_bias: ``[Hv]``; b: ``[T, Hv]``.

    Returns:
        ``(g [T, Hv], beta [T, Hv])`` float32 with ``g = -exp(A_log) * softplus(a + dt_bias)`` (<= 0;
        softplus threshold 20 as torch) and ``beta = sigmoid(b)``.
    """
    check_gdn_gating(A_log, a, dt_bias, b)
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b.float())
