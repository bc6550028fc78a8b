"""The verify op's default launch (WY form up to 2 tokens, capped at 128 registers; one token after another
beyond) against ``form="seq"``, checked against the float32 reference first; B=1/64/256, Q=1/2/4, bf16 and
float32 pools. Session 4 run 9: results/verify_s4_run9.log. Run on the GPU machine:
``PYTHONPATH=$PWD/packages/atom-core/src:$PWD/packages/atom-kernels/src python3 benchmarks/gpu/exp_verify_forms.py``.
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
    """Check the default on one case, then time decode, the default and form='seq'."""
    c = verify_case(B, Q, sd, dev, False)
    q, k, v, g, beta = c["args"]
    pool, pend, idx, na, scale = c["pool"], c["pend"], c["idx"], c["na"], c["scale"]
    a = (q, k, v, g, beta, pool, pend, idx, na, scale)
    pt, et = pool.clone(), pend.clone()
    o_t = tv.gated_delta_rule_verify(q, k, v, g, beta, pt, et, idx, na, scale)
    check(c, "default", o_t, pt, et)
    fns = {
        "decode": lambda: gdr.gated_delta_rule_recurrent(
            q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], pool, idx[:, None], None, scale
        ),
        "default": lambda: tv.gated_delta_rule_verify(*a),
        "seq": lambda: tv.gated_delta_rule_verify(*a, form="seq", max_registers=0),
    }
    for name, fn in fns.items():
        us = common.time_ms(fn, graph=True) * 1e3
        print(f"time B={B} Q={Q} {str(sd)[6:]:8s} {name:8s} {us:7.1f} us", flush=True)


def main() -> None:
    dev = common.require_cuda()
    for sd in (torch.bfloat16, torch.float32):
        for B in (1, 64, 256):
            for Q in (1, 2, 4):
                run_case(sd, B, Q, dev)


if __name__ == "__main__":
    main()
