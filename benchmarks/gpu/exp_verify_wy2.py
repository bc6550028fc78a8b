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

Run 7 (results/verify_wy2_s4_run7.*) timed this file's own kernel; the op has since taken the WY form as
``form="wy"`` (its default up to 2 tokens), which this script now drives. The op's WY path compiles to the
same SASS as that kernel up to 2 tokens and at float32 Q=4 (Triton 3.6, sm_90), not at bf16 Q >= 4.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from exp_verify_common import check, time_candidates, verify_case  # noqa: E402

CANDIDATES = {
    "wy2 BV=8": dict(block_v=8, max_registers=0),
    "wy2 BV=16": dict(block_v=16, max_registers=0),
    "wy2 BV=32": dict(block_v=32, max_registers=0),
    "wy2 BV=16 maxnreg=128": dict(block_v=16, max_registers=128),
}


def run_candidate(name, q, k, v, g, beta, pool, pend, idx, na, scale):
    """One verify step with candidate ``name``: the op in WY form with that candidate's launch."""
    from atom_kernels.ops.gated_delta_rule.triton_verify import gated_delta_rule_verify

    o = gated_delta_rule_verify(q, k, v, g, beta, pool, pend, idx, na, scale, form="wy", **CANDIDATES[name])
    return o, None


def check_case(case, name, na) -> bool:
    """Run candidate ``name`` on copies of the case's pool/pending with ``num_accepted = na`` and check it
    against the float32 reference on the same inputs."""
    from atom_kernels.ops.gated_delta_rule import reference

    args_, pool, pend, idx, scale = (case[n] for n in ("args", "pool", "pend", "idx", "scale"))
    pt, et = pool.clone(), pend.clone()
    o_t, _ = run_candidate(name, *args_, pt, et, idx, na, scale)
    pr, er = pool.float().clone(), pend.clone()
    o_r = reference.gated_delta_rule_verify(*(x.float() for x in args_), pr, er, idx, na, scale)
    return check(dict(case, ref=(o_r, pr, er)), name, o_t, pt, et)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, small shapes, no timing")
    ap.add_argument("--batches", default="64", help="comma-separated batch sizes (GPU)")
    args = ap.parse_args()
    dev = torch.device("cpu") if args.smoke else common.require_cuda()
    out = common.out_dir(args.out)
    ceil = None if args.smoke else common.ceilings(out, dev)
    rows, fails = [], 0
    for sd in (torch.float32, torch.bfloat16):
        for B in (3,) if args.smoke else tuple(int(b) for b in args.batches.split(",")):
            for Q in (1, 2, 4) if args.smoke else (2, 4):
                case = verify_case(B, Q, sd, dev, args.smoke)
                na = case["na"]
                na_part = na.clone()  # a partly accepted batch: row 0 none, row 1 one token
                na_part[0], na_part[1] = 0, min(1, Q)
                for name in CANDIDATES:
                    for acc in (na, na_part):
                        fails += not check_case(case, name, acc)
                if args.smoke:
                    continue
                args_, pool, pend, idx, scale = (case[n] for n in ("args", "pool", "pend", "idx", "scale"))
                cands = {n: partial(run_candidate, n, *args_, pool, pend, idx, na, scale) for n in CANDIDATES}
                rows += time_candidates(args_, pool, pend, idx, na, scale, cands, case["name"], ceil)
    if not args.smoke:
        payload = {"env": common.environment(), "ceilings": ceil, "rows": rows}
        common.write_json(out / "verify_wy2.json", payload)
    print(f"checks failed: {fails}")
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
