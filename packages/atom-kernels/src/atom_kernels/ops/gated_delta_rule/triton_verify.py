"""Triton ``gated_delta_rule_verify``: MTP verification with deferred commit (docs/kernel-api.md, last section).

Two launches, in stream order:

1. ``_verify_kernel``: one program per (sequence, value head, block of ``BV`` value rows) keeps its
   ``[BV, Dk]`` float32 state tile in registers, as ``_recurrent_kernel`` does. Every global load is
   issued up front, before any arithmetic: the state tile, the ``R`` pending tokens (masked to the
   ``num_accepted`` ones) and the ``Q`` verify tokens, as ``[R, Dk]`` / ``[Q, Dk]`` register tiles. The
   per-token recurrent kernel loaded each token's q/k/v inside its token loop, behind the previous
   token's state store, so a verify step paid one dependent global-memory round trip per token; at full
   memory load such a round trip waits in the same queues as the state traffic. Then, arithmetic only:
   commit the accepted pending tokens (a runtime loop of ``num_accepted`` steps), store the tile once
   (rounded to the pool dtype; skipped when nothing was committed: the slot holds that value already)
   and continue from the rounded value, verify the ``Q`` tokens (outputs collected in a ``[Q, BV]``
   tile and stored at the end) and stash this program's own ``v`` rows into ``pending``: only this
   program reads them, after its loads.
2. ``_stash_kernel``: writes the shared part of each new pending token, ``k`` (read by every program of
   the key head's group) and ``g`` / ``beta`` (read by every value-row block of the head), after all
   programs of launch 1 have read the old ones.

The per-token math is the recurrent kernel's (decay, ``h k`` reduction, rank-1 update, ``h q``
reduction) with the update written as ``h + (beta v) k^T - (beta h k) k^T`` instead of
``h + beta (v - h k) k^T``: the ``v`` term does not depend on ``h``, so the layout conversion Triton puts
between the value-row vectors of the token tiles and those of the state tile happens off the dependency
chain (compiled for sm_90: no conversion left between one token's ``h k`` reduction and the next). The
results differ from the recurrent kernel's by float32 rounding only. Slots < 0 are padding rows: zero state, nothing read from or written to
``ssm_state`` / ``pending`` (``num_accepted`` is ignored there); ``num_accepted`` above ``R`` is clamped.

``_verify_wy_kernel`` (``kernel="wy"``, not the default): the same step in the chunked WY/UT form, the
commit tokens as one chunk and the verify tokens as another (``tl.dot`` tiles, (I + A)^{-1} by Neumann
squarings). Correct on the H200 (run 5, ``results/gdn_run5_verify.log``: 22 tests passed, bench checks
ok, fp32 committed state 6.3e-7 from the reference) but 10-14x SLOWER than the per-token kernel
(B=64 Q=4 fp32: 1.68 ms tf32x3 / 1.43 ms ieee vs 0.136 ms): kept selectable for investigation only.

Only ``tl`` primitives: the sources compile for ROCm too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels.ops._checks import check_num_accepted_values, check_slot_values
from atom_kernels.ops.gated_delta_rule.checks import check_gated_delta_rule_verify
from atom_kernels.ops.gated_delta_rule.triton import recurrent_launch_config
from atom_kernels.ops.l2norm.checks import DEFAULT_EPS as L2NORM_EPS


@triton.jit
def _row(x, o_r, j):
    """Row ``j`` of a register tile ``x[RP, C]`` (rows indexed by ``o_r``) as a ``[C]`` vector."""
    return tl.sum(tl.where(o_r[:, None] == j, x, 0.0), 0)


@triton.jit
def _verify_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    o_ptr,
    state_ptr,
    pend_ptr,
    idx_ptr,
    acc_ptr,
    scale,
    eps,
    s_qn,
    s_qt,
    s_qh,
    s_qd,
    s_kn,
    s_kt,
    s_kh,
    s_kd,
    s_vn,
    s_vt,
    s_vh,
    s_vd,
    s_gn,
    s_gt,
    s_gh,
    s_bn,
    s_bt,
    s_bh,
    s_on,
    s_ot,
    s_oh,
    s_od,
    s_ss,
    s_sh,
    s_sv,
    s_sk,
    s_ps,
    s_pr,
    s_pp,
    s_in,
    Q: tl.constexpr,
    R: tl.constexpr,
    QP: tl.constexpr,
    RP: tl.constexpr,
    HK: tl.constexpr,
    HV: tl.constexpr,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    L2NORM: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = (i_nh // HV).to(tl.int64)
    i_hv = i_nh % HV
    i_hk = i_hv // GROUP
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_q = tl.arange(0, QP)
    o_r = tl.arange(0, RP)
    m_k = o_k < DK
    m_v = o_v < DV
    m_q = o_q < Q

    slot = tl.load(idx_ptr + i_n * s_in).to(tl.int64)
    valid = slot >= 0
    n_acc = tl.where(valid, tl.minimum(tl.load(acc_ptr + i_n), R), 0)
    # Value-row masks of the pool accesses: empty on padding rows, and for the state store also when
    # nothing is committed. (Scalar conditions enter masks through these bounds, not `mask & cond`:
    # Triton 3.9's interpreter turns a tensor & scalar bool into int32, which tl.load rejects.)
    m_vs = o_v < tl.where(valid, DV, 0)
    m_vc = o_v < tl.where(n_acc > 0, DV, 0)

    # ---- every load first: state tile, pending tokens (only the accepted ones), verify tokens.
    p_h = state_ptr + slot * s_ss + i_hv * s_sh + o_v[:, None] * s_sv + o_k[None, :] * s_sk
    h = tl.load(p_h, mask=m_vs[:, None] & m_k[None, :], other=0.0).to(tl.float32)
    p_pend = pend_ptr + slot * s_ps + o_r[:, None] * s_pr  # [RP, 1]: token rows of this slot
    m_r = (o_r < n_acc)[:, None]
    pk = tl.load(p_pend + (i_hk * DK + o_k[None, :]) * s_pp, mask=m_r & m_k[None, :], other=0.0)
    pv = tl.load(p_pend + (HK * DK + i_hv * DV + o_v[None, :]) * s_pp, mask=m_r & m_v[None, :], other=0.0)
    p_gb = pend_ptr + slot * s_ps + o_r * s_pr + (HK * DK + HV * DV + i_hv) * s_pp
    pg = tl.load(p_gb, mask=o_r < n_acc, other=0.0)
    pb = tl.load(p_gb + HV * s_pp, mask=o_r < n_acc, other=0.0)

    m_qk = m_q[:, None] & m_k[None, :]
    m_qv = m_q[:, None] & m_v[None, :]
    b_q = tl.load(
        q_ptr + i_n * s_qn + o_q[:, None] * s_qt + i_hk * s_qh + o_k[None, :] * s_qd, mask=m_qk, other=0.0
    ).to(tl.float32)
    b_k = tl.load(
        k_ptr + i_n * s_kn + o_q[:, None] * s_kt + i_hk * s_kh + o_k[None, :] * s_kd, mask=m_qk, other=0.0
    ).to(tl.float32)
    b_v = tl.load(
        v_ptr + i_n * s_vn + o_q[:, None] * s_vt + i_hv * s_vh + o_v[None, :] * s_vd, mask=m_qv, other=0.0
    ).to(tl.float32)
    b_g = tl.load(g_ptr + i_n * s_gn + o_q * s_gt + i_hv * s_gh, mask=m_q, other=0.0).to(tl.float32)
    b_b = tl.load(beta_ptr + i_n * s_bn + o_q * s_bt + i_hv * s_bh, mask=m_q, other=0.0).to(tl.float32)

    if L2NORM:  # per token row; zero (masked) rows stay zero
        pk = pk / tl.sqrt(tl.sum(pk * pk, 1) + eps)[:, None]
        b_q = b_q / tl.sqrt(tl.sum(b_q * b_q, 1) + eps)[:, None]
        b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, 1) + eps)[:, None]

    # ---- 1. commit the accepted pending tokens, store the state once, continue from the rounded value.
    for j in range(n_acc):
        c_k = _row(pk, o_r, j)
        c_v = _row(pv, o_r, j)
        c_g = tl.sum(tl.where(o_r == j, pg, 0.0))
        c_b = tl.sum(tl.where(o_r == j, pb, 0.0))
        h = h * tl.exp(c_g)
        c_hk = tl.sum(h * c_k[None, :], 1)
        h = h + (c_b * c_v)[:, None] * c_k[None, :] - (c_b * c_hk)[:, None] * c_k[None, :]
    h = h.to(state_ptr.dtype.element_ty)
    tl.store(p_h, h, mask=m_vc[:, None] & m_k[None, :])
    h = h.to(tl.float32)

    # ---- 2. verify the Q tokens; outputs only.
    b_o = tl.zeros([QP, BV], dtype=tl.float32)
    for j in tl.static_range(Q):
        t_k = _row(b_k, o_q, j)
        t_q = _row(b_q, o_q, j)
        t_v = _row(b_v, o_q, j)
        t_g = tl.sum(tl.where(o_q == j, b_g, 0.0))
        t_b = tl.sum(tl.where(o_q == j, b_b, 0.0))
        h = h * tl.exp(t_g)
        t_hk = tl.sum(h * t_k[None, :], 1)
        h = h + (t_b * t_v)[:, None] * t_k[None, :] - (t_b * t_hk)[:, None] * t_k[None, :]
        t_o = tl.sum(h * t_q[None, :], 1) * scale
        b_o = tl.where(o_q[:, None] == j, t_o[None, :], b_o)
    tl.store(
        o_ptr + i_n * s_on + o_q[:, None] * s_ot + i_hv * s_oh + o_v[None, :] * s_od,
        b_o.to(o_ptr.dtype.element_ty),
        mask=m_qv,
    )

    # ---- 3. stash this program's own v rows (only it reads them, above); k, g, beta: _stash_kernel.
    p_sv = pend_ptr + slot * s_ps + o_q[:, None] * s_pr + (HK * DK + i_hv * DV + o_v[None, :]) * s_pp
    tl.store(p_sv, b_v, mask=m_q[:, None] & m_vs[None, :])


@triton.jit
def _lower_decay(b_g, o_t, STRICT: tl.constexpr):
    """``[TP, TP]`` matrix ``exp(G_t - G_i)`` for ``i < t`` (``i <= t`` unless STRICT; 0 elsewhere) and the
    ``[TP]`` cumulative log decay ``G`` (inclusive prefix sum of ``b_g``)."""
    b_G = tl.sum(tl.where(o_t[None, :] <= o_t[:, None], b_g[None, :], 0.0), 1)
    if STRICT:
        m = o_t[None, :] < o_t[:, None]
    else:
        m = o_t[None, :] <= o_t[:, None]
    d = tl.where(m, b_G[:, None] - b_G[None, :], 0.0)
    return tl.where(m, tl.exp(d), 0.0), b_G


@triton.jit
def _wy_u(h, b_k, b_v, b_g, b_b, o_t, NSQ: tl.constexpr, PREC: tl.constexpr):
    """One chunk of tokens (rows of ``b_k [TP, BK]``, ``b_v [TP, BV]``) from the state tile ``h [BV, BK]``:
    ``U [BV, TP]`` (column t = the delta-rule update u_t of every value row), ``G [TP]`` (cumulative log
    decay) and ``X = h k^T``. Forward substitution in closed form: U = B (I + A)^{-T} with
    ``A[t, i] = beta_t exp(G_t - G_i) k_i.k_t`` (i < t) and ``B[r, t] = beta_t (v_t[r] - exp(G_t) X[r, t])``;
    A is strictly lower triangular and nilpotent, (I + A)^{-1} = (I - A)(I + A^2)(I + A^4).. (NSQ squarings)."""
    dec, b_G = _lower_decay(b_g, o_t, True)
    kk = tl.dot(b_k, tl.trans(b_k), input_precision=PREC)  # [TP, TP]
    a = b_b[:, None] * dec * kk
    eye = tl.where(o_t[:, None] == o_t[None, :], 1.0, 0.0)
    t_inv = eye - a
    a_p = a
    for _ in tl.static_range(NSQ):
        a_p = tl.dot(a_p, a_p, input_precision=PREC)
        t_inv = t_inv + tl.dot(t_inv, a_p, input_precision=PREC)
    x = tl.dot(h, tl.trans(b_k), input_precision=PREC)  # [BV, TP]
    bm = b_b[None, :] * (tl.trans(b_v) - tl.exp(b_G)[None, :] * x)
    u = tl.dot(bm, tl.trans(t_inv), input_precision=PREC)  # [BV, TP]
    return u, b_G


@triton.jit
def _verify_wy_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    o_ptr,
    state_ptr,
    pend_ptr,
    idx_ptr,
    acc_ptr,
    scale,
    eps,
    s_qn,
    s_qt,
    s_qh,
    s_qd,
    s_kn,
    s_kt,
    s_kh,
    s_kd,
    s_vn,
    s_vt,
    s_vh,
    s_vd,
    s_gn,
    s_gt,
    s_gh,
    s_bn,
    s_bt,
    s_bh,
    s_on,
    s_ot,
    s_oh,
    s_od,
    s_ss,
    s_sh,
    s_sv,
    s_sk,
    s_ps,
    s_pr,
    s_pp,
    s_in,
    Q: tl.constexpr,
    R: tl.constexpr,
    QP: tl.constexpr,
    RP: tl.constexpr,
    NSQ_R: tl.constexpr,
    NSQ_Q: tl.constexpr,
    HK: tl.constexpr,
    HV: tl.constexpr,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    L2NORM: tl.constexpr,
    PREC: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = (i_nh // HV).to(tl.int64)
    i_hv = i_nh % HV
    i_hk = i_hv // GROUP
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_q = tl.arange(0, QP)
    o_r = tl.arange(0, RP)
    m_k = o_k < DK
    m_v = o_v < DV
    m_q = o_q < Q

    slot = tl.load(idx_ptr + i_n * s_in).to(tl.int64)
    valid = slot >= 0
    n_acc = tl.where(valid, tl.minimum(tl.load(acc_ptr + i_n), R), 0)
    m_vs = o_v < tl.where(valid, DV, 0)
    m_vc = o_v < tl.where(n_acc > 0, DV, 0)

    # ---- every load first: state tile, pending tokens (rows >= num_accepted: zero identity tokens),
    # verify tokens (rows >= Q: zero identity tokens).
    p_h = state_ptr + slot * s_ss + i_hv * s_sh + o_v[:, None] * s_sv + o_k[None, :] * s_sk
    h = tl.load(p_h, mask=m_vs[:, None] & m_k[None, :], other=0.0).to(tl.float32)
    p_pend = pend_ptr + slot * s_ps + o_r[:, None] * s_pr
    m_r = (o_r < n_acc)[:, None]
    pk = tl.load(p_pend + (i_hk * DK + o_k[None, :]) * s_pp, mask=m_r & m_k[None, :], other=0.0)
    pv = tl.load(p_pend + (HK * DK + i_hv * DV + o_v[None, :]) * s_pp, mask=m_r & m_v[None, :], other=0.0)
    p_gb = pend_ptr + slot * s_ps + o_r * s_pr + (HK * DK + HV * DV + i_hv) * s_pp
    pg = tl.load(p_gb, mask=o_r < n_acc, other=0.0)
    pb = tl.load(p_gb + HV * s_pp, mask=o_r < n_acc, other=0.0)

    m_qk = m_q[:, None] & m_k[None, :]
    m_qv = m_q[:, None] & m_v[None, :]
    b_q = tl.load(
        q_ptr + i_n * s_qn + o_q[:, None] * s_qt + i_hk * s_qh + o_k[None, :] * s_qd, mask=m_qk, other=0.0
    ).to(tl.float32)
    b_k = tl.load(
        k_ptr + i_n * s_kn + o_q[:, None] * s_kt + i_hk * s_kh + o_k[None, :] * s_kd, mask=m_qk, other=0.0
    ).to(tl.float32)
    b_v = tl.load(
        v_ptr + i_n * s_vn + o_q[:, None] * s_vt + i_hv * s_vh + o_v[None, :] * s_vd, mask=m_qv, other=0.0
    ).to(tl.float32)
    b_g = tl.load(g_ptr + i_n * s_gn + o_q * s_gt + i_hv * s_gh, mask=m_q, other=0.0).to(tl.float32)
    b_b = tl.load(beta_ptr + i_n * s_bn + o_q * s_bt + i_hv * s_bh, mask=m_q, other=0.0).to(tl.float32)

    if L2NORM:  # per token row; zero (masked) rows stay zero
        pk = pk / tl.sqrt(tl.sum(pk * pk, 1) + eps)[:, None]
        b_q = b_q / tl.sqrt(tl.sum(b_q * b_q, 1) + eps)[:, None]
        b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, 1) + eps)[:, None]
    b_q = b_q * scale

    # ---- 1. commit: S_a = exp(G_last) S_0 + U diag(exp(G_last - G_i)) K. Identity tokens past
    # num_accepted have k = v = g = beta = 0, so G_last = G[RP - 1] and their columns of U vanish.
    u, p_G = _wy_u(h, pk, pv, pg, pb, o_r, NSQ_R, PREC)
    g_last = tl.sum(tl.where(o_r == RP - 1, p_G, 0.0))
    u = u * tl.exp(g_last - p_G)[None, :]
    h = h * tl.exp(g_last) + tl.dot(u, pk, input_precision=PREC)
    h = h.to(state_ptr.dtype.element_ty)
    tl.store(p_h, h, mask=m_vc[:, None] & m_k[None, :])
    h = h.to(tl.float32)

    # ---- 2. verify: O[r, t] = exp(G_t) (S_a q_t)[r] + sum_{i <= t} exp(G_t - G_i) (k_i.q_t) U[r, i].
    u2, q_G = _wy_u(h, b_k, b_v, b_g, b_b, o_q, NSQ_Q, PREC)
    dec, _ = _lower_decay(b_g, o_q, False)
    c = dec * tl.dot(b_q, tl.trans(b_k), input_precision=PREC)  # [t, i]
    y = tl.dot(h, tl.trans(b_q), input_precision=PREC)  # [BV, QP]
    b_o = tl.exp(q_G)[None, :] * y + tl.dot(u2, tl.trans(c), input_precision=PREC)  # [BV, QP]
    tl.store(
        o_ptr + i_n * s_on + o_q[None, :] * s_ot + i_hv * s_oh + o_v[:, None] * s_od,
        b_o.to(o_ptr.dtype.element_ty),
        mask=m_v[:, None] & m_q[None, :],
    )

    # ---- 3. stash this program's own v rows (only it reads them, above); k, g, beta: _stash_kernel.
    p_sv = pend_ptr + slot * s_ps + o_q[:, None] * s_pr + (HK * DK + i_hv * DV + o_v[None, :]) * s_pp
    tl.store(p_sv, b_v, mask=m_q[:, None] & m_vs[None, :])


@triton.jit
def _stash_kernel(
    k_ptr,
    g_ptr,
    beta_ptr,
    pend_ptr,
    idx_ptr,
    s_kn,
    s_kt,
    s_kh,
    s_kd,
    s_gn,
    s_gt,
    s_gh,
    s_bn,
    s_bt,
    s_bh,
    s_ps,
    s_pr,
    s_pp,
    s_in,
    HK: tl.constexpr,
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK: tl.constexpr,
    BH: tl.constexpr,
):
    """pending[slot, j] k part and g / beta parts = this step's token j (float32); slot < 0 skipped."""
    i_n = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    slot = tl.load(idx_ptr + i_n * s_in).to(tl.int64)
    if slot >= 0:
        p_row = pend_ptr + slot * s_ps + j * s_pr
        for off in range(0, HK * DK, BLOCK):
            o = off + tl.arange(0, BLOCK)
            m = o < HK * DK
            x = tl.load(k_ptr + i_n * s_kn + j * s_kt + (o // DK) * s_kh + (o % DK) * s_kd, mask=m)
            tl.store(p_row + o * s_pp, x.to(tl.float32), mask=m)
        o_h = tl.arange(0, BH)
        m_h = o_h < HV
        b_g = tl.load(g_ptr + i_n * s_gn + j * s_gt + o_h * s_gh, mask=m_h)
        b_b = tl.load(beta_ptr + i_n * s_bn + j * s_bt + o_h * s_bh, mask=m_h)
        tl.store(p_row + (HK * DK + HV * DV + o_h) * s_pp, b_g.to(tl.float32), mask=m_h)
        tl.store(p_row + (HK * DK + HV * DV + HV + o_h) * s_pp, b_b.to(tl.float32), mask=m_h)


def _tokens_pad(n: int) -> int:
    """Token rows of a WY tile: a power of two, >= 16 (``tl.dot`` needs 16 in every dimension)."""
    return max(16, triton.next_power_of_2(n))


def _neumann_squarings(n: int) -> int:
    """Squarings m with (I + A)^{-1} = (I - A) prod_{j=1..m} (I + A^(2^j)) exact for n tokens (A^n = 0)."""
    return max(0, (n - 1).bit_length() - 1)


def wy_launch_config(num_seqs: int, num_v_heads: int, dv: int) -> tuple[int, int]:
    """(BV, num_warps) of the WY verify kernel: 16 value rows (the smallest ``tl.dot`` tile), 4 warps."""
    return max(16, min(16, triton.next_power_of_2(dv))), 4


def gated_delta_rule_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    pending: torch.Tensor,
    state_indices: torch.Tensor,
    num_accepted: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool = True,
    *,
    block_v: int | None = None,
    num_warps: int | None = None,
    kernel: str = "per_token",
    input_precision: str | None = None,
) -> torch.Tensor:
    """See :func:`atom_kernels.ops.gated_delta_rule.reference.gated_delta_rule_verify`.

    Benchmark knobs: ``kernel`` "wy" (chunked WY/UT form, ``tl.dot``) or "per_token" (sequential
    per-token updates); ``block_v`` / ``num_warps`` override the launch config; ``input_precision`` of the
    float32 dots ("tf32x3" or "ieee"; default tf32x3 on CUDA, ieee on ROCm).
    """
    check_gated_delta_rule_verify(
        q, k, v, g, beta, ssm_state, pending, state_indices, num_accepted, scale, use_qk_l2norm
    )
    N, Q, HK, DK = q.shape
    HV, DV = v.shape[2], v.shape[3]
    R = pending.shape[1]
    if q.device.type == "cpu":  # reads values: only under the interpreter (no device sync on a GPU)
        op = "gated_delta_rule_verify"
        check_slot_values(op, "state_indices", state_indices, ssm_state.shape[0])
        check_num_accepted_values(op, num_accepted, R, f"R={R}", low=0)
    o = torch.empty((N, Q, HV, DV), dtype=q.dtype, device=q.device)
    if N == 0 or Q == 0:
        return o
    if kernel == "wy":
        bv, nw = wy_launch_config(N, HV, DV)
        bv, nw = block_v or bv, num_warps or nw
        prec = input_precision or ("ieee" if torch.version.hip else "tf32x3")
        if prec not in ("tf32x3", "ieee"):
            raise ValueError(f"input_precision must be 'tf32x3' or 'ieee', got {prec!r}")
        _verify_wy_kernel[(triton.cdiv(DV, bv), N * HV)](
            q, k, v, g, beta, o, ssm_state, pending, state_indices, num_accepted,
            float(scale), L2NORM_EPS,
            *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(), *o.stride(),
            *ssm_state.stride(), *pending.stride(), state_indices.stride(0),
            Q=Q, R=R, QP=_tokens_pad(Q), RP=_tokens_pad(R), NSQ_R=_neumann_squarings(R),
            NSQ_Q=_neumann_squarings(Q), HK=HK, HV=HV, GROUP=HV // HK, DK=DK, DV=DV,
            BK=max(16, triton.next_power_of_2(DK)), BV=bv, L2NORM=use_qk_l2norm, PREC=prec, num_warps=nw,
        )  # fmt: skip
    elif kernel == "per_token":
        bv, nw = recurrent_launch_config(N, HV, DV)
        bv, nw = block_v or bv, num_warps or nw
        _verify_kernel[(triton.cdiv(DV, bv), N * HV)](
            q, k, v, g, beta, o, ssm_state, pending, state_indices, num_accepted,
            float(scale), L2NORM_EPS,
            *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(), *o.stride(),
            *ssm_state.stride(), *pending.stride(), state_indices.stride(0),
            Q=Q, R=R, QP=triton.next_power_of_2(Q), RP=triton.next_power_of_2(R), HK=HK, HV=HV,
            GROUP=HV // HK, DK=DK, DV=DV, BK=triton.next_power_of_2(DK), BV=bv,
            L2NORM=use_qk_l2norm, num_warps=nw,
        )  # fmt: skip
    else:
        raise ValueError(f"kernel must be 'wy' or 'per_token', got {kernel!r}")
    _stash_kernel[(N, Q)](
        k, g, beta, pending, state_indices,
        *k.stride(), *g.stride(), *beta.stride(), *pending.stride(), state_indices.stride(0),
        HK=HK, HV=HV, DK=DK, DV=DV, BLOCK=min(2048, triton.next_power_of_2(HK * DK)),
        BH=triton.next_power_of_2(HV), num_warps=4,
    )  # fmt: skip
    return o
