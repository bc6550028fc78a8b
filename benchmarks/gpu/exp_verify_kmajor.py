"""Experiment: the deferred-commit verify with a K-major register tile (issue 6, verify k=3 <= 1.3x decode).

Our ``gated_delta_rule_verify`` kernel holds the state tile as ``[BV value rows, Dk]``. The pool is
``[S, Hv, Dv, Dk]`` with Dk contiguous, so Triton lays the tile out with all 32 lanes of the warp along
Dk (4 elements each) and every ``h k`` / ``h q`` reduction costs 5 shuffle levels per value row: the
kernel is bound by those shuffles, not by memory (run 6: k=3 at 1.59x / 1.66x a decode, fp32 pool).
fla-core's recurrent kernel, on a ``[K, V]`` state with V contiguous, gets lanes mostly along V and
reduces over K mostly inside a thread. This kernel builds the same picture on our pool: the tile is
``[Dk, BV]`` and the Dk stride is not specialised (``do_not_specialize``), so Triton's default layout
puts 8 lanes along the value rows and 4 along Dk (32 Dk elements per thread, 2 shuffle levels).

Same semantics as ``atom_kernels``' ``gated_delta_rule_verify`` (pending ``[k | u | g]``), checked
against the float32 reference; timed next to our decode (recurrent Q=1) and our verify kernel.
Writes ``<out>/verify_kmajor.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from exp_verify_common import check, time_candidates, verify_case  # noqa: E402


@triton.jit(do_not_specialize=["s_sk"])
def _verify_kmajor_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, state_ptr, pend_ptr, idx_ptr, acc_ptr, scale, eps,
    s_qn, s_qt, s_qh, s_qd, s_kn, s_kt, s_kh, s_kd, s_vn, s_vt, s_vh, s_vd, s_gn, s_gt, s_gh,
    s_bn, s_bt, s_bh, s_on, s_ot, s_oh, s_od, s_ss, s_sh, s_sv, s_sk, s_ps, s_pr, s_pp,
    Q: tl.constexpr, R: tl.constexpr, HK: tl.constexpr, HV: tl.constexpr, GROUP: tl.constexpr,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = (i_nh // HV).to(tl.int64)
    i_hv = i_nh % HV
    i_hk = i_hv // GROUP
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < DK
    slot = tl.load(idx_ptr + i_n).to(tl.int64)
    valid = slot >= 0
    n_acc = tl.where(valid, tl.minimum(tl.load(acc_ptr + i_n), R), 0)
    m_vs = o_v < tl.where(valid, DV, 0)
    m_vc = o_v < tl.where(n_acc > 0, DV, 0)
    p_h = state_ptr + slot * s_ss + i_hv * s_sh + o_k[:, None] * s_sk + o_v[None, :] * s_sv  # [BK, BV]
    h = tl.load(p_h, mask=m_k[:, None] & m_vs[None, :], other=0.0).to(tl.float32)
    p_pend = pend_ptr + slot * s_ps
    for j in range(n_acc):  # commit: h exp(g) + k u^T
        c_k = tl.load(p_pend + j * s_pr + (i_hk * DK + o_k) * s_pp, mask=m_k, other=0.0)
        c_k = c_k / tl.sqrt(tl.sum(c_k * c_k) + eps)
        c_u = tl.load(p_pend + j * s_pr + (HK * DK + i_hv * DV + o_v) * s_pp, mask=m_vs, other=0.0)
        c_g = tl.load(p_pend + j * s_pr + (HK * DK + HV * DV + i_hv) * s_pp)
        h = h * tl.exp(c_g) + c_k[:, None] * c_u[None, :]
    h = h.to(state_ptr.dtype.element_ty)
    tl.store(p_h, h, mask=m_k[:, None] & m_vc[None, :])
    h = h.to(tl.float32)
    for j in tl.static_range(Q):
        t_q = tl.load(q_ptr + i_n * s_qn + j * s_qt + i_hk * s_qh + o_k * s_qd, mask=m_k, other=0.0)
        t_k = tl.load(k_ptr + i_n * s_kn + j * s_kt + i_hk * s_kh + o_k * s_kd, mask=m_k, other=0.0)
        t_v = tl.load(v_ptr + i_n * s_vn + j * s_vt + i_hv * s_vh + o_v * s_vd, mask=o_v < DV, other=0.0)
        t_g = tl.load(g_ptr + i_n * s_gn + j * s_gt + i_hv * s_gh).to(tl.float32)
        t_b = tl.load(beta_ptr + i_n * s_bn + j * s_bt + i_hv * s_bh).to(tl.float32)
        t_q = t_q.to(tl.float32)
        t_k = t_k.to(tl.float32)
        t_q = t_q / tl.sqrt(tl.sum(t_q * t_q) + eps)
        t_k = t_k / tl.sqrt(tl.sum(t_k * t_k) + eps)
        h = h * tl.exp(t_g)
        t_u = t_b * (t_v.to(tl.float32) - tl.sum(h * t_k[:, None], 0))
        h = h + t_k[:, None] * t_u[None, :]
        t_o = tl.sum(h * t_q[:, None], 0) * scale
        tl.store(o_ptr + i_n * s_on + j * s_ot + i_hv * s_oh + o_v * s_od, t_o.to(o_ptr.dtype.element_ty),
                 mask=o_v < DV)  # fmt: skip
        tl.store(p_pend + j * s_pr + (HK * DK + i_hv * DV + o_v) * s_pp, t_u, mask=m_vs)


def verify_kmajor(q, k, v, g, beta, ssm_state, pending, state_indices, num_accepted, scale, bv=8, nw=1):
    from atom_kernels.ops.gated_delta_rule.triton_verify import stash_shared
    from atom_kernels.ops.l2norm.checks import DEFAULT_EPS

    N, Q, HK, DK = q.shape
    HV, DV = v.shape[2], v.shape[3]
    o = torch.empty((N, Q, HV, DV), dtype=q.dtype, device=q.device)
    _verify_kmajor_kernel[(triton.cdiv(DV, bv), N * HV)](
        q, k, v, g, beta, o, ssm_state, pending, state_indices, num_accepted, float(scale), DEFAULT_EPS,
        *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(), *o.stride(),
        *ssm_state.stride(), *pending.stride(),
        Q=Q, R=pending.shape[1], HK=HK, HV=HV, GROUP=HV // HK, DK=DK, DV=DV,
        BK=triton.next_power_of_2(DK), BV=bv, num_warps=nw,
    )  # fmt: skip
    stash_shared(k, g, pending, state_indices)
    return o


def time_case(args_, pool, pend, idx, na, scale, configs, case, ceil) -> list[dict]:
    """CUDA-graph replay times of our decode (Q=1), our verify and the K-major candidates on one case."""
    cands = {
        f"verify kmajor BV={bv} w={nw}": lambda bv=bv, nw=nw: verify_kmajor(
            *args_, pool, pend, idx, na, scale, bv, nw
        )
        for bv, nw in configs
    }
    return time_candidates(args_, pool, pend, idx, na, scale, cands, case, ceil)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, small shapes, no timing")
    args = ap.parse_args()
    dev = torch.device("cpu") if args.smoke else common.require_cuda()
    out = common.out_dir(args.out)
    ceil = None if args.smoke else common.ceilings(out, dev)
    rows, fails = [], 0
    batches = (3,) if args.smoke else (64, 256)
    configs = ((8, 1),) if args.smoke else ((8, 1), (16, 1), (16, 2), (32, 4))
    for sd in (torch.float32, torch.bfloat16):
        for B in batches:
            for Q in (1, 4):
                case = verify_case(B, Q, sd, dev, args.smoke)
                args_, pool, pend, idx, na, scale = (
                    case[n] for n in ("args", "pool", "pend", "idx", "na", "scale")
                )
                for bv, nw in configs:
                    pt, et = pool.clone(), pend.clone()
                    o_t = verify_kmajor(*args_, pt, et, idx, na, scale, bv, nw)
                    fails += not check(case, f"kmajor BV={bv} w={nw}", o_t, pt, et)
                if args.smoke:
                    continue
                rows += time_case(args_, pool, pend, idx, na, scale, configs, case["name"], ceil)
    if not args.smoke:
        common.write_json(
            out / "verify_kmajor.json", {"env": common.environment(), "ceilings": ceil, "rows": rows}
        )
    print(f"checks failed: {fails}")
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
