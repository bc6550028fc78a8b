"""Triton fused MoE experts with FP8 block-scaled weights (W8A8, dynamic per-token-group activations).

Up to ``PAIR_MAX_TOKENS`` tokens :func:`moe_experts_fp8` takes the pair path of
:mod:`atom_kernels.ops.moe.triton_fp8_decode`; above it, the aligned path below.

The structure of :mod:`atom_kernels.ops.moe.triton` (same align, same tile plans, same weighted sum),
with e4m3 operands:

1. ``_act_quant_kernel`` quantises x per token and group of ``bk`` channels;
2. ``moe_align`` (``_moe_align_kernel``) sorts the (token, expert) pairs into ``BLOCK_M``-row blocks of one expert;
3. ``_moe_gemm1_fp8_kernel``: gate and up tiles ``x_q @ w13[e].T`` (e4m3 ``tl.dot``, float32 accumulation),
   each K tile scaled by the token's group scale and the weight block's scale; the gate's scale rows
   are ``w13_scale[e, :ceil(I/bn)]`` and the up projection's ``w13_scale[e, ceil(I/bn):]``; SiLU-and-mul
   in the epilogue, stored in x.dtype;
4. the activation is quantised per row and group (``_act_quant_kernel``), ``_moe_gemm2_fp8_kernel``
   multiplies it with ``w2[e]`` (block scales ``w2_scale[e]``), and ``_moe_sum_kernel`` adds each
   token's ``K`` rows times their routing weights in float32.

``BLOCK_K = min(128, bk)`` (one scale per K tile); column tiles gather one scale per column, so any
``BLOCK_N`` works. No host synchronisation; portable launch options (ROCm-compilable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels.ops._pdl import launch_options, pdl_enter
from atom_kernels.ops.fp8.triton import _act_quant_2d
from atom_kernels.ops.moe.checks import check_moe_experts_fp8
from atom_kernels.ops.moe.triton import aligned_tile, check_ids_on_cpu, moe_align, plan, weighted_sum
from atom_kernels.ops.moe.triton_fp8_decode import PAIR_MAX_TOKENS, PAIR_TILES, pair_experts_fp8


@triton.jit
def _moe_gemm1_fp8_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, act_ptr, sorted_ptr, block_expert_ptr, num_pairs, H, inter, nb_inter,
    stride_xt, stride_xst, stride_we, stride_wn, stride_se, stride_sn, stride_at,
    BN_Q: tl.constexpr, BK_Q: tl.constexpr, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_enter(PDL)  # first: wait for the previous kernel (PDL launches)
    e = tl.load(block_expert_ptr + tl.program_id(0))
    if e < 0:
        return
    rows, pair, valid, offs_n, n_ok, offs_k = aligned_tile(
        sorted_ptr, num_pairs, inter, BLOCK_M, BLOCK_N, BLOCK_K
    )
    tok = (pair // TOP_K).to(tl.int64)
    e64 = e.to(tl.int64)
    a_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :]
    as_ptrs = xs_ptr + tok * stride_xst
    g_ptrs = w_ptr + e64 * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    u_ptrs = g_ptrs + inter * stride_wn
    gs_ptrs = ws_ptr + e64 * stride_se + (offs_n // BN_Q) * stride_sn
    us_ptrs = gs_ptrs + nb_inter * stride_sn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_ok = (k0 + offs_k) < H
        kb = k0 // BK_Q
        a = tl.load(a_ptrs + k0, mask=valid[:, None] & k_ok[None, :], other=0.0)
        wg = tl.load(g_ptrs + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        wu = tl.load(u_ptrs + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        a_s = tl.load(as_ptrs + kb, mask=valid, other=0.0)
        g_s = tl.load(gs_ptrs + kb, mask=n_ok, other=0.0)
        u_s = tl.load(us_ptrs + kb, mask=n_ok, other=0.0)
        acc_g += tl.dot(a, wg) * a_s[:, None] * g_s[None, :]
        acc_u += tl.dot(a, wu) * a_s[:, None] * u_s[None, :]
    dt = act_ptr.dtype.element_ty
    g = acc_g.to(dt).to(tl.float32)
    u = acc_u.to(dt).to(tl.float32)
    h = g * tl.sigmoid(g) * u
    out = act_ptr + rows[:, None].to(tl.int64) * stride_at + offs_n[None, :]
    tl.store(out, h.to(dt), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _moe_gemm2_fp8_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, y_ptr, sorted_ptr, block_expert_ptr, num_pairs, H, inter,
    stride_at, stride_ast, stride_we, stride_wn, stride_se, stride_sn, stride_yt,
    BN_Q: tl.constexpr, BK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_enter(PDL)  # first: wait for the previous kernel (PDL launches)
    e = tl.load(block_expert_ptr + tl.program_id(0))
    if e < 0:
        return
    rows, pair, valid, offs_n, n_ok, offs_k = aligned_tile(
        sorted_ptr, num_pairs, H, BLOCK_M, BLOCK_N, BLOCK_K
    )
    e64 = e.to(tl.int64)
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_at + offs_k[None, :]
    as_ptrs = as_ptr + rows.to(tl.int64) * stride_ast
    w_ptrs = w_ptr + e64 * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    s_ptrs = ws_ptr + e64 * stride_se + (offs_n // BN_Q) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_ok = (k0 + offs_k) < inter
        kb = k0 // BK_Q
        a = tl.load(a_ptrs + k0, mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        a_s = tl.load(as_ptrs + kb, mask=valid, other=0.0)
        w_s = tl.load(s_ptrs + kb, mask=n_ok, other=0.0)
        acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
    out = y_ptr + pair[:, None].to(tl.int64) * stride_yt + offs_n[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


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
    config: dict | None = None,
) -> torch.Tensor:
    """FP8 routed experts (semantics: the reference ``moe_experts_fp8``). Ids must lie in ``[-1, E)``
    (checked only on CPU); a -1 slot (an expert this rank does not hold) contributes zero. Up to ``PAIR_MAX_TOKENS`` tokens the pair path of
    :mod:`~atom_kernels.ops.moe.triton_fp8_decode` runs (``config["PAIRS"]`` forces it on or off), else the
    aligned path. ``tickets``: int32 zeros, at least ``experts_fp8_tickets(H)``, that the pair path's
    second GEMM takes as its per-(token, column tile) counters for the routed sum and leaves zero (without
    them it allocates zeroed counters per call: one memset). ``config`` overrides the tile plans (keys of
    :func:`atom_kernels.ops.moe.triton.plan`, ``PAIR_TILES``' keys, and ``FUSED_SUM``: False sums the
    pair path's rows in a launch of its own)."""
    check_moe_experts_fp8(x, weights, ids, w13, w13_scale, w2, w2_scale, block, tickets)
    bn, bk = int(block[0]), int(block[1])
    if bk < 32 or bk & (bk - 1):
        raise ValueError(f"moe_experts_fp8 (triton): block[1] must be a power of two >= 32, got {bk}")
    num_tokens, hidden = x.shape
    top_k = ids.shape[1]
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    if w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("moe_experts_fp8 (triton): w13 and w2 need a unit last-dim stride")
    check_ids_on_cpu("moe_experts_fp8", ids, num_experts)
    flat_ids = ids.reshape(-1).contiguous()
    flat_w = weights.reshape(-1).contiguous()
    config = config or {}
    if config.get("PAIRS", num_tokens <= PAIR_MAX_TOKENS):
        cfg = {**PAIR_TILES, **config}
        return pair_experts_fp8(
            x, flat_ids, flat_w, w13, w13_scale, w2, w2_scale, (bn, bk), top_k, cfg, out, tickets
        )
    cfg = plan(num_tokens, top_k, num_experts, config)
    k1 = k2 = min(128, bk)  # one scale group per K tile (measured faster than 64 for fp8 at 4096 tokens)
    bm = cfg["BLOCK_M"]
    dev = x.device
    sorted_ids, block_expert = moe_align(flat_ids, num_experts, bm)
    max_blocks = block_expert.numel()
    xq, xs = _act_quant_2d(x, bk)
    act = torch.empty((max_blocks * bm, inter), dtype=x.dtype, device=dev)
    _moe_gemm1_fp8_kernel[(max_blocks, triton.cdiv(inter, cfg["N1"]))](
        xq, xs, w13, w13_scale, act, sorted_ids, block_expert, num_pairs, hidden, inter,
        triton.cdiv(inter, bn), xq.stride(0), xs.stride(0), w13.stride(0), w13.stride(1),
        w13_scale.stride(0), w13_scale.stride(1), act.stride(0),
        BN_Q=bn, BK_Q=bk, TOP_K=top_k, BLOCK_M=bm, BLOCK_N=cfg["N1"], BLOCK_K=k1,
        num_warps=cfg["W1"], num_stages=cfg["S1"], **launch_options(dev),
    )  # fmt: skip
    aq, a_s = _act_quant_2d(act, bk)
    y = torch.empty((num_pairs, hidden), dtype=x.dtype, device=dev)
    _moe_gemm2_fp8_kernel[(max_blocks, triton.cdiv(hidden, cfg["N2"]))](
        aq, a_s, w2, w2_scale, y, sorted_ids, block_expert, num_pairs, hidden, inter,
        aq.stride(0), a_s.stride(0), w2.stride(0), w2.stride(1), w2_scale.stride(0), w2_scale.stride(1),
        y.stride(0), BN_Q=bn, BK_Q=bk, BLOCK_M=bm, BLOCK_N=cfg["N2"], BLOCK_K=k2,
        num_warps=cfg["W2"], num_stages=cfg["S2"], **launch_options(dev),
    )  # fmt: skip
    return weighted_sum(y, flat_w, flat_ids, out, top_k)
