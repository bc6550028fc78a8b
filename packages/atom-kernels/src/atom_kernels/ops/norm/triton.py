"""Triton RMS norms: ``rms_norm`` (zero-centred weight, optional fused residual add) and ``gated_rms_norm``.

Both are one pass over rows: each program normalises ``ROWS`` rows of width ``H`` held in registers
(statistics in float32, output in x.dtype). The residual variant reads ``x`` and ``residual`` once and
writes ``h = x + residual`` and ``y = rms_norm(h)`` in the same pass (the unfused pair reads ``h`` back);
like the reference, ``y`` is computed from the float32 sum, ``h`` is stored rounded to x.dtype. Only ``tl`` primitives: also
compiles for ROCm.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from atom_kernels.ops._pdl import launch_options, pdl_enter
from atom_kernels.ops.norm.checks import check_gated_rms_norm, check_rms_norm


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    y_ptr,
    h_ptr,
    num_rows,
    inner,
    H,
    eps,
    s_xa,
    s_xb,
    stride_r,
    stride_y,
    stride_h,
    HAS_RES: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)  # first: wait for the previous kernel (PDL launches)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_H)
    rows64 = rows.to(tl.int64)
    mask = (rows < num_rows)[:, None] & (cols < H)[None, :]
    p_x = x_ptr + (rows64 // inner * s_xa + rows64 % inner * s_xb)[:, None] + cols[None, :]
    x = tl.load(p_x, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    if HAS_RES:  # the float32 sum is normalised; h is stored rounded
        r = tl.load(res_ptr + rows64[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        xf = xf + r.to(tl.float32)
        tl.store(h_ptr + rows64[:, None] * stride_h + cols[None, :], xf.to(h_ptr.dtype.element_ty), mask=mask)
    inv = tl.rsqrt(tl.sum(xf * xf, 1) / H + eps)
    w = tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
    y = xf * inv[:, None] * (1.0 + w)[None, :]
    tl.store(y_ptr + rows64[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr,
    z_ptr,
    w_ptr,
    y_ptr,
    num_rows,
    inner,
    D,
    eps,
    s_xa,
    s_xb,
    s_za,
    s_zb,
    stride_y,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Row ``r`` of x / z is ``[r // inner, r % inner]`` of their ``[A, inner, D]`` views (any row strides,
    unit last stride), so a row-strided ``z[T, Hv, Dv]`` (a view of the projection output) needs no copy."""
    pdl_enter(PDL)  # first: wait for the previous kernel (PDL launches)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    rows64 = rows.to(tl.int64)
    ra, rb = rows64 // inner, rows64 % inner
    mask = (rows < num_rows)[:, None] & (cols < D)[None, :]
    p_x = x_ptr + (ra * s_xa + rb * s_xb)[:, None] + cols[None, :]
    p_z = z_ptr + (ra * s_za + rb * s_zb)[:, None] + cols[None, :]
    x = tl.load(p_x, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(p_z, mask=mask, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, 1) / D + eps)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    y = x * inv[:, None] * w[None, :] * (z * tl.sigmoid(z))
    tl.store(y_ptr + rows64[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def _rows_2d(t: torch.Tensor) -> torch.Tensor:
    """``[..., H]`` as ``[R, H]`` with a unit last stride (a view where possible)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _rows_3d(t: torch.Tensor) -> torch.Tensor:
    """``[..., B, H]`` as ``[A, B, H]`` with a unit last stride: a view unless the leading dims do not merge
    or the last stride is not 1 (then a copy); ``[H]`` as ``[1, 1, H]``."""
    if t.dim() < 2:
        return t.reshape(1, 1, -1) if t.stride(-1) == 1 else t.contiguous().reshape(1, 1, -1)
    t3 = t.reshape(math.prod(t.shape[:-2]), t.shape[-2], t.shape[-1])  # an explicit size: T = 0 reshapes too
    return t3 if t3.stride(-1) == 1 else t3.contiguous()


def _launch_shape(num_rows: int, width: int) -> tuple[int, int, int, int]:
    block = triton.next_power_of_2(max(width, 1))
    rows = max(1, min(64, 4096 // block, triton.next_power_of_2(max(num_rows, 1))))
    warps = 4 if block * rows <= 4096 else 8
    return block, rows, warps, triton.cdiv(num_rows, rows)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Zero-centred RMS norm ``x_hat * (1 + weight)``; with ``residual`` returns ``(y, x + residual)``
    (``h`` in residual's dtype: x's or float32).
    ``x`` may have any strides in its last two leading dims (e.g. ``k[T, Hkv, D]`` a view of a fused
    projection's output, or the query half of ``[T, Hq, 2D]``) without a copy; the last dim needs stride 1
    (otherwise a copy); ``y`` (and ``h``) are contiguous."""
    check_rms_norm(x, weight, eps, residual)
    hidden = x.shape[-1]
    x3 = _rows_3d(x)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y2 = y.view(-1, hidden)
    num_rows = y2.shape[0]
    if residual is not None:
        r2 = _rows_2d(residual)
        h = torch.empty(x.shape, dtype=residual.dtype, device=x.device)
        h2 = h.view(-1, hidden)
    else:
        r2 = h2 = y2
    if num_rows:
        block, rows, warps, grid = _launch_shape(num_rows, hidden)
        _rms_norm_kernel[(grid,)](
            x3, r2, weight, y2, h2, num_rows, x3.shape[1], hidden, float(eps),
            x3.stride(0), x3.stride(1), r2.stride(0), y2.stride(0), h2.stride(0),
            HAS_RES=residual is not None, ROWS=rows, BLOCK_H=block, num_warps=warps,
            **launch_options(x.device),
        )  # fmt: skip
    return y if residual is None else (y, h)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GDN output norm (NOT zero-centred): ``weight * x_hat * silu(z)``. ``x`` / ``z`` may have any row
    strides (e.g. ``z[T, Hv, Dv]`` a view of a wider projection output); the last dim needs stride 1
    (otherwise a copy)."""
    check_gated_rms_norm(x, z, weight, eps)
    width = x.shape[-1]
    x3, z3 = _rows_3d(x), _rows_3d(z)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y2 = y.view(-1, width)
    num_rows = y2.shape[0]
    if num_rows:
        block, rows, warps, grid = _launch_shape(num_rows, width)
        _gated_rms_norm_kernel[(grid,)](
            x_ptr=x3, z_ptr=z3, w_ptr=weight, y_ptr=y2, num_rows=num_rows, inner=x3.shape[1], D=width,
            eps=float(eps), s_xa=x3.stride(0), s_xb=x3.stride(1), s_za=z3.stride(0), s_zb=z3.stride(1),
            stride_y=y2.stride(0), ROWS=rows, BLOCK_D=block, num_warps=warps, **launch_options(x.device),
        )  # fmt: skip
    return y
