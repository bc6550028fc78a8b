"""Experiment: the verify tokens in WY form, on session 4's kernel (issue 6, verify k=3 <= 1.3x decode).

Session 4's ``_verify_kernel`` (atom_kernels ``triton_verify``) halved the instructions of a k=3 verify and
is now bound by latency (Nsight Compute: 55-65% of cycles without an eligible warp): each token's update
waits for the token before it, through an ``h k`` reduction (in-thread sums and 3 shuffle levels). Here the
Q tokens read only the committed state ``h0``:

    x_t = h0 k_t,  y_t = h0 q_t                                  (2Q independent row reductions)
    u_t = b_t (v_t - A_t x_t - sum_{s<t} (A_t / A_s) (k_s . k_t) u_s)
    o_t = A_t y_t + sum_{s<=t} (A_t / A_s) (k_s . q_t) u_s       (q carries the scale)

with ``A_t`` the product of the decays up to token t (``A_t / A_s = exp(G_t - G_s)``, G the running sum of
g: no overflow) and k, q L2-normalised (as row scalars, like the kernel). The state is not updated per
token at all; the only chain left is the per-row Q x Q recurrence for u. Token-token dot products come
from a ``[QP, NC, KC]`` tile of the Q keys. Same semantics as ``gated_delta_rule_verify`` (prologue and
commit are the kernel's), checked against the float32 reference, timed next to our decode and verify.
Writes ``<out>/verify_wy2.json``.
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
def _rsum(x):
    """Row reduction of a ``[BV, NC, KC]`` tile: in-thread over the chunks first, then across the KC lanes."""
    return tl.sum(tl.sum(x, 1), 1)


@triton.jit
def _verify_wy2_kernel(
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
    HK: tl.constexpr,
    HV: tl.constexpr,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    NC: tl.constexpr,
    KC: tl.constexpr,
    BV: tl.constexpr,
    L2NORM: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = (i_nh // HV).to(tl.int64)
    i_hv = i_nh % HV
    i_hk = i_hv // GROUP
    d2 = tl.arange(0, NC)[:, None] * KC + tl.arange(0, KC)[None, :]  # [NC, KC]: Dk positions
    m_d2 = d2 < DK
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < DV

    slot = tl.load(idx_ptr + i_n * s_in).to(tl.int64)
    valid = slot >= 0
    n_acc = tl.where(valid, tl.minimum(tl.load(acc_ptr + i_n), R), 0)
    m_vs = o_v < tl.where(valid, DV, 0)
    m_vc = o_v < tl.where(n_acc > 0, DV, 0)

    p_h = state_ptr + slot * s_ss + i_hv * s_sh + o_v[:, None, None] * s_sv + d2[None, :, :] * s_sk
    m_h = m_d2[None, :, :]
    h = tl.load(p_h, mask=m_vs[:, None, None] & m_h, other=0.0).to(tl.float32)

    # ---- 1. commit (as the kernel): h E + sum_j (u_j r_j W_j) k_j^T.
    p_pend = pend_ptr + slot * s_ps
    w = tl.full([BV], 1.0, tl.float32)
    acc = tl.zeros([BV, NC, KC], dtype=tl.float32)
    for jj in tl.static_range(R):
        j = R - 1 - jj
        m_j = o_v < tl.where(j < n_acc, DV, 0)
        c_k = tl.load(
            p_pend + j * s_pr + (i_hk * DK + d2) * s_pp, mask=d2 < tl.where(j < n_acc, DK, 0), other=0.0
        )
        c_u = tl.load(p_pend + j * s_pr + (HK * DK + i_hv * DV + o_v) * s_pp, mask=m_j, other=0.0)
        c_g = tl.load(p_pend + j * s_pr + (HK * DK + HV * DV + i_hv) * s_pp, mask=j < n_acc, other=0.0)
        if L2NORM:
            c_u = c_u / tl.sqrt(tl.sum(tl.sum(c_k * c_k, 1), 0) + eps)
        acc = acc + (c_u * w)[:, None, None] * c_k[None, :, :]
        w = w * tl.exp(c_g)
    h = h * w[:, None, None] + acc
    h_c = h.to(state_ptr.dtype.element_ty)
    tl.store(p_h, h_c, mask=m_vc[:, None, None] & m_h)
    h = h_c.to(tl.float32)

    # ---- 2. the Q tokens in WY form: every reduction of the state is against h0 (= h), none waits.
    o_q = tl.arange(0, QP)
    m_q = o_q < Q
    # the Q keys as one [QP, NC, KC] tile, for the token-token dot products, and their norms
    kt = tl.load(
        k_ptr + i_n * s_kn + o_q[:, None, None] * s_kt + i_hk * s_kh + d2[None, :, :] * s_kd,
        mask=m_q[:, None, None] & m_h,
        other=0.0,
    ).to(tl.float32)
    rk_all = tl.full([QP], 1.0, tl.float32)
    if L2NORM:
        rk_all = 1.0 / tl.sqrt(tl.sum(tl.sum(kt * kt, 2), 1) + eps)
    b_o = tl.zeros([BV, QP], dtype=tl.float32)
    b_u = tl.zeros([BV, QP], dtype=tl.float32)
    b_gc = tl.zeros([QP], dtype=tl.float32)  # running sum of g per token
    gcum = 0.0
    for t in tl.static_range(Q):
        t_q = tl.load(q_ptr + i_n * s_qn + t * s_qt + i_hk * s_qh + d2 * s_qd, mask=m_d2, other=0.0)
        t_k = tl.load(k_ptr + i_n * s_kn + t * s_kt + i_hk * s_kh + d2 * s_kd, mask=m_d2, other=0.0)
        t_v = tl.load(v_ptr + i_n * s_vn + t * s_vt + i_hv * s_vh + o_v * s_vd, mask=m_v, other=0.0)
        t_g = tl.load(g_ptr + i_n * s_gn + t * s_gt + i_hv * s_gh).to(tl.float32)
        t_b = tl.load(beta_ptr + i_n * s_bn + t * s_bt + i_hv * s_bh).to(tl.float32)
        t_q = t_q.to(tl.float32)
        t_k = t_k.to(tl.float32)
        r_q = scale
        r_k = 1.0
        if L2NORM:
            r_q = scale / tl.sqrt(tl.sum(tl.sum(t_q * t_q, 1), 0) + eps)
            r_k = 1.0 / tl.sqrt(tl.sum(tl.sum(t_k * t_k, 1), 0) + eps)
        gcum = gcum + t_g
        b_gc = tl.where(o_q == t, gcum, b_gc)
        a_t = tl.exp(gcum)
        x_t = _rsum(h * t_k[None, :, :]) * r_k
        y_t = _rsum(h * t_q[None, :, :]) * r_q
        # (A_t / A_s) (k_s . k_t) for s < t and (A_t / A_s) (k_s . q_t) for s <= t, as [QP] vectors over s
        dec = tl.exp(gcum - b_gc)
        c_kk = tl.where(o_q < t, dec * tl.sum(tl.sum(kt * t_k[None, :, :], 2), 1) * rk_all * r_k, 0.0)
        c_qk = tl.where(o_q <= t, dec * tl.sum(tl.sum(kt * t_q[None, :, :], 2), 1) * rk_all * r_q, 0.0)
        t_u = t_b * (t_v.to(tl.float32) - a_t * x_t - tl.sum(b_u * c_kk[None, :], 1))
        b_u = tl.where(o_q[None, :] == t, t_u[:, None], b_u)
        t_o = a_t * y_t + tl.sum(b_u * c_qk[None, :], 1)
        b_o = tl.where(o_q[None, :] == t, t_o[:, None], b_o)
    tl.store(
        o_ptr + i_n * s_on + o_q[None, :] * s_ot + i_hv * s_oh + o_v[:, None] * s_od,
        b_o.to(o_ptr.dtype.element_ty),
        mask=m_v[:, None] & m_q[None, :],
    )
    # ---- 3. stash this program's own u rows; k and g: stash_shared.
    p_su = p_pend + o_q[None, :] * s_pr + (HK * DK + i_hv * DV + o_v[:, None]) * s_pp
    tl.store(p_su, b_u, mask=m_vs[:, None] & m_q[None, :])


def verify_wy2(
    q, k, v, g, beta, o, ssm_state, pending, state_indices, num_accepted, scale, use_qk_l2norm, eps,
    block_v, num_warps=1, block_k=32, max_registers=None,
):  # fmt: skip
    """``_verify_wy2_kernel`` into ``o``; returns the compiled kernel."""
    N, Q, HK, DK = q.shape
    HV, DV = v.shape[2], v.shape[3]
    BK = triton.next_power_of_2(DK)
    kc = min(BK, block_k)
    extra = {"maxnreg": max_registers} if max_registers else {}
    return _verify_wy2_kernel[(triton.cdiv(DV, block_v), N * HV)](
        q, k, v, g, beta, o, ssm_state, pending, state_indices, num_accepted, float(scale), eps,
        *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(), *o.stride(),
        *ssm_state.stride(), *pending.stride(), state_indices.stride(0),
        Q=Q, R=pending.shape[1], QP=triton.next_power_of_2(Q), HK=HK, HV=HV, GROUP=HV // HK, DK=DK,
        DV=DV, NC=BK // kc, KC=kc, BV=block_v, L2NORM=use_qk_l2norm, num_warps=num_warps, **extra,
    )  # fmt: skip


CANDIDATES = {
    "wy2 BV=8": dict(block_v=8),
    "wy2 BV=16": dict(block_v=16),
    "wy2 BV=32": dict(block_v=32),
    "wy2 BV=16 maxnreg=128": dict(block_v=16, max_registers=128),
}


def run_candidate(name, q, k, v, g, beta, pool, pend, idx, na, scale):
    """One verify step with candidate ``name`` (its kernel, then our shared k/g stash)."""
    from atom_kernels.ops.gated_delta_rule.triton_verify import stash_shared
    from atom_kernels.ops.l2norm.checks import DEFAULT_EPS

    N, Q, _, _ = q.shape
    o = torch.empty((N, Q, v.shape[2], v.shape[3]), dtype=q.dtype, device=q.device)
    kern = verify_wy2(q, k, v, g, beta, o, pool, pend, idx, na, scale, True, DEFAULT_EPS, **CANDIDATES[name])
    stash_shared(k, g, pend, idx)
    return o, kern


def check_case(case, name, na) -> bool:
    """Run candidate ``name`` on copies of the case's pool/pending with ``num_accepted = na`` and check it
    against the float32 reference on the same inputs."""
    from atom_kernels.ops.gated_delta_rule import reference

    args_, pool, pend, idx, scale = (case[n] for n in ("args", "pool", "pend", "idx", "scale"))
    pt, et = pool.clone(), pend.clone()
    o_t, kern = run_candidate(name, *args_, pt, et, idx, na, scale)
    pr, er = pool.float().clone(), pend.clone()
    o_r = reference.gated_delta_rule_verify(*(x.float() for x in args_), pr, er, idx, na, scale)
    ok = check(dict(case, ref=(o_r, pr, er)), name, o_t, pt, et)
    return ok, kern


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, small shapes, no timing")
    ap.add_argument("--batches", default="64", help="comma-separated batch sizes (GPU)")
    args = ap.parse_args()
    dev = torch.device("cpu") if args.smoke else common.require_cuda()
    out = common.out_dir(args.out)
    ceil = None if args.smoke else common.ceilings(out, dev)
    rows, resources, fails = [], {}, 0
    for sd in (torch.float32, torch.bfloat16):
        for B in (3,) if args.smoke else tuple(int(b) for b in args.batches.split(",")):
            for Q in (1, 2, 4) if args.smoke else (2, 4):
                case = verify_case(B, Q, sd, dev, args.smoke)
                na = case["na"]
                na_part = na.clone()  # a partly accepted batch: row 0 none, row 1 one token
                na_part[0], na_part[1] = 0, min(1, Q)
                for name in CANDIDATES:
                    for acc in (na, na_part):
                        ok, kern = check_case(case, name, acc)
                        fails += not ok
                    if not args.smoke:
                        res = (getattr(kern, "n_regs", None), getattr(kern, "n_spills", None))
                        resources[f"{case['name']} {name}"] = res
                        print(f"kernel {case['name']} {name}: (registers, spills) {res}")
                if args.smoke:
                    continue
                args_, pool, pend, idx, scale = (case[n] for n in ("args", "pool", "pend", "idx", "scale"))
                cands = {n: partial(run_candidate, n, *args_, pool, pend, idx, na, scale) for n in CANDIDATES}
                rows += time_candidates(args_, pool, pend, idx, na, scale, cands, case["name"], ceil)
    if not args.smoke:
        payload = {"env": common.environment(), "ceilings": ceil, "rows": rows, "kernels": resources}
        common.write_json(out / "verify_wy2.json", payload)
    print(f"checks failed: {fails}")
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
