"""Triton ``moe_gate_router``: the MoE router's Linear and the softmax top-k in one launch at decode sizes.

At ``T <= FUSED_MAX_T`` tokens (a batch-1 decode or k = 1 verify), ``_gate_router_kernel`` runs over
column tiles of the router weight: program ``p`` computes the logits of ``BLOCK_E`` router rows for every
token (float32 products and sums over ``H``, rounded to x.dtype as a Linear's output) and writes them to a
float32 scratch ``[T, C]``; the last program to take the grid-wide ticket (which it returns to 0) routes
all tokens at once: softmax over the ``E`` routed columns, the top ``top_k``, renormalisation, and the
shared columns (``sigmoid(logit E)``, ids ``E .. E + m - 1``), with the results of
:func:`~atom_kernels.ops.moe.triton.moe_router` (NaN ranks as -inf, exact ties go to the higher index).
Each program holds its weight rows in registers (the whole row at the 80B model's H = 2048) and reads them
once for all tokens; the router's weight is read once by ``C / BLOCK_E`` programs in one launch where a
cuBLAS GEMM and the separate router kernel take two.

The top-k ranks experts by an int32 key (the bits of the probability; -1 for NaN) and then by the higher
index, in two stages. Stage 1 splits the experts into ``GROUPS`` groups (one per warp, matching the layout
Triton gives the softmax: lane ``l`` of warp ``g`` holds experts ``(s * GROUPS + g) * 32 + l``), and takes
``top_k`` rounds of (max key, then max index at that key) inside each group: warp reductions without
shared memory or barriers. The top ``top_k`` of all experts lie among these ``GROUPS * top_k`` candidates;
stage 2 ranks each candidate by the number of candidates ahead of it (one comparison matrix and one sum),
so that slot ``j`` takes the candidate of rank ``j``. The weights are the probabilities of the chosen
experts, renormalised as in ``moe_router``.

Larger ``T``: the Linear (``torch.nn.functional.linear``, all ``R`` rows so that the output rows stay
aligned) and :func:`~atom_kernels.ops.moe.triton.moe_router`. No host synchronisation (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from atom_kernels.ops._pdl import launch_options, pdl_enter
from atom_kernels.ops.moe.checks import check_moe_gate_router
from atom_kernels.ops.moe.triton import moe_router

# The fused launch's largest token count. H200, 80B router (2048 x 513, top-10), CUDA graphs
# (gate_router_h200.json): fused 5.5 / 6.1 / 8.9 / 14.8 us at T = 1 / 2 / 4 / 8 against 9.6-9.8 us for
# cuBLAS + moe_router: every program multiplies all T rows, so past T = 4 the two launches win.
FUSED_MAX_T = 4
BLOCK_E = 2  # router rows per program (fastest or within 0.3 us of the sweep's best at T = 1, 2)
MAX_TILE = 4096  # weight elements a program holds in registers per step: the whole row at H = 2048
INT32_MIN = tl.constexpr(-(2**31))  # rank key of padding lanes and taken experts


@triton.jit
def _gate_router_kernel(
    x_ptr, w_ptr, logits_ptr, weights_ptr, ids_ptr, count_ptr, T, H, cols, num_experts, stride_x, stride_w,
    TOP_K: tl.constexpr, RENORM: tl.constexpr, NUM_SHARED: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, E_P2: tl.constexpr, K_P2: tl.constexpr,
    SUB: tl.constexpr, GROUPS: tl.constexpr, LANES: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """Logits of router rows ``[pid * BLOCK_E, +BLOCK_E)`` for tokens ``0 .. T - 1`` (``T <= ROWS``), then,
    in the last program to arrive, the routing of every token (module docstring)."""
    pdl_enter(PDL)  # first: wait for the previous kernel (PDL launches)
    pid = tl.program_id(0)
    offs_t = tl.arange(0, ROWS)
    offs_e = pid * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_h = tl.arange(0, BLOCK_H)
    t_ok = offs_t < T
    e_ok = offs_e < cols
    w_ptrs = w_ptr + offs_e[:, None].to(tl.int64) * stride_w + offs_h[None, :]
    acc = tl.zeros([ROWS, BLOCK_E], tl.float32)
    for h0 in range(0, H, BLOCK_H):  # one iteration when BLOCK_H covers H (the decode launch)
        h_ok = (h0 + offs_h) < H
        wv = tl.load(w_ptrs + h0, mask=e_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32)
        for r in tl.static_range(ROWS):  # the weight tile stays in registers for every token
            x_ok = h_ok & (offs_h * 0 + r < T)
            xr = tl.load(x_ptr + r * stride_x + h0 + offs_h, mask=x_ok, other=0.0).to(tl.float32)
            acc += tl.where(offs_t[:, None] == r, tl.sum(wv * xr[None, :], 1)[None, :], 0.0)
    logits = acc.to(x_ptr.dtype.element_ty).to(tl.float32)  # rounded as the Linear's output
    lg_ptrs = logits_ptr + offs_t[:, None] * cols + offs_e[None, :]
    tl.store(lg_ptrs, logits, mask=t_ok[:, None] & e_ok[None, :])
    tl.debug_barrier()  # every thread's logits are written before the ticket is taken
    ticket = tl.atomic_add(count_ptr, 1, sem="acq_rel")
    if ticket == tl.num_programs(0) - 1:
        tl.atomic_xchg(count_ptr, 0)  # every program has taken its ticket: reset for the next launch
        row = TOP_K + NUM_SHARED  # output columns per token: routed, then shared
        if NUM_SHARED > 0:  # the shared gate logit sits after the routed ones
            gate = tl.sigmoid(tl.load(logits_ptr + offs_t * cols + num_experts, mask=t_ok, other=0.0))
            for j in tl.static_range(NUM_SHARED):
                tl.store(weights_ptr + offs_t * row + TOP_K + j, gate, mask=t_ok)
                tl.store(
                    ids_ptr + offs_t * row + TOP_K + j, (offs_t * 0 + num_experts + j).to(tl.int64), mask=t_ok
                )
        offs = tl.arange(0, E_P2)
        routed = offs < num_experts
        lg = tl.load(
            logits_ptr + offs_t[:, None] * cols + offs[None, :],
            mask=t_ok[:, None] & routed[None, :],
            other=float("-inf"),
        )
        lg = tl.where(t_ok[:, None], lg, tl.where(routed, 0.0, float("-inf"))[None, :])  # finite pad rows
        m = tl.max(lg, 1)
        p = tl.exp(lg - m[:, None])
        p = p / tl.sum(p, 1)[:, None]
        # Rank key (int32): the bits of p (monotonic in p for p >= 0), -1 for NaN (below every number),
        # INT32_MIN for padding lanes and taken experts (below all); equal keys rank the higher index first.
        key = tl.where(p == p, p.to(tl.int32, bitcast=True), -1)
        key = tl.where(routed[None, :], key, INT32_MIN)
        lane = tl.broadcast_to(offs[None, :], [ROWS, E_P2])
        # Stage 1: expert (s * GROUPS + g) * LANES + l is [., s, g, l]; each round takes every group's
        # best key (reduced over s and l) and the highest index holding it, then marks that expert taken.
        # Candidates are kept as key * 2^32 + index (int64: the same order as (key, index)).
        key4 = tl.reshape(key, [ROWS, SUB, GROUPS, LANES])
        lane4 = tl.reshape(lane, [ROWS, SUB, GROUPS, LANES])
        cslot = tl.arange(0, K_P2)[None, None, :]
        cand = tl.full([ROWS, GROUPS, K_P2], INT32_MIN * 2**32, tl.int64)
        for j in tl.static_range(TOP_K):
            v = tl.max(tl.max(key4, 1), 2)  # [ROWS, GROUPS]
            i = tl.max(tl.max(tl.where(key4 == v[:, None, :, None], lane4, -1), 1), 2)
            cand = tl.where(cslot == j, ((v.to(tl.int64) << 32) | i.to(tl.int64))[:, :, None], cand)
            key4 = tl.where(lane4 == i[:, None, :, None], INT32_MIN, key4)
        # Stage 2: a candidate's rank is the number of candidates ahead of it. The real candidates are
        # distinct, so ranks 0 .. TOP_K - 1 name one each (there are >= TOP_K of them: a group yields
        # min(TOP_K, its experts)); unfilled slots and exhausted groups' picks (INT32_MIN) rank after them.
        c = tl.reshape(cand, [ROWS, GROUPS * K_P2])
        rank = tl.sum((c[:, None, :] > c[:, :, None]).to(tl.int32), 2)
        slots = tl.arange(0, K_P2)
        at = rank[:, :, None] == slots[None, None, :]  # [ROWS, candidates, slots]
        best = tl.max(tl.where(at, c[:, :, None], INT32_MIN * 2**32), 1)  # [ROWS, slots]
        top_i = best & 0xFFFFFFFF
        top_key = (best >> 32).to(tl.int32)
        top_w = tl.where(top_key >= 0, top_key.to(tl.float32, bitcast=True), float("nan"))
        if RENORM:
            top_w = top_w / tl.sum(tl.where(slots[None, :] < TOP_K, top_w, 0.0), 1)[:, None]
        top_w = top_w.to(x_ptr.dtype.element_ty).to(tl.float32)  # rounded to the logits' dtype
        out = offs_t[:, None] * row + slots[None, :]
        keep = t_ok[:, None] & (slots < TOP_K)[None, :]
        tl.store(weights_ptr + out, top_w, mask=keep)
        tl.store(ids_ptr + out, top_i, mask=keep)


def moe_gate_router(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    num_experts: int,
    top_k: int,
    renormalize: bool,
    num_shared: int = 0,
    *,
    tickets: torch.Tensor | None = None,
    block_e: int = BLOCK_E,
    num_warps: int = 4,
    max_fused_tokens: int = FUSED_MAX_T,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe_router(linear(x, gate_weight)[:, :C], ...)`` (see the reference): one launch of
    ``_gate_router_kernel`` at ``T <= FUSED_MAX_T`` (``tickets``: the caller's zeroed counter, else one
    allocated per call: a memset), else the Linear and the router kernel. ``block_e`` (router rows per
    program), ``num_warps`` and ``max_fused_tokens``: knobs that benchmarks sweep."""
    cols = check_moe_gate_router(x, gate_weight, num_experts, top_k, renormalize, num_shared, tickets)
    if block_e < 1 or block_e & (block_e - 1):
        raise ValueError(f"moe_gate_router (triton): block_e must be a power of two, got {block_e}")
    if not 0 <= max_fused_tokens <= 16:
        raise ValueError(
            f"moe_gate_router (triton): max_fused_tokens must be in [0, 16], got {max_fused_tokens}"
        )
    num_tokens, hidden = x.shape
    if num_tokens > max_fused_tokens:
        return moe_router(F.linear(x, gate_weight)[:, :cols], top_k, renormalize, num_shared)
    width = top_k + num_shared
    weights = torch.empty((num_tokens, width), dtype=torch.float32, device=x.device)
    ids = torch.empty((num_tokens, width), dtype=torch.int64, device=x.device)
    if num_tokens == 0:
        return weights, ids
    if x.stride(-1) != 1:
        x = x.contiguous()
    if gate_weight.stride(-1) != 1:
        raise ValueError("moe_gate_router (triton): gate_weight needs a unit last-dim stride")
    if tickets is None:
        tickets = torch.zeros(1, dtype=torch.int32, device=x.device)
    logits = torch.empty((num_tokens, cols), dtype=torch.float32, device=x.device)
    rows = max(2, triton.next_power_of_2(num_tokens))
    e_p2 = triton.next_power_of_2(num_experts)
    lanes = min(32, e_p2)  # the top-k's stage-1 groups: one per warp, LANES x SUB experts each
    groups = min(num_warps, e_p2 // lanes)
    _gate_router_kernel[(triton.cdiv(cols, block_e),)](
        x_ptr=x, w_ptr=gate_weight, logits_ptr=logits, weights_ptr=weights, ids_ptr=ids, count_ptr=tickets,
        T=num_tokens, H=hidden, cols=cols, num_experts=num_experts, stride_x=x.stride(0),
        stride_w=gate_weight.stride(0), TOP_K=top_k, RENORM=bool(renormalize), NUM_SHARED=num_shared,
        ROWS=rows, BLOCK_E=block_e, BLOCK_H=min(triton.next_power_of_2(hidden), MAX_TILE // block_e),
        E_P2=e_p2, K_P2=triton.next_power_of_2(top_k), SUB=e_p2 // (groups * lanes), GROUPS=groups,
        LANES=lanes, num_warps=num_warps,
        **launch_options(x.device),
    )  # fmt: skip
    return weights, ids
