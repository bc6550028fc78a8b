"""Experiment: the deferred-commit verify without a per-token state update, and with a Dk-chunked tile
(issue 6, verify k=3 <= 1.3x decode). Session 3; all three were slower than our kernel on the H200.

Same semantics as ``atom_kernels``' ``gated_delta_rule_verify`` (pending ``[k | u | g]``), checked against
the float32 reference, timed next to our decode (recurrent Q=1) and our verify kernel, with each
kernel's registers and spills as compiled on the machine. Writes ``<out>/verify_wy.json``.

**WY form.** The Q verify tokens start from the committed state ``h0`` and run ``h <- a_t h``,
``u_t = b_t (v_t - h k_t)``, ``h <- h + u_t k_t^T``, ``o_t = scale h q_t``. Unrolled with the cumulative
decay ``A_t = a_1 ... a_t``, every token needs ``h0`` only through ``x_t = h0 k_t`` and ``y_t = h0 q_t``
(2Q independent row reductions); the rest is Q x Q algebra on token-side data:

    U (I + M) = V diag(b) - X diag(A b),   M[j, t] = b_t (A_t / A_j) (k_j . k_t)  for j < t
    O = scale Y diag(A) + U N,             N[j, t] = scale (A_t / A_j) (k_j . q_t) for j <= t

so ``U = V Pv + X Px`` and ``O = V Pvn + X Pxn + Y scale diag(A)`` with ``Pv = diag(b) T``,
``Px = -diag(A b) T``, ``T = (I + M)^-1`` (unit upper triangular: a finite Neumann series),
``Pvn = Pv N``, ``Pxn = Px N``. ``_coef_kernel`` (one program per sequence and value head) writes these
matrices to a small float32 scratch; two consumers:

- ``_verify_wy_kernel``: ``[X | Y] = h [k | q]^T`` as one ``tl.dot`` (tf32x3 on CUDA, ieee elsewhere) and
  U, O as four ``[BV, 16] x [16, 16]`` dots. H200: about 2x a decode already at Q=1 (B=64 fp32: 140 us vs
  72 us): the dot's fixed cost per program (state tile staged through shared memory).
- ``_verify_kc_kernel`` with ``WY=True``: the reductions and the Q x Q algebra in registers, no dot.

**Dk-chunked tile** (``_verify_kc_kernel``, both forms). The pool is ``[S, Hv, Dv, Dk]`` with Dk contiguous,
so Triton puts a ``[BV, Dk]`` tile's 32 lanes along Dk and every row reduction costs 5 shuffle levels.
A 3-D tile with Dk split into NC chunks of KC gets 4 lanes along KC and 8 along the value rows, the chunk
axis in registers: a row reduction is in-thread over NC plus 2 shuffle levels. Which axis must come first
for that depends on the Triton version's tie-break in its coalescing order (``rows_first``).

H200 results. Run 4 (results/verify_wy_h200.json): the first version (token tiles ``[Q, NC, KC]`` and the
3.9 axis order) compiled on the device's Triton 3.6 with the lanes along the chunks instead: 1224 SHFL,
168-255 registers, 2-3.6x slower than our kernel. Run 7 (results/verify_wy_h200_run7.json), with the
3.6 order and per-token k/q loads, as designed (Triton 3.6 for sm_90, locally: 82-98 SHFL against our
kernel's 252-316; registers on the device 86-128 at Q=4 with BV=8 against our 153-165): all checks
passed, and still slower than ours at Q=4 and Q=5 (B=64, fp32 / bf16 pool: ours 122 / 99 us, best
chunked (WY, BV=16) 127 / 111 us, decode 71 / 39 us); faster only at Q=2 with BV=16 (fp32 83 vs 93 us).
So neither the shuffle count nor the register count alone decides this kernel's time; a profile of
its stall reasons (Nsight Compute) is the next step, not another rewrite.

Compile for sm_90 without a GPU, with the device's Triton: ``uv venv /tmp/t36 && uv pip install --python
/tmp/t36/bin/python triton==3.6.0``, then put ``/tmp/t36/lib/python3.11/site-packages`` first on
``PYTHONPATH``; ``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`` and the bundled
``cuobjdump`` give the layouts (TTGIR), registers and SASS mix (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from exp_verify_common import check, time_candidates, verify_case  # noqa: E402


@triton.jit
def _mm(a, b):
    """Small ``[M, K] x [K, N]`` product by broadcast and sum (Q x Q matrices: below tl.dot's 16)."""
    return tl.sum(a[:, :, None] * b[None, :, :], 1)


@triton.jit
def _coef_kernel(
    q_ptr,
    k_ptr,
    g_ptr,
    beta_ptr,
    c_ptr,
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
    s_gn,
    s_gt,
    s_gh,
    s_bn,
    s_bt,
    s_bh,
    Q: tl.constexpr,
    QP: tl.constexpr,
    HV: tl.constexpr,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    BK: tl.constexpr,
    L2NORM: tl.constexpr,
):
    """c[n * Hv + h] = [Pv | Px | Pvn | Pxn (x rows) : QP x QP each, row-major | scale A : QP]."""
    i_nh = tl.program_id(0)
    i_n = (i_nh // HV).to(tl.int64)
    i_hv = i_nh % HV
    i_hk = i_hv // GROUP
    o_t = tl.arange(0, QP)
    o_k = tl.arange(0, BK)
    m_t = o_t < Q
    m_tk = m_t[:, None] & (o_k < DK)[None, :]
    b_k = tl.load(
        k_ptr + i_n * s_kn + o_t[:, None] * s_kt + i_hk * s_kh + o_k[None, :] * s_kd, mask=m_tk, other=0.0
    ).to(tl.float32)
    b_q = tl.load(
        q_ptr + i_n * s_qn + o_t[:, None] * s_qt + i_hk * s_qh + o_k[None, :] * s_qd, mask=m_tk, other=0.0
    ).to(tl.float32)
    if L2NORM:
        b_k = b_k / tl.sqrt(tl.sum(b_k * b_k, 1) + eps)[:, None]
        b_q = b_q / tl.sqrt(tl.sum(b_q * b_q, 1) + eps)[:, None]
    b_g = tl.load(g_ptr + i_n * s_gn + o_t * s_gt + i_hv * s_gh, mask=m_t, other=0.0).to(tl.float32)
    b_b = tl.load(beta_ptr + i_n * s_bn + o_t * s_bt + i_hv * s_bh, mask=m_t, other=0.0).to(tl.float32)
    G = tl.cumsum(b_g, 0)  # log A_t
    j = o_t[:, None]
    t = o_t[None, :]
    # A_t / A_j for j <= t (an exponent <= 0 for the model's g <= 0); 0 above the diagonal.
    dec = tl.where(j <= t, tl.exp(tl.where(j <= t, G[None, :] - G[:, None], 0.0)), 0.0)
    kk = tl.sum(b_k[:, None, :] * b_k[None, :, :], 2)  # k_j . k_t
    kq = tl.sum(b_k[:, None, :] * b_q[None, :, :], 2)  # k_j . q_t
    m_strict = tl.where(j < t, b_b[None, :] * dec * kk, 0.0)
    eye = tl.where(j == t, 1.0, 0.0)
    inv = eye  # (I + M)^-1 = sum_p (-M)^p, M nilpotent (strictly upper triangular, QP x QP)
    term = eye
    for _ in tl.static_range(QP - 1):
        term = -_mm(term, m_strict)
        inv = inv + term
    A = tl.exp(G)
    p_v = b_b[:, None] * inv
    p_x = -(A * b_b)[:, None] * inv
    n_o = scale * dec * kq
    base = c_ptr + i_nh.to(tl.int64) * (4 * QP * QP + QP) + j * QP + t
    tl.store(base, p_v)
    tl.store(base + QP * QP, p_x)
    tl.store(base + 2 * QP * QP, _mm(p_v, n_o))
    tl.store(base + 3 * QP * QP, _mm(p_x, n_o))
    tl.store(c_ptr + i_nh.to(tl.int64) * (4 * QP * QP + QP) + 4 * QP * QP + o_t, scale * A)


@triton.jit
def _verify_wy_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    state_ptr,
    pend_ptr,
    idx_ptr,
    acc_ptr,
    c_ptr,
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
    D2: tl.constexpr,
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
    o_r = tl.arange(0, RP)
    o_c = tl.arange(0, D2)  # columns of the token tiles: x (k tokens) in [0, QP), y (q tokens) in [QP, 2 QP)
    m_k = o_k < DK
    m_v = o_v < DV

    slot = tl.load(idx_ptr + i_n * s_in).to(tl.int64)
    valid = slot >= 0
    n_acc = tl.where(valid, tl.minimum(tl.load(acc_ptr + i_n), R), 0)
    # Scalar conditions enter masks as bounds (Triton 3.9's interpreter rejects tensor & scalar bool).
    m_vs = o_v < tl.where(valid, DV, 0)
    m_vc = o_v < tl.where(n_acc > 0, DV, 0)

    # ---- loads: state tile, accepted pending tokens, token tiles, coefficients.
    p_h = state_ptr + slot * s_ss + i_hv * s_sh + o_v[:, None] * s_sv + o_k[None, :] * s_sk
    h = tl.load(p_h, mask=m_vs[:, None] & m_k[None, :], other=0.0).to(tl.float32)
    p_pend = pend_ptr + slot * s_ps + o_r[:, None] * s_pr
    m_r = (o_r < n_acc)[:, None]
    pk = tl.load(p_pend + (i_hk * DK + o_k[None, :]) * s_pp, mask=m_r & m_k[None, :], other=0.0)
    pu = tl.load(p_pend + (HK * DK + i_hv * DV + o_v[None, :]) * s_pp, mask=m_r & m_v[None, :], other=0.0)
    pg = tl.load(
        pend_ptr + slot * s_ps + o_r * s_pr + (HK * DK + HV * DV + i_hv) * s_pp, mask=o_r < n_acc, other=0.0
    )
    tok = tl.where(o_c < QP, o_c, o_c - QP)
    m_wk = ((o_c < QP) & (tok < Q))[:, None] & m_k[None, :]
    m_wq = ((o_c >= QP) & (tok < Q))[:, None] & m_k[None, :]
    w_k = tl.load(
        k_ptr + i_n * s_kn + tok[:, None] * s_kt + i_hk * s_kh + o_k[None, :] * s_kd, mask=m_wk, other=0.0
    )
    w_q = tl.load(
        q_ptr + i_n * s_qn + tok[:, None] * s_qt + i_hk * s_qh + o_k[None, :] * s_qd, mask=m_wq, other=0.0
    )
    w = w_k.to(tl.float32) + w_q.to(tl.float32)  # [D2, BK]: k tokens, then q tokens, zero rows after
    if L2NORM:  # per token row; zero (masked) rows stay zero
        w = w / tl.sqrt(tl.sum(w * w, 1) + eps)[:, None]
        pk = pk / tl.sqrt(tl.sum(pk * pk, 1) + eps)[:, None]
    m_cq = o_c < Q
    b_v = tl.load(
        v_ptr + i_n * s_vn + o_c[None, :] * s_vt + i_hv * s_vh + o_v[:, None] * s_vd,
        mask=m_v[:, None] & m_cq[None, :],
        other=0.0,
    ).to(tl.float32)  # [BV, D2]: token t in column t
    rr = o_c[:, None]
    cc = o_c[None, :]
    c_base = c_ptr + i_nh.to(tl.int64) * (4 * QP * QP + QP)
    m_blk = (rr < QP) & (cc < QP)
    c_off = rr * QP + cc
    p_v = tl.load(c_base + c_off, mask=m_blk, other=0.0)
    p_x = tl.load(c_base + QP * QP + c_off, mask=m_blk, other=0.0)
    p_vn = tl.load(c_base + 2 * QP * QP + c_off, mask=m_blk, other=0.0)
    p_xn = tl.load(c_base + 3 * QP * QP + c_off, mask=m_blk, other=0.0)
    sa = tl.load(c_base + 4 * QP * QP + cc, mask=cc < QP, other=0.0)  # [1, D2]: scale A_t
    p_xn = p_xn + tl.where(rr == cc + QP, sa, 0.0)  # the y rows: scale diag(A)

    # ---- 1. commit the accepted pending tokens (S exp(g) + u k^T each), store once, continue rounded.
    for j in range(n_acc):
        c_k = tl.sum(tl.where(o_r[:, None] == j, pk, 0.0), 0)
        c_u = tl.sum(tl.where(o_r[:, None] == j, pu, 0.0), 0)
        c_g = tl.sum(tl.where(o_r == j, pg, 0.0))
        h = h * tl.exp(c_g) + c_u[:, None] * c_k[None, :]
    h = h.to(state_ptr.dtype.element_ty)
    tl.store(p_h, h, mask=m_vc[:, None] & m_k[None, :])
    h = h.to(tl.float32)

    # ---- 2. the Q tokens: [X | Y] = h [k | q]^T, then U and O from the coefficient matrices.
    xy = tl.dot(h, tl.trans(w), input_precision=PREC)  # [BV, D2]
    b_u = tl.dot(b_v, p_v, input_precision=PREC) + tl.dot(xy, p_x, input_precision=PREC)
    b_o = tl.dot(b_v, p_vn, input_precision=PREC) + tl.dot(xy, p_xn, input_precision=PREC)
    tl.store(
        o_ptr + i_n * s_on + cc * s_ot + i_hv * s_oh + o_v[:, None] * s_od,
        b_o.to(o_ptr.dtype.element_ty),
        mask=m_v[:, None] & m_cq[None, :],
    )
    # ---- 3. stash this program's own u rows (read only by it, above); k and g: stash_shared.
    p_su = pend_ptr + slot * s_ps + cc * s_pr + (HK * DK + i_hv * DV + o_v[:, None]) * s_pp
    tl.store(p_su, b_u, mask=m_vs[:, None] & m_cq[None, :])


def dot_precision(device: torch.device) -> str:
    """Float32 ``tl.dot`` precision: tf32x3 (float32-level error, tensor cores) on CUDA, ieee on ROCm."""
    return "tf32x3" if device.type == "cuda" and torch.version.hip is None else "ieee"


def verify_wy(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    o: torch.Tensor,
    ssm_state: torch.Tensor,
    pending: torch.Tensor,
    state_indices: torch.Tensor,
    num_accepted: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
    eps: float,
    block_v: int,
    num_warps: int,
    precision: str | None = None,
) -> tuple:
    """Coefficients, then ``_verify_wy_kernel`` into ``o``; returns both compiled kernels (the shared k/g
    stash is the caller's)."""
    N, Q, HK, DK = q.shape
    HV, DV = v.shape[2], v.shape[3]
    R = pending.shape[1]
    QP = triton.next_power_of_2(Q)
    BK = max(16, triton.next_power_of_2(DK))
    coef = torch.empty((N * HV, 4 * QP * QP + QP), dtype=torch.float32, device=q.device)
    c = _coef_kernel[(N * HV,)](
        q, k, g, beta, coef, float(scale), eps,
        *q.stride(), *k.stride(), *g.stride(), *beta.stride(),
        Q=Q, QP=QP, HV=HV, GROUP=HV // HK, DK=DK, BK=BK, L2NORM=use_qk_l2norm, num_warps=1,
    )  # fmt: skip
    bv = max(16, block_v)
    m = _verify_wy_kernel[(triton.cdiv(DV, bv), N * HV)](
        q, k, v, o, ssm_state, pending, state_indices, num_accepted, coef, eps,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        *ssm_state.stride(), *pending.stride(), state_indices.stride(0),
        Q=Q, R=R, QP=QP, RP=triton.next_power_of_2(R), D2=max(16, 2 * QP), HK=HK, HV=HV,
        GROUP=HV // HK, DK=DK, DV=DV, BK=BK, BV=bv, L2NORM=use_qk_l2norm,
        PREC=precision or dot_precision(q.device), num_warps=num_warps,
    )  # fmt: skip
    return c, m


@triton.jit
def _tok(ptr, mask, eps, L2NORM: tl.constexpr):
    """One token's ``[NC, KC]`` key/query vector in float32, L2-normalised when asked."""
    t = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    if L2NORM:
        t = t / tl.sqrt(tl.sum(tl.sum(t * t, 1), 0) + eps)
    return t


@triton.jit
def _tok3(t, ROWS_FIRST: tl.constexpr):
    """A token vector ``[NC, KC]`` broadcast against the state tile."""
    if ROWS_FIRST:
        return tl.expand_dims(t, 0)
    else:
        return tl.expand_dims(t, 1)


@triton.jit
def _rowsum(x, ROWS_FIRST: tl.constexpr):
    """Row reduction of a state-shaped tile: in-thread over the chunks first, then across the KC lanes."""
    if ROWS_FIRST:
        return tl.sum(tl.sum(x, 1), 1)
    else:
        return tl.sum(tl.sum(x, 0), 1)


@triton.jit
def _rows3b(x, ROWS_FIRST: tl.constexpr):
    """A value-row vector (a ``_rowsum`` result) broadcast back against the state tile."""
    if ROWS_FIRST:
        return tl.expand_dims(tl.expand_dims(x, 1), 1)
    else:
        return tl.expand_dims(tl.expand_dims(x, 1), 0)


@triton.jit
def _verify_kc_kernel(
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
    c_ptr,
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
    NC: tl.constexpr,
    KC: tl.constexpr,
    BV: tl.constexpr,
    L2NORM: tl.constexpr,
    WY: tl.constexpr,
    ROWS_FIRST: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = (i_nh // HV).to(tl.int64)
    i_hv = i_nh % HV
    i_hk = i_hv // GROUP
    o_v = i_v * BV + tl.arange(0, BV)
    o_q = tl.arange(0, QP)
    o_r = tl.arange(0, RP)
    # Dk split into NC chunks of KC, the chunk axis first: [NC, BV, KC] tiles put the lanes along KC, then
    # along the value rows; the chunk axis stays in registers, so a row reduction is in-thread over NC and
    # log2(KC / vector) shuffle levels.
    # Which axis comes first decides, through the tie-break in Triton's coalescing order, whether the 8
    # non-KC lanes go to the value rows (wanted) or to the chunks: Triton 3.9 needs [NC, BV, KC]
    # (ROWS_FIRST=False), Triton 3.6 [BV, NC, KC] (ROWS_FIRST=True).
    d2t = tl.arange(0, NC)[:, None] * KC + tl.arange(0, KC)[None, :]  # [NC, KC]
    d3 = _tok3(d2t, ROWS_FIRST)
    m_d = d3 < DK
    v3 = _rows3b(o_v, ROWS_FIRST)
    m_v = o_v < DV
    m_q = o_q < Q

    slot = tl.load(idx_ptr + i_n * s_in).to(tl.int64)
    valid = slot >= 0
    n_acc = tl.where(valid, tl.minimum(tl.load(acc_ptr + i_n), R), 0)
    m_vs = o_v < tl.where(valid, DV, 0)
    m_vc = o_v < tl.where(n_acc > 0, DV, 0)

    # ---- every load first.
    p_h = state_ptr + slot * s_ss + i_hv * s_sh + v3 * s_sv + d3 * s_sk
    h = tl.load(p_h, mask=_rows3b(m_vs, ROWS_FIRST) & m_d, other=0.0).to(tl.float32)
    p_row = pend_ptr + slot * s_ps
    m_r = o_r < n_acc
    pu = tl.load(
        p_row + o_r[:, None] * s_pr + (HK * DK + i_hv * DV + o_v[None, :]) * s_pp,
        mask=m_r[:, None] & m_v[None, :],
        other=0.0,
    )
    pg = tl.load(p_row + o_r * s_pr + (HK * DK + HV * DV + i_hv) * s_pp, mask=m_r, other=0.0)
    # Token k / q vectors are loaded per token ([NC, KC], _tok): a [Q, NC, KC] tile gets its own layout
    # (lanes along the token axis with Triton 3.6) and extracting a row then costs shuffles. No store
    # precedes them, so the compiler may issue them early.
    p_k = k_ptr + i_n * s_kn + i_hk * s_kh + d2t * s_kd
    p_q = q_ptr + i_n * s_qn + i_hk * s_qh + d2t * s_qd
    m_d2 = d2t < DK
    m_vq = m_v[:, None] & m_q[None, :]
    b_v = tl.load(
        v_ptr + i_n * s_vn + o_q[None, :] * s_vt + i_hv * s_vh + o_v[:, None] * s_vd, mask=m_vq, other=0.0
    ).to(tl.float32)  # [BV, QP]
    if not WY:
        b_g = tl.load(g_ptr + i_n * s_gn + o_q * s_gt + i_hv * s_gh, mask=m_q, other=0.0).to(tl.float32)
        b_b = tl.load(beta_ptr + i_n * s_bn + o_q * s_bt + i_hv * s_bh, mask=m_q, other=0.0).to(tl.float32)

    # ---- 1. commit the accepted pending tokens (S exp(g) + u k^T each), store once, continue rounded.
    for j in range(n_acc):
        c_k = _tok3(_tok(p_row + j * s_pr + (i_hk * DK + d2t) * s_pp, m_d2, eps, L2NORM), ROWS_FIRST)
        c_u = tl.sum(tl.where(o_r[:, None] == j, pu, 0.0), 0)
        c_g = tl.sum(tl.where(o_r == j, pg, 0.0))
        h = h * tl.exp(c_g) + _rows3b(c_u, ROWS_FIRST) * c_k
    h = h.to(state_ptr.dtype.element_ty)
    tl.store(p_h, h, mask=_rows3b(m_vc, ROWS_FIRST) & m_d)
    h = h.to(tl.float32)

    b_o = tl.zeros([BV, QP], dtype=tl.float32)
    b_u = tl.zeros([BV, QP], dtype=tl.float32)
    if WY:
        # ---- 2a. x_t = h k_t, y_t = h q_t: 2Q independent reductions of the committed state.
        b_x = tl.zeros([BV, QP], dtype=tl.float32)
        b_y = tl.zeros([BV, QP], dtype=tl.float32)
        for j in tl.static_range(Q):
            t_k = _tok3(_tok(p_k + j * s_kt, m_d2, eps, L2NORM), ROWS_FIRST)
            t_q = _tok3(_tok(p_q + j * s_qt, m_d2, eps, L2NORM), ROWS_FIRST)
            b_x = tl.where(o_q[None, :] == j, _rowsum(h * t_k, ROWS_FIRST)[:, None], b_x)
            b_y = tl.where(o_q[None, :] == j, _rowsum(h * t_q, ROWS_FIRST)[:, None], b_y)
        # ---- 2b. U = V Pv + X Px, O = V Pvn + X Pxn + Y scale diag(A) (coefficients: _coef_kernel).
        c_base = c_ptr + i_nh.to(tl.int64) * (4 * QP * QP + QP)
        c_off = o_q[:, None] * QP + o_q[None, :]
        p_v = tl.load(c_base + c_off)
        p_x = tl.load(c_base + QP * QP + c_off)
        p_vn = tl.load(c_base + 2 * QP * QP + c_off)
        p_xn = tl.load(c_base + 3 * QP * QP + c_off)
        s_a = tl.load(c_base + 4 * QP * QP + o_q)
        b_u = _mm(b_v, p_v) + _mm(b_x, p_x)
        b_o = _mm(b_v, p_vn) + _mm(b_x, p_xn) + b_y * s_a[None, :]
    else:
        # ---- 2. the Q tokens one by one (decay, h k, rank-1 update, h q).
        for j in tl.static_range(Q):
            t_k = _tok3(_tok(p_k + j * s_kt, m_d2, eps, L2NORM), ROWS_FIRST)
            t_q = _tok3(_tok(p_q + j * s_qt, m_d2, eps, L2NORM), ROWS_FIRST)
            t_v = tl.sum(tl.where(o_q[None, :] == j, b_v, 0.0), 1)
            t_g = tl.sum(tl.where(o_q == j, b_g, 0.0))
            t_b = tl.sum(tl.where(o_q == j, b_b, 0.0))
            h = h * tl.exp(t_g)
            t_hk = _rowsum(h * t_k, ROWS_FIRST)
            t_u = t_b * t_v - t_b * t_hk
            h = h + _rows3b(t_u, ROWS_FIRST) * t_k
            t_o = _rowsum(h * t_q, ROWS_FIRST) * scale
            b_o = tl.where(o_q[None, :] == j, t_o[:, None], b_o)
            b_u = tl.where(o_q[None, :] == j, t_u[:, None], b_u)
    tl.store(
        o_ptr + i_n * s_on + o_q[None, :] * s_ot + i_hv * s_oh + o_v[:, None] * s_od,
        b_o.to(o_ptr.dtype.element_ty),
        mask=m_vq,
    )
    # ---- 3. stash this program's own u rows (read only by it, above); k and g: stash_shared.
    p_su = p_row + o_q[None, :] * s_pr + (HK * DK + i_hv * DV + o_v[:, None]) * s_pp
    tl.store(p_su, b_u, mask=m_vs[:, None] & m_q[None, :])


def rows_first() -> bool:
    """Tile axis order that gives lanes to the value rows with this Triton (see ``_verify_kc_kernel``)."""
    major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    return (major, minor) < (3, 9)


def verify_kc(
    q, k, v, g, beta, o, ssm_state, pending, state_indices, num_accepted, scale, use_qk_l2norm, eps,
    block_v, num_warps, block_k=None, wy=False,
) -> tuple:  # fmt: skip
    """``_verify_kc_kernel`` (after ``_coef_kernel`` when ``wy``) into ``o``; returns the compiled kernels."""
    N, Q, HK, DK = q.shape
    HV, DV = v.shape[2], v.shape[3]
    BK = triton.next_power_of_2(DK)
    QP = triton.next_power_of_2(Q)
    kc = min(BK, block_k or 64 // ssm_state.element_size())
    coef, c = o, None  # the scratch is unused unless WY
    if wy:
        coef = torch.empty((N * HV, 4 * QP * QP + QP), dtype=torch.float32, device=q.device)
        c = _coef_kernel[(N * HV,)](
            q, k, g, beta, coef, float(scale), eps,
            *q.stride(), *k.stride(), *g.stride(), *beta.stride(),
            Q=Q, QP=QP, HV=HV, GROUP=HV // HK, DK=DK, BK=BK, L2NORM=use_qk_l2norm, num_warps=1,
        )  # fmt: skip
    m = _verify_kc_kernel[(triton.cdiv(DV, block_v), N * HV)](
        q, k, v, g, beta, o, ssm_state, pending, state_indices, num_accepted, coef,
        float(scale), eps,
        *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(), *o.stride(),
        *ssm_state.stride(), *pending.stride(), state_indices.stride(0),
        Q=Q, R=pending.shape[1], QP=QP, RP=triton.next_power_of_2(pending.shape[1]), HK=HK, HV=HV,
        GROUP=HV // HK, DK=DK, DV=DV, NC=BK // kc, KC=kc, BV=block_v, L2NORM=use_qk_l2norm, WY=wy,
        ROWS_FIRST=rows_first(),
        num_warps=num_warps,
    )  # fmt: skip
    return c, m


# name -> (launcher, kwargs); block sizes: the best of session 3's sweeps (results/gdn_s3_run2/3.json).
CANDIDATES = {
    "kc BV=8 w=1": (verify_kc, dict(block_v=8, num_warps=1)),
    "kc BV=16 w=1": (verify_kc, dict(block_v=16, num_warps=1)),
    "wykc BV=8 w=1": (verify_kc, dict(block_v=8, num_warps=1, wy=True)),
    "wykc BV=16 w=1": (verify_kc, dict(block_v=16, num_warps=1, wy=True)),
}
# --with-dot adds the tl.dot WY kernel (session 3 run 4: 155 / 161 us at B=64 Q=4, fp32 / bf16 pool).
WITH_DOT = {"wy-dot BV=32 w=2": (verify_wy, dict(block_v=32, num_warps=2))}


def run_candidate(name, q, k, v, g, beta, pool, pend, idx, na, scale):
    """One verify step with candidate ``name`` (its kernels, then our shared k/g stash); returns
    (outputs, compiled kernels)."""
    from atom_kernels.ops.gated_delta_rule.triton_verify import stash_shared
    from atom_kernels.ops.l2norm.checks import DEFAULT_EPS

    fn, kw = CANDIDATES[name]
    N, Q, _, _ = q.shape
    o = torch.empty((N, Q, v.shape[2], v.shape[3]), dtype=q.dtype, device=q.device)
    kw = dict(kw)
    bv, nw = kw.pop("block_v"), kw.pop("num_warps")
    kernels = fn(q, k, v, g, beta, o, pool, pend, idx, na, scale, True, DEFAULT_EPS, bv, nw, **kw)
    stash_shared(k, g, pend, idx)
    return o, kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, small shapes, no timing")
    ap.add_argument("--with-dot", action="store_true", help="also the tl.dot WY kernel")
    args = ap.parse_args()
    if args.with_dot:
        CANDIDATES.update(WITH_DOT)
    dev = torch.device("cpu") if args.smoke else common.require_cuda()
    out = common.out_dir(args.out)
    ceil = None if args.smoke else common.ceilings(out, dev)
    rows, resources, fails = [], {}, 0
    for sd in (torch.float32, torch.bfloat16):
        for B in (3,) if args.smoke else (64,):
            for Q in (2, 4, 5):
                case = verify_case(B, Q, sd, dev, args.smoke)
                args_, pool, pend, idx, na, scale = (
                    case[n] for n in ("args", "pool", "pend", "idx", "na", "scale")
                )
                for name in CANDIDATES:
                    pt, et = pool.clone(), pend.clone()
                    o_t, kernels = run_candidate(name, *args_, pt, et, idx, na, scale)
                    fails += not check(case, name, o_t, pt, et)
                    if not args.smoke:  # registers / spills of each kernel as compiled here
                        res = [
                            (kn.name, getattr(kn, "n_regs", None), getattr(kn, "n_spills", None))
                            for kn in kernels
                            if kn
                        ]
                        resources[f"{case['name']} {name}"] = res
                        print(f"kernels {case['name']} {name}: (name, registers, spills) {res}")
                if args.smoke:
                    continue
                cands = {
                    name: partial(run_candidate, name, *args_, pool, pend, idx, na, scale)
                    for name in CANDIDATES
                }
                rows += time_candidates(args_, pool, pend, idx, na, scale, cands, case["name"], ceil)
    if not args.smoke:
        payload = {"env": common.environment(), "ceilings": ceil, "rows": rows, "kernels": resources}
        common.write_json(out / "verify_wy.json", payload)
    print(f"checks failed: {fails}")
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
