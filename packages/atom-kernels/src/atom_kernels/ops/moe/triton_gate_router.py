"""Triton ``moe_gate_router``: the MoE router's Linear and the softmax top-k in one launch at decode sizes.

At ``T <= FUSED_MAX_T`` tokens (a batch-1 decode or k = 1 verify), ``_gate_router_kernel`` runs over
column tiles of the router weight: program ``p`` computes the logits of ``BLOCK_E`` router rows for every token (float32 products and sums over
``H``, rounded to x.dtype as a Linear's output) and writes them to a float32 scratch ``[T, C]``; the last
program to take the grid-wide ticket (which it returns to 0) routes all tokens at once: softmax over the
``E`` routed columns, ``top_k`` rounds of argmax, renormalisation, and the shared columns
(``sigmoid(logit E)``, ids ``E .. E + m - 1``): the rules of :func:`~atom_kernels.ops.moe.triton.moe_router`
(NaN ranks as -inf, exact ties go to the higher index), one max reduction per round on a packed
(probability, index) key. Each program holds its weight rows in registers (the whole row at the 80B
model's H = 2048) and reads them once for all tokens; the router's weight is read once by ``C / BLOCK_E``
programs in one launch where a cuBLAS GEMM and the separate router kernel take two.

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
# (gate_router_h200.json): fused 7.5 / 7.9 / 11.1 / 18.0 us at T = 1 / 2 / 4 / 8 against 9.4-9.6 us for
# cuBLAS + moe_router: every program multiplies all T rows, so past T = 2 the two launches win.
FUSED_MAX_T = 2
BLOCK_E = 2  # router rows per program (fastest or within 0.3 us of the sweep's best at T = 1, 2)
MAX_TILE = 4096  # weight elements a program holds in registers per step: the whole row at H = 2048


@triton.jit
def _gate_router_kernel(
    x_ptr, w_ptr, logits_ptr, weights_ptr, ids_ptr, count_ptr, T, H, cols, num_experts, stride_x, stride_w,
    TOP_K: tl.constexpr, RENORM: tl.constexpr, NUM_SHARED: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, E_P2: tl.constexpr, K_P2: tl.constexpr,
    PDL: tl.constexpr = False,
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
        # One max per round: key = (bits of p) << 32 | expert, monotonic in p for p >= 0, ties to the
        # higher index; NaN ranks below every number (key = expert - 2^32, still the higher index
        # first) and taken experts and padding lanes below all (the rules of moe_router's kernel: the ids
        # stay distinct in [0, E), a NaN row keeps NaN weights).
        lane = offs[None, :].to(tl.int64)
        bits = p.to(tl.int32, bitcast=True).to(tl.int64)
        key = tl.where(p == p, (bits << 32) | lane, lane - (1 << 32))
        taken = -(1 << 62)
        key = tl.where(routed[None, :], key, taken)
        slots = tl.arange(0, K_P2)
        top_w = tl.zeros([ROWS, K_P2], tl.float32)
        top_i = tl.zeros([ROWS, K_P2], tl.int64)
        for j in tl.static_range(TOP_K):
            best = tl.max(key, 1)
            i = best & 0xFFFFFFFF
            w = tl.where(best >= 0, (best >> 32).to(tl.int32).to(tl.float32, bitcast=True), float("nan"))
            top_w = tl.where(slots[None, :] == j, w[:, None], top_w)
            top_i = tl.where(slots[None, :] == j, i[:, None], top_i)
            key = tl.where(lane == i[:, None], taken, key)
        if RENORM:
            top_w = top_w / tl.sum(tl.where(slots[None, :] < TOP_K, top_w, 0.0), 1)[:, None]
        row = TOP_K + NUM_SHARED  # output columns per token: routed, then shared
        out = offs_t[:, None] * row + slots[None, :]
        keep = t_ok[:, None] & (slots < TOP_K)[None, :]
        tl.store(weights_ptr + out, top_w, mask=keep)
        tl.store(ids_ptr + out, top_i, mask=keep)
        if NUM_SHARED > 0:  # the shared gate logit sits after the routed ones
            gate = tl.sigmoid(tl.load(logits_ptr + offs_t * cols + num_experts, mask=t_ok, other=0.0))
            for j in tl.static_range(NUM_SHARED):
                tl.store(weights_ptr + offs_t * row + TOP_K + j, gate, mask=t_ok)
                tl.store(
                    ids_ptr + offs_t * row + TOP_K + j, (offs_t * 0 + num_experts + j).to(tl.int64), mask=t_ok
                )
        tl.atomic_xchg(count_ptr, 0)  # reset for the next launch


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
    _gate_router_kernel[(triton.cdiv(cols, block_e),)](
        x_ptr=x, w_ptr=gate_weight, logits_ptr=logits, weights_ptr=weights, ids_ptr=ids, count_ptr=tickets,
        T=num_tokens, H=hidden, cols=cols, num_experts=num_experts, stride_x=x.stride(0),
        stride_w=gate_weight.stride(0), TOP_K=top_k, RENORM=bool(renormalize), NUM_SHARED=num_shared,
        ROWS=rows, BLOCK_E=block_e, BLOCK_H=min(triton.next_power_of_2(hidden), MAX_TILE // block_e),
        E_P2=triton.next_power_of_2(num_experts), K_P2=triton.next_power_of_2(top_k), num_warps=num_warps,
        **launch_options(x.device),
    )  # fmt: skip
    return weights, ids
