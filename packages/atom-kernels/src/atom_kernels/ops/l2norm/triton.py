"""Triton L2 norm over the last dim: ``x / sqrt(sum(x^2) + eps)``, float32 math, x.dtype out.

Several rows per program, each row held in registers (one read, one write). The gated delta rule
kernels fuse this into their loads (``use_qk_l2norm``); this standalone op serves other callers.
Only ``tl`` primitives: also compiles for ROCm.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels.ops.l2norm.checks import DEFAULT_EPS, check_l2norm


@triton.jit
def _l2norm_kernel(x_ptr, y_ptr, R, D, eps, s_x, s_y, ROWS: tl.constexpr, BD: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BD)
    m = (rows < R)[:, None] & (cols < D)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + r64 * s_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
    y = x / tl.sqrt(tl.sum(x * x, 1) + eps)[:, None]
    tl.store(y_ptr + r64 * s_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=m)


def l2norm(x: torch.Tensor, eps: float = DEFAULT_EPS) -> torch.Tensor:
    """See :func:`atom_kernels.ops.l2norm.reference.l2norm` (same contract)."""
    check_l2norm(x, eps)
    D = x.shape[-1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return y
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    R = x2.shape[0]
    BD = triton.next_power_of_2(D)
    ROWS = max(1, min(64, 4096 // BD))
    _l2norm_kernel[(triton.cdiv(R, ROWS),)](
        x2, y.view(-1, D), R, D, float(eps), x2.stride(0), D, ROWS=ROWS, BD=BD, num_warps=4
    )
    return y
