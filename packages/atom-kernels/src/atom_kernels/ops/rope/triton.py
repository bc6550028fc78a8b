"""Triton partial neox RoPE.

``rope`` matches the reference op: one program rotates a block of heads of one token for q and k (one
launch for both) as three contiguous pieces (the two rotated halves and the copied tail), computing
``inv_freq``, ``cos`` and ``sin`` once per program for the ``rotary_dim / 2`` frequencies with the
accurate libdevice ``pow``/``cos``/``sin`` (angles reach tens of thousands of radians, where fast
approximations fail). Triton's CPU interpreter (``TRITON_INTERPRET=1``) has no libdevice: there the
kernel uses ``tl`` math (numpy), chosen by the ``INTERPRET`` constexpr.

q/k RMS norms are separate ops, not fused in here: a fused kernel was slower than the three unfused
launches (docs/performance.md). Only ``tl`` and libdevice calls: also compiles for ROCm.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from atom_kernels.ops._pdl import launch_options, pdl_enter
from atom_kernels.ops._triton_env import interpreting
from atom_kernels.ops.rope.checks import check_rope


@triton.jit
def _pow(a, b, INTERPRET: tl.constexpr):
    if INTERPRET:
        return tl.exp2(b * tl.log2(a))
    else:
        return libdevice.pow(a, b)


@triton.jit
def _cos(a, INTERPRET: tl.constexpr):
    if INTERPRET:
        return tl.cos(a)
    else:
        return libdevice.cos(a)


@triton.jit
def _sin(a, INTERPRET: tl.constexpr):
    if INTERPRET:
        return tl.sin(a)
    else:
        return libdevice.sin(a)


@triton.jit
def _rope_heads(
    src_ptr,
    dst_ptr,
    t,
    head0,
    num_heads,
    stride_st,
    stride_sh,
    stride_dt,
    stride_dh,
    pos_f,
    theta,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P2: tl.constexpr,
    ROT: tl.constexpr,
    HB: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    # Three contiguous pieces per head: x1 = [0, HALF), x2 = [HALF, ROT) rotated; [ROT, D) copied.
    heads = head0 + tl.arange(0, HB)
    h_ok = heads < num_heads
    cols = tl.arange(0, BLOCK_D)
    hc = tl.arange(0, HALF_P2)
    hc_ok = hc < HALF
    row = src_ptr + t.to(tl.int64) * stride_st + heads[:, None] * stride_sh
    out = dst_ptr + t.to(tl.int64) * stride_dt + heads[:, None] * stride_dh
    m1 = h_ok[:, None] & hc_ok[None, :]
    x1 = tl.load(row + hc[None, :], mask=m1, other=0.0)
    x2 = tl.load(row + HALF + hc[None, :], mask=m1, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    # inv_freq[i] = 1 / theta ** (2i / ROT) with float32 division as the reference; the power in float64
    # rounded once to float32 is the correctly rounded powf of CPU torch (glibc). GPU powf can be 1-2 ulp
    # off, and 1 ulp of inv_freq moves the angle at position 40000 by ~5e-3.
    expo = tl.div_rn((2 * hc).to(tl.float32), tl.full([HALF_P2], ROT, tl.float32))
    powed = _pow(tl.zeros([HALF_P2], tl.float64) + theta, expo.to(tl.float64), INTERPRET).to(tl.float32)
    inv_freq = tl.div_rn(tl.full([HALF_P2], 1.0, tl.float32), powed)
    freq = pos_f * inv_freq
    # cos / sin rounded to the activations' dtype first, as the reference
    c = _cos(freq, INTERPRET).to(dst_ptr.dtype.element_ty).to(tl.float32)[None, :]
    s = _sin(freq, INTERPRET).to(dst_ptr.dtype.element_ty).to(tl.float32)[None, :]
    tl.store(out + hc[None, :], (x1f * c - x2f * s).to(dst_ptr.dtype.element_ty), mask=m1)
    tl.store(out + HALF + hc[None, :], (x2f * c + x1f * s).to(dst_ptr.dtype.element_ty), mask=m1)
    if ROT < D:
        pm = h_ok[:, None] & ((cols >= ROT) & (cols < D))[None, :]
        xp = tl.load(row + cols[None, :], mask=pm, other=0.0)
        tl.store(out + cols[None, :], xp.to(dst_ptr.dtype.element_ty), mask=pm)


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    qo_ptr,
    ko_ptr,
    pos_ptr,
    num_q_heads,
    num_k_heads,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    theta,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P2: tl.constexpr,
    ROT: tl.constexpr,
    HB: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)  # first: wait for the previous kernel (PDL launches)
    t = tl.program_id(0)
    hb = tl.program_id(1)
    pos_f = tl.load(pos_ptr + t).to(tl.float32)
    q_blocks = tl.cdiv(num_q_heads, HB)
    if hb < q_blocks:
        _rope_heads(q_ptr, qo_ptr, t, hb * HB, num_q_heads, stride_qt, stride_qh, stride_qot, stride_qoh,
                    pos_f, theta, D, BLOCK_D, HALF, HALF_P2, ROT, HB, INTERPRET)  # fmt: skip
    else:
        _rope_heads(k_ptr, ko_ptr, t, (hb - q_blocks) * HB, num_k_heads, stride_kt, stride_kh, stride_kot,
                    stride_koh, pos_f, theta, D, BLOCK_D, HALF, HALF_P2, ROT, HB, INTERPRET)  # fmt: skip


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rotary_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox RoPE on the first ``rotary_dim`` channels of every q and k head (new tensors)."""
    check_rope(q, k, positions, rotary_dim, theta)
    q, k = _unit_last(q), _unit_last(k)
    num_tokens, num_q, d = q.shape
    num_k = k.shape[1]
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ko = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return qo, ko
    block_d = triton.next_power_of_2(d)
    hb = max(1, min(16, 4096 // block_d))
    grid = (num_tokens, triton.cdiv(num_q, hb) + triton.cdiv(num_k, hb))
    _rope_kernel[grid](
        q, k, qo, ko, positions, num_q, num_k,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), qo.stride(0), qo.stride(1), ko.stride(0),
        ko.stride(1), float(theta),
        D=d, BLOCK_D=block_d, HALF=rotary_dim // 2, HALF_P2=triton.next_power_of_2(rotary_dim // 2),
        ROT=rotary_dim, HB=hb, INTERPRET=interpreting(), num_warps=4, **launch_options(q.device),
    )  # fmt: skip
    return qo, ko
