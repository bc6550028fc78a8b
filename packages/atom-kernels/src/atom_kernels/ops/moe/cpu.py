"""Routed experts for CPUs: the reference's contract and rounding points.

Where a C compiler builds it, :mod:`.cpu_native` runs the whole op in one C call (float32 or bf16 tokens,
float32 or bf16 weights); the torch forms below are the fallback (no compiler, other dtypes) and the
spec that the C pass is tested against.

The products are float32 sums of x.dtype operands (the reference's, and stock vLLM's CPU kernel's, rounding
points: the activation and the result only). CPU torch has no x.dtype x x.dtype -> float32 matmul, so the
weights enter the float32 matmuls as float32: where ``w13`` / ``w2`` are x.dtype they are converted on every
call (a memory-bound copy of every expert's weights: 0.09 ms for the bundled model's 10 experts of
``[128, 256]`` + ``[256, 64]``, one core); their owner may instead pass float32 copies made once at load
(``float32_weights``, same products; atom_models' ``Experts.hold_float32``).

Three forms, chosen from the shapes alone where they can be (``T`` tokens, ``K`` slots, ``E`` experts):

- dense (:func:`_dense`, where ``E * T <= T * K + E * LOOP_ROWS`` (few tokens) and ``E <= MAX_PADDING * K``
  (few experts a slot: not the 80B model's 512 experts top-10, where every expert on every token would
  be ~50x the routed work)): every expert on every token,
  one ``[T, H] x [H, E * 2I]`` matmul and one batched ``[E, T, I] x [E, I, H]`` matmul, then each token's
  ``K`` slots gathered from the ``[E, T, H]`` outputs and summed in ascending expert order (the order the
  sorted forms sum them in: bit-equal to the padded batch, in float32 too, at T = 1..106 of the bundled
  model's shapes). No host synchronisation and no sort of the pairs: at decode and verify sizes the op is
  its dispatch, and this form has the fewest ops.
- padded batch: the pairs laid out ``[E, C, H]`` (``C`` = the busiest expert's count, rows past an
  expert's count zero) and the experts as two batched matmuls.
- sorted loop: where the padding would cost more rows than a loop's per-expert overhead (:data:`LOOP_ROWS`
  rows an expert; a shared expert in every token's row pads each routed expert up to ``T``: the prompt
  steps) the pairs are sorted by expert into one ``[T * K, H]`` block and each expert's rows run as two
  matmuls on their slice, with ``out=`` into the sorted buffers.

Where the padding would exceed :data:`MAX_PADDING` times the real pairs (few tokens, many experts) the
reference's per-expert loop runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atom_kernels.ops._checks import values_checkable
from atom_kernels.ops.moe import cpu_native, reference
from atom_kernels.ops.moe.checks import check_moe_experts

MAX_PADDING = 4
"""The batched form runs when ``E * C <= MAX_PADDING * T * K`` (a shared expert, in every token's row, makes
``C = T``: the bundled model, E = 8 + 2 shared slices, K = 2 + 2, needs 2.5)."""

LOOP_ROWS = 64
"""Padded rows worth one expert's ops in the sorted loop (an op of a few microseconds of dispatch against
a row's two small matmuls): the loop runs where ``E * C > T * K + E * LOOP_ROWS``."""


def moe_experts(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """:func:`atom_kernels.ops.moe.reference.moe_experts` (same contract; -1 ids contribute zero), and
    ``w13`` / ``w2`` may be float32 copies of x.dtype weights (module docstring)."""
    check_moe_experts(x, weights, ids, w13, w2, float32_weights=True)
    if cpu_native.usable(x, w13):
        return cpu_native.moe_experts(x, weights, ids, w13, w2)
    return torch_forms(x, weights, ids, w13, w2)


def torch_forms(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """The torch forms of the module docstring (operands checked by the caller)."""
    num_experts = w13.shape[0]
    flat_ids = ids.reshape(-1).long()
    if flat_ids.numel() and values_checkable(flat_ids):
        lo, hi = int(flat_ids.min()), int(flat_ids.max())
        if lo < -1 or hi >= num_experts:
            raise ValueError(
                f"moe_experts: ids must lie in [-1, E={num_experts}), got values in [{lo}, {hi}]"
            )
    tokens, top_k = ids.shape
    # the dense form's E * T rows, against the real pairs (at most T * K): within MAX_PADDING of them, and
    # fewer than the sorted loop's pairs plus its per-expert overhead
    dense_rows = num_experts * tokens
    if (
        tokens
        and dense_rows <= MAX_PADDING * tokens * top_k
        and dense_rows <= tokens * top_k + num_experts * LOOP_ROWS
    ):
        return _dense(x, weights, ids, w13, w2)
    held = torch.nonzero(flat_ids >= 0).squeeze(1)  # the (token, slot) pairs of experts held here
    pairs = held.numel()
    if pairs == 0:
        return torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    held_ids = flat_ids[held]
    counts = torch.bincount(held_ids, minlength=num_experts)
    cap = int(counts.max())
    if num_experts * cap > MAX_PADDING * pairs:
        return reference.moe_experts(x, weights, ids, w13, w2)
    order = torch.argsort(held_ids, stable=True)
    if num_experts * cap > pairs + num_experts * LOOP_ROWS:
        return _sorted_loop(x, weights, held[order], counts.tolist(), top_k, w13, w2)
    sorted_ids = held_ids[order]
    first = torch.cumsum(counts, 0) - counts  # [E] index of each expert's first pair in `order`
    slot = torch.arange(pairs, device=x.device) - first[sorted_ids]  # rank of the pair within its expert
    token_of = held[order] // top_k
    xs = x.new_zeros(num_experts, cap, x.shape[1])
    xs[sorted_ids, slot] = x[token_of]
    # float32 products of x.dtype operands (the reference's rounding points: activation and result only)
    h = torch.bmm(xs.float(), w13.float().transpose(1, 2))  # [E, C, 2I]
    half = h.shape[-1] // 2
    act = (F.silu(h[..., :half]) * h[..., half:]).to(x.dtype)
    y = torch.bmm(act.float(), w2.float().transpose(1, 2))[sorted_ids, slot]  # [pairs, H] in `order`
    y = y * weights.reshape(-1).float()[held[order], None]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    out.index_add_(0, token_of, y)
    return out.to(x.dtype)


def _per_expert_mm(a: torch.Tensor, w: torch.Tensor, counts: list[int], out: torch.Tensor) -> None:
    """``out[rows_e] = a[rows_e] @ w[e].T`` for each expert's slice of ``counts[e]`` consecutive rows."""
    start = 0
    for e, n in enumerate(counts):
        if n:
            torch.mm(a[start : start + n], w[e].t().to(a.dtype), out=out[start : start + n])
            start += n


def _sorted_loop(x, weights, order, counts: list[int], top_k: int, w13, w2) -> torch.Tensor:
    """The held pairs sorted by expert (``order``: flat ``(token, slot)`` indices), each expert's ``counts[e]``
    rows as two float32 matmuls of x.dtype operands on its slice; the reference's rounding points (the
    activation and the float32 weighted sum only)."""
    token_of = order // top_k
    xs = x[token_of].float()  # [pairs, H] in expert order
    inter = w2.shape[2]
    h = xs.new_empty(xs.shape[0], 2 * inter)
    y = xs.new_empty(xs.shape)
    _per_expert_mm(xs, w13, counts, h)
    act = (F.silu(h[:, :inter]) * h[:, inter:]).to(x.dtype).float()
    _per_expert_mm(act, w2, counts, y)
    yw = y.mul_(weights.reshape(-1).float()[order, None])
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    out.index_add_(0, token_of, yw)
    return out.to(x.dtype)


def _dense(x, weights, ids, w13, w2) -> torch.Tensor:
    """Every expert on every token (``[T, E, 2I]`` then ``[E, T, H]`` float32), each token's slots gathered
    and weighted, and summed over the slots in ascending expert order (stable: a repeated id keeps its slot
    order), as the sorted forms' ``index_add_`` sums them; a -1 slot's term is zero."""
    tokens, top_k = ids.shape
    num_experts, two_i, hidden = w13.shape
    inter = two_i // 2
    sorted_ids, perm = torch.sort(ids.long(), dim=1, stable=True)
    held = sorted_ids >= 0
    h = torch.mm(x.float(), w13.float().reshape(num_experts * two_i, hidden).t()).view(
        tokens, num_experts, two_i
    )
    act = (F.silu(h[..., :inter]) * h[..., inter:]).to(x.dtype).float()  # [T, E, I]
    y = torch.bmm(act.transpose(0, 1), w2.float().transpose(1, 2))  # [E, T, H]
    rows = torch.arange(tokens, device=x.device)[:, None]
    terms = y[sorted_ids.clamp(min=0), rows]  # [T, K, H]: the slots' expert outputs
    terms.mul_(weights.float().gather(1, perm)[..., None])
    terms.masked_fill_(~held[..., None], 0.0)
    out = terms[:, 0].clone()
    for j in range(1, top_k):
        out += terms[:, j]
    return out.to(x.dtype)
