"""Routed experts for CPUs: the reference's contract and rounding points, experts batched.

The reference runs each expert that received tokens on its own (five small ops per expert). When every
expert gets about as many (token, slot) pairs as the busiest one, the pairs are instead laid out
``[E, C, H]`` (``C`` = the busiest expert's count, rows past an expert's count zero) and the experts run
as two batched matmuls over the unchanged ``w13 [E, 2I, H]`` and ``w2 [E, H, I]``: no weight is copied.
Otherwise (padding would exceed :data:`MAX_PADDING` times the real pairs: few tokens, many experts) the
reference's per-expert loop runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atom_kernels.ops._checks import values_checkable
from atom_kernels.ops.moe import reference
from atom_kernels.ops.moe.checks import check_moe_experts

MAX_PADDING = 4
"""The batched form runs when ``E * C <= MAX_PADDING * T * K`` (a shared expert, in every token's row, makes
``C = T``: the bundled model, E = 8 + 2 shared slices, K = 2 + 2, needs 2.5)."""


def moe_experts(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """:func:`atom_kernels.ops.moe.reference.moe_experts` (same contract)."""
    check_moe_experts(x, weights, ids, w13, w2)
    num_experts = w13.shape[0]
    flat_ids = ids.reshape(-1).long()
    pairs = flat_ids.numel()
    if pairs == 0:
        return torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    if values_checkable(flat_ids):
        lo, hi = int(flat_ids.min()), int(flat_ids.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"moe_experts: ids must lie in [0, E={num_experts}), got values in [{lo}, {hi}]")
    counts = torch.bincount(flat_ids, minlength=num_experts)
    cap = int(counts.max())
    if num_experts * cap > MAX_PADDING * pairs:
        return reference.moe_experts(x, weights, ids, w13, w2)
    top_k = ids.shape[1]
    order = torch.argsort(flat_ids, stable=True)
    sorted_ids = flat_ids[order]
    first = torch.cumsum(counts, 0) - counts  # [E] index of each expert's first pair in `order`
    slot = torch.arange(pairs, device=x.device) - first[sorted_ids]  # rank of the pair within its expert
    token_of = order // top_k
    xs = x.new_zeros(num_experts, cap, x.shape[1])
    xs[sorted_ids, slot] = x[token_of]
    h = torch.bmm(xs, w13.transpose(1, 2)).float()  # [E, C, 2I]
    half = h.shape[-1] // 2
    act = (F.silu(h[..., :half]) * h[..., half:]).to(x.dtype)
    y = torch.bmm(act, w2.transpose(1, 2))[sorted_ids, slot].float()  # [pairs, H] in `order`
    y = y * weights.reshape(-1).float()[order, None]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    out.index_add_(0, token_of, y)
    return out.to(x.dtype)
