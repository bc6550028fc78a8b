"""ncu target: the 80B decode-sized FP8 kernels at M = 2 (qkvz one-launch linear, cuBLAS per-tensor at
the same shape, the MoE pair GEMMs at T = 2). Run under `ncu --kernel-name regex:... --launch-skip N`."""

import sys

import torch
from atom_kernels.ops.fp8.triton import fp8_linear
from atom_kernels.ops.moe.triton_fp8 import moe_experts_fp8

dev = torch.device("cuda")
torch.manual_seed(0)
what = sys.argv[1]
m = 2
if what in ("qkvz", "outp"):
    n, k = (12288, 2048) if what == "qkvz" else (2048, 4096)
    copies = 8
    ws = [torch.randn(n, k, device=dev).to(torch.float8_e4m3fn) for _ in range(copies)]
    ss = [torch.rand(n // 128, k // 128, device=dev) + 0.5 for _ in range(copies)]
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    tickets = torch.zeros(n // 16, dtype=torch.int32, device=dev)
    for i in range(12):
        fp8_linear(x, ws[i % copies], ss[i % copies], tickets=tickets)
    one = torch.ones((), device=dev)
    for i in range(12):
        torch._scaled_mm(
            x.to(torch.float8_e4m3fn), ws[i % copies].t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16
        )
else:
    e, h, inter, topk = 513, 2048, 512, 11
    w13 = torch.randn(e, 2 * inter, h, device=dev).to(torch.float8_e4m3fn)
    s13 = torch.rand(e, 2 * inter // 128, h // 128, device=dev) + 0.5
    w2 = torch.randn(e, h, inter, device=dev).to(torch.float8_e4m3fn)
    s2 = torch.rand(e, h // 128, inter // 128, device=dev) + 0.5
    x = torch.randn(m, h, device=dev, dtype=torch.bfloat16)
    for _ in range(12):
        ids = torch.stack([torch.randperm(512, device=dev)[:topk] for _ in range(m)]).to(torch.int32)
        ids[:, -1] = 512
        wts = torch.rand(m, topk, device=dev)
        moe_experts_fp8(x, wts, ids, w13, s13, w2, s2, (128, 128))
torch.cuda.synchronize()
print("done", what)
