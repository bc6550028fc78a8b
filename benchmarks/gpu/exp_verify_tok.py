"""Experiment: a verify kernel with fewer instructions (issue 6, verify k=3 <= 1.3x decode). Session 4.

Nsight Compute on the H200 (session 4, ``profile_verify.py``; results/verify_ncu_s4.*) showed that our
``_verify_kernel`` at B=64, Q=4 (float32 pool) is bound by instruction issue, not memory: 87 M warp
instructions (2657 per warp, 3.9x a decode's 682), issue slots 72% busy, the top warp states "selected" and
"not selected" (53%), DRAM at 44%. Per warp: 654 FFMA, 510 FMUL, 358 FADD, 352 SHFL, 280 FSEL/SEL. So
this kernel cuts instructions, keeping the semantics (pending ``[k | u | g]``, deferred commit):

- **L2 norms as scalars**: ``x / sqrt(...)`` per element compiles to an IEEE division (about 4
  instructions per element, for q and k of every token and every pending k). The norm only scales the
  reductions and the update coefficient, so it is applied to those per-row scalars instead
  (``h (k r) = (h k) r``, ``u (k r)^T = (u r) k^T``), as the reference's ``x * rsqrt(...)`` allows.
- **Dk-chunked tile** ``[BV, NC, KC]`` (Triton 3.6's axis order): 8 lanes along KC and 4 along the value
  rows, the chunk axis in registers; a row reduction is in-thread over NC, then 3 shuffle levels.
- **No row extraction**: every token's q/k/v/g/beta and every pending row is its own load (the old kernel
  loaded ``[Q, Dk]`` tiles and extracted rows with where + sum, which costs selects and shuffles), and the
  commit is ``R`` static steps; a row beyond ``num_accepted`` loads g = 0 and u = 0, i.e. ``h 1 + 0 k^T``.
- **Stores last** (``STORE_EARLY=False``): the committed tile is kept (rounded to the pool dtype) and stored
  after the token loop, so no store precedes a load and the compiler may issue all loads early.
- ``MERGE_COMMIT``: the R commits as one pass, ``h E + sum_j (u_j W_j) k_j^T`` with ``E`` the product of
  the accepted decays and ``W_j`` those after token j (1 multiply + R FMAs per element instead of 2R).

Checked against the float32 reference (outputs, committed state, pending buffer), timed next to our decode
and our verify op; registers and spills as compiled on the machine. Writes ``<out>/verify_tok.json``.

H200 (results/verify_tok_s4_run2.*, run3.*): every candidate correct. The winner, "merge early" (merged
commit, committed tile stored at once) with BV=16, became the op's kernel (B=64 float32 k=1 77 us against
93 for session 3's kernel, k=3 118 against 123; decode 71); the first version of this file (commit
f20cccf, 2-D grid) is the statement order the op keeps. Storing the tile last needs 168-255 registers and
lost; the persistent ``PREFETCH`` grid lost 1.5-2x (243-255 registers, 8 warps per SM); the 1-D grid of
this version moved BV=16's registers from 168 to 201 (slower) for the same code.
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
    """Row reduction of a ``[BV, NC, KC]`` tile: in-thread over the chunks, then across the KC lanes."""
    return tl.sum(tl.sum(x, 1), 1)


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
def _tile(
    t,
    h_raw,
    d2,
    m_d2,
    m_h,
    NV: tl.constexpr,
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
    num_seqs,
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
    STORE_EARLY: tl.constexpr,
    MERGE_COMMIT: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """One tile: commit, verify the Q tokens, store (``h_raw``: its state as loaded)."""
    i_v = t % NV
    i_nh = t // NV
    i_n = (i_nh // HV).to(tl.int64)
    i_hv = i_nh % HV
    i_hk = i_hv // GROUP
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < DV
    slot = tl.load(idx_ptr + i_n * s_in).to(tl.int64)
    valid = slot >= 0
    n_acc = tl.where(valid, tl.minimum(tl.load(acc_ptr + i_n), R), 0)
    m_vs = o_v < tl.where(valid, DV, 0)  # bounds, not `mask & scalar` (Triton 3.9 interpreter)
    m_vc = o_v < tl.where(n_acc > 0, DV, 0)
    p_h = state_ptr + slot * s_ss + i_hv * s_sh + o_v[:, None, None] * s_sv + d2[None, :, :] * s_sk
    h = h_raw.to(tl.float32)

    # ---- 1. commit the accepted pending tokens: h exp(g_j) + (u_j r_j) k_j^T, r_j = 1 / |k_j|.
    p_pend = pend_ptr + slot * s_ps
    if MERGE_COMMIT:
        w = tl.full([BV], 1.0, tl.float32)  # product of the decays after token j (walked backwards)
        acc = tl.zeros([BV, NC, KC], dtype=tl.float32)
        for jj in tl.static_range(R):
            j = R - 1 - jj
            m_j = o_v < tl.where(j < n_acc, DV, 0)
            c_k = tl.load(
                p_pend + j * s_pr + (i_hk * DK + d2) * s_pp,
                mask=d2 < tl.where(j < n_acc, DK, 0),
                other=0.0,
            )
            c_u = tl.load(p_pend + j * s_pr + (HK * DK + i_hv * DV + o_v) * s_pp, mask=m_j, other=0.0)
            c_g = tl.load(p_pend + j * s_pr + (HK * DK + HV * DV + i_hv) * s_pp, mask=j < n_acc, other=0.0)
            if L2NORM:
                c_u = c_u / tl.sqrt(tl.sum(tl.sum(c_k * c_k, 1), 0) + eps)
            acc = acc + (c_u * w)[:, None, None] * c_k[None, :, :]
            w = w * tl.exp(c_g)
        h = h * w[:, None, None] + acc
    else:
        for j in tl.static_range(R):
            m_j = o_v < tl.where(j < n_acc, DV, 0)
            c_k = tl.load(
                p_pend + j * s_pr + (i_hk * DK + d2) * s_pp,
                mask=d2 < tl.where(j < n_acc, DK, 0),
                other=0.0,
            )
            c_u = tl.load(p_pend + j * s_pr + (HK * DK + i_hv * DV + o_v) * s_pp, mask=m_j, other=0.0)
            c_g = tl.load(p_pend + j * s_pr + (HK * DK + HV * DV + i_hv) * s_pp, mask=j < n_acc, other=0.0)
            if L2NORM:
                c_u = c_u / tl.sqrt(tl.sum(tl.sum(c_k * c_k, 1), 0) + eps)
            h = h * tl.exp(c_g) + c_u[:, None, None] * c_k[None, :, :]
    h_c = h.to(state_ptr.dtype.element_ty)
    if STORE_EARLY:
        tl.store(p_h, h_c, mask=m_vc[:, None, None] & m_h)
    h = h_c.to(tl.float32)

    # ---- 2. the Q tokens (decay, h k, rank-1 update, h q); outputs and u rows collected in [BV, QP].
    o_q = tl.arange(0, QP)
    b_o = tl.zeros([BV, QP], dtype=tl.float32)
    b_u = tl.zeros([BV, QP], dtype=tl.float32)
    for j in tl.static_range(Q):
        t_q = tl.load(q_ptr + i_n * s_qn + j * s_qt + i_hk * s_qh + d2 * s_qd, mask=m_d2, other=0.0)
        t_k = tl.load(k_ptr + i_n * s_kn + j * s_kt + i_hk * s_kh + d2 * s_kd, mask=m_d2, other=0.0)
        t_v = tl.load(v_ptr + i_n * s_vn + j * s_vt + i_hv * s_vh + o_v * s_vd, mask=m_v, other=0.0)
        t_g = tl.load(g_ptr + i_n * s_gn + j * s_gt + i_hv * s_gh).to(tl.float32)
        t_b = tl.load(beta_ptr + i_n * s_bn + j * s_bt + i_hv * s_bh).to(tl.float32)
        t_q = t_q.to(tl.float32)
        t_k = t_k.to(tl.float32)
        r_q = scale
        r_k = 1.0
        if L2NORM:
            r_q = scale / tl.sqrt(tl.sum(tl.sum(t_q * t_q, 1), 0) + eps)
            r_k = 1.0 / tl.sqrt(tl.sum(tl.sum(t_k * t_k, 1), 0) + eps)
        h = h * tl.exp(t_g)
        t_u = t_b * (t_v.to(tl.float32) - _rsum(h * t_k[None, :, :]) * r_k)
        h = h + (t_u * r_k)[:, None, None] * t_k[None, :, :]
        t_o = _rsum(h * t_q[None, :, :]) * r_q
        b_o = tl.where(o_q[None, :] == j, t_o[:, None], b_o)
        b_u = tl.where(o_q[None, :] == j, t_u[:, None], b_u)
    if not STORE_EARLY:
        tl.store(p_h, h_c, mask=m_vc[:, None, None] & m_h)
    m_q = o_q < Q
    tl.store(
        o_ptr + i_n * s_on + o_q[None, :] * s_ot + i_hv * s_oh + o_v[:, None] * s_od,
        b_o.to(o_ptr.dtype.element_ty),
        mask=m_v[:, None] & m_q[None, :],
    )
    # ---- 3. stash this program's own u rows (read only by it, above); k and g: stash_shared.
    p_su = p_pend + o_q[None, :] * s_pr + (HK * DK + i_hv * DV + o_v[:, None]) * s_pp
    tl.store(p_su, b_u, mask=m_vs[:, None] & m_q[None, :])


@triton.jit
def _verify_tok_kernel(
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
    num_seqs,
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
    STORE_EARLY: tl.constexpr,
    MERGE_COMMIT: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    # Tiles (sequence, value head, block of BV value rows), PREFETCH: a grid of fewer programs than tiles,
    # each loads its next tile's state before computing the current one (loads overlap the arithmetic).
    NV: tl.constexpr = (DV + BV - 1) // BV
    n_tiles = num_seqs * HV * NV
    d2 = tl.arange(0, NC)[:, None] * KC + tl.arange(0, KC)[None, :]  # [NC, KC]: Dk positions
    m_d2 = d2 < DK
    m_h = m_d2[None, :, :]
    t0 = tl.program_id(0)
    if PREFETCH:
        h_nx = _load_tile_state(
            state_ptr, idx_ptr, s_in, s_ss, s_sh, s_sv, s_sk, t0, n_tiles, d2, HV, DV, DK, BV
        )
        for t in range(t0, n_tiles, tl.num_programs(0)):
            h_raw = h_nx
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
            _tile(
                t,
                h_raw,
                d2,
                m_d2,
                m_h,
                NV,
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
                num_seqs,
                Q,
                R,
                QP,
                HK,
                HV,
                GROUP,
                DK,
                DV,
                NC,
                KC,
                BV,
                L2NORM,
                STORE_EARLY,
                MERGE_COMMIT,
                PREFETCH,
            )
    else:
        t = t0
        h_raw = _load_tile_state(
            state_ptr, idx_ptr, s_in, s_ss, s_sh, s_sv, s_sk, t, n_tiles, d2, HV, DV, DK, BV
        )
        _tile(
            t,
            h_raw,
            d2,
            m_d2,
            m_h,
            NV,
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
            num_seqs,
            Q,
            R,
            QP,
            HK,
            HV,
            GROUP,
            DK,
            DV,
            NC,
            KC,
            BV,
            L2NORM,
            STORE_EARLY,
            MERGE_COMMIT,
            PREFETCH,
        )


def verify_tok(
    q, k, v, g, beta, o, ssm_state, pending, state_indices, num_accepted, scale, use_qk_l2norm, eps,
    block_v, num_warps, block_k=32, store_early=False, merge_commit=False, programs_per_sm=0,
    max_registers=None,
):  # fmt: skip
    """``_verify_tok_kernel`` into ``o``; returns the compiled kernel. ``programs_per_sm`` > 0: a grid of
    that many programs per multiprocessor (one multiprocessor on CPU), each prefetching its next tile's state."""
    N, Q, HK, DK = q.shape
    HV, DV = v.shape[2], v.shape[3]
    BK = triton.next_power_of_2(DK)
    kc = min(BK, block_k)
    n_tiles = N * HV * triton.cdiv(DV, block_v)
    grid = n_tiles
    if programs_per_sm:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 1
        grid = min(n_tiles, sms * programs_per_sm)
    return _verify_tok_kernel[(grid,)](
        q, k, v, g, beta, o, ssm_state, pending, state_indices, num_accepted, float(scale), eps,
        *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(), *o.stride(),
        *ssm_state.stride(), *pending.stride(), state_indices.stride(0), N,
        Q=Q, R=pending.shape[1], QP=triton.next_power_of_2(Q), HK=HK, HV=HV, GROUP=HV // HK, DK=DK,
        DV=DV, NC=BK // kc, KC=kc, BV=block_v, L2NORM=use_qk_l2norm, STORE_EARLY=store_early,
        MERGE_COMMIT=merge_commit, PREFETCH=programs_per_sm > 0, num_warps=num_warps,
        **({"maxnreg": max_registers} if max_registers else {}),
    )  # fmt: skip


_ME = dict(num_warps=1, merge_commit=True, store_early=True)
CANDIDATES = {
    "tok BV=8": dict(block_v=8, **_ME),
    "tok BV=16": dict(block_v=16, **_ME),
    "tok BV=16 maxnreg=168": dict(block_v=16, max_registers=168, **_ME),
    "tok BV=32": dict(block_v=32, **_ME),
    "pf BV=8 x6": dict(block_v=8, programs_per_sm=6, **_ME),
    "pf BV=8 x8": dict(block_v=8, programs_per_sm=8, **_ME),
    "pf BV=16 x4": dict(block_v=16, programs_per_sm=4, **_ME),
    "pf BV=16 x8": dict(block_v=16, programs_per_sm=8, **_ME),
}


def run_candidate(name, q, k, v, g, beta, pool, pend, idx, na, scale):
    """One verify step with candidate ``name`` (its kernel, then our shared k/g stash)."""
    from atom_kernels.ops.gated_delta_rule.triton_verify import stash_shared
    from atom_kernels.ops.l2norm.checks import DEFAULT_EPS

    N, Q, _, _ = q.shape
    o = torch.empty((N, Q, v.shape[2], v.shape[3]), dtype=q.dtype, device=q.device)
    kern = verify_tok(q, k, v, g, beta, o, pool, pend, idx, na, scale, True, DEFAULT_EPS, **CANDIDATES[name])
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
