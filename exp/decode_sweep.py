"""Experiment (H200): the FP8 MoE pair path and a CUDA-core FP8 GEMV prototype at decode sizes.

Writes $OUT/decode_sweep.json. Weights rotate over copies inside one CUDA graph so L2 does not hold them.
"""
import itertools
import json
import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, "benchmarks/gpu")
import common  # noqa: E402
from atom_kernels.ops._fp8_math import FP8_MAX  # noqa: E402
from atom_kernels.ops._pdl import launch_options, pdl_enter  # noqa: E402
from atom_kernels.ops.fp8 import reference as fp8_ref  # noqa: E402
from atom_kernels.ops.fp8 import triton as fp8_triton  # noqa: E402
from atom_kernels.ops.fp8.reference import ACT_SCALE_EPS  # noqa: E402
from atom_kernels.ops.fp8.triton import _quant_e4m3  # noqa: E402
from atom_kernels.ops.moe import reference as moe_ref  # noqa: E402
from atom_kernels.ops.moe import triton_fp8  # noqa: E402

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
def _gemv_kernel(
    x_ptr, w_ptr, ws_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_wsn, stride_ym,
    EPS: tl.constexpr, FMAX: tl.constexpr, BN_Q: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
    TWO: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_enter(PDL)
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_g = tl.arange(0, GROUP)
    n_ok = offs_n < N
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_g[None, :]
    ws_ptrs = ws_ptr + (offs_n // BN_Q).to(tl.int64) * stride_wsn
    acc0 = tl.zeros([BLOCK_N], tl.float32)
    acc1 = tl.zeros([BLOCK_N], tl.float32)
    for g in range(0, tl.cdiv(K, GROUP)):
        k0 = g * GROUP
        w = tl.load(w_ptrs + k0, mask=n_ok[:, None], other=0.0).to(tl.float32)
        b_s = tl.load(ws_ptrs + g, mask=n_ok, other=0.0)
        x0 = tl.load(x_ptr + k0 + offs_g).to(tl.float32)
        q0, s0 = _quant_e4m3(x0[None, :], 1, EPS, FMAX)
        acc0 += tl.sum(w * q0.to(tl.float32), 1) * s0 * b_s
        if TWO:
            x1 = tl.load(x_ptr + stride_xm + k0 + offs_g, mask=(offs_g * 0 + 1) < M, other=0.0).to(tl.float32)
            q1, s1 = _quant_e4m3(x1[None, :], 1, EPS, FMAX)
            acc1 += tl.sum(w * q1.to(tl.float32), 1) * s1 * b_s
    tl.store(y_ptr + offs_n, acc0.to(y_ptr.dtype.element_ty), mask=n_ok)
    if TWO:
        tl.store(y_ptr + stride_ym + offs_n, acc1.to(y_ptr.dtype.element_ty), mask=n_ok & (M > 1))


def gemv(x, w, ws, block_n, warps, stages):
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, w, ws, y, m, n, k, x.stride(0), w.stride(0), ws.stride(0), y.stride(0), EPS=ACT_SCALE_EPS,
        FMAX=FP8_MAX, BN_Q=128, GROUP=128, BLOCK_N=block_n, TWO=m > 1, num_warps=warps, num_stages=stages,
        **launch_options(x.device),
    )
    return y


def block_quantize(w):
    n, k = w.shape
    t = w.float().reshape(n // 128, 128, k // 128, 128)
    s = t.abs().amax((1, 3)).clamp(min=1e-12) / 448.0
    return (t / s[:, None, :, None]).reshape(n, k).to(E4M3), s


def part_gemv():
    shapes = {"qkvz": (12288, 2048), "q_proj": (8192, 2048), "out_proj": (2048, 4096), "kv": (512, 2048)}
    copies = 8
    for name, (n, k) in shapes.items():
        ws_list = [block_quantize(torch.randn(n, k, device=dev) * k**-0.5) for _ in range(copies)]
        wt = [(q.float() * 1.0).to(E4M3).t() for q, _ in ws_list]
        one = torch.ones((), device=dev)
        nbytes = n * k
        for m in (1, 2):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = fp8_ref.fp8_linear(x.float(), ws_list[0][0], ws_list[0][1]).float()
            base = graph_us([lambda q=q, s=s: fp8_triton.fp8_linear(x, q, s) for q, s in ws_list])
            xq = x.to(E4M3)
            cub = graph_us([lambda t=t: torch._scaled_mm(xq, t, one, one, out_dtype=torch.bfloat16) for t in wt])
            log(part="gemv", shape=name, m=m, impl="one-launch default", us=base, frac=nbytes / base / copy_gbps / 1e3)
            log(part="gemv", shape=name, m=m, impl="cublas per-tensor", us=cub, frac=nbytes / cub / copy_gbps / 1e3)
            best = None
            for bn, wp, st in itertools.product((8, 16, 32), (2, 4, 8), (2, 3, 4)):
                try:
                    y = gemv(x, *ws_list[0], bn, wp, st)
                    err = (y.float() - ref).abs().max().item()
                    us = graph_us([lambda q=q, s=s: gemv(x, q, s, bn, wp, st) for q, s in ws_list])
                except Exception as exc:  # noqa: BLE001
                    log(part="gemv", shape=name, m=m, impl=f"cuda-core bn{bn} w{wp} s{st}", error=str(exc)[:200])
                    continue
                if best is None or us < best[0]:
                    best = (us, bn, wp, st, err)
            us, bn, wp, st, err = best
            log(part="gemv", shape=name, m=m, impl=f"cuda-core best bn{bn} w{wp} s{st}", us=us, err=err,
                frac=nbytes / us / copy_gbps / 1e3)


def part_moe():
    H, E, INTER, TOP = 2048, 513, 512, 11
    g = torch.Generator(device=dev).manual_seed(0)
    q13 = (torch.randn(E, 2 * INTER, H, device=dev, generator=g) * 8).clamp(-448, 448).to(E4M3)
    q2 = (torch.randn(E, H, INTER, device=dev, generator=g) * 8).clamp(-448, 448).to(E4M3)
    s13 = torch.rand(E, 2 * INTER // 128, H // 128, device=dev, generator=g) * 1e-3 + 1e-3
    s2 = torch.rand(E, H // 128, INTER // 128, device=dev, generator=g) * 1e-3 + 1e-3

    def routing(t, seed):
        gg = torch.Generator(device=dev).manual_seed(seed)
        w, i = torch.softmax(torch.randn((t, 512), device=dev, generator=gg), -1).topk(TOP - 1, -1)
        w = torch.cat([w, torch.full((t, 1), 0.3, device=dev)], 1)
        i = torch.cat([i, torch.full((t, 1), 512, device=dev, dtype=i.dtype)], 1)
        return w, i

    for t in (1, 2, 4, 8):
        x = torch.randn(t, H, device=dev, dtype=torch.bfloat16)
        routes = [routing(t, 100 + r) for r in range(8)]
        w0, i0 = routes[0]
        expect = moe_ref.moe_experts_fp8(x, w0, i0, q13, s13, q2, s2).float()
        touched = sum(torch.unique(i).numel() for _, i in routes) / len(routes)
        nbytes = touched * 3 * INTER * H

        def run(cfg):
            got = triton_fp8.moe_experts_fp8(x, w0, i0, q13, s13, q2, s2, config=cfg).float()
            err = (got - expect).abs().max().item()
            us = graph_us([lambda w=w, i=i: triton_fp8.moe_experts_fp8(x, w, i, q13, s13, q2, s2, config=cfg)
                           for w, i in routes])
            return us, err

        for name, cfg in (("aligned", {"PAIRS": False}), ("pairs default", {"PAIRS": True})):
            us, err = run(cfg)
            log(part="moe", t=t, impl=name, us=us, err=err, frac=nbytes / us / copy_gbps / 1e3)
        if t > 2:
            continue
        best1 = None
        for pn, pw, ps in itertools.product((16, 32, 64), (2, 4), (2, 3, 4)):
            us, err = run({"PAIRS": True, "PN1": pn, "PW1": pw, "PS1": ps})
            log(part="moe-sweep1", t=t, cfg=[pn, pw, ps], us=us, err=err)
            if best1 is None or us < best1[0]:
                best1 = (us, pn, pw, ps)
        _, pn, pw, ps = best1
        best2 = None
        for pn2, pw2, ps2 in itertools.product((16, 32, 64, 128), (2, 4), (2, 3, 4)):
            cfg = {"PAIRS": True, "PN1": pn, "PW1": pw, "PS1": ps, "PN2": pn2, "PW2": pw2, "PS2": ps2}
            us, err = run(cfg)
            log(part="moe-sweep2", t=t, cfg=[pn2, pw2, ps2], us=us, err=err)
            if best2 is None or us < best2[0]:
                best2 = (us, cfg, err)
        log(part="moe", t=t, impl="pairs best", us=best2[0], cfg=best2[1], err=best2[2],
            frac=nbytes / best2[0] / copy_gbps / 1e3)


t0 = time.time()
for part in sys.argv[1:] or ["moe", "gemv"]:
    {"moe": part_moe, "gemv": part_gemv}[part]()
    json.dump({"copy_gbps": copy_gbps, "rows": rows}, open(f"{OUT}/decode_sweep.json", "w"), indent=1)
print("done in", time.time() - t0)
