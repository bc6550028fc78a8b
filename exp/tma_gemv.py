"""Experiment (H200): the one-launch FP8 decode linear with its weight tiles loaded through TMA (host
tensor descriptors) vs the pointer loads of the product kernel and cuBLAS per-tensor; weights rotate
over 8 copies in one CUDA graph. Writes $OUT/tma_gemv.json."""
import itertools
import json
import os
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, "benchmarks/gpu")
import common  # noqa: E402
from atom_kernels.ops._fp8_math import FP8_MAX  # noqa: E402
from atom_kernels.ops._pdl import launch_options, pdl_enter  # noqa: E402
from atom_kernels.ops.fp8 import reference as fp8_ref  # noqa: E402
from atom_kernels.ops.fp8 import triton as fp8_triton  # noqa: E402
from atom_kernels.ops.fp8.reference import ACT_SCALE_EPS  # noqa: E402
from atom_kernels.ops.fp8.triton import _quant_e4m3  # noqa: E402

E4M3 = torch.float8_e4m3fn
OUT = os.environ.get("OUT", "/tmp")
dev = torch.device("cuda")
copy_gbps = common.measure_copy_gbps(dev)
rows = []


def log(**kw):
    rows.append(kw)
    print(json.dumps(kw), flush=True)


def graph_us(fns):
    return common.time_ms(lambda: [f() for f in fns], graph=True, rep_ms=40) * 1e3 / len(fns)


@triton.jit
def _tma_kernel(
    x_ptr, w_desc, ws_ptr, y_ptr, part_ptr, count_ptr, M, N, K, stride_xm, stride_wsn, stride_ym,
    GROUPS_PER_SPLIT, SPLIT_K, EPS: tl.constexpr, FMAX: tl.constexpr, BN_Q: tl.constexpr, GROUP: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_enter(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_r = tl.arange(0, ROWS)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_g = tl.arange(0, GROUP)
    r_ok = offs_r < M
    n_ok = offs_n < N
    g0 = pid_k * GROUPS_PER_SPLIT
    g1 = tl.minimum(g0 + GROUPS_PER_SPLIT, tl.cdiv(K, GROUP))
    ws_ptrs = ws_ptr + (offs_n // BN_Q).to(tl.int64) * stride_wsn
    x_ptrs = x_ptr + offs_r[None, :].to(tl.int64) * stride_xm + offs_g[:, None]
    acc_t = tl.zeros([BLOCK_N, ROWS], tl.float32)
    for g in range(g0, g1):
        k0 = g * GROUP
        x = tl.load(x_ptrs + k0, mask=r_ok[None, :], other=0.0).to(tl.float32)
        b = w_desc.load([n0, k0])
        a, a_s = _quant_e4m3(x, 0, EPS, FMAX)
        b_s = tl.load(ws_ptrs + g, mask=n_ok, other=0.0)
        acc_t += tl.dot(b, a) * a_s[None, :] * b_s[:, None]
    acc = tl.trans(acc_t)
    mask = r_ok[:, None] & n_ok[None, :]
    out = offs_r[:, None].to(tl.int64) * N + offs_n[None, :]
    if SPLIT:
        tl.store(part_ptr + pid_k.to(tl.int64) * M * N + out, acc, mask=mask)
        tl.debug_barrier()
        ticket = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if ticket == SPLIT_K - 1:
            acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
            for s in range(0, SPLIT_K):
                acc += tl.load(part_ptr + s.to(tl.int64) * M * N + out, mask=mask, other=0.0)
            tl.store(y_ptr + offs_r[:, None].to(tl.int64) * stride_ym + offs_n[None, :],
                     acc.to(y_ptr.dtype.element_ty), mask=mask)  # fmt: skip
            tl.atomic_xchg(count_ptr + pid_n, 0)
    else:
        tl.store(y_ptr + offs_r[:, None].to(tl.int64) * stride_ym + offs_n[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=mask)  # fmt: skip


def tma_linear(x, desc, n, ws, block_n, split, warps, stages, count):
    m, k = x.shape
    groups = k // 128
    per = triton.cdiv(groups, split)
    split = triton.cdiv(groups, per)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else y
    _tma_kernel[(triton.cdiv(n, block_n), split)](
        x, desc, ws, y, part, count, m, n, k, x.stride(0), ws.stride(0), y.stride(0), per, split,
        EPS=ACT_SCALE_EPS, FMAX=FP8_MAX, BN_Q=128, GROUP=128, ROWS=2, BLOCK_N=block_n, SPLIT=split > 1,
        num_warps=warps, num_stages=stages, **launch_options(x.device),
    )  # fmt: skip
    return y


def block_quantize(w):
    n, k = w.shape
    t = w.float().reshape(n // 128, 128, k // 128, 128)
    s = t.abs().amax((1, 3)).clamp(min=1e-12) / 448.0
    return (t / s[:, None, :, None]).reshape(n, k).to(E4M3), s


shapes = {"qkvz": (12288, 2048), "q_proj": (8192, 2048), "out_proj": (2048, 4096), "kv": (512, 2048)}
for name, (n, k) in shapes.items():
    ws_list = [block_quantize(torch.randn(n, k, device=dev) * k**-0.5) for _ in range(8)]
    count = torch.zeros(4096, dtype=torch.int32, device=dev)
    tickets = torch.zeros(4096, dtype=torch.int32, device=dev)
    wt = [q.t() for q, _ in ws_list]
    one = torch.ones((), device=dev)
    for m in (1, 2):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        ref = fp8_ref.fp8_linear(x.float(), *ws_list[0]).float()
        base = graph_us([lambda q=q, s=s: fp8_triton.fp8_linear(x, q, s, tickets=tickets) for q, s in ws_list])
        xq = x.to(E4M3)
        cub = graph_us([lambda t=t: torch._scaled_mm(xq, t, one, one, out_dtype=torch.bfloat16) for t in wt])
        for impl, us in (("one-launch default", base), ("cublas per-tensor", cub)):
            log(shape=name, m=m, impl=impl, us=us, frac=n * k / us / copy_gbps / 1e3)
        best = None
        for bn, split, wp, st in itertools.product((16, 32, 64), (1, 2, 4), (2, 4), (3, 4)):
            try:
                descs = [TensorDescriptor.from_tensor(q, [bn, 128]) for q, _ in ws_list]
                y = tma_linear(x, descs[0], n, ws_list[0][1], bn, split, wp, st, count)
                err = (y.float() - ref).abs().max().item()
                us = graph_us([lambda d=d, s=s: tma_linear(x, d, n, s, bn, split, wp, st, count)
                               for d, (_, s) in zip(descs, ws_list)])
            except Exception as exc:  # noqa: BLE001
                log(shape=name, m=m, impl=f"tma bn{bn} sk{split} w{wp} s{st}", error=str(exc)[:300])
                continue
            log(shape=name, m=m, impl=f"tma bn{bn} sk{split} w{wp} s{st}", us=us, err=err)
            if best is None or us < best[0]:
                best = (us, f"tma bn{bn} sk{split} w{wp} s{st}", err)
        if best:
            log(shape=name, m=m, impl="tma best " + best[1], us=best[0], err=best[2],
                frac=n * k / best[0] / copy_gbps / 1e3)
json.dump({"copy_gbps": copy_gbps, "rows": rows}, open(f"{OUT}/tma_gemv.json", "w"), indent=1)
