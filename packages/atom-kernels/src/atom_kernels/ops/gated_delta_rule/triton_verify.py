"""Triton ``gated_delta_rule_verify``: MTP verification with deferred commit (docs/kernel-api.md).

Two launches, in stream order:

1. ``_verify_kernel``: one program (one warp) per (sequence, value head, block of ``BV`` value rows) keeps
   its float32 state tile in registers as ``[BV, NC, KC]``: Dk split into NC chunks of KC. Then:
   commit the first ``num_commit`` pending tokens (a pending token carries the update coefficients
   ``u = beta (v - S k)`` its verify computed, so a commit is ``S exp(g) + u k^T``, no reduction over the
   state; the R pending rows are R static steps, merged into one pass ``S E + sum_j (u_j W_j) k_j^T`` with
   ``E`` the product of the committed decays and ``W_j`` that of the decays after row j; a row beyond
   ``num_commit`` loads g = 0, u = 0), store the tile once (rounded to the pool dtype; skipped when nothing
   was committed: the slot holds that value already) and continue from the rounded value; verify the ``Q``
   tokens (outputs and u rows collected in ``[BV, Q]`` tiles and stored at the end) and stash this
   program's own ``u`` rows into ``pending``: only this program reads them, before. The tokens go one after
   another (decay, ``h k`` reduction, rank-1 update, ``h q`` reduction) or, in WY form, with every state
   reduction against the committed state (``x_t = h k_t``, ``y_t = h q_t``), none waiting for another,
   and only a per-row Q x Q recurrence on scalars linking the tokens (see the kernel).
2. ``_stash_kernel``: writes the shared part of each new pending token, ``k`` (read by every program of
   the key head's group) and ``g`` (read by every value-row block of the head), after all programs of
   launch 1 have read the old ones.

With ``A_log``/``dt_bias`` (fused gating) both launches read the raw gate inputs ``a``/``b`` where they would
read g/beta and compute them with :func:`~atom_kernels.ops.gdn_gating.triton.gdn_gate` (the gating op's
expression): the gating op's launch is gone, which is what a small batch pays for. Where the one-token-after-
another form runs at 64 sequences or more, the launch config (``fuse_gating=False``) runs the gating op first
instead: there the in-kernel gate measured slower (k=3, B=64: 145 us fused against 123 us with the gating
op's launch; fused won at B=8, 17.4 against 19.1 us, and at every batch of the WY form).

Instruction count is what bounds this kernel at large batch, so:
- L2 norms are per-row scalars: ``h (k r) = (h k) r`` and ``u (k r)^T = (u r) k^T`` with ``r = 1/|k|``;
  no per-element division of q and k.
- The ``[BV, NC, KC]`` tile: with Triton 3.6, 8 lanes go along KC and 4 along the value rows, the chunk
  axis stays in registers, so a row reduction is in-thread over NC and 3 shuffle levels. Other Triton
  versions may lay it out otherwise: still correct, possibly slower.
- Every token's q/k/v/g/beta and every pending row is its own load, in the layout it is used in.
The launch defaults (:func:`verify_launch_config`) come from side-by-side timings on an H200
(``benchmarks/gpu/bench_gdn.py``): the WY form with a 128-register cap for up to 2 tokens, one token after
another beyond (the WY form's register use leaves too few warps per SM there). ptxas's schedule of this
kernel is sensitive to statement order (a reordering of the token loads measured 15-25% slower with the
same instruction mix): keep the order and compare timings when editing.

Slots < 0 are padding rows: zero state, nothing read from or written to ``ssm_state`` / ``pending``
(``num_commit`` is ignored there); ``num_commit`` above ``R`` is clamped. Only ``tl`` primitives: the
sources compile for ROCm too.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from atom_kernels.ops._checks import check_num_accepted_values, check_slot_values
from atom_kernels.ops._pdl import launch_options, pdl_enter
from atom_kernels.ops.gated_delta_rule.checks import check_gated_delta_rule_verify
from atom_kernels.ops.gated_delta_rule.triton import (
    head_gate_params,
    head_program,
    recurrent_launch_config,
    strides,
)
from atom_kernels.ops.gdn_gating.triton import gdn_gate, gdn_gating
from atom_kernels.ops.l2norm.checks import DEFAULT_EPS as L2NORM_EPS

VERIFY_BLOCK_K = 32  # KC: Dk chunk of the state tile (8 lanes x 4 float32, 16-byte loads)


class VerifyLaunch(NamedTuple):
    """How ``_verify_kernel`` is launched: value rows per program, warps, the WY form of the token section
    (``wy``), CUDA's per-thread register cap (``max_registers``, None or 0: the compiler's choice; not
    applied on ROCm, where Triton has no such option) and, when the op is given ``A_log``/``dt_bias``, whether
    the kernels gate in-kernel (``fuse_gating``) or the gating op runs first."""

    block_v: int
    num_warps: int
    wy: bool
    max_registers: int | None
    fuse_gating: bool = True


def verify_launch_config(num_seqs: int, num_v_heads: int, dv: int, num_tokens: int) -> VerifyLaunch:
    """One warp per program; 16 value rows when that still leaves >= 4096 programs, else the recurrent
    kernel's tile (fewer programs cannot fill the GPU); up to 2 tokens the WY form capped at 128 registers,
    else one token after another; gating fused in-kernel except for the latter at >= 64 sequences."""
    bv = min(16, triton.next_power_of_2(dv))
    if num_seqs * num_v_heads * triton.cdiv(dv, bv) < 4096:
        bv = recurrent_launch_config(num_seqs, num_v_heads, dv)[0]
    wy = num_tokens <= 2
    return VerifyLaunch(bv, 1, wy, 128 if wy else None, fuse_gating=wy or num_seqs < 64)


@triton.jit
def _rsum(x):
    """Row reduction of a ``[BV, NC, KC]`` tile: in-thread over the chunks first, then across the KC lanes."""
    return tl.sum(tl.sum(x, 1), 1)


@triton.jit
def _token(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, i_n, i_hk, i_hv, t, d2, m_d2, o_v, m_v, scale, eps, A_log, dt_bias,
    s_q, s_k, s_v, s_g, s_b, L2NORM: tl.constexpr, GATED: tl.constexpr,
):  # fmt: skip
    """Token ``t`` of sequence ``i_n``: q and k as ``[NC, KC]`` float32, v as ``[BV]`` (its dtype: converted
    where used), g, beta, and the L2 norms as scalars, ``r_q`` (times the scale) and ``r_k``. ``GATED``:
    g_ptr / beta_ptr hold the raw a / b, gated here with the head's float32 ``A_log`` and ``dt_bias``."""
    t_q = tl.load(q_ptr + i_n * s_q[0] + t * s_q[1] + i_hk * s_q[2] + d2 * s_q[3], mask=m_d2, other=0.0)
    t_k = tl.load(k_ptr + i_n * s_k[0] + t * s_k[1] + i_hk * s_k[2] + d2 * s_k[3], mask=m_d2, other=0.0)
    t_v = tl.load(v_ptr + i_n * s_v[0] + t * s_v[1] + i_hv * s_v[2] + o_v * s_v[3], mask=m_v, other=0.0)
    t_g = tl.load(g_ptr + i_n * s_g[0] + t * s_g[1] + i_hv * s_g[2]).to(tl.float32)
    t_b = tl.load(beta_ptr + i_n * s_b[0] + t * s_b[1] + i_hv * s_b[2]).to(tl.float32)
    if GATED:
        t_g, t_b = gdn_gate(t_g, t_b, A_log, dt_bias)
    t_q = t_q.to(tl.float32)
    t_k = t_k.to(tl.float32)
    r_q = scale
    r_k = 1.0
    if L2NORM:  # the norms as scalars on the reductions and the update coefficient
        r_q = scale / tl.sqrt(tl.sum(tl.sum(t_q * t_q, 1), 0) + eps)
        r_k = 1.0 / tl.sqrt(tl.sum(tl.sum(t_k * t_k, 1), 0) + eps)
    return t_q, t_k, t_v, t_g, t_b, r_q, r_k


@triton.jit
def _verify_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, state_ptr, pend_ptr, idx_ptr, commit_ptr, A_ptr, dt_ptr,
    scale, eps,
    s_q, s_k, s_v, s_g, s_b, s_o, s_s, s_p, s_i, s_A, s_dt,  # strides: tuples in the axis order of strides()
    Q: tl.constexpr, R: tl.constexpr, QP: tl.constexpr, HK: tl.constexpr, HV: tl.constexpr,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, NC: tl.constexpr, KC: tl.constexpr,
    BV: tl.constexpr, L2NORM: tl.constexpr, WY: tl.constexpr, GATED: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    i_n, i_hv, i_hk, o_v, m_v, slot = head_program(idx_ptr, s_i, HV, GROUP, DV, BV, PDL)
    d2 = tl.arange(0, NC)[:, None] * KC + tl.arange(0, KC)[None, :]  # [NC, KC]: Dk positions
    m_d2 = d2 < DK
    valid = slot >= 0
    A_log, dt_bias = head_gate_params(A_ptr, dt_ptr, i_hv, s_A, s_dt, GATED)  # GATED: g / beta hold a / b
    n_commit = tl.where(valid, tl.minimum(tl.load(commit_ptr + i_n), R), 0)
    # Scalar conditions enter masks as bounds, not `mask & cond`: the interpreter turns a tensor &
    # scalar bool into int32, which tl.load rejects. Empty on padding rows; for the state store also
    # when nothing is committed.
    m_vs = o_v < tl.where(valid, DV, 0)
    m_vc = o_v < tl.where(n_commit > 0, DV, 0)

    p_h = state_ptr + slot * s_s[0] + i_hv * s_s[1] + o_v[:, None, None] * s_s[2] + d2[None, :, :] * s_s[3]
    m_h = m_d2[None, :, :]
    h = tl.load(p_h, mask=m_vs[:, None, None] & m_h, other=0.0).to(tl.float32)

    # ---- 1. commit: h E + sum_j (u_j r_j W_j) k_j^T (r_j = 1/|k_j|), rows walked from the last, so W_j
    # (the product of the decays after row j) builds up; a row beyond num_commit has g = 0, u = 0.
    p_pend = pend_ptr + slot * s_p[0]
    w = tl.full([BV], 1.0, tl.float32)
    acc = tl.zeros([BV, NC, KC], dtype=tl.float32)
    for jj in tl.static_range(R):
        j = R - 1 - jj
        m_j = o_v < tl.where(j < n_commit, DV, 0)
        c_k = tl.load(
            p_pend + j * s_p[1] + (i_hk * DK + d2) * s_p[2],
            mask=d2 < tl.where(j < n_commit, DK, 0),
            other=0.0,
        )
        c_u = tl.load(p_pend + j * s_p[1] + (HK * DK + i_hv * DV + o_v) * s_p[2], mask=m_j, other=0.0)
        c_g = tl.load(p_pend + j * s_p[1] + (HK * DK + HV * DV + i_hv) * s_p[2], mask=j < n_commit, other=0.0)
        if L2NORM:
            c_u = c_u / tl.sqrt(tl.sum(tl.sum(c_k * c_k, 1), 0) + eps)
        acc = acc + (c_u * w)[:, None, None] * c_k[None, :, :]
        w = w * tl.exp(c_g)
    h = h * w[:, None, None] + acc
    h_c = h.to(state_ptr.dtype.element_ty)
    tl.store(p_h, h_c, mask=m_vc[:, None, None] & m_h)
    h = h_c.to(tl.float32)

    # ---- 2. verify the Q tokens; outputs and u rows collected in [BV, QP] tiles; no state stored.
    # (Statement order matters to ptxas's schedule, see the docstring.)
    o_q = tl.arange(0, QP)
    b_o = tl.zeros([BV, QP], dtype=tl.float32)
    b_u = tl.zeros([BV, QP], dtype=tl.float32)
    if WY:
        # WY form: every state reduction is against the committed h (x_t = h k_t, y_t = h q_t), so none
        # waits for another; u_t = b_t (v_t - A_t x_t - sum_{s<t} (A_t/A_s) (k_s.k_t) u_s) and
        # o_t = A_t y_t + sum_{s<=t} (A_t/A_s) (k_s.q_t) u_s, A_t/A_s = exp(G_t - G_s) (G: running sum of g).
        kt = tl.load(
            k_ptr + i_n * s_k[0] + o_q[:, None, None] * s_k[1] + i_hk * s_k[2] + d2[None, :, :] * s_k[3],
            mask=(o_q < Q)[:, None, None] & m_h,
            other=0.0,
        ).to(tl.float32)  # the Q keys, for the token-token dot products
        rk_all = tl.full([QP], 1.0, tl.float32)
        if L2NORM:
            rk_all = 1.0 / tl.sqrt(tl.sum(tl.sum(kt * kt, 2), 1) + eps)
        b_gc = tl.zeros([QP], dtype=tl.float32)
        gcum = 0.0
        for t in tl.static_range(Q):
            t_q, t_k, t_v, t_g, t_b, r_q, r_k = _token(
                q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, i_n, i_hk, i_hv, t, d2, m_d2, o_v, m_v, scale, eps,
                A_log, dt_bias, s_q, s_k, s_v, s_g, s_b, L2NORM, GATED,
            )  # fmt: skip
            gcum = gcum + t_g
            b_gc = tl.where(o_q == t, gcum, b_gc)
            a_t = tl.exp(gcum)
            x_t = _rsum(h * t_k[None, :, :]) * r_k
            y_t = _rsum(h * t_q[None, :, :]) * r_q
            dec = tl.exp(gcum - b_gc)
            c_kk = tl.where(o_q < t, dec * tl.sum(tl.sum(kt * t_k[None, :, :], 2), 1) * rk_all * r_k, 0.0)
            c_qk = tl.where(o_q <= t, dec * tl.sum(tl.sum(kt * t_q[None, :, :], 2), 1) * rk_all * r_q, 0.0)
            t_u = t_b * (t_v.to(tl.float32) - a_t * x_t - tl.sum(b_u * c_kk[None, :], 1))
            b_u = tl.where(o_q[None, :] == t, t_u[:, None], b_u)
            t_o = a_t * y_t + tl.sum(b_u * c_qk[None, :], 1)
            b_o = tl.where(o_q[None, :] == t, t_o[:, None], b_o)
    else:  # one token after another: decay, h k, rank-1 update, h q
        for j in tl.static_range(Q):
            t_q, t_k, t_v, t_g, t_b, r_q, r_k = _token(
                q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, i_n, i_hk, i_hv, j, d2, m_d2, o_v, m_v, scale, eps,
                A_log, dt_bias, s_q, s_k, s_v, s_g, s_b, L2NORM, GATED,
            )  # fmt: skip
            h = h * tl.exp(t_g)
            t_u = t_b * (t_v.to(tl.float32) - _rsum(h * t_k[None, :, :]) * r_k)  # beta (v - h k): stashed
            h = h + (t_u * r_k)[:, None, None] * t_k[None, :, :]
            t_o = _rsum(h * t_q[None, :, :]) * r_q
            b_o = tl.where(o_q[None, :] == j, t_o[:, None], b_o)
            b_u = tl.where(o_q[None, :] == j, t_u[:, None], b_u)
    m_q = o_q < Q
    tl.store(
        o_ptr + i_n * s_o[0] + o_q[None, :] * s_o[1] + i_hv * s_o[2] + o_v[:, None] * s_o[3],
        b_o.to(o_ptr.dtype.element_ty),
        mask=m_v[:, None] & m_q[None, :],
    )

    # ---- 3. stash this program's own u rows (only it reads them, above); k and g: _stash_kernel.
    p_su = p_pend + o_q[None, :] * s_p[1] + (HK * DK + i_hv * DV + o_v[:, None]) * s_p[2]
    tl.store(p_su, b_u, mask=m_vs[:, None] & m_q[None, :])


@triton.jit
def _stash_kernel(
    k_ptr, g_ptr, pend_ptr, idx_ptr, A_ptr, dt_ptr, pos_ptr, commit_ptr,
    s_k, s_g, s_p, s_i, s_A, s_dt, s_pos, s_c,  # strides: tuples in the axis order of strides()
    HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK: tl.constexpr,
    BH: tl.constexpr, GATED: tl.constexpr, HAS_POS: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """pending[slot, j] k and g parts = this step's token j (float32); slot < 0 skipped. ``GATED``: g_ptr
    holds the raw a, gated here (as the verify kernel does). ``HAS_POS``: the program of token 0 also
    advances ``pending_pos[slot]`` by the sequence's ``num_commit`` (no other program reads it)."""
    pdl_enter(PDL)  # first: wait for the previous kernel (PDL launches)
    i_n = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    slot = tl.load(idx_ptr + i_n * s_i[0]).to(tl.int64)
    if slot >= 0:
        p_row = pend_ptr + slot * s_p[0] + j * s_p[1]
        for off in range(0, HK * DK, BLOCK):
            o = off + tl.arange(0, BLOCK)
            m = o < HK * DK
            x = tl.load(k_ptr + i_n * s_k[0] + j * s_k[1] + (o // DK) * s_k[2] + (o % DK) * s_k[3], mask=m)
            tl.store(p_row + o * s_p[2], x.to(tl.float32), mask=m)
        o_h = tl.arange(0, BH)
        m_h = o_h < HV
        b_g = tl.load(g_ptr + i_n * s_g[0] + j * s_g[1] + o_h * s_g[2], mask=m_h).to(tl.float32)
        if GATED:
            A_log = tl.load(A_ptr + o_h * s_A[0], mask=m_h, other=0.0).to(tl.float32)
            dt_bias = tl.load(dt_ptr + o_h * s_dt[0], mask=m_h, other=0.0).to(tl.float32)
            b_g, _ = gdn_gate(b_g, b_g, A_log, dt_bias)
        tl.store(p_row + (HK * DK + HV * DV + o_h) * s_p[2], b_g, mask=m_h)
        if HAS_POS:  # noqa: SIM102  (constexpr, then a runtime test: Triton compiles the first away)
            if j == 0:
                p_pos = pos_ptr + slot * s_pos[0]
                tl.store(p_pos, tl.load(p_pos) + tl.load(commit_ptr + i_n * s_c[0]).to(tl.int32))


def stash_shared(
    k: torch.Tensor,
    g: torch.Tensor,
    pending: torch.Tensor,
    state_indices: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    pending_pos: torch.Tensor | None = None,
    num_commit: torch.Tensor | None = None,
) -> None:
    """Launch 2 of the verify op: ``pending[slot, j]``'s k and g parts = this step's token j (``g`` is the
    raw ``a`` when ``A_log``/``dt_bias`` are given), and ``pending_pos[slot] += num_commit`` where given.
    Must follow every read of the old pending tokens (stream order after the verify kernel)."""
    N, Q, HK, DK = k.shape
    HV = g.shape[2]
    DV = (pending.shape[2] - HK * DK - HV) // HV
    _stash_kernel[(N, Q)](
        k_ptr=k, g_ptr=g, pend_ptr=pending, idx_ptr=state_indices, A_ptr=A_log, dt_ptr=dt_bias,
        pos_ptr=pending_pos, commit_ptr=num_commit,
        **strides("k", k, "nthd"), **strides("g", g, "nth"), **strides("p", pending, "srp"),
        **strides("i", state_indices, "n"), **strides("A", A_log, "h"), **strides("dt", dt_bias, "h"),
        **strides("pos", pending_pos, "s1"), **strides("c", num_commit, "n"),
        HK=HK, HV=HV, DK=DK, DV=DV, BLOCK=min(2048, triton.next_power_of_2(HK * DK)),
        BH=triton.next_power_of_2(HV), GATED=A_log is not None, HAS_POS=pending_pos is not None,
        num_warps=4, **launch_options(k.device),
    )  # fmt: skip


def gated_delta_rule_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    pending: torch.Tensor,
    state_indices: torch.Tensor,
    num_commit: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool = True,
    *,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    pending_pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """See :func:`atom_kernels.ops.gated_delta_rule.reference.gated_delta_rule_verify` (with
    ``A_log``/``dt_bias``: the gating fused into both launches; ``pending_pos`` advanced in the second)."""
    check_gated_delta_rule_verify(
        q, k, v, g, beta, ssm_state, pending, state_indices, num_commit, scale, use_qk_l2norm, A_log, dt_bias,
        pending_pos,
    )  # fmt: skip
    if q.device.type == "cpu":  # reads values: only under the interpreter (no device sync on a GPU)
        op, r = "gated_delta_rule_verify", pending.shape[1]
        check_slot_values(op, "state_indices", state_indices, ssm_state.shape[0])
        check_num_accepted_values(op, num_commit, r, f"R={r}", low=0, name="num_commit")
    return _launch_verify(
        q, k, v, g, beta, ssm_state, pending, state_indices, num_commit, scale, use_qk_l2norm,
        A_log=A_log, dt_bias=dt_bias, pending_pos=pending_pos,
    )  # fmt: skip


def _launch_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    pending: torch.Tensor,
    state_indices: torch.Tensor,
    num_commit: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool = True,
    launch: VerifyLaunch | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    pending_pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """The two launches of the verify op with ``launch`` (None: :func:`verify_launch_config`); no input
    checks. Benchmarks and tests compare launch settings through this. ``A_log``/``dt_bias`` given: fused
    gating (``g``/``beta`` are the raw ``a``/``b``)."""
    N, Q, HK, DK = q.shape
    HV, DV = v.shape[2], v.shape[3]
    R = pending.shape[1]
    o = torch.empty((N, Q, HV, DV), dtype=q.dtype, device=q.device)
    if N == 0 or Q == 0:
        return o
    cfg = launch or verify_launch_config(N, HV, DV, Q)
    if A_log is not None and not cfg.fuse_gating:  # the gating op's launch, then the unfused kernels
        g, beta = gdn_gating(A_log, g.reshape(N * Q, HV), dt_bias, beta.reshape(N * Q, HV))
        g, beta = g.view(N, Q, HV), beta.view(N, Q, HV)
        A_log = dt_bias = None
    # maxnreg is an option of Triton's CUDA backend only (the HIP backend rejects unknown options)
    regs = cfg.max_registers
    extra = {"maxnreg": regs} if regs and q.is_cuda and torch.version.hip is None else {}
    kc = min(VERIFY_BLOCK_K, triton.next_power_of_2(DK))
    _verify_kernel[(triton.cdiv(DV, cfg.block_v), N * HV)](
        q_ptr=q, k_ptr=k, v_ptr=v, g_ptr=g, beta_ptr=beta, o_ptr=o, state_ptr=ssm_state, pend_ptr=pending,
        idx_ptr=state_indices, commit_ptr=num_commit, A_ptr=A_log, dt_ptr=dt_bias,
        scale=float(scale), eps=L2NORM_EPS,
        **strides("q", q, "nthd"), **strides("k", k, "nthd"), **strides("v", v, "nthd"),
        **strides("g", g, "nth"), **strides("b", beta, "nth"), **strides("o", o, "nthd"),
        **strides("s", ssm_state, "shvk"), **strides("p", pending, "srp"),
        **strides("i", state_indices, "n"), **strides("A", A_log, "h"), **strides("dt", dt_bias, "h"),
        Q=Q, R=R, QP=triton.next_power_of_2(Q), HK=HK, HV=HV, GROUP=HV // HK, DK=DK, DV=DV,
        NC=triton.next_power_of_2(DK) // kc, KC=kc, BV=cfg.block_v,
        L2NORM=use_qk_l2norm, WY=cfg.wy, GATED=A_log is not None, num_warps=cfg.num_warps, **extra,
        **launch_options(q.device),
    )  # fmt: skip
    stash_shared(k, g, pending, state_indices, A_log, dt_bias, pending_pos, num_commit)
    return o
