"""Register caps (CUDA ``maxnreg``) on the verify op and on the WY-form experiment (exp_verify_wy2.py), B=64/256,
Q=2/4, bf16 and float32 pools. Session 4 run 8 (results/verify_s4_run8.log) ran before the op took the WY
form (then exp_verify_wy2.py's kernel, the same SASS at Q=2): "ours" is the op's one-token-after-another form,
"wy2 bv16 r128" what the op now runs by default up to 2 tokens.
Run on the GPU machine: ``PYTHONPATH=$PWD/packages/atom-core/src:$PWD/packages/atom-kernels/src python3
benchmarks/gpu/exp_verify_regcap.py``.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from atom_kernels.ops.gated_delta_rule import triton as gdr  # noqa: E402
from atom_kernels.ops.gated_delta_rule import triton_verify as tv  # noqa: E402
from exp_verify_common import check, verify_case  # noqa: E402


def run_case(sd: torch.dtype, B: int, Q: int, dev: torch.device) -> None:
    """Check the capped op on one case, then time every variant."""
    c = verify_case(B, Q, sd, dev, False)
    q, k, v, g, beta = c["args"]
    pool, pend, idx, na, scale = c["pool"], c["pend"], c["idx"], c["na"], c["scale"]
    a = (q, k, v, g, beta, pool, pend, idx, na, scale)

    fns = {
        "decode": lambda: gdr.gated_delta_rule_recurrent(
            q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], pool, idx[:, None], None, scale
        ),
        "ours": lambda: tv.gated_delta_rule_verify(*a, form="seq", max_registers=0),
        "ours r128": lambda: tv.gated_delta_rule_verify(*a, form="seq", max_registers=128),
        "ours bv8 r128": lambda: tv.gated_delta_rule_verify(*a, form="seq", block_v=8, max_registers=128),
        "ours bv32 r128": lambda: tv.gated_delta_rule_verify(*a, form="seq", block_v=32, max_registers=128),
        "wy2 bv16 r128": lambda: tv.gated_delta_rule_verify(*a, form="wy", block_v=16, max_registers=128),
        "wy2 bv32 r128": lambda: tv.gated_delta_rule_verify(*a, form="wy", block_v=32, max_registers=128),
    }
    # correctness of the capped op on this case
    pt, et = pool.clone(), pend.clone()
    o_t = tv.gated_delta_rule_verify(q, k, v, g, beta, pt, et, idx, na, scale, form="seq", max_registers=128)
    check(c, "ours r128", o_t, pt, et)
    for name, fn in fns.items():
        us = common.time_ms(fn, graph=True) * 1e3
        print(f"time B={B} Q={Q} {str(sd)[6:]:8s} {name:15s} {us:7.1f} us", flush=True)


def main() -> None:
    dev = common.require_cuda()
    for sd in (torch.bfloat16, torch.float32):
        for B in (64, 256):
            for Q in (2, 4):
                run_case(sd, B, Q, dev)


if __name__ == "__main__":
    main()
