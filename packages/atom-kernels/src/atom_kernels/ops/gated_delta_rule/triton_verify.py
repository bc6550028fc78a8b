"""Triton ``gated_delta_rule_verify``: MTP verification with deferred commit (docs/kernel-api.md, last section).

Two launches, in stream order:

1. ``_verify_kernel``: one program per (sequence, value head, block of ``BV`` value rows) keeps its
   ``[BV, Dk]`` float32 state tile in registers, as ``_recurrent_kernel`` does. Every global load is
   issued up front, before any arithmetic: the state tile, the ``R`` pending tokens (masked to the
   ``num_accepted`` ones) and the ``Q`` verify tokens, as ``[R, Dk]`` / ``[Q, Dk]`` register tiles. The
   per-token recurrent kernel loaded each token's q/k/v inside its token loop, behind the previous
   token's state store, so a verify step paid one dependent global-memory round trip per token; at full
   memory load such a round trip waits in the same queues as the state traffic. Then, arithmetic only:
   commit the accepted pending tokens (a runtime loop of ``num_accepted`` steps, each ``S exp(g) + u k^T``:
   a pending token carries the update coefficients ``u = beta (v - S k)`` its verify computed, so a commit
   needs no reduction over the state), store the tile once (rounded to the pool dtype; skipped when
   nothing was committed: the slot holds that value already) and continue from the rounded value, verify
   the ``Q`` tokens (outputs and u collected in ``[Q, BV]`` tiles and stored at the end) and stash this
   program's own ``u`` rows into ``pending``: only this program reads them, after its loads.
2. ``_stash_kernel``: writes the shared part of each new pending token, ``k`` (read by every program of
   the key head's group) and ``g`` (read by every value-row block of the head), after all programs of
   launch 1 have read the old ones.

The per-token math is the recurrent kernel's (decay, ``h k`` reduction, rank-1 update, ``h q``
reduction) with the update written as ``h + (beta v) k^T - (beta h k) k^T`` instead of
``h + beta (v - h k) k^T``: the ``v`` term does not depend on ``h``, so the layout conversion Triton puts
between the value-row vectors of the token tiles and those of the state tile happens off the dependency
chain (compiled for sm_90: no conversion left between one token's ``h k`` reduction and the next). The
results differ from the recurrent kernel's by float32 rounding only. Slots < 0 are padding rows: zero
state, nothing read from or written to ``ssm_state`` / ``pending`` (``num_accepted`` is ignored there);
``num_accepted`` above ``R`` is clamped.

History (H200): run 4 stashed raw ``v``/``beta`` and replayed full per-token steps (two reductions
per committed token): k=3 verify 1.78x (B=64) / 1.84x (B=256) a decode with a float32 pool, 3.25x with
bf16. Run 5 tried the chunked WY/UT form with ``tl.dot`` tiles (commit 21d70c5): correct but 10-14x
slower (per-program fixed cost, likely spills / layout conversions); removed. Session 3 tried the WY
form without per-token state updates (with ``tl.dot`` and in registers) and a Dk-chunked tile with a
third of this kernel's shuffles: all correct, all slower at Q >= 4, as were register caps and two warps
per program (benchmarks/gpu/exp_verify_wy.py, benchmarks/README.md); only BV=32 for bf16 pools won.

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


def verify_launch_config(num_seqs: int, num_v_heads: int, dv: int, state_bytes: int) -> tuple[int, int]:
    """(BV, num_warps) of ``_verify_kernel``: one warp; 8 value rows (the recurrent kernel's choice), or 32
    with a 2-byte pool when that still leaves >= 4096 programs: its smaller tile leaves the kernel short of
    loads in flight, but fewer programs cannot fill the GPU.

    H200, k=3 verify (session 3; results/gdn_s3_run5.json ``--sweep``, gdn_s3_run6.json side by side):
    bf16 pool, BV=32 against BV=8: B=64 100 / 100 us against 109 / 108 us, B=256 363 / 361 us against
    419 / 412 us, but B=1 11.9 us against 5.8 us (128 programs); at Q=1 (not a verify shape in serving)
    BV=32 is 3-6% slower. float32 pool: BV=8 (121 us at B=64 against 139 us with BV=32). Two warps per
    program were 3-5x slower (results/gdn_s3_run4.json). Between B=1 and B=64 (80B shape: B >= 32
    takes BV=32) the threshold is a guess, not a measurement.
    """
    bv = 32 if state_bytes < 4 else recurrent_launch_config(num_seqs, num_v_heads, dv)[0]
    bv = min(bv, triton.next_power_of_2(dv))
    if num_seqs * num_v_heads * triton.cdiv(dv, bv) < 4096:
        bv = recurrent_launch_config(num_seqs, num_v_heads, dv)[0]
    return bv, 1


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
    pu = tl.load(p_pend + (HK * DK + i_hv * DV + o_v[None, :]) * s_pp, mask=m_r & m_v[None, :], other=0.0)
    pg = tl.load(
        pend_ptr + slot * s_ps + o_r * s_pr + (HK * DK + HV * DV + i_hv) * s_pp, mask=o_r < n_acc, other=0.0
    )

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
    # A pending token carries its update coefficients u (computed by the previous step's verify), so a
    # commit is S exp(g) + u k^T: two element-wise passes, no reduction over the state.
    for j in range(n_acc):
        c_k = _row(pk, o_r, j)
        c_u = _row(pu, o_r, j)
        c_g = tl.sum(tl.where(o_r == j, pg, 0.0))
        h = h * tl.exp(c_g) + c_u[:, None] * c_k[None, :]
    h = h.to(state_ptr.dtype.element_ty)
    tl.store(p_h, h, mask=m_vc[:, None] & m_k[None, :])
    h = h.to(tl.float32)

    # ---- 2. verify the Q tokens: outputs and each token's u; no state stored.
    b_o = tl.zeros([QP, BV], dtype=tl.float32)
    b_u = tl.zeros([QP, BV], dtype=tl.float32)
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
        # u = beta (v - h k) for the stash; off the token chain (only stored at the end).
        b_u = tl.where(o_q[:, None] == j, (t_b * t_v - t_b * t_hk)[None, :], b_u)
    tl.store(
        o_ptr + i_n * s_on + o_q[:, None] * s_ot + i_hv * s_oh + o_v[None, :] * s_od,
        b_o.to(o_ptr.dtype.element_ty),
        mask=m_qv,
    )

    # ---- 3. stash this program's own u rows (only it reads them, above); k and g: _stash_kernel.
    p_su = pend_ptr + slot * s_ps + o_q[:, None] * s_pr + (HK * DK + i_hv * DV + o_v[None, :]) * s_pp
    tl.store(p_su, b_u, mask=m_q[:, None] & m_vs[None, :])


@triton.jit
def _stash_kernel(
    k_ptr,
    g_ptr,
    pend_ptr,
    idx_ptr,
    s_kn,
    s_kt,
    s_kh,
    s_kd,
    s_gn,
    s_gt,
    s_gh,
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
    """pending[slot, j] k and g parts = this step's token j (float32); slot < 0 skipped."""
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
        tl.store(p_row + (HK * DK + HV * DV + o_h) * s_pp, b_g.to(tl.float32), mask=m_h)


def stash_shared(
    k: torch.Tensor, g: torch.Tensor, pending: torch.Tensor, state_indices: torch.Tensor
) -> None:
    """Launch 2 of the verify op: ``pending[slot, j]``'s k and g parts = this step's token j. Must follow
    every read of the old pending tokens (stream order after the verify kernel)."""
    N, Q, HK, DK = k.shape
    HV = g.shape[2]
    DV = (pending.shape[2] - HK * DK - HV) // HV
    _stash_kernel[(N, Q)](
        k, g, pending, state_indices,
        *k.stride(), *g.stride(), *pending.stride(), state_indices.stride(0),
        HK=HK, HV=HV, DK=DK, DV=DV, BLOCK=min(2048, triton.next_power_of_2(HK * DK)),
        BH=triton.next_power_of_2(HV), num_warps=4,
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
    num_accepted: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool = True,
    *,
    block_v: int | None = None,
    num_warps: int | None = None,
    max_registers: int | None = None,
) -> torch.Tensor:
    """See :func:`atom_kernels.ops.gated_delta_rule.reference.gated_delta_rule_verify`.

    ``block_v`` / ``num_warps`` override :func:`verify_launch_config`; ``max_registers`` caps the
    kernel's registers per thread (CUDA's ``maxnreg``: more resident warps, possibly spills). Benchmarks only.
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
    bv, nw = verify_launch_config(N, HV, DV, ssm_state.element_size())
    bv, nw = block_v or bv, num_warps or nw
    extra = {"maxnreg": max_registers} if max_registers else {}
    _verify_kernel[(triton.cdiv(DV, bv), N * HV)](
        q, k, v, g, beta, o, ssm_state, pending, state_indices, num_accepted,
        float(scale), L2NORM_EPS,
        *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(), *o.stride(),
        *ssm_state.stride(), *pending.stride(), state_indices.stride(0),
        Q=Q, R=R, QP=triton.next_power_of_2(Q), RP=triton.next_power_of_2(R), HK=HK, HV=HV,
        GROUP=HV // HK, DK=DK, DV=DV, BK=triton.next_power_of_2(DK), BV=bv,
        L2NORM=use_qk_l2norm, num_warps=nw, **extra,
    )  # fmt: skip
    stash_shared(k, g, pending, state_indices)
    return o
