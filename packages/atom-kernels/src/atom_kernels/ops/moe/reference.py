"""Reference MoE: softmax top-k router and a loop over the experts that received tokens (bf16/float32
weights, or FP8 block-scaled weights with per-token-group activation quantisation)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atom_kernels.ops._checks import values_checkable
from atom_kernels.ops.fp8.reference import fp8_act_quant
from atom_kernels.ops.moe.checks import (
    check_moe_experts,
    check_moe_experts_fp8,
    check_moe_gate_router,
    check_moe_router,
)


def moe_router(
    logits: torch.Tensor, top_k: int, renormalize: bool, num_shared: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax (float32) over the routed experts, top-k, optionally renormalised to sum 1; with
    ``num_shared = m > 0`` also ``m`` shared columns gated by ``sigmoid(logits[:, E])``.

    Args:
        logits: ``[T, E]`` router logits, or ``[T, E + 1]`` with ``num_shared > 0``: the routed experts'
            logits, then the shared expert's gate logit.
        top_k: routed experts per token.
        renormalize: divide the top-k weights by their sum (Qwen3-Next ``norm_topk_prob``).
        num_shared: pseudo-experts ``E .. E + m - 1`` (a shared expert stored as ``m`` slices of the
            routed experts' intermediate size) that every token uses; 0: none.

    Returns:
        ``(weights [T, top_k + m] float32, ids [T, top_k + m] int64)``: the routed weights in descending
        order (softmax over ``logits[:, :E]`` only, rounded to the logits' dtype), then columns ``top_k + j`` with id ``E + j`` and weight
        ``sigmoid(logits[:, E])`` (float32). A row with a NaN or +inf routed logit gets NaN routed weights
        and ``top_k`` distinct ids in ``[0, E)``.
    """
    num_experts = check_moe_router(logits, top_k, renormalize, num_shared)
    probs = torch.softmax(logits[:, :num_experts].float(), dim=-1)
    # A NaN or +inf logit makes its row NaN: NaN ranks as -inf (as in the triton backend), the ids stay
    # distinct experts in [0, E) and the weights keep the NaN.
    _, ids = torch.topk(probs.masked_fill(probs.isnan(), float("-inf")), top_k, dim=-1)
    weights = probs.gather(-1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    # rounded to the logits' dtype, as stock vLLM's router returns them (a softmax of the top-k logits in
    # their own dtype); float32 logits: unchanged
    weights = weights.to(logits.dtype).float()
    if num_shared:
        gate = torch.sigmoid(logits[:, num_experts:].float())  # [T, 1]
        shared_ids = torch.arange(num_experts, num_experts + num_shared, device=ids.device)
        weights = torch.cat([weights, gate.expand(-1, num_shared)], dim=-1)
        ids = torch.cat([ids, shared_ids.expand(ids.shape[0], -1)], dim=-1)
    return weights, ids


def moe_gate_router(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    num_experts: int,
    top_k: int,
    renormalize: bool,
    num_shared: int = 0,
    *,
    tickets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's Linear and :func:`moe_router` in one op:
    ``moe_router((x @ gate_weight.T)[:, :C], top_k, renormalize, num_shared)``, the logits rounded to
    x.dtype as a Linear's output, ``C = E`` or ``E + 1`` with ``num_shared > 0``.

    Args:
        x: ``[T, H]``; gate_weight: ``[R, H]`` in x.dtype, ``R >= C`` (rows past ``C`` are padding the
            op never reads into the result: a router padded for alignment).
        num_experts: routed experts ``E``; top_k, renormalize, num_shared: as :func:`moe_router`.
        tickets: None, or int32 zeros (one or more) that a backend may use as a grid-wide counter and
            must leave zero (owned by the caller, so that no launch zeroes a fresh one); never changes
            the result. The reference does not use it.

    Returns:
        :func:`moe_router`'s ``(weights [T, top_k + m] float32, ids [T, top_k + m] int64)``.
    """
    cols = check_moe_gate_router(x, gate_weight, num_experts, top_k, renormalize, num_shared, tickets)
    logits = F.linear(x, gate_weight)[:, :cols]
    return moe_router(logits, top_k, renormalize, num_shared)


def moe_experts(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """``out[t] = sum_j weights[t, j] * (silu_and_mul(x[t] @ w13[e].T) @ w2[e].T)``, ``e = ids[t, j]``;
    a slot with ``e = -1`` contributes zero.

    Expert parallelism: a rank holding experts ``[s, s + E)`` of the model's passes its ``E`` experts'
    weights and the router's global ids mapped by :func:`~atom_kernels.ops.moe.local_expert_ids`
    (``id - s`` for ids it holds, -1 for the rest); the ranks' outputs sum to the full result.

    Args:
        x: ``[T, H]`` tokens.
        weights: ``[T, K]`` routing weights (any float dtype; used in float32).
        ids: ``[T, K]`` int64/int32 expert ids in ``[-1, E)`` (-1: an expert not held here: skipped).
        w13: ``[E, 2I, H]`` fused ``[gate; up]`` projections, x.dtype (or float32 copies of x.dtype
            values, held once by their owner instead of converted per call: the same products).
        w2: ``[E, H, I]`` down projections, in w13's dtype.

    Returns:
        ``[T, H]`` in x.dtype. Rounding: only the activation (the down projection's input) and the result
        are rounded to x.dtype; both products are float32 sums of x.dtype operands and stay float32 (the
        gate/up output into the activation, each expert's down output into the float32 weighted sum).
        Stock vLLM's CPU fused-MoE kernel rounds at the same two points; rounding the products as well
        (as a Linear's output) measured 1.7x its error against a float64 oracle (``test_kernels_moe``).
    """
    check_moe_experts(x, weights, ids, w13, w2, float32_weights=True)

    def expert(e: int, xs: torch.Tensor) -> torch.Tensor:
        h = xs.float() @ w13[e].float().t()
        half = h.shape[-1] // 2
        act = (F.silu(h[:, :half]) * h[:, half:]).to(x.dtype)
        return act.float() @ w2[e].float().t()

    return _route(x, weights, ids, w13.shape[0], expert, "moe_experts")


def _route(x, weights, ids, num_experts, expert, op: str) -> torch.Tensor:
    """``sum_j weights[t, j] * expert(ids[t, j], x[t])`` over the slots with ``ids[t, j] >= 0``, in float32,
    returned in x.dtype."""
    flat_ids = ids.reshape(-1).long()
    if values_checkable(flat_ids) and flat_ids.numel() > 0:
        lo, hi = int(flat_ids.min()), int(flat_ids.max())
        if lo < -1 or hi >= num_experts:
            raise ValueError(f"{op}: ids must lie in [-1, E={num_experts}), got values in [{lo}, {hi}]")
    top_k = ids.shape[1]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    if flat_ids.numel() == 0:
        return out.to(x.dtype)
    order = torch.argsort(flat_ids, stable=True)  # the -1 slots (not held here) sort first: skipped
    held = flat_ids >= 0
    counts = torch.bincount(flat_ids[held], minlength=num_experts).tolist()
    token_of = order // top_k
    flat_w = weights.reshape(-1).float()[order]
    start = int((~held).sum())
    for e, n in enumerate(counts):
        if n == 0:
            continue
        tok = token_of[start : start + n]
        y = expert(e, x[tok]).float() * flat_w[start : start + n, None]
        out.index_add_(0, tok, y)
        start += n
    return out.to(x.dtype)


def _qdq(a: torch.Tensor, group: int) -> torch.Tensor:
    """``fp8_act_quant`` then back to float32 (what an FP8 GEMM multiplies)."""
    q, s = fp8_act_quant(a, group)
    return q.float() * s.repeat_interleave(group, -1)[..., : a.shape[-1]]


def _dequant(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    bn, bk = block
    full = scale.float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)
    return w.float() * full[: w.shape[0], : w.shape[1]]


def moe_experts_fp8(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    *,
    tickets: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`moe_experts` with FP8 block-scaled expert weights (W8A8, dynamic activation scales); a slot
    with id -1 (an expert not held here) contributes zero, as in :func:`moe_experts`.

    Per expert: ``h = qdq(x) @ dequant(w13[e]).T`` rounded to x.dtype, ``act = silu(gate) * up`` (float32,
    rounded to x.dtype), ``y = qdq(act) @ dequant(w2[e]).T`` rounded to x.dtype, where ``qdq`` is
    :func:`~atom_kernels.ops.fp8.reference.fp8_act_quant` with groups of ``bk`` channels, dequantised;
    products in float32. The routed sum accumulates in float32.

    Args:
        x: ``[T, H]``; weights: ``[T, K]``; ids: ``[T, K]`` in ``[-1, E)``.
        w13: ``[E, 2I, H]`` float8_e4m3fn, rows ``[gate; up]``.
        w13_scale: ``[E, 2 * ceil(I/bn), ceil(H/bk)]`` float32: the gate's ``ceil(I/bn)`` row blocks, then
            the up projection's (each half blocked on its own, so ``I`` need not be a multiple of ``bn``).
        w2: ``[E, H, I]`` float8_e4m3fn; w2_scale: ``[E, ceil(H/bn), ceil(I/bk)]`` float32.
        block: ``(bn, bk)``.
        tickets: None, or int32 zeros, contiguous, at least
            :func:`~atom_kernels.ops.moe.checks.experts_fp8_tickets` ``(H)`` of them, that a backend may use
            as per-(token, column tile) counters and must leave zero (owned by the caller, so that no launch
            zeroes fresh ones); never changes the result. The reference does not use them.

    Returns:
        ``[T, H]`` in x.dtype.
    """
    check_moe_experts_fp8(x, weights, ids, w13, w13_scale, w2, w2_scale, block, tickets)
    bn, bk = int(block[0]), int(block[1])
    inter = w13.shape[1] // 2
    nb = -(-inter // bn)

    def expert(e: int, xs: torch.Tensor) -> torch.Tensor:
        gate = _dequant(w13[e, :inter], w13_scale[e, :nb], (bn, bk))
        up = _dequant(w13[e, inter:], w13_scale[e, nb:], (bn, bk))
        xq = _qdq(xs, bk)
        g = (xq @ gate.t()).to(x.dtype).float()
        u = (xq @ up.t()).to(x.dtype).float()
        act = (F.silu(g) * u).to(x.dtype)
        return (_qdq(act, bk) @ _dequant(w2[e], w2_scale[e], (bn, bk)).t()).to(x.dtype)

    return _route(x, weights, ids, w13.shape[0], expert, "moe_experts_fp8")
