"""Profile the GDN decode and verify kernels at the 80B shape: ablation timings, and single launches for Nsight
Compute.

``--time``: CUDA-graph replay times, side by side in one run, of our decode (``_recurrent_kernel``, Q=1) and
our verify (``_verify_kernel`` + ``_stash_kernel``) with every pending token committed and with none
(``num_accepted`` = 0: the commit loop does nothing and the state is not stored), for Q = 1, 2, 4, float32
and bf16 pools, B=64. The differences place the time inside the verify step without counters.

``--launch-once``: each case once, in the order printed (for ``ncu --kernel-name``; launch ids map to the
printed list). Typical device call::

    ncu --clock-control none --set full --import-source yes -o $OUT/verify \\
        --kernel-name regex:'^(_verify_kernel|_recurrent_kernel)$' \\
        python3 benchmarks/gpu/profile_verify.py --launch-once
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from exp_verify_common import verify_case  # noqa: E402


def cases(dev: torch.device, B: int) -> list[tuple[str, callable]]:
    """(name, launch) of every profiled case; each launch runs on its own copies of the pool/pending."""
    from atom_kernels.ops.gated_delta_rule import triton as gdr_triton
    from atom_kernels.ops.gated_delta_rule import triton_verify

    out = []
    for sd in (torch.float32, torch.bfloat16):
        sname = str(sd)[6:]
        c = verify_case(B, 4, sd, dev, smoke=False)
        q, k, v, g, beta = c["args"]
        pool, idx, scale = c["pool"].clone(), c["idx"], c["scale"]

        def decode(q=q, k=k, v=v, g=g, beta=beta, pool=pool, idx=idx, scale=scale):
            gdr_triton.gated_delta_rule_recurrent(
                q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], pool, idx[:, None], None, scale
            )

        out.append((f"decode B={B} state={sname}", decode))
        for Q in (1, 2, 4):
            for committed in (True, False):
                pend = c["pend"][:, :Q].clone()
                na = torch.full((B,), Q if committed else 0, dtype=torch.int32, device=dev)
                a = [x[:, :Q].contiguous() for x in (q, k, v, g, beta)]

                def verify(a=a, pool=pool, pend=pend, idx=idx, na=na, scale=scale):
                    triton_verify.gated_delta_rule_verify(*a, pool, pend, idx, na, scale)

                tag = "commit all" if committed else "commit none"
                out.append((f"verify B={B} Q={Q} state={sname} {tag}", verify))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--batch", type=int, default=64)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--time", action="store_true")
    mode.add_argument("--launch-once", action="store_true")
    args = ap.parse_args()
    dev = common.require_cuda()
    todo = cases(dev, args.batch)
    if args.launch_once:
        for i, (name, fn) in enumerate(todo):
            print(f"launch {i}: {name}", flush=True)
            fn()
        torch.cuda.synchronize()
        return
    out = common.out_dir(args.out)
    ceil = common.ceilings(out, dev)
    rows = []
    for name, fn in todo:
        us = common.time_ms(fn, graph=True) * 1e3
        rows.append({"case": name, "us": us})
        print(f"time {name:44s} {us:8.1f} us", flush=True)
    common.write_json(
        out / "profile_verify.json", {"env": common.environment(), "ceilings": ceil, "rows": rows}
    )


if __name__ == "__main__":
    main()
