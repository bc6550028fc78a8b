"""Experiment (H200): max errors of the FP8 MoE pair and aligned paths against the tests' float64 per-token
loop, bf16 and float32, I = 512 beside the test shapes (for the tolerance table)."""
import sys

import torch

sys.path.insert(0, "packages/atom-kernels/tests")
from test_kernels_moe_fp8 import make_experts, per_token_loop  # noqa: E402
from atom_kernels.testing import randn  # noqa: E402
from atom_kernels.ops.moe import triton_fp8  # noqa: E402

dev = torch.device("cuda")
for dtype in (torch.float32, torch.bfloat16):
    for (t, h, i) in [(3, 384, 512)]:
        worst = {True: (0.0, 0.0), False: (0.0, 0.0)}
        for seed in range(2):
            q13, s13, q2, s2 = make_experts(8, h, i, (128, 128), dev, seed=seed)
            x = randn(t, h, seed=10 + seed, dtype=dtype, device=dev)
            lg = randn(t, 8, seed=20 + seed, dtype=torch.float32, device=dev)
            w, ids = torch.softmax(lg, -1).topk(3, -1)
            exp = per_token_loop(x, w, ids, q13, s13, q2, s2, (128, 128))
            for pairs in (True, False):
                out = triton_fp8.moe_experts_fp8(x, w, ids, q13, s13, q2, s2, config={"PAIRS": pairs})
                err = (out.double().cpu() - exp).abs().max().item()
                worst[pairs] = max(worst[pairs], (err, exp.abs().max().item()))
        print(f"{dtype} T={t} H={h} I={i}: pair max abs {worst[True][0]:.2e} (max|e| {worst[True][1]:.2f}), "
              f"aligned {worst[False][0]:.2e}", flush=True)
for dtype in (torch.float32, torch.bfloat16):
    q13, s13, q2, s2 = make_experts(8, 384, 512, (128, 128), dev, seed=1)
    x = randn(3, 384, seed=2, dtype=dtype, device=dev)
    w, ids = torch.softmax(randn(3, 8, seed=3, dtype=torch.float32, device=dev), -1).topk(3, -1)
    a = triton_fp8.moe_experts_fp8(x, w, ids, q13, s13, q2, s2, config={"PAIRS": True})
    b = triton_fp8.moe_experts_fp8(x, w, ids, q13, s13, q2, s2, config={"PAIRS": False})
    print(dtype, "pair == aligned bitwise:", torch.equal(a, b), (a.float() - b.float()).abs().max().item())
