"""Triton SwiGLU: ``silu(x[..., :I]) * x[..., I:]`` in one pass (float32 math; ``silu`` rounded to x.dtype
before the product, and the product rounded, as the reference)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels.ops.activation.checks import check_silu_and_mul


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, y_ptr, num_rows, inter, stride_x, stride_y, ROWS: tl.constexpr, BLOCK: tl.constexpr
):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows < num_rows)[:, None] & (cols < inter)[None, :]
    base = x_ptr + rows[:, None] * stride_x + cols[None, :]
    g = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(base + inter, mask=mask, other=0.0).to(tl.float32)
    y = (g * tl.sigmoid(g)).to(y_ptr.dtype.element_ty).to(tl.float32) * u
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``[..., 2I] -> [..., I]``."""
    check_silu_and_mul(x)
    half = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty((*x.shape[:-1], half), dtype=x.dtype, device=x.device)
    y2 = y.view(-1, half)
    num_rows = x2.shape[0]
    if num_rows and half:
        block = min(1024, triton.next_power_of_2(half))
        rows = max(1, min(16, 2048 // block, triton.next_power_of_2(num_rows)))
        grid = (triton.cdiv(num_rows, rows), triton.cdiv(half, block))
        _silu_and_mul_kernel[grid](x2, y2, num_rows, half, x2.stride(0), y2.stride(0), ROWS=rows, BLOCK=block)
    return y
