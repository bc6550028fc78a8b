"""Experiment: the verify kernel on a persistent grid that prefetches (issue 6, verify k=3 <= 1.3x decode).
Session 4.

This file first held the candidates of session 4's verify rewrite (runs 2-3, results/verify_tok_s4_run2.*,
run3.*; the code of those runs is in git, commits f20cccf and bc3129f): L2 norms as row scalars, the
Dk-chunked ``[BV, NC, KC]`` tile, per-token loads, static commits merged into one pass, the committed tile
stored at once. That combination with BV=16 became atom_kernels' ``_verify_kernel`` (B=64 float32 k=1 77 us
against 93 for session 3's kernel, k=3 118 against 123; decode 71). Storing the committed tile after the
token loop instead needed 168-255 registers and lost; a 1-D grid moved BV=16's registers from 168 to 201
for the same code (slower).

What is left here is the variant that lost most: a grid of ``programs_per_sm`` programs per multiprocessor,
each looping over tiles and loading its next tile's state before computing the current one, so the loads
overlap the arithmetic. Its body is the op's (the ``_token`` loader and the merged commit). H200 run 3:
1.5-2x slower than the op (243-255 registers leave 8 warps per SM, and each loop iteration still waits for
its pending and token loads). Checked against the float32 reference (outputs, committed state, pending
buffer) and timed next to our decode and verify op. Writes ``<out>/verify_tok.json``.
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
from atom_kernels.ops.gated_delta_rule.triton_verify import _rsum, _token  # noqa: E402
from exp_verify_common import check, time_candidates, verify_case  # noqa: E402


@triton.jit
def _load_tile_state(
    state_ptr, idx_ptr, s_in, s_ss, s_sh, s_sv, s_sk, t, n_tiles, d2, HV, DV, DK, BV: tl.constexpr
):
    """Tile ``t``'s ``[BV, NC, KC]`` state in the pool dtype; zeros for padding rows and past the last tile."""
    NV = (DV + BV - 1) // BV
    i_nh = t // NV
    i_n = (i_nh // HV).to(tl.int64)
    slot = tl.load(idx_ptr + i_n * s_in, mask=t < n_tiles, other=-1).to(tl.int64)
    o_v = (t % NV) * BV + tl.arange(0, BV)
    m_vs = o_v < tl.where(slot >= 0, DV, 0)
    p_h = state_ptr + slot * s_ss + (i_nh % HV) * s_sh + o_v[:, None, None] * s_sv + d2[None, :, :] * s_sk
    return tl.load(p_h, mask=m_vs[:, None, None] & (d2 < DK)[None, :, :], other=0.0)


@triton.jit
def _verify_pf_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, state_ptr, pend_ptr, idx_ptr, acc_ptr, scale, eps,
    s_qn, s_qt, s_qh, s_qd, s_kn, s_kt, s_kh, s_kd, s_vn, s_vt, s_vh, s_vd, s_gn, s_gt, s_gh,
    s_bn, s_bt, s_bh, s_on, s_ot, s_oh, s_od, s_ss, s_sh, s_sv, s_sk, s_ps, s_pr, s_pp, s_in, num_seqs,
    Q: tl.constexpr, R: tl.constexpr, QP: tl.constexpr, HK: tl.constexpr, HV: tl.constexpr,
    GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, NC: tl.constexpr, KC: tl.constexpr,
    BV: tl.constexpr, L2NORM: tl.constexpr,
):  # fmt: skip
    NV: tl.constexpr = (DV + BV - 1) // BV
    n_tiles = num_seqs * HV * NV
    d2 = tl.arange(0, NC)[:, None] * KC + tl.arange(0, KC)[None, :]  # [NC, KC]: Dk positions
    m_d2 = d2 < DK
    m_h = m_d2[None, :, :]
    o_q = tl.arange(0, QP)
    m_q = o_q < Q
    t0 = tl.program_id(0)
    h_nx = _load_tile_state(state_ptr, idx_ptr, s_in, s_ss, s_sh, s_sv, s_sk, t0, n_tiles, d2, HV, DV, DK, BV)
    for t in range(t0, n_tiles, tl.num_programs(0)):
        h = h_nx.to(tl.float32)
        h_nx = _load_tile_state(
            state_ptr,
            idx_ptr,
            s_in,
            s_ss,
            s_sh,
            s_sv,
            s_sk,
            t + tl.num_programs(0),
            n_tiles,
            d2,
            HV,
            DV,
            DK,
            BV,
        )
        i_nh = t // NV
        i_n = (i_nh // HV).to(tl.int64)
        i_hv = i_nh % HV
        i_hk = i_hv // GROUP
        o_v = (t % NV) * BV + tl.arange(0, BV)
        m_v = o_v < DV
        slot = tl.load(idx_ptr + i_n * s_in).to(tl.int64)
        valid = slot >= 0
        n_acc = tl.where(valid, tl.minimum(tl.load(acc_ptr + i_n), R), 0)
        m_vs = o_v < tl.where(valid, DV, 0)  # bounds, not `mask & scalar` (Triton 3.9 interpreter)
        m_vc = o_v < tl.where(n_acc > 0, DV, 0)
        p_h = state_ptr + slot * s_ss + i_hv * s_sh + o_v[:, None, None] * s_sv + d2[None, :, :] * s_sk
        # commit, merged (as the op): h E + sum_j (u_j r_j W_j) k_j^T
        p_pend = pend_ptr + slot * s_ps
        w = tl.full([BV], 1.0, tl.float32)
        acc = tl.zeros([BV, NC, KC], dtype=tl.float32)
        for jj in tl.static_range(R):
            j = R - 1 - jj
            p_j = p_pend + j * s_pr
            c_k = tl.load(p_j + (i_hk * DK + d2) * s_pp, mask=d2 < tl.where(j < n_acc, DK, 0), other=0.0)
            c_u = tl.load(
                p_j + (HK * DK + i_hv * DV + o_v) * s_pp, mask=o_v < tl.where(j < n_acc, DV, 0), other=0.0
            )
            c_g = tl.load(p_j + (HK * DK + HV * DV + i_hv) * s_pp, mask=j < n_acc, other=0.0)
            if L2NORM:
                c_u = c_u / tl.sqrt(tl.sum(tl.sum(c_k * c_k, 1), 0) + eps)
            acc = acc + (c_u * w)[:, None, None] * c_k[None, :, :]
            w = w * tl.exp(c_g)
        h_c = (h * w[:, None, None] + acc).to(state_ptr.dtype.element_ty)
        tl.store(p_h, h_c, mask=m_vc[:, None, None] & m_h)
        h = h_c.to(tl.float32)
        # the Q tokens one after another (as the op's seq form)
        b_o = tl.zeros([BV, QP], dtype=tl.float32)
        b_u = tl.zeros([BV, QP], dtype=tl.float32)
        for j in tl.static_range(Q):
            t_q, t_k, t_v, t_g, t_b, r_q, r_k = _token(
                q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, i_n, i_hk, i_hv, j, d2, m_d2, o_v, m_v, scale, eps,
                s_qn, s_qt, s_qh, s_qd, s_kn, s_kt, s_kh, s_kd, s_vn, s_vt, s_vh, s_vd, s_gn, s_gt, s_gh,
                s_bn, s_bt, s_bh, L2NORM,
            )  # fmt: skip
            h = h * tl.exp(t_g)
            t_u = t_b * (t_v.to(tl.float32) - _rsum(h * t_k[None, :, :]) * r_k)
            h = h + (t_u * r_k)[:, None, None] * t_k[None, :, :]
            t_o = _rsum(h * t_q[None, :, :]) * r_q
            b_o = tl.where(o_q[None, :] == j, t_o[:, None], b_o)
            b_u = tl.where(o_q[None, :] == j, t_u[:, None], b_u)
        tl.store(
            o_ptr + i_n * s_on + o_q[None, :] * s_ot + i_hv * s_oh + o_v[:, None] * s_od,
            b_o.to(o_ptr.dtype.element_ty),
            mask=m_v[:, None] & m_q[None, :],
        )
        p_su = p_pend + o_q[None, :] * s_pr + (HK * DK + i_hv * DV + o_v[:, None]) * s_pp
        tl.store(p_su, b_u, mask=m_vs[:, None] & m_q[None, :])


def verify_pf(
    q, k, v, g, beta, o, ssm_state, pending, state_indices, num_accepted, scale, use_qk_l2norm, eps,
    block_v, programs_per_sm, block_k=32,
):  # fmt: skip
    """``_verify_pf_kernel`` into ``o`` on ``programs_per_sm`` programs per multiprocessor (one
    multiprocessor on CPU); returns the compiled kernel."""
    N, Q, HK, DK = q.shape
    HV, DV = v.shape[2], v.shape[3]
    BK = triton.next_power_of_2(DK)
    kc = min(BK, block_k)
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 1
    grid = min(N * HV * triton.cdiv(DV, block_v), sms * programs_per_sm)
    return _verify_pf_kernel[(grid,)](
        q, k, v, g, beta, o, ssm_state, pending, state_indices, num_accepted, float(scale), eps,
        *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(), *o.stride(),
        *ssm_state.stride(), *pending.stride(), state_indices.stride(0), N,
        Q=Q, R=pending.shape[1], QP=triton.next_power_of_2(Q), HK=HK, HV=HV, GROUP=HV // HK, DK=DK,
        DV=DV, NC=BK // kc, KC=kc, BV=block_v, L2NORM=use_qk_l2norm, num_warps=1,
    )  # fmt: skip


CANDIDATES = {
    "pf BV=8 x6": dict(block_v=8, programs_per_sm=6),
    "pf BV=8 x8": dict(block_v=8, programs_per_sm=8),
    "pf BV=16 x4": dict(block_v=16, programs_per_sm=4),
    "pf BV=16 x8": dict(block_v=16, programs_per_sm=8),
}


def run_candidate(name, q, k, v, g, beta, pool, pend, idx, na, scale):
    """One verify step with candidate ``name`` (its kernel, then our shared k/g stash)."""
    from atom_kernels.ops.gated_delta_rule.triton_verify import stash_shared
    from atom_kernels.ops.l2norm.checks import DEFAULT_EPS

    N, Q, _, _ = q.shape
    o = torch.empty((N, Q, v.shape[2], v.shape[3]), dtype=q.dtype, device=q.device)
    kern = verify_pf(q, k, v, g, beta, o, pool, pend, idx, na, scale, True, DEFAULT_EPS, **CANDIDATES[name])
    stash_shared(k, g, pend, idx)
    return o, kern


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, small shapes, no timing")
    ap.add_argument("--batches", default="64", help="comma-separated batch sizes (GPU)")
    ap.add_argument("--no-time", action="store_true", help="checks only: one launch per candidate (for ncu)")
    args = ap.parse_args()
    dev = torch.device("cpu") if args.smoke else common.require_cuda()
    out = common.out_dir(args.out)
    ceil = None if args.smoke else common.ceilings(out, dev)
    rows, resources, fails = [], {}, 0
    for sd in (torch.float32, torch.bfloat16):
        for B in (3,) if args.smoke else tuple(int(b) for b in args.batches.split(",")):
            for Q in (2, 4) if not args.smoke else (1, 2, 4):
                case = verify_case(B, Q, sd, dev, args.smoke)
                args_, pool, pend, idx, na, scale = (
                    case[n] for n in ("args", "pool", "pend", "idx", "na", "scale")
                )
                if args.smoke:  # a partly accepted batch too: row 0 none, row 1 one token
                    na = na.clone()
                    na[0], na[1] = 0, min(1, Q)
                for name in CANDIDATES:
                    pt, et = pool.clone(), pend.clone()
                    o_t, kern = run_candidate(name, *args_, pt, et, idx, na, scale)
                    if not args.smoke:
                        fails += not check(case, name, o_t, pt, et)
                        res = (getattr(kern, "n_regs", None), getattr(kern, "n_spills", None))
                        resources[f"{case['name']} {name}"] = res
                        print(f"kernel {case['name']} {name}: (registers, spills) {res}")
                    else:
                        fails += not check_partial(case, name, args_, pool, pend, idx, na, scale, o_t, pt, et)
                if args.smoke or args.no_time:
                    continue
                cands = {
                    name: partial(run_candidate, name, *args_, pool, pend, idx, na, scale)
                    for name in CANDIDATES
                }
                rows += time_candidates(args_, pool, pend, idx, na, scale, cands, case["name"], ceil)
    if not args.smoke and not args.no_time:
        payload = {"env": common.environment(), "ceilings": ceil, "rows": rows, "kernels": resources}
        common.write_json(out / "verify_tok.json", payload)
    print(f"checks failed: {fails}")
    sys.exit(1 if fails else 0)


def check_partial(case, name, args_, pool, pend, idx, na, scale, o_t, pt, et) -> bool:
    """Smoke check with a custom ``num_accepted``: the float32 reference on the same inputs."""
    from atom_kernels.ops.gated_delta_rule import reference

    pr, er = pool.float().clone(), pend.clone()
    o_r = reference.gated_delta_rule_verify(*(x.float() for x in args_), pr, er, idx, na, scale)
    ref = dict(case, ref=(o_r, pr, er))
    return check(ref, name, o_t, pt, et)


if __name__ == "__main__":
    main()
