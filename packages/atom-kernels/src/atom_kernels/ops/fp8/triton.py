"""Triton FP8 (e4m3) kernels: per-token-group activation quantisation, the W8A8 block-scaled GEMM
(``fp8_linear``; ``gated_norm_fp8_linear``: the GDN output's gated RMS norm folded into it;
``rms_norm_fp8_linear``: the decoder layer's residual add and RMS norm folded into it), block dequantisation and per-tensor KV quantisation.

Activations are quantised per token and group of ``bk`` channels: absmax / 448 (floored at 1e-10 / 448),
IEEE division, clamp, round to nearest e4m3, all in one ``@triton.jit`` function, ``_quant_e4m3``, which
every kernel here that quantises activations calls (``_act_quant_kernel``, the one-launch decode kernel
of ``triton_decode.py``): their operands and scales agree bit for bit.
The e4m3 x e4m3 products run on the tensor cores (``tl.dot``, float32 accumulation), each K tile scaled by
the token's group scale and the weight block's scale.
:func:`plan` picks one of three plans from the shapes:

- decode (M <= ``ONE_LAUNCH_MAX_M``, ``ONE_LAUNCH``): one launch of ``_fp8_linear_decode_kernel``. Program
  ``(n tile, k split)`` quantises, in registers (``_quant_e4m3``), the groups of its own K range for the
  ``ROWS >= M`` rows only and multiplies them with its ``BLOCK_N``-column weight tiles. Narrow column
  tiles give the parallelism; where they leave SMs idle, split-K: float32 partials, and the last program
  of a column tile to take an atomic ticket (which it returns to 0, so the counters stay zero between
  launches: CUDA-graph safe) sums them in split order (deterministic) and adds the bias. Split-K
  allocates its partials (``torch.empty``) per call; its tickets are the caller's (``tickets``: a zeroed
  buffer the caller keeps, e.g. one per linear layer), else zeros allocated per call (a memset).
  ``gated_norm_fp8_linear`` runs this plan with the kernel's GATED_NORM prologue (each 128-channel
  activation group is one head, normalised and gated in registers before it is quantised): one launch
  instead of ``gated_rms_norm`` + ``fp8_linear``. ``rms_norm_fp8_linear`` likewise runs the RMS_NORM
  prologue (each program sums the squares of its rows over all K, then normalises the groups of its K
  range; column tile 0 also writes the new residual and the normed rows): one launch instead of
  ``rms_norm`` + ``fp8_linear``. Under the other plans both run their two ops.
- decode up to M = 64 otherwise (``ONE_LAUNCH=False``): ``_act_quant_kernel`` (one program per token),
  ``_fp8_gemm_kernel`` with one row tile of ``16 <= BLOCK_M <= 64`` rows and split-K float32 partials
  ``[SPLIT_K, M, N]``, summed in a fixed order by ``_splitk_reduce_kernel`` (deterministic), which also adds
  the bias.
- prefill (M > 64): ``_act_quant_kernel``, then ``_fp8_gemm_kernel`` with 64- or 128-row tiles,
  128-column tiles, grouped tile order for L2 reuse; ``BLOCK_K`` divides the scale block ``bk``.

Hopper's e4m3 tensor-core instructions accumulate with less than float32 precision inside one ``tl.dot``
(Triton's default on sm_90, as in vLLM's block-FP8 kernel); the float32 accumulator takes each K tile's
product, so the error is that of a 128-term sum (measured rel. 2.7e-4 of max |y|, H200).

No host synchronisation (CUDA-graph safe). Launch options are portable (no CUDA-only options), so the
sources compile for ROCm too. Triton 3.9's CPU interpreter flushes e4m3 subnormals to zero, does not
saturate, and rounds values just below a power of two that should round up to it down to the power below
(124.9 -> 64), so these kernels are registered for real GPUs only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from atom_kernels.ops._device import device_name, device_sms
from atom_kernels.ops._fp8_math import FP8_MAX, scale_tensor
from atom_kernels.ops._pdl import launch_options, pdl_enter
from atom_kernels.ops.fp8.checks import (
    check_fp8_act_quant,
    check_fp8_block_dequant,
    check_fp8_kv_dequant,
    check_fp8_kv_quant,
    check_fp8_linear,
    check_gated_norm_fp8_linear,
    check_rms_norm_fp8_linear,
)
from atom_kernels.ops.fp8.decode_table import tuned_table
from atom_kernels.ops.fp8.reference import ACT_SCALE_EPS
from atom_kernels.ops.fp8.triton_decode import _quant_e4m3, launch_decode
from atom_kernels.ops.norm.triton import gated_rms_norm, rms_norm

E4M3 = torch.float8_e4m3fn
# Largest M whose default plan is the one-launch kernel: each of its programs quantises M x (its K range),
# so the redundant quantisation grows with M (the one-launch plan runs at any M when asked for). H200
# (fp8_decode_h200.json): at M = 2 its best tiles beat the three-launch plan by 3-15% at the 80B shapes; at
# M = 8 the three-launch plan is 1.1-1.4x faster on every shape wider than 1024 columns.
ONE_LAUNCH_MAX_M = 2


@triton.jit
def _act_quant_kernel(
    x_ptr, q_ptr, s_ptr, K, num_groups, stride_x, stride_q, stride_s, EPS: tl.constexpr, FMAX: tl.constexpr,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, GROUPS_PER_ITER: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """One token per program: ``GROUPS_PER_ITER`` groups of ``GROUP`` channels per iteration."""
    pdl_enter(PDL)  # first: wait for the previous kernel (PDL launches)
    t = tl.program_id(0).to(tl.int64)
    gi = tl.arange(0, GROUPS_PER_ITER)
    ci = tl.arange(0, GROUP_P2)
    for g0 in range(0, num_groups, GROUPS_PER_ITER):
        g = g0 + gi
        cols = g[:, None] * GROUP + ci[None, :]
        m = (ci < GROUP)[None, :] & (cols < K) & (g < num_groups)[:, None]
        x = tl.load(x_ptr + t * stride_x + cols, mask=m, other=0.0).to(tl.float32)
        q, s = _quant_e4m3(x, 1, EPS, FMAX)
        tl.store(q_ptr + t * stride_q + cols, q, mask=m)
        tl.store(s_ptr + t * stride_s + g, s, mask=g < num_groups)


@triton.jit
def _fp8_gemm_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, bias_ptr, M, N, K,
    stride_am, stride_asm, stride_bn, stride_bsn, stride_cm, stride_cs, TILES_PER_SPLIT,
    BN_Q: tl.constexpr, BK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PARTIAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """``c[m, n] = sum_k a[m, k] b[n, k] as[m, k // BK_Q] bs[n // BN_Q, k // BK_Q]`` over this program's
    K tiles; PARTIAL: float32 partial sums to ``c[pid_k]`` (no bias), else the output in c's dtype."""
    pdl_enter(PDL)  # first: wait for the previous kernel (PDL launches)
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    rows_in_group = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_in_group
    pid_n = (pid % per_group) // rows_in_group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_tiles = tl.cdiv(K, BLOCK_K)
    t0 = pid_k * TILES_PER_SPLIT
    t1 = tl.minimum(t0 + TILES_PER_SPLIT, k_tiles)
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    as_ptrs = as_ptr + offs_m.to(tl.int64) * stride_asm
    bs_ptrs = bs_ptr + (offs_n // BN_Q).to(tl.int64) * stride_bsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kt in range(t0, t1):
        k0 = kt * BLOCK_K
        k_ok = (k0 + offs_k) < K
        a = tl.load(a_ptrs + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        kb = k0 // BK_Q
        a_s = tl.load(as_ptrs + kb, mask=m_ok, other=0.0)
        b_s = tl.load(bs_ptrs + kb, mask=n_ok, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if PARTIAL:
        tl.store(c_ptrs + pid_k.to(tl.int64) * stride_cs, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _splitk_reduce_kernel(
    ws_ptr, bias_ptr, c_ptr, MN, N, stride_ws, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_enter(PDL)  # first: wait for the previous kernel (PDL launches)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < MN
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT_K):  # fixed order: deterministic
        acc += tl.load(ws_ptr + s * stride_ws + offs, mask=m, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=m, other=0.0).to(tl.float32)
    tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=m)


@triton.jit
def _block_dequant_kernel(
    w_ptr, s_ptr, out_ptr, N, K, stride_w, stride_s, stride_o, BN: tl.constexpr, BK: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    m = (rows < N)[:, None] & (cols < K)[None, :]
    w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_w + cols[None, :], mask=m, other=0.0)
    s = tl.load(s_ptr + (rows // BN)[:, None] * stride_s + (cols // BK)[None, :], mask=m, other=0.0)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_o + cols[None, :], (w.to(tl.float32) * s).to(
        out_ptr.dtype.element_ty), mask=m)  # fmt: skip


@triton.jit
def _kv_quant_kernel(
    x_ptr, s_ptr, out_ptr, numel, FMAX: tl.constexpr, DEQUANT: tl.constexpr, BLOCK: tl.constexpr
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < numel
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    s = tl.load(s_ptr)
    if DEQUANT:
        y = x * s
    else:
        y = tl.minimum(tl.maximum(tl.math.div_rn(x, s), -FMAX), FMAX)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=m)


def _act_quant_2d(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    t, k = x.shape
    groups = triton.cdiv(k, group)
    q = torch.empty((t, k), dtype=E4M3, device=x.device)
    s = torch.empty((t, groups), dtype=torch.float32, device=x.device)
    if t:
        group_p2 = triton.next_power_of_2(group)
        per_iter = max(1, min(triton.next_power_of_2(groups), 4096 // group_p2))
        _act_quant_kernel[(t,)](
            x, q, s, k, groups, x.stride(0), q.stride(0), s.stride(0), EPS=ACT_SCALE_EPS, FMAX=FP8_MAX,
            GROUP=group, GROUP_P2=group_p2, GROUPS_PER_ITER=per_iter, num_warps=4, **launch_options(x.device),
        )  # fmt: skip
    return q, s


def fp8_act_quant(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-group e4m3 quantisation: ``(x_fp8 [..., K], scales [..., ceil(K/group)] float32)``."""
    check_fp8_act_quant(x, group)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    q, s = _act_quant_2d(x2, group)
    return q.reshape(*lead, k), s.reshape(*lead, s.shape[-1])


def plan(
    m: int, n: int, k: int, bk: int, sms: int, config: dict | None = None, table: Mapping | None = None
) -> dict:
    """Launch plan from shapes alone (``sms``: the device's multiprocessor count); ``config`` overrides keys.

    ``table``: per-shape one-launch configs ``{(n, k, rows): keys}`` (see
    :mod:`atom_kernels.ops.fp8.decode_table`, ``rows = max(2, 2^ceil(log2 M))``): the entry of this shape,
    if any, replaces the heuristic's keys below (its ``ONE_LAUNCH`` picks the plan at any M); ``config``
    still overrides both.

    - ``M <= ONE_LAUNCH_MAX_M`` (decode; or ``ONE_LAUNCH=True`` at any M): ``_fp8_linear_decode_kernel``,
      ``ROWS = max(2, 2^ceil(log2 M))`` rows; up to 8 rows ``SWAP_AB`` (the weight tile is the left
      operand: each 16-row tensor-core instruction covers 16 weight rows) with 2 warps and column tiles
      of 64 or 32, at 16+ rows (where the swapped dot would take Hopper's ``wgmma``, whose fp8
      accumulation differs from the three-launch plan's) 4 warps and tiles of 64, 32 or 16 (at least 64
      for M > 16: each program's quantisation work grows with M); the widest tile that gives two programs
      per SM; split-K over ``SPLIT_K`` programs only where the column tiles leave SMs idle and each split
      keeps >= 4 K groups.
    - other ``M <= 64`` (or ``ONE_LAUNCH=False``, or ``bk > 256``): the three-launch plan (act quant, GEMM
      with one row tile of ``16 <= BLOCK_M <= 64`` rows, split-K float32 partials, ``_splitk_reduce_kernel``).
    - ``M > 64`` (prefill): act quant, then whole-K tiles of 64 or 128 rows (64-column tiles where 128
      would leave SMs idle), grouped tile order for L2 reuse.
    """
    block_k = min(128, bk)
    rows = max(2, triton.next_power_of_2(m))
    entry = (table or {}).get((n, k, rows), {})
    one_launch = m <= ONE_LAUNCH_MAX_M and bk <= 256
    if "ONE_LAUNCH" in entry:
        one_launch = bool(entry["ONE_LAUNCH"]) and bk <= 256
    if config and "ONE_LAUNCH" in config:
        one_launch = bool(config["ONE_LAUNCH"])
    if one_launch:
        swap = rows <= 8
        if swap:  # H200 sweep at M = 2 (fp8_decode_h200.json): 64-column tiles from N ~ 32 x SMs, split 4
            block_n = 64 if n >= 32 * sms else 32
            split = max(1, min(triton.cdiv(k, bk) // 4, 4))
        else:
            min_bn = 16 if m <= 16 else 64
            block_n = next((b for b in (64, 32) if b >= min_bn and triton.cdiv(n, b) >= 2 * sms), min_bn)
            split = max(1, min(triton.cdiv(k, bk) // 4, sms // triton.cdiv(n, block_n)))
        cfg = dict(ONE_LAUNCH=True, ROWS=rows, BLOCK_N=block_n, SPLIT_K=split, SWAP_AB=swap,
                   num_warps=2 if swap else 4, num_stages=4)  # fmt: skip
        cfg.update(entry)
        cfg.update(config or {})
        return cfg
    if m <= 64:
        block_n = 64 if triton.cdiv(n, 64) >= 2 * sms else 32
        tiles = triton.cdiv(n, block_n)
        k_tiles = triton.cdiv(k, block_k)
        split = max(1, min(k_tiles // 2, (2 * sms) // tiles))
        cfg = dict(BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=1,
                   SPLIT_K=split, num_warps=4, num_stages=4)  # fmt: skip
    elif m <= 256:
        block_n = 64 if triton.cdiv(m, 64) * triton.cdiv(n, 128) < sms else 128
        cfg = dict(
            BLOCK_M=64, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, SPLIT_K=1, num_warps=4, num_stages=3
        )
    else:
        cfg = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=block_k, GROUP_M=8, SPLIT_K=1, num_warps=8, num_stages=3)
    cfg["ONE_LAUNCH"] = False
    if config:
        cfg.update(config)
    return cfg


def _check_block(op: str, block: tuple[int, int]) -> tuple[int, int]:
    bn, bk = int(block[0]), int(block[1])
    if bk < 32 or bk & (bk - 1):
        raise ValueError(f"{op} (triton): block[1] must be a power of two >= 32, got {bk}")
    return bn, bk


def _launch_gemm(a, a_scales, w, w_scales, block, out_dtype, bias, cfg) -> torch.Tensor:
    m, k = a.shape
    n = w.shape[0]
    bn, bk = block
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    k_tiles = triton.cdiv(k, cfg["BLOCK_K"])
    per = triton.cdiv(k_tiles, cfg["SPLIT_K"])
    split = triton.cdiv(k_tiles, per)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]), split)
    partial = split > 1
    ws = torch.empty((split, m, n), dtype=torch.float32, device=a.device) if partial else out
    has_bias = bias is not None
    _fp8_gemm_kernel[grid](
        a, a_scales, w, w_scales, ws, bias if has_bias else out, m, n, k,
        a.stride(0), a_scales.stride(0), w.stride(0), w_scales.stride(0),
        ws.stride(-2), ws.stride(0) if partial else 0, per,
        BN_Q=bn, BK_Q=bk, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        GROUP_M=cfg["GROUP_M"], PARTIAL=partial, HAS_BIAS=has_bias,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch_options(a.device),
    )  # fmt: skip
    if partial:
        block_r = 1024
        _splitk_reduce_kernel[(triton.cdiv(m * n, block_r),)](
            ws, bias if has_bias else out, out, m * n, n, ws.stride(0), SPLIT_K=split, HAS_BIAS=has_bias,
            BLOCK=block_r, num_warps=4, **launch_options(a.device),
        )  # fmt: skip
    return out


def fp8_gemm(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    w: torch.Tensor,
    w_scales: torch.Tensor,
    block: tuple[int, int],
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """``[M, K] e4m3 (group scales [M, ceil(K/bk)]) x [N, K] e4m3 (block scales) -> [M, N] out_dtype``."""
    bn, bk = _check_block("fp8_gemm", block)
    cfg = plan(
        a.shape[0], w.shape[0], a.shape[1], bk, device_sms(a.device), {**(config or {}), "ONE_LAUNCH": False}
    )
    return _launch_gemm(a, a_scales, w, w_scales, (bn, bk), out_dtype, bias, cfg)


def fp8_linear(
    x: torch.Tensor,
    w_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    bias: torch.Tensor | None = None,
    *,
    tickets: torch.Tensor | None = None,
    config: dict | None = None,
    table: Mapping | None = None,
) -> torch.Tensor:
    """W8A8 block-scaled linear (see the reference) ``[..., K] -> [..., N]`` in x.dtype: one launch of
    ``_fp8_linear_decode_kernel`` at decode-sized M, else act quant + :func:`fp8_gemm`'s kernels;
    ``tickets``: int32 zeros, ``>= ceil(N / 16)``, that the one-launch split-K plan takes as its counters
    and leaves zero (without them it allocates zeroed counters per call: one memset); ``config``
    overrides the launch plan (keys of :func:`plan`; ``ONE_LAUNCH`` picks the plan); ``table``: the
    per-shape configs :func:`plan` takes (``config`` overrides them); None: the table measured for this
    device and shipped with the package (:func:`~atom_kernels.ops.fp8.decode_table.tuned_table`; empty
    for a device without one), ``{}``: the heuristic alone."""
    check_fp8_linear(x, w_fp8, scale_inv, block, bias, tickets)
    if w_fp8.stride(-1) != 1:
        raise ValueError("fp8_linear (triton): w_fp8 needs a unit last-dim stride")
    bn, bk = _check_block("fp8_linear", block)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    scales = scale_inv if scale_inv.dtype == torch.float32 else scale_inv.float()
    tab = tuned_table(device_name(x.device)) if table is None else table
    cfg = plan(x2.shape[0], w_fp8.shape[0], k, bk, device_sms(x.device), config, tab)
    if cfg["ONE_LAUNCH"]:
        y = launch_decode(x2, w_fp8, scales, (bn, bk), bias, cfg, tickets)
    else:
        a, a_s = _act_quant_2d(x2, bk)
        y = _launch_gemm(a, a_s, w_fp8, scales, (bn, bk), x.dtype, bias, cfg)
    return y.reshape(*lead, w_fp8.shape[0])


def _unit_rows(t: torch.Tensor, k: int) -> torch.Tensor:
    """``[..., Hv, Dv]`` as ``[T, Hv * Dv]`` with a unit last stride (a view of a row-strided head view)."""
    t2 = t.reshape(-1, k)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def gated_norm_fp8_linear(
    o: torch.Tensor,
    z: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    w_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    bias: torch.Tensor | None = None,
    *,
    tickets: torch.Tensor | None = None,
    config: dict | None = None,
    table: Mapping | None = None,
) -> torch.Tensor:
    """``fp8_linear(gated_rms_norm(o, z, norm_weight, eps).flatten(-2), ...)`` ``-> [..., N]`` in o.dtype.

    Where :func:`plan` picks the one-launch plan and a head is one activation group (``Dv == bk``): one
    launch of the decode kernel with its GATED_NORM prologue; otherwise the two ops (``gated_rms_norm``,
    then :func:`fp8_linear`). ``z`` may be a row-strided view (the gate part of the projection output);
    ``tickets`` / ``config`` / ``table`` as for :func:`fp8_linear`."""
    check_gated_norm_fp8_linear(o, z, norm_weight, eps, w_fp8, scale_inv, block, bias, tickets)
    if w_fp8.stride(-1) != 1:
        raise ValueError("gated_norm_fp8_linear (triton): w_fp8 needs a unit last-dim stride")
    bn, bk = _check_block("gated_norm_fp8_linear", block)
    lead, dv = o.shape[:-2], o.shape[-1]
    k = o.shape[-2] * dv
    tab = tuned_table(device_name(o.device)) if table is None else table
    cfg = plan(math.prod(lead), w_fp8.shape[0], k, bk, device_sms(o.device), config, tab)
    if not (cfg["ONE_LAUNCH"] and dv == bk):
        y = gated_rms_norm(o, z, norm_weight, eps)
        return fp8_linear(y.reshape(*lead, k), w_fp8, scale_inv, block, bias, tickets=tickets, config=config,
                          table=table)  # fmt: skip
    o2 = _unit_rows(o, k)
    scales = scale_inv if scale_inv.dtype == torch.float32 else scale_inv.float()
    gate = (_unit_rows(z, k), norm_weight.contiguous(), float(eps))
    y = launch_decode(o2, w_fp8, scales, (bn, bk), bias, cfg, tickets, gate=gate)
    return y.reshape(*lead, w_fp8.shape[0])


def rms_norm_fp8_linear(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    w_fp8: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    *,
    tickets: torch.Tensor | None = None,
    config: dict | None = None,
    table: Mapping | None = None,
) -> tuple[torch.Tensor, ...]:
    """``rms_norm(x, norm_weight, eps, residual)`` then ``fp8_linear`` of the normed rows: ``(y [..., N],
    normed [..., K])`` in x.dtype, with ``residual`` ``(y, normed, h)`` (``h`` in residual.dtype).

    Where :func:`plan` picks the one-launch plan: one launch of the decode kernel with its RMS_NORM
    prologue; otherwise the two ops (``rms_norm``, then :func:`fp8_linear`). ``tickets`` / ``config`` /
    ``table`` as for :func:`fp8_linear`."""
    check_rms_norm_fp8_linear(x, norm_weight, eps, w_fp8, scale_inv, block, bias, residual, tickets)
    if w_fp8.stride(-1) != 1:
        raise ValueError("rms_norm_fp8_linear (triton): w_fp8 needs a unit last-dim stride")
    bn, bk = _check_block("rms_norm_fp8_linear", block)
    lead, k = x.shape[:-1], x.shape[-1]
    tab = tuned_table(device_name(x.device)) if table is None else table
    cfg = plan(math.prod(lead), w_fp8.shape[0], k, bk, device_sms(x.device), config, tab)
    if not cfg["ONE_LAUNCH"]:
        normed = rms_norm(x, norm_weight, eps, residual)
        normed, h = (normed, None) if residual is None else normed
        y = fp8_linear(normed, w_fp8, scale_inv, block, bias, tickets=tickets, config=config, table=table)
        return (y, normed) if residual is None else (y, normed, h)
    x2 = _unit_rows(x, k)
    r2 = None if residual is None else _unit_rows(residual, k)
    scales = scale_inv if scale_inv.dtype == torch.float32 else scale_inv.float()
    norm = (norm_weight.contiguous(), float(eps), r2)
    y, normed, h = launch_decode(x2, w_fp8, scales, (bn, bk), bias, cfg, tickets, norm=norm)
    y, normed = y.reshape(*lead, w_fp8.shape[0]), normed.reshape(*lead, k)
    return (y, normed) if residual is None else (y, normed, h.reshape(*lead, k))


def fp8_block_dequant(
    w: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``[N, K]`` ``w * scale_inv[n // bn, k // bk]`` (float32 math) in ``dtype``."""
    check_fp8_block_dequant(w, scale_inv, block, dtype)
    n, k = w.shape
    out = torch.empty((n, k), dtype=dtype, device=w.device)
    scales = scale_inv if scale_inv.dtype == torch.float32 else scale_inv.float()
    if n and k:
        _block_dequant_kernel[(triton.cdiv(n, 64), triton.cdiv(k, 64))](
            w, scales, out, n, k, w.stride(0), scales.stride(0), out.stride(0), BN=int(block[0]),
            BK=int(block[1]), BLOCK_N=64, BLOCK_K=64, num_warps=4,
        )  # fmt: skip
    return out


def _per_tensor(x: torch.Tensor, scale, out_dtype: torch.dtype, dequant: bool) -> torch.Tensor:
    flat = x.contiguous().reshape(-1)
    out = torch.empty(flat.shape, dtype=out_dtype, device=x.device)
    s = scale_tensor(scale, x.device)
    if flat.numel():
        _kv_quant_kernel[(triton.cdiv(flat.numel(), 1024),)](
            flat, s, out, flat.numel(), FMAX=FP8_MAX, DEQUANT=dequant, BLOCK=1024, num_warps=4
        )
    return out.reshape(x.shape)


def fp8_kv_quant(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """Per-tensor ``clamp(x / scale, -448, 448)`` as float8_e4m3fn (any shape)."""
    check_fp8_kv_quant(x, scale)
    return _per_tensor(x, scale, E4M3, dequant=False)


def fp8_kv_dequant(x_fp8: torch.Tensor, scale: float | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x_fp8 * scale`` in ``dtype`` (float32 math), any shape."""
    check_fp8_kv_dequant(x_fp8, scale, dtype)
    return _per_tensor(x_fp8, scale, dtype, dequant=True)
