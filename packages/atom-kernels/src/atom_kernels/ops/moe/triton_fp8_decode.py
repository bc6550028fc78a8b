"""FP8 routed experts for a few tokens (decode): one program per (token, expert) pair, no align, no
separate activation quantisation.

With a handful of tokens each expert gets at most a row or two, so sorting the pairs into per-expert row
blocks (``moe_align``) and quantising the activations in their own launches cost more than they save.
Here the pair is the unit of work:

1. ``_moe_pair_gemm1_fp8_kernel``, program ``(pair, column tile)``: quantises its token's row group by
   group in registers (``_quant_e4m3``, the bits of ``_act_quant_kernel``), multiplies it with the gate and
   up tiles of its expert (the weight tile is the dot's left operand, so one tensor-core instruction covers
   16 weight rows: the token is a 2-column right operand whose second column is zero), scales each K group
   by the token's group scale and the weight block's scale, applies SiLU-and-mul and stores the pair's
   activation row in x.dtype;
2. ``_moe_pair_gemm2_fp8_kernel``, program ``(pair, column tile)``: quantises the pair's activation row
   the same way, multiplies it with ``w2[e]`` and stores the pair's output row in x.dtype; then it takes
   an atomic ticket of its (token, column tile), and the last of the token's ``K`` programs of that tile
   adds the token's ``K`` pair rows times their routing weights (float32, in pair order: the arithmetic of
   ``_moe_sum_kernel``) into the output tile and returns the ticket to 0 (the counters stay zero between
   launches: CUDA-graph safe). The tickets are the caller's (``tickets``: a zeroed buffer the caller
   keeps, e.g. one per experts module), else zeros allocated per call (a memset).
   ``config={"FUSED_SUM": False}`` leaves the sum to a third launch, ``weighted_sum``
   (``_moe_sum_kernel``); the result is the same bit for bit.

The arithmetic is that of :mod:`atom_kernels.ops.moe.triton_fp8` (same operands, scales, roundings and
per-group float32 accumulation); an expert two tokens share is read twice (from L2 when the programs run
together), which at the decode sizes this path serves is cheaper than aligning. No host synchronisation;
portable launch options.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels.ops._fp8_math import FP8_MAX
from atom_kernels.ops._pdl import launch_options, pdl_enter
from atom_kernels.ops.fp8.reference import ACT_SCALE_EPS
from atom_kernels.ops.fp8.triton_decode import _quant_e4m3
from atom_kernels.ops.moe.triton import weighted_sum

# H200, 80B-A3B experts (513 x [1024 x 2048] / [2048 x 512] e4m3, top-10 + the shared expert), CUDA graphs,
# weights rotating over 8 routings: pair path vs aligned path 19.6 / 27.9 us at T = 1, 25.1 / 34.8 at T = 2,
# 40.9 / 50.2 at T = 4, 75.0 / 78.0 at T = 8 (exp/decode_sweep.py in git history; docs/performance.md).
PAIR_MAX_TOKENS = 8
"""Most tokens the pair path serves by default (``moe_experts_fp8``)."""
PAIR_TILES = dict(PN1=32, PW1=2, PS1=4, PN2=64, PW2=2, PS2=3)
"""Column tile, warps and stages of the pair path's two GEMMs (the fastest of an 18 + 24 config sweep at
T = 2 on the H200; T = 1 picks the same first GEMM and a second within 2%)."""


@triton.jit
def _token_group(ptrs, k0, offs_g, c_ok, n_k, EVEN_K: tl.constexpr, EPS: tl.constexpr, FMAX: tl.constexpr):
    """Channels ``k0 .. k0 + GROUP`` of one row (``ptrs``: ``[GROUP, 2]``, column 1 masked off) quantised
    as the dot's right operand: ``(q [GROUP, 2] e4m3, s [2])``, column 1 zero."""
    if EVEN_K:
        x = tl.load(ptrs + k0, mask=c_ok[None, :], other=0.0)
    else:
        x = tl.load(ptrs + k0, mask=((k0 + offs_g) < n_k)[:, None] & c_ok[None, :], other=0.0)
    return _quant_e4m3(x.to(tl.float32), 0, EPS, FMAX)  # one group per column


@triton.jit
def _weight_group(ptrs, k0, offs_g, n_ok, n_k, EVEN_K: tl.constexpr):
    """The ``[BLOCK_N, GROUP]`` weight tile at channel ``k0`` (rows past N and channels past ``n_k`` zero)."""
    if EVEN_K:
        return tl.load(ptrs + k0, mask=n_ok[:, None], other=0.0)
    return tl.load(ptrs + k0, mask=n_ok[:, None] & ((k0 + offs_g) < n_k)[None, :], other=0.0)


@triton.jit
def _moe_pair_gemm1_fp8_kernel(
    x_ptr, ids_ptr, w_ptr, ws_ptr, act_ptr, H, inter, nb_inter,
    stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_at,
    EPS: tl.constexpr, FMAX: tl.constexpr, BN_Q: tl.constexpr, GROUP: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """``act[p, n-tile] = silu(g) * u`` for pair ``p = program_id(0)`` (token ``p // TOP_K``, expert
    ``ids[p]``), ``g`` / ``u`` its gate / up rows of ``w13[e]`` times the quantised token."""
    pdl_enter(PDL)  # first: wait for the previous kernel (PDL launches)
    p = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(ids_ptr + p).to(tl.int64)
    if e < 0:  # an expert this rank does not hold: no activation row (the second GEMM skips the pair)
        return
    tok = (p // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_g = tl.arange(0, GROUP)
    offs_c = tl.arange(0, 2)  # column 0: the token; column 1: zeros (the dot's narrowest right operand)
    c_ok = offs_c < 1
    n_ok = offs_n < inter
    x_ptrs = x_ptr + tok * stride_xt + offs_g[:, None] + offs_c[None, :] * 0
    g_ptrs = w_ptr + e * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_g[None, :]
    u_ptrs = g_ptrs + inter * stride_wn
    gs_ptrs = ws_ptr + e * stride_se + (offs_n // BN_Q) * stride_sn
    us_ptrs = gs_ptrs + nb_inter * stride_sn
    acc_g = tl.zeros([BLOCK_N, 2], tl.float32)
    acc_u = tl.zeros([BLOCK_N, 2], tl.float32)
    for g in range(0, tl.cdiv(H, GROUP)):
        k0 = g * GROUP
        a, a_s = _token_group(x_ptrs, k0, offs_g, c_ok, H, EVEN_K, EPS, FMAX)
        wg = _weight_group(g_ptrs, k0, offs_g, n_ok, H, EVEN_K)
        wu = _weight_group(u_ptrs, k0, offs_g, n_ok, H, EVEN_K)
        g_s = tl.load(gs_ptrs + g, mask=n_ok, other=0.0)
        u_s = tl.load(us_ptrs + g, mask=n_ok, other=0.0)
        acc_g += tl.dot(wg, a) * a_s[None, :] * g_s[:, None]
        acc_u += tl.dot(wu, a) * a_s[None, :] * u_s[:, None]
    dt = act_ptr.dtype.element_ty
    gv = acc_g.to(dt).to(tl.float32)
    uv = acc_u.to(dt).to(tl.float32)
    h = gv * tl.sigmoid(gv) * uv
    out = act_ptr + p.to(tl.int64) * stride_at + offs_n[:, None] + offs_c[None, :] * 0
    tl.store(out, h.to(dt), mask=n_ok[:, None] & c_ok[None, :])


@triton.jit
def _moe_pair_gemm2_fp8_kernel(
    a_ptr, ids_ptr, w_ptr, ws_ptr, y_ptr, topw_ptr, out_ptr, count_ptr, H, inter,
    stride_at, stride_we, stride_wn, stride_se, stride_sn, stride_yt, stride_ot,
    EPS: tl.constexpr, FMAX: tl.constexpr, BN_Q: tl.constexpr, GROUP: tl.constexpr, TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr, FUSED_SUM: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """``y[p, n-tile] = quant(act[p]) @ w2[ids[p]].T`` for pair ``p = program_id(0)``, in y's dtype.

    FUSED_SUM: then the ticket ``count[token, n-tile]`` (one per token and column tile, ``token = p //
    TOP_K``); the last of the token's ``TOP_K`` programs of this tile to take it writes ``out[token,
    n-tile] = sum_j topw[token * TOP_K + j] * y[token * TOP_K + j, n-tile]`` (float32, in pair order: the
    arithmetic of ``_moe_sum_kernel``) and resets the ticket to 0."""
    pdl_enter(PDL)  # first: wait for the previous kernel (PDL launches)
    p = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(ids_ptr + p).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_g = tl.arange(0, GROUP)
    offs_c = tl.arange(0, 2)
    c_ok = offs_c < 1
    n_ok = offs_n < H
    if e >= 0:  # id -1: an expert this rank does not hold; no row, but the pair still takes its ticket
        a_ptrs = a_ptr + p.to(tl.int64) * stride_at + offs_g[:, None] + offs_c[None, :] * 0
        w_ptrs = w_ptr + e * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_g[None, :]
        s_ptrs = ws_ptr + e * stride_se + (offs_n // BN_Q) * stride_sn
        acc = tl.zeros([BLOCK_N, 2], tl.float32)
        for g in range(0, tl.cdiv(inter, GROUP)):
            k0 = g * GROUP
            a, a_s = _token_group(a_ptrs, k0, offs_g, c_ok, inter, EVEN_K, EPS, FMAX)
            w = _weight_group(w_ptrs, k0, offs_g, n_ok, inter, EVEN_K)
            w_s = tl.load(s_ptrs + g, mask=n_ok, other=0.0)
            acc += tl.dot(w, a) * a_s[None, :] * w_s[:, None]
        out = y_ptr + p.to(tl.int64) * stride_yt + offs_n[:, None] + offs_c[None, :] * 0
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & c_ok[None, :])
    if FUSED_SUM:
        tok = p // TOP_K
        count = count_ptr + tok * tl.num_programs(1) + pid_n
        tl.debug_barrier()  # every thread's part of the tile is written before the ticket is taken
        ticket = tl.atomic_add(count, 1, sem="acq_rel")
        if ticket == TOP_K - 1:
            t = tok.to(tl.int64)
            s = tl.zeros([BLOCK_N], tl.float32)
            for j in tl.static_range(TOP_K):  # pair order, as _moe_sum_kernel (-1 pairs add nothing)
                ej = tl.load(ids_ptr + t * TOP_K + j)
                rw = tl.where(ej >= 0, tl.load(topw_ptr + t * TOP_K + j).to(tl.float32), 0.0)
                held = (offs_n * 0 + ej) >= 0
                yj = tl.load(y_ptr + (t * TOP_K + j) * stride_yt + offs_n, mask=n_ok & held, other=0.0)
                s += rw * yj.to(tl.float32)
            tl.store(out_ptr + t * stride_ot + offs_n, s.to(out_ptr.dtype.element_ty), mask=n_ok)
            tl.atomic_xchg(count, 0)  # reset for the next launch


def pair_experts_fp8(
    x, flat_ids, flat_w, w13, w13_scale, w2, w2_scale, block, top_k, cfg, out, tickets=None
) -> torch.Tensor:
    """The pair path: ``x [T, H]`` (unit last stride), ``flat_ids`` / ``flat_w [T * K]`` -> ``out [T, H]``
    (x.dtype), ``out[t] = sum_j flat_w[t * K + j] * y[t * K + j]`` over the per-pair expert outputs ``y``.

    ``cfg``: ``PN1``, ``PW1``, ``PS1`` for the first GEMM's column tile, warps and stages, ``PN2``, ``PW2``,
    ``PS2`` for the second; ``FUSED_SUM`` (default True): the second GEMM sums each token's pair rows
    itself (per-(token, column tile) tickets: ``tickets``, int32 zeros the launch leaves zero, at least
    ``T * ceil(H / PN2)`` of them, else zeros allocated here), otherwise a third launch
    (``_moe_sum_kernel``) does, with the same arithmetic: the two agree bit for bit."""
    bn, bk = block
    num_pairs = flat_ids.numel()
    num_tokens, hidden = x.shape
    inter = w13.shape[1] // 2
    dev = x.device
    tiles = triton.cdiv(hidden, cfg["PN2"])
    fused = bool(cfg.get("FUSED_SUM", True))
    count = flat_ids  # unused without the fused sum
    if fused:
        need = num_tokens * tiles
        if tickets is None:
            count = torch.zeros((need,), dtype=torch.int32, device=dev)
        elif tickets.numel() < need:
            raise ValueError(
                f"moe_experts_fp8 (triton): tickets holds {tickets.numel()} counters, the pair path needs "
                f"{need} (T={num_tokens} x ceil(H={hidden} / PN2={cfg['PN2']}))"
            )
        else:
            count = tickets
    act = torch.empty((num_pairs, inter), dtype=x.dtype, device=dev)
    _moe_pair_gemm1_fp8_kernel[(num_pairs, triton.cdiv(inter, cfg["PN1"]))](
        x_ptr=x, ids_ptr=flat_ids, w_ptr=w13, ws_ptr=w13_scale, act_ptr=act, H=hidden, inter=inter,
        nb_inter=triton.cdiv(inter, bn), stride_xt=x.stride(0), stride_we=w13.stride(0),
        stride_wn=w13.stride(1), stride_se=w13_scale.stride(0), stride_sn=w13_scale.stride(1),
        stride_at=act.stride(0), EPS=ACT_SCALE_EPS, FMAX=FP8_MAX, BN_Q=bn, GROUP=bk, TOP_K=top_k,
        BLOCK_N=cfg["PN1"], EVEN_K=hidden % bk == 0, num_warps=cfg["PW1"], num_stages=cfg["PS1"],
        **launch_options(dev),
    )  # fmt: skip
    y = torch.empty((num_pairs, hidden), dtype=x.dtype, device=dev)
    _moe_pair_gemm2_fp8_kernel[(num_pairs, tiles)](
        a_ptr=act, ids_ptr=flat_ids, w_ptr=w2, ws_ptr=w2_scale, y_ptr=y, topw_ptr=flat_w, out_ptr=out,
        count_ptr=count, H=hidden, inter=inter, stride_at=act.stride(0), stride_we=w2.stride(0),
        stride_wn=w2.stride(1), stride_se=w2_scale.stride(0), stride_sn=w2_scale.stride(1),
        stride_yt=y.stride(0), stride_ot=out.stride(0), EPS=ACT_SCALE_EPS, FMAX=FP8_MAX, BN_Q=bn, GROUP=bk,
        TOP_K=top_k, BLOCK_N=cfg["PN2"], EVEN_K=inter % bk == 0, FUSED_SUM=fused, num_warps=cfg["PW2"],
        num_stages=cfg["PS2"], **launch_options(dev),
    )  # fmt: skip
    return out if fused else weighted_sum(y, flat_w, flat_ids, out, top_k)
