"""Session 4's side-by-side check of the verify kernels (results/verify_s4_run5.log, verify_s4_run6.log).

Times, in one process (CUDA-graph replay, B=64/256, Q=2/4, float32/bf16 pools): our decode, session 3's
verify kernel ("old"), the current op at its default and other block sizes ("new ..."), and the first
version of the session-4 experiment kernel ("r2"). Runs 5 and 6 found the op 15-25% slower than "r2" at the
same block size although their SASS instruction mix matched; after the op took r2's statement order the two
compile to the same SASS and time the same (run 6). The old kernels come from git, into the ignored .exp/:

    mkdir -p .exp && echo /.exp/ >> .git/info/exclude
    git show 1968cc1:packages/atom-kernels/src/atom_kernels/ops/gated_delta_rule/triton_verify.py > .exp/old_verify.py
    git show f20cccf:benchmarks/gpu/exp_verify_tok.py > .exp/tok_r2.py
    # device call with carry [".exp"]:
    PYTHONPATH=$PWD/packages/atom-core/src:$PWD/packages/atom-kernels/src python3 benchmarks/gpu/exp_verify_cmp.py
"""

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks/gpu"))
sys.path.insert(0, str(ROOT / ".exp"))
import common  # noqa: E402
import old_verify  # noqa: E402
import tok_r2  # noqa: E402
from atom_kernels.ops.gated_delta_rule import triton as gdr  # noqa: E402
from atom_kernels.ops.gated_delta_rule import triton_verify as tv  # noqa: E402
from atom_kernels.ops.l2norm.checks import DEFAULT_EPS  # noqa: E402
from exp_verify_common import verify_case  # noqa: E402


def run_case(sd: torch.dtype, B: int, Q: int, dev: torch.device) -> None:
    """Time every variant on one case."""
    c = verify_case(B, Q, sd, dev, False)
    q, k, v, g, beta = c["args"]
    pool, pend, idx, na, scale = c["pool"], c["pend"], c["idx"], c["na"], c["scale"]
    o = torch.empty(B, Q, v.shape[2], v.shape[3], dtype=q.dtype, device=dev)
    args = (q, k, v, g, beta, pool, pend, idx, na, scale)

    def r2(bv):
        tok_r2.verify_tok(*args[:5], o, *args[5:], True, DEFAULT_EPS, bv, 1, 32, True, True)
        tv.stash_shared(k, g, pend, idx)

    fns = {
        "decode": lambda: gdr.gated_delta_rule_recurrent(
            q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], pool, idx[:, None], None, scale
        ),
        "old": lambda: old_verify.gated_delta_rule_verify(*args),
        "new": lambda: tv.gated_delta_rule_verify(*args),
        "new bv16": lambda: tv.gated_delta_rule_verify(*args, block_v=16),
        "new bv32": lambda: tv.gated_delta_rule_verify(*args, block_v=32),
        "new bv16 r168": lambda: tv.gated_delta_rule_verify(*args, block_v=16, max_registers=168),
        "r2 bv32": lambda: r2(32),
        "r2 bv16": lambda: r2(16),
    }
    for name, fn in fns.items():
        us = common.time_ms(fn, graph=True) * 1e3
        print(f"time B={B} Q={Q} {str(sd)[6:]:8s} {name:14s} {us:7.1f} us", flush=True)


def main() -> None:
    dev = common.require_cuda()
    for sd in (torch.float32, torch.bfloat16):
        for B in (64, 256):
            for Q in (2, 4):
                run_case(sd, B, Q, dev)


if __name__ == "__main__":
    main()
