"""Triton GDN gating: ``g = -exp(A_log) * softplus(a + dt_bias)`` and ``beta = sigmoid(b)`` in one pass.

One launch produces both float32 outputs (the reference needs six elementwise kernels). Softplus uses
torch's threshold (``x > 20 -> x``) and the overflow-free ``max(x, 0) + log(1 + exp(-|x|))``. The math is
:func:`gdn_gate`, which the gated delta rule's decode and verify kernels also call when they fuse the
gating in (so fused and unfused compute the same expression). Only ``tl`` primitives: also compiles for
ROCm.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels.ops.gdn_gating.checks import check_gdn_gating


@triton.jit
def gdn_gate(a, b, A_log, dt_bias):
    """float32 ``(g, beta)`` from float32 values of the raw gate inputs (any broadcastable shapes):
    ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``."""
    x = a + dt_bias
    sp = tl.where(x > 20.0, x, tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x))))
    return -tl.exp(A_log) * sp, tl.sigmoid(b)


@triton.jit
def _gdn_gating_kernel(
    A_ptr,
    a_ptr,
    dt_ptr,
    b_ptr,
    g_ptr,
    beta_ptr,
    T,
    HV,
    s_at,
    s_ah,
    s_bt,
    s_bh,
    BT: tl.constexpr,
    BH: tl.constexpr,
):
    o_t = tl.program_id(0) * BT + tl.arange(0, BT)
    o_h = tl.arange(0, BH)
    m_h = o_h < HV
    m = (o_t < T)[:, None] & m_h[None, :]
    t64 = o_t.to(tl.int64)[:, None]
    A = tl.load(A_ptr + o_h, mask=m_h, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + o_h, mask=m_h, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + t64 * s_at + o_h[None, :] * s_ah, mask=m, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + t64 * s_bt + o_h[None, :] * s_bh, mask=m, other=0.0).to(tl.float32)
    g, beta = gdn_gate(a, b, A[None, :], dt[None, :])
    tl.store(g_ptr + t64 * HV + o_h[None, :], g, mask=m)
    tl.store(beta_ptr + t64 * HV + o_h[None, :], beta, mask=m)


def gdn_gating(
    A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`atom_kernels.ops.gdn_gating.reference.gdn_gating` (same contract)."""
    check_gdn_gating(A_log, a, dt_bias, b)
    T, HV = a.shape
    g = torch.empty((T, HV), dtype=torch.float32, device=a.device)
    beta = torch.empty((T, HV), dtype=torch.float32, device=a.device)
    if T == 0:
        return g, beta
    A_log, dt_bias = A_log.contiguous(), dt_bias.contiguous()
    BH = triton.next_power_of_2(HV)
    BT = max(1, 2048 // BH)
    _gdn_gating_kernel[(triton.cdiv(T, BT),)](
        A_ptr=A_log,
        a_ptr=a,
        dt_ptr=dt_bias,
        b_ptr=b,
        g_ptr=g,
        beta_ptr=beta,
        T=T,
        HV=HV,
        s_at=a.stride(0),
        s_ah=a.stride(1),
        s_bt=b.stride(0),
        s_bh=b.stride(1),
        BT=BT,
        BH=BH,
        num_warps=4,
    )
    return g, beta
