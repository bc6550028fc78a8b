"""Reference MoE: softmax top-k router and a loop over the experts that received tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atom_kernels.ops._checks import values_checkable
from atom_kernels.ops.moe.checks import check_moe_experts, check_moe_router


def moe_router(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax (float32) over experts, top-k, optionally renormalised to sum 1.

    Args:
        logits: ``[T, E]`` router logits.
        top_k: experts per token.
        renormalize: divide the top-k weights by their sum (Qwen3-Next ``norm_topk_prob``).

    Returns:
        ``(weights [T, top_k] float32, ids [T, top_k] int64)``, weights in descending order. A row with
        a NaN or +inf logit gets NaN weights and ``top_k`` distinct ids in ``[0, E)``.
    """
    check_moe_router(logits, top_k, renormalize)
    probs = torch.softmax(logits.float(), dim=-1)
    # A NaN or +inf logit makes its row NaN: NaN ranks as -inf (as in the triton backend), the ids stay
    # distinct experts in [0, E) and the weights keep the NaN.
    _, ids = torch.topk(probs.masked_fill(probs.isnan(), float("-inf")), top_k, dim=-1)
    weights = probs.gather(-1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_experts(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """``out[t] = sum_j weights[t, j] * (silu_and_mul(x[t] @ w13[e].T) @ w2[e].T)``, ``e = ids[t, j]``.

    Args:
        x: ``[T, H]`` tokens.
        weights: ``[T, K]`` routing weights (any float dtype; used in float32).
        ids: ``[T, K]`` int64/int32 expert ids in ``[0, E)``.
        w13: ``[E, 2I, H]`` fused ``[gate; up]`` projections, x.dtype.
        w2: ``[E, H, I]`` down projections, x.dtype.

    Returns:
        ``[T, H]`` in x.dtype. Matmuls run in x.dtype (float32 accumulation inside), the activation in
        float32, and the weighted sum over experts accumulates in float32.
    """
    check_moe_experts(x, weights, ids, w13, w2)
    num_experts = w13.shape[0]
    flat_ids = ids.reshape(-1).long()
    if values_checkable(flat_ids) and flat_ids.numel() > 0:
        lo, hi = int(flat_ids.min()), int(flat_ids.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"moe_experts: ids must lie in [0, E={num_experts}), got values in [{lo}, {hi}]")
    top_k = ids.shape[1]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    if flat_ids.numel() == 0:
        return out.to(x.dtype)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    token_of = order // top_k
    flat_w = weights.reshape(-1).float()[order]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        tok = token_of[start : start + n]
        h = x[tok] @ w13[e].t()
        half = h.shape[-1] // 2
        h32 = h.float()
        act = (F.silu(h32[:, :half]) * h32[:, half:]).to(x.dtype)
        y = (act @ w2[e].t()).float() * flat_w[start : start + n, None]
        out.index_add_(0, tok, y)
        start += n
    return out.to(x.dtype)
