"""Triton FP8 one-launch decode linear (``_fp8_linear_decode_kernel``) and the e4m3 activation quantiser
that every FP8 kernel shares (``_quant_e4m3``).

The decode kernel quantises, in registers, the activation groups of its own K range for the few token
rows and multiplies them with its weight tiles (the plan and its tiles: ``atom_kernels.ops.fp8.triton``).
``GATED_NORM`` (constexpr) gives it a prologue for the Gated-DeltaNet output: each ``GROUP``-channel
group is one head of ``o``, normalised as ``gated_rms_norm`` does (``x * rsqrt(mean(x^2) + eps) * w *
silu(z)`` in float32, rounded to o's dtype) before it is quantised, so the group's e4m3 scale is that of
the normalised values. ``RMS_NORM`` (constexpr) gives it the decoder layer's input norm: ``h = x +
residual`` in float32, ``h * rsqrt(mean(h^2) + eps) * (1 + w)`` over the whole row, rounded to x's dtype,
as ``rms_norm`` computes it; every program first sums the squares of its rows over all K (a few rows of
K values in wide loads, read again by the main loop from cache), and the programs of column tile 0 write
``h`` and the normed values of their K range. Off, the prologues are not traced and the kernel is the plain linear.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels.ops._fp8_math import FP8_MAX
from atom_kernels.ops._pdl import launch_options, pdl_enter
from atom_kernels.ops.fp8.reference import ACT_SCALE_EPS


@triton.jit
def _quant_e4m3(x, AXIS: tl.constexpr, EPS: tl.constexpr, FMAX: tl.constexpr):
    """Quantise the float32 tile ``x`` in groups along ``AXIS`` (one group per index of the other axis):
    ``s = max(max|x|, EPS) / FMAX`` per group, ``q = clamp(div_rn(x, s), -FMAX, FMAX)`` rounded to
    e4m3. Returns ``(q, s)``, ``q`` of x's shape and ``s`` with ``AXIS`` reduced. Every FP8 kernel
    quantises activations through this function, so operands and scales agree bit for bit."""
    s = tl.maximum(tl.max(tl.abs(x), AXIS), EPS) / FMAX
    sb = tl.expand_dims(s, AXIS)
    nz = x != 0.0  # div_rn(+-0, s) is +-0: zeros skip the division's slow path
    q = tl.where(nz, tl.math.div_rn(tl.where(nz, x, 1.0), sb), x)
    return tl.minimum(tl.maximum(q, -FMAX), FMAX).to(tl.float8e4nv), s


@triton.jit
def _gated_norm(x, z, w, AXIS: tl.constexpr, D: tl.constexpr, EPS: tl.constexpr):
    """``gated_rms_norm`` of the float32 tile ``x`` (one head of ``D`` channels per index of the other
    axis, reduced along ``AXIS``) with gate ``z`` and the broadcast norm weight ``w``; float32, in the
    order of ``_gated_rms_norm_kernel``."""
    inv = tl.rsqrt(tl.sum(x * x, AXIS) / D + EPS)
    return x * tl.expand_dims(inv, AXIS) * w * (z * tl.sigmoid(z))


@triton.jit
def _row_inv_rms(x_ptr, res_ptr, offs_r, r_ok, stride_xm, stride_rm, K, BLOCK: tl.constexpr,
                 ROWS: tl.constexpr, HAS_RES: tl.constexpr, EPS: tl.constexpr):  # fmt: skip
    """``rsqrt(mean(h^2) + EPS)`` per row (``[ROWS]``) of the float32 ``h = x (+ residual)``, over all K,
    ``BLOCK`` columns per load (wide loads: the row arrives in a few round trips)."""
    offs_g = tl.arange(0, BLOCK)
    ss = tl.zeros([ROWS, BLOCK], tl.float32)
    for k0 in range(0, K, BLOCK):
        m = r_ok[:, None] & ((k0 + offs_g) < K)[None, :]
        rows = offs_r[:, None].to(tl.int64)
        h = tl.load(x_ptr + rows * stride_xm + k0 + offs_g[None, :], mask=m, other=0.0).to(tl.float32)
        if HAS_RES:
            h += tl.load(res_ptr + rows * stride_rm + k0 + offs_g[None, :], mask=m, other=0.0).to(tl.float32)
        ss += h * h
    return tl.rsqrt(tl.sum(ss, 1) / K + EPS)


@triton.jit
def _rms_norm_group(x, res_ptrs, h_ptrs, yn_ptrs, nw, inv, mask, keep, HAS_RES: tl.constexpr):
    """The float32 tile ``x`` (one K group of the rows) normalised as ``rms_norm`` does: ``h = x +
    residual``, ``h * inv * (1 + nw)`` rounded to yn's (x's) dtype, returned as float32; ``inv`` and ``nw``
    broadcast to the tile. Where ``keep`` (a mask of the tile's shape), ``h`` (rounded to h's dtype) and the
    normed values are stored."""
    if HAS_RES:
        x += tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(h_ptrs, x.to(h_ptrs.dtype.element_ty), mask=keep)
    n = (x * inv * (1.0 + nw)).to(yn_ptrs.dtype.element_ty)
    tl.store(yn_ptrs, n, mask=keep)
    return n.to(tl.float32)


@triton.jit
def _fp8_linear_decode_kernel(
    x_ptr, w_ptr, ws_ptr, y_ptr, bias_ptr, part_ptr, count_ptr, M, N, K,
    stride_xm, stride_wn, stride_wsn, stride_ym, GROUPS_PER_SPLIT, SPLIT_K, z_ptr, nw_ptr, stride_zm,
    res_ptr, h_ptr, yn_ptr, stride_rm, stride_hm, stride_ynm,
    EPS: tl.constexpr, FMAX: tl.constexpr, BN_Q: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr, EVEN_K: tl.constexpr, SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr, PDL: tl.constexpr = False, GATED_NORM: tl.constexpr = False,
    NORM_EPS: tl.constexpr = 0.0, RMS_NORM: tl.constexpr = False, HAS_RES: tl.constexpr = False,
    SS_BLOCK: tl.constexpr = 128,
):  # fmt: skip
    """``y[:M, n-tile] = x @ w.T`` for decode-sized ``M <= ROWS``; program ``(pid_n, pid_k)``
    covers ``BLOCK_N`` columns and K groups ``[pid_k * GROUPS_PER_SPLIT, ...)`` of ``GROUP`` channels.

    Each group of the program's K range is quantised here, for the ``ROWS`` rows only, by
    ``_quant_e4m3`` (``_act_quant_kernel``'s operands and scales bit for bit; rows ``>= M`` are masked), and
    multiplied on the tensor cores (8-bit ``tl.dot`` takes any row count). SWAP_AB: the weight tile is
    the left operand (``w_tile @ q.T``; a 16-row instruction then covers 16 weight rows, not the few
    token rows); the products and their order per K tile are unchanged. SPLIT: float32 partials
    ``part[pid_k, M, N]``; the last program of a column tile to arrive (``count[pid_n]`` ticket, which it
    resets to 0) sums them in split order, adds the bias and writes ``y``.

    GATED_NORM: ``x`` is the GDN core output ``o`` viewed ``[M, Hv * GROUP]`` (group g = head g), ``z`` the
    gate in the same layout (row stride ``stride_zm``), ``nw`` the ``[GROUP]`` norm weight; each group is
    replaced by ``_gated_norm`` of it, rounded to x's dtype, before ``_quant_e4m3`` (``gated_rms_norm``
    then this kernel, value for value, up to the float32 order of the sum of squares).

    RMS_NORM: ``x`` is the layer input ``[M, K]``, ``res`` (HAS_RES) the residual stream (row stride
    ``stride_rm``), ``nw`` the ``[K]`` zero-centred norm weight; each group is replaced by ``_rms_norm_group``
    of it (the row's ``_row_inv_rms`` computed first by every program) before ``_quant_e4m3``; the programs
    with ``pid_n == 0`` store ``h = x + res`` (``h_ptr``, HAS_RES) and the normed values (``yn_ptr``) of
    their K groups (``rms_norm`` then this kernel, up to the float32 order of the sum of squares)."""
    pdl_enter(PDL)  # first: wait for the previous kernel (PDL launches)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_r = tl.arange(0, ROWS)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_g = tl.arange(0, GROUP)
    r_ok = offs_r < M
    n_ok = offs_n < N
    g0 = pid_k * GROUPS_PER_SPLIT
    g1 = tl.minimum(g0 + GROUPS_PER_SPLIT, tl.cdiv(K, GROUP))
    ws_ptrs = ws_ptr + (offs_n // BN_Q).to(tl.int64) * stride_wsn
    if GATED_NORM:
        nw = tl.load(nw_ptr + offs_g).to(tl.float32)
    if RMS_NORM:
        inv = _row_inv_rms(
            x_ptr, res_ptr, offs_r, r_ok, stride_xm, stride_rm, K, SS_BLOCK, ROWS, HAS_RES, NORM_EPS
        )
        r_keep = offs_r < M * (1 - pid_n)  # the rows, in column tile 0 only: it writes h and the normed rows
    if SWAP_AB:  # y.T tile = w tile @ q.T: the weight is the [BLOCK_N, GROUP] left operand
        x_ptrs = x_ptr + offs_r[None, :].to(tl.int64) * stride_xm + offs_g[:, None]
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_g[None, :]
        if GATED_NORM:
            z_ptrs = z_ptr + offs_r[None, :].to(tl.int64) * stride_zm + offs_g[:, None]
        if RMS_NORM:
            r_ptrs = res_ptr + offs_r[None, :].to(tl.int64) * stride_rm + offs_g[:, None]
            h_ptrs = h_ptr + offs_r[None, :].to(tl.int64) * stride_hm + offs_g[:, None]
            yn_ptrs = yn_ptr + offs_r[None, :].to(tl.int64) * stride_ynm + offs_g[:, None]
        acc_t = tl.zeros([BLOCK_N, ROWS], tl.float32)
        for g in range(g0, g1):
            k0 = g * GROUP
            if EVEN_K:
                x = tl.load(x_ptrs + k0, mask=r_ok[None, :], other=0.0).to(tl.float32)
                b = tl.load(w_ptrs + k0, mask=n_ok[:, None], other=0.0)
            else:
                k_ok = (k0 + offs_g) < K
                x = tl.load(x_ptrs + k0, mask=k_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
                b = tl.load(w_ptrs + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            if GATED_NORM:  # whole heads only (K = Hv * GROUP): the row mask suffices
                zt = tl.load(z_ptrs + k0, mask=r_ok[None, :], other=0.0).to(tl.float32)
                x = _gated_norm(x, zt, nw[:, None], 0, GROUP, NORM_EPS)
                x = x.to(x_ptr.dtype.element_ty).to(tl.float32)
            if RMS_NORM:
                kk = k0 + offs_g
                xm = r_ok[None, :] & (kk < K)[:, None]
                nwg = tl.load(nw_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
                x = _rms_norm_group(x, r_ptrs + k0, h_ptrs + k0, yn_ptrs + k0, nwg[:, None], inv[None, :], xm,
                                    xm & r_keep[None, :], HAS_RES)  # fmt: skip
            a, a_s = _quant_e4m3(x, 0, EPS, FMAX)  # x.T tile: one group per column
            b_s = tl.load(ws_ptrs + g, mask=n_ok, other=0.0)
            acc_t += tl.dot(b, a) * a_s[None, :] * b_s[:, None]
        acc = tl.trans(acc_t)
    else:
        x_ptrs = x_ptr + offs_r[:, None].to(tl.int64) * stride_xm + offs_g[None, :]
        w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_g[:, None]
        if GATED_NORM:
            z_ptrs = z_ptr + offs_r[:, None].to(tl.int64) * stride_zm + offs_g[None, :]
        if RMS_NORM:
            r_ptrs = res_ptr + offs_r[:, None].to(tl.int64) * stride_rm + offs_g[None, :]
            h_ptrs = h_ptr + offs_r[:, None].to(tl.int64) * stride_hm + offs_g[None, :]
            yn_ptrs = yn_ptr + offs_r[:, None].to(tl.int64) * stride_ynm + offs_g[None, :]
        acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
        for g in range(g0, g1):
            k0 = g * GROUP
            if EVEN_K:
                x = tl.load(x_ptrs + k0, mask=r_ok[:, None], other=0.0).to(tl.float32)
                b = tl.load(w_ptrs + k0, mask=n_ok[None, :], other=0.0)
            else:
                k_ok = (k0 + offs_g) < K
                x = tl.load(x_ptrs + k0, mask=r_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
                b = tl.load(w_ptrs + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if GATED_NORM:
                zt = tl.load(z_ptrs + k0, mask=r_ok[:, None], other=0.0).to(tl.float32)
                x = _gated_norm(x, zt, nw[None, :], 1, GROUP, NORM_EPS)
                x = x.to(x_ptr.dtype.element_ty).to(tl.float32)
            if RMS_NORM:
                kk = k0 + offs_g
                xm = r_ok[:, None] & (kk < K)[None, :]
                nwg = tl.load(nw_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
                x = _rms_norm_group(x, r_ptrs + k0, h_ptrs + k0, yn_ptrs + k0, nwg[None, :], inv[:, None], xm,
                                    xm & r_keep[:, None], HAS_RES)  # fmt: skip
            a, a_s = _quant_e4m3(x, 1, EPS, FMAX)
            b_s = tl.load(ws_ptrs + g, mask=n_ok, other=0.0)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
    mask = r_ok[:, None] & n_ok[None, :]
    out = offs_r[:, None].to(tl.int64) * N + offs_n[None, :]
    if SPLIT:
        tl.store(part_ptr + pid_k.to(tl.int64) * M * N + out, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the ticket is taken
        ticket = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if ticket == SPLIT_K - 1:
            acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
            for s in range(0, SPLIT_K):  # fixed order: deterministic
                # tl.cast: s is a loop tensor compiled, an int interpreted; M or N equal to 1 arrive as
                # constexprs (no .to on them)
                acc += tl.load(part_ptr + tl.cast(s, tl.int64) * M * N + out, mask=mask, other=0.0)
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptr + offs_r[:, None].to(tl.int64) * stride_ym + offs_n[None, :],
                     acc.to(y_ptr.dtype.element_ty), mask=mask)  # fmt: skip
            tl.atomic_xchg(count_ptr + pid_n, 0)  # reset for the next launch
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_r[:, None].to(tl.int64) * stride_ym + offs_n[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=mask)  # fmt: skip


def _ss_block(k: int, bk: int, rows: int) -> int:
    """Columns per load of the RMS_NORM sum of squares: 2048 elements of the rows per load (K = 2048 at
    two rows: two loads of x and of the residual), at least one group, at most K (a power of two)."""
    return max(triton.next_power_of_2(bk), min(triton.next_power_of_2(k), 2048 // rows))


def launch_decode(x, w, w_scales, block, bias, cfg, tickets=None, gate=None, norm=None):
    """One launch of ``_fp8_linear_decode_kernel``: ``x [M, K]`` (unit last stride, ``M <= cfg["ROWS"]``)
    x ``w [N, K]`` e4m3 with float32 block scales -> ``[M, N]`` in x.dtype. ``tickets``: the caller's
    zeroed split-K counters (see ``fp8_linear``), else zeros allocated here. ``gate``: None, or
    ``(z [M, K] with unit last stride, norm_weight [bk] contiguous, eps)`` for the GATED_NORM prologue
    (``K`` a multiple of ``bk``: x holds whole heads of ``bk`` channels). ``norm``: None, or
    ``(norm_weight [K] contiguous, eps, residual [M, K] with unit last stride or None)`` for the RMS_NORM
    prologue; then returns ``(y, normed [M, K] in x.dtype, h [M, K] in residual.dtype or None)``."""
    m, k = x.shape
    n = w.shape[0]
    bn, bk = block
    rows = cfg["ROWS"]
    if not m <= rows or rows & (rows - 1):
        raise ValueError(f"fp8_linear (triton): config ROWS={rows} must be a power of two >= M={m}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if norm is not None:
        norm_w, norm_eps, residual = norm
        normed = torch.empty((m, k), dtype=x.dtype, device=x.device)
        h = None if residual is None else torch.empty((m, k), dtype=residual.dtype, device=x.device)
    if m == 0:
        return out if norm is None else (out, normed, h)
    groups = triton.cdiv(k, bk)
    per = triton.cdiv(groups, max(1, min(int(cfg["SPLIT_K"]), groups)))
    split = triton.cdiv(groups, per)
    tiles = triton.cdiv(n, cfg["BLOCK_N"])
    if split > 1:  # float32 partials; tickets that the kernel returns to 0 (fresh ones cost a memset)
        part = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        if tickets is None:
            count = torch.zeros((tiles,), dtype=torch.int32, device=x.device)
        elif tickets.numel() < tiles or tickets.device != x.device:
            raise ValueError(
                f"fp8_linear (triton): tickets holds {tickets.numel()} counters on {tickets.device}, the plan "
                f"needs {tiles} (BLOCK_N={cfg['BLOCK_N']}) on {x.device}"
            )
        else:
            count = tickets
    else:
        part, count = out, out
    has_bias = bias is not None
    z, norm_weight, eps = gate if gate is not None else (x, x, 0.0)
    res, h_out, yn = x, x, x
    if norm is not None:
        norm_weight, eps = norm_w, norm_eps
        res, h_out, yn = (x, x, normed) if residual is None else (residual, h, normed)
    _fp8_linear_decode_kernel[(tiles, split)](
        x_ptr=x, w_ptr=w, ws_ptr=w_scales, y_ptr=out, bias_ptr=bias if has_bias else out, part_ptr=part,
        count_ptr=count, z_ptr=z, nw_ptr=norm_weight, res_ptr=res, h_ptr=h_out, yn_ptr=yn, M=m, N=n, K=k,
        stride_xm=x.stride(0), stride_wn=w.stride(0), stride_wsn=w_scales.stride(0), stride_ym=out.stride(0),
        stride_zm=z.stride(0), stride_rm=res.stride(0), stride_hm=h_out.stride(0), stride_ynm=yn.stride(0),
        GROUPS_PER_SPLIT=per, SPLIT_K=split, EPS=ACT_SCALE_EPS, FMAX=FP8_MAX, BN_Q=bn, GROUP=bk, ROWS=rows,
        BLOCK_N=cfg["BLOCK_N"], SWAP_AB=cfg["SWAP_AB"], EVEN_K=k % bk == 0, SPLIT=split > 1,
        HAS_BIAS=has_bias, GATED_NORM=gate is not None, NORM_EPS=float(eps), RMS_NORM=norm is not None,
        HAS_RES=norm is not None and residual is not None,
        SS_BLOCK=_ss_block(k, bk, rows) if norm is not None else 128,  # the plain kernel: one specialisation
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch_options(x.device),
    )  # fmt: skip
    return out if norm is None else (out, normed, h)
