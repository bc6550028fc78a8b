"""Triton gated delta rule: our recurrent decode kernel and fla-core's chunked prefill, wrapped.

``gated_delta_rule_recurrent`` (decode) is our own kernel. One program per (sequence, value head, block of
``BV`` value rows) loads its ``[BV, Dk]`` float32 state tile from the sequence's slot, loops over the Q
tokens (q/k L2-normalised in the kernel) and stores the tile back once, rounded to the pool dtype. With
``A_log``/``dt_bias`` (fused gating) it reads the raw gate inputs ``a``/``b`` where it would read g/beta and
computes them with :func:`~atom_kernels.ops.gdn_gating.triton.gdn_gate` (the gating op's expression): one
launch instead of two, which is what a small decode batch pays for. fla-core's
``fused_recurrent_gated_delta_rule`` reads a dense ``initial_state[N]`` instead of a slot pool.

``gated_delta_rule_chunked`` (varlen prefill) wraps fla-core's ``chunk_gated_delta_rule``: its math is
ours (log-space decay ``g``, ``beta`` after the sigmoid, L2 norm of q/k with eps 1e-6, GQA with
``Hv % Hk == 0``), and ``state_v_first=True`` gives exactly our ``[.., Dv, Dk]`` state layout. What it lacks
is the slot pool: it takes ``initial_state[N]`` and returns ``final_state[N]`` (float32). So two small
Triton kernels gather the pool slots into a dense float32 ``h0`` (zeros where ``has_initial_state`` is False
or the slot is < 0) and scatter the final states back (cast to the pool dtype, slots < 0 skipped): two
passes over ``N`` states. fla-core's host-side launch path dominates the eager time of a small prefill.
fla-core supports chunk sizes 16, 32, 64; any other ``chunk_size`` runs with 64 (the result does not
depend on it beyond rounding).

``cu_seqlens`` goes to fla-core as the caller's own tensor object: fla caches the chunk indices it derives
from it by object identity, and computing them synchronises with the device. A converted copy (e.g.
``.long()``) misses that cache on every call and synchronises every layer; passing the same tensor to every
GDN layer of a step costs one sync per step.

Only ``tl`` primitives: the sources compile for ROCm too (fla-core supports ROCm as well).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels.ops._pdl import launch_options, pdl_enter
from atom_kernels.ops.gated_delta_rule.checks import (
    check_gated_delta_rule_chunked,
    check_gated_delta_rule_recurrent,
)
from atom_kernels.ops.gdn_gating.triton import gdn_gate
from atom_kernels.ops.l2norm.checks import DEFAULT_EPS as L2NORM_EPS

FLA_CHUNK_SIZES = (16, 32, 64)


def strides(name: str, t: torch.Tensor | None, axes: str) -> dict[str, tuple[int, ...]]:
    """Keyword argument ``s_<name>`` = ``t.stride()`` (a tuple, indexed in the kernel in ``axes`` order, one
    letter per axis of ``t``) for a kernel launch; zeros when ``t`` is None (an input the kernel does not
    read)."""
    if t is None:
        return {f"s_{name}": (0,) * len(axes)}
    if t.dim() != len(axes):
        raise ValueError(f"strides: {name} has {t.dim()} dims, the kernel names {len(axes)} ({axes!r})")
    return {f"s_{name}": tuple(t.stride())}


@triton.jit
def head_program(
    idx_ptr,
    s_i,
    HV: tl.constexpr,
    GROUP: tl.constexpr,
    DV: tl.constexpr,
    BV: tl.constexpr,
    PDL: tl.constexpr,
):
    """The prologue of a kernel with one program per (block of ``BV`` value rows, sequence x value head) on
    grid ``(cdiv(DV, BV), N * HV)``: waits for the previous kernel first (PDL launches), then returns the
    sequence ``i_n`` (int64), value head ``i_hv``, key head ``i_hk``, the value rows ``o_v`` and their mask
    ``m_v``, and the sequence's state slot (int64; < 0: padding row)."""
    pdl_enter(PDL)
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = (i_nh // HV).to(tl.int64)
    i_hv = i_nh % HV
    i_hk = i_hv // GROUP
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < DV
    slot = tl.load(idx_ptr + i_n * s_i[0]).to(tl.int64)
    return i_n, i_hv, i_hk, o_v, m_v, slot


@triton.jit
def head_gate_params(A_ptr, dt_ptr, i_hv, s_A, s_dt, GATED: tl.constexpr):
    """Fused gating (``GATED``): the head's ``A_log`` and ``dt_bias`` as float32 scalars; else zeros (unused)."""
    A_log = 0.0
    dt_bias = 0.0
    if GATED:
        A_log = tl.load(A_ptr + i_hv * s_A[0]).to(tl.float32)
        dt_bias = tl.load(dt_ptr + i_hv * s_dt[0]).to(tl.float32)
    return A_log, dt_bias


@triton.jit
def _recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, state_ptr, idx_ptr, A_ptr, dt_ptr, scale, eps,
    s_q, s_k, s_v, s_g, s_b, s_o, s_s, s_i, s_A, s_dt,  # strides: tuples in the axis order of strides()
    Q: tl.constexpr, HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr, GATED: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    i_n, i_hv, i_hk, o_v, m_v, slot = head_program(idx_ptr, s_i, HV, GROUP, DV, BV, PDL)
    o_k = tl.arange(0, BK)
    m_k = o_k < DK
    p_h = (
        state_ptr + slot * s_s[0] + i_hv * s_s[1] + o_v[:, None] * s_s[2] + o_k[None, :] * s_s[3]
    )  # [BV, BK] tile
    # The slot condition enters the mask as a bound, not `mask & cond` (the interpreter rejects a
    # tensor & scalar-bool mask); empty on padding rows.
    m_h = (o_v < tl.where(slot >= 0, DV, 0))[:, None] & m_k[None, :]
    h = tl.load(p_h, mask=m_h, other=0.0).to(tl.float32)
    A_log, dt_bias = head_gate_params(A_ptr, dt_ptr, i_hv, s_A, s_dt, GATED)  # GATED: g / beta hold a / b

    for j in tl.static_range(Q):
        b_q = tl.load(
            q_ptr + i_n * s_q[0] + j * s_q[1] + i_hk * s_q[2] + o_k * s_q[3], mask=m_k, other=0.0
        ).to(tl.float32)
        b_k = tl.load(
            k_ptr + i_n * s_k[0] + j * s_k[1] + i_hk * s_k[2] + o_k * s_k[3], mask=m_k, other=0.0
        ).to(tl.float32)
        b_v = tl.load(
            v_ptr + i_n * s_v[0] + j * s_v[1] + i_hv * s_v[2] + o_v * s_v[3], mask=m_v, other=0.0
        ).to(tl.float32)
        b_g = tl.load(g_ptr + i_n * s_g[0] + j * s_g[1] + i_hv * s_g[2]).to(tl.float32)
        b_b = tl.load(beta_ptr + i_n * s_b[0] + j * s_b[1] + i_hv * s_b[2]).to(tl.float32)
        if GATED:
            b_g, b_b = gdn_gate(b_g, b_b, A_log, dt_bias)
        if L2NORM:
            b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + eps)
            b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + eps)
        h = h * tl.exp(b_g)
        b_u = b_b * (b_v - tl.sum(h * b_k[None, :], 1))
        h = h + b_u[:, None] * b_k[None, :]
        b_o = tl.sum(h * b_q[None, :], 1) * scale
        tl.store(
            o_ptr + i_n * s_o[0] + j * s_o[1] + i_hv * s_o[2] + o_v * s_o[3],
            b_o.to(o_ptr.dtype.element_ty),
            mask=m_v,
        )
    tl.store(p_h, h.to(state_ptr.dtype.element_ty), mask=m_h)


def recurrent_launch_config(num_seqs: int, num_v_heads: int, dv: int) -> tuple[int, int]:
    """(BV, num_warps) of the recurrent kernel: 8 value rows per program, one warp (fla-core's choice).

    Small tiles give ``N * Hv * Dv / 8`` independent programs, enough loads in flight at every batch size.
    ``benchmarks/gpu/bench_gdn.py --sweep`` compares other tiles on the device.
    """
    return min(8, triton.next_power_of_2(dv)), 1


def gated_delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool = True,
    *,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """See :func:`atom_kernels.ops.gated_delta_rule.reference.gated_delta_rule_recurrent` (with
    ``A_log``/``dt_bias``: the gating fused into the kernel)."""
    check_gated_delta_rule_recurrent(
        q, k, v, g, beta, ssm_state, state_indices, scale, use_qk_l2norm, A_log, dt_bias
    )
    return _launch_recurrent(
        q, k, v, g, beta, ssm_state, state_indices, scale, use_qk_l2norm, A_log=A_log, dt_bias=dt_bias
    )


def _launch_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool = True,
    block_v: int | None = None,
    num_warps: int | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The recurrent kernel's launch; ``block_v`` / ``num_warps`` override :func:`recurrent_launch_config`
    (benchmarks compare launch settings through this; no input checks). ``A_log``/``dt_bias`` given: fused
    gating (``g``/``beta`` are the raw ``a``/``b``)."""
    N, Q, HK, DK = q.shape
    HV, DV = v.shape[2], v.shape[3]
    o = torch.empty((N, Q, HV, DV), dtype=q.dtype, device=q.device)
    if N == 0 or Q == 0:
        return o
    bv, nw = recurrent_launch_config(N, HV, DV)
    bv, nw = block_v or bv, num_warps or nw
    _recurrent_kernel[(triton.cdiv(DV, bv), N * HV)](
        q_ptr=q, k_ptr=k, v_ptr=v, g_ptr=g, beta_ptr=beta, o_ptr=o, state_ptr=ssm_state,
        idx_ptr=state_indices, A_ptr=A_log, dt_ptr=dt_bias, scale=float(scale), eps=L2NORM_EPS,
        **strides("q", q, "nthd"), **strides("k", k, "nthd"), **strides("v", v, "nthd"),
        **strides("g", g, "nth"), **strides("b", beta, "nth"), **strides("o", o, "nthd"),
        **strides("s", ssm_state, "shvk"), **strides("i", state_indices, "n"),
        **strides("A", A_log, "h"), **strides("dt", dt_bias, "h"),
        Q=Q, HV=HV, GROUP=HV // HK, DK=DK, DV=DV, BK=triton.next_power_of_2(DK), BV=bv,
        L2NORM=use_qk_l2norm, GATED=A_log is not None, num_warps=nw, **launch_options(q.device),
    )  # fmt: skip
    return o


@triton.jit
def _gather_states_kernel(state_ptr, idx_ptr, init_ptr, out_ptr, s_ss, s_on, NUMEL, BLOCK: tl.constexpr):
    """out[n] = float32(state[idx[n]]) where has_initial_state[n] and idx[n] >= 0, else 0."""
    n = tl.program_id(0).to(tl.int64)
    o = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = o < NUMEL
    slot = tl.load(idx_ptr + n).to(tl.int64)
    use = (tl.load(init_ptr + n) != 0) & (slot >= 0)
    # The scalar condition enters the mask as a bound (Triton 3.9's interpreter rejects tensor & scalar bool).
    val = tl.load(state_ptr + slot * s_ss + o, mask=o < tl.where(use, NUMEL, 0), other=0.0).to(tl.float32)
    tl.store(out_ptr + n * s_on + o, val, mask=m)


@triton.jit
def _scatter_states_kernel(src_ptr, idx_ptr, state_ptr, s_sn, s_ss, NUMEL, BLOCK: tl.constexpr):
    """state[idx[n]] = src[n] cast to the pool dtype; idx[n] < 0 is skipped."""
    n = tl.program_id(0).to(tl.int64)
    o = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(idx_ptr + n).to(tl.int64)
    m = o < tl.where(slot >= 0, NUMEL, 0)  # a bound, not tensor & scalar bool (see the gather kernel)
    val = tl.load(src_ptr + n * s_sn + o, mask=m, other=0.0)
    tl.store(state_ptr + slot * s_ss + o, val.to(state_ptr.dtype.element_ty), mask=m)


def gated_delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    ssm_state: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
) -> torch.Tensor:
    """See :func:`atom_kernels.ops.gated_delta_rule.reference.gated_delta_rule_chunked` (fla-core inside)."""
    check_gated_delta_rule_chunked(
        q,
        k,
        v,
        g,
        beta,
        cu_seqlens,
        ssm_state,
        state_indices,
        has_initial_state,
        scale,
        use_qk_l2norm,
        chunk_size,
    )
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    N = state_indices.shape[0]
    _, HV, DV, DK = ssm_state.shape
    if not ssm_state[0].is_contiguous():
        raise ValueError(
            "gated_delta_rule_chunked (triton): each ssm_state slot must be contiguous [Hv, Dv, Dk], "
            f"got strides {tuple(ssm_state.stride())}"
        )
    if N == 0 or q.shape[0] == 0:
        return torch.empty(v.shape, dtype=q.dtype, device=q.device)
    numel, BLOCK = HV * DV * DK, 2048
    grid = (N, triton.cdiv(numel, BLOCK))
    h0 = torch.empty((N, HV, DV, DK), dtype=torch.float32, device=q.device)
    init = has_initial_state.view(torch.int8)  # reinterpret the bools: no conversion kernel per call
    _gather_states_kernel[grid](
        state_ptr=ssm_state, idx_ptr=state_indices, init_ptr=init, out_ptr=h0,
        s_ss=ssm_state.stride(0), s_on=h0.stride(0), NUMEL=numel, BLOCK=BLOCK,
    )  # fmt: skip
    o, final = chunk_gated_delta_rule(
        q.unsqueeze(0),
        k.unsqueeze(0),
        v.unsqueeze(0),
        g.unsqueeze(0),
        beta.unsqueeze(0),
        scale=float(scale),
        initial_state=h0,
        output_final_state=True,
        use_qk_l2norm_in_kernel=use_qk_l2norm,
        state_v_first=True,
        cu_seqlens=cu_seqlens,  # as given (int32): see the module docstring on fla's chunk-index cache
        chunk_size=chunk_size if chunk_size in FLA_CHUNK_SIZES else 64,
    )
    final = final.contiguous()
    _scatter_states_kernel[grid](
        src_ptr=final, idx_ptr=state_indices, state_ptr=ssm_state,
        s_sn=final.stride(0), s_ss=ssm_state.stride(0), NUMEL=numel, BLOCK=BLOCK,
    )  # fmt: skip
    return o.squeeze(0).to(q.dtype)
