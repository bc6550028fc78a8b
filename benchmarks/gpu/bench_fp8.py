"""FP8 W8A8 block-scaled GEMM and fused MoE at the Qwen3-Next-80B-A3B shapes, H200.

GEMM (``fp8_linear``: per-token-group(128) activation quantisation + block-scaled e4m3 GEMM), timed in
the same run on the same weights against:
- ``cuBLAS fp8 per-tensor``: ``torch._scaled_mm`` with one scale per tensor on pre-quantised operands
  (the fastest FP8 GEMM torch offers; it refuses 1x128 / 128x128 block scales);
- ``cuBLAS bf16``: ``x @ w.T`` with the weight in bf16;
- ``triton block-scaled gemm only``: our GEMM on pre-quantised activations (the activation quantisation
  launch left out, like the per-tensor baseline).
MoE (``moe_experts_fp8``, 512 experts top-10, H=2048, I=512) against our bf16 fused MoE on the same
routing. Every case is first checked against the float32 reference on the same inputs (max abs error
printed and stored). Times are CUDA-graph replays (launch gaps out); the eager time of our op is stored
too. Bytes: weights (fp8: 1 B/element + block scales; bf16: 2 B) + activations in + out.

Usage: python benchmarks/gpu/bench_fp8.py [--out DIR] [--quick]
"""

# ruff: noqa: B023  (closures are timed inside the loop iteration that made them)
from __future__ import annotations

import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

E4M3 = torch.float8_e4m3fn
H, E, TOP_K, INTER = 2048, 512, 10, 512
GEMMS = {  # name -> (N, K) of the 80B-A3B's quantised dense projections
    "gdn in_proj_qkvz": (12288, 2048),
    "attn q_proj": (8192, 2048),
    "gdn/attn out_proj": (2048, 4096),
    "shared expert gate_up": (1024, 2048),
}
MS = [1, 8, 64, 256, 4096]
SWEEP = {  # tile alternatives to fp8 triton.plan, timed in the same run
    "small": [dict(BLOCK_N=64), dict(BLOCK_N=32), dict(SPLIT_K=1)],
    256: [dict(BLOCK_N=128), dict(BLOCK_N=64), dict(BLOCK_M=128, num_warps=8)],
    4096: [dict(BLOCK_M=64, BLOCK_N=128, num_warps=4), dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=4),
           dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=4)],
}  # fmt: skip


def block_quantize(w: torch.Tensor, bn: int = 128, bk: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    t = w.float().reshape(n // bn, bn, k // bk, bk)
    s = t.abs().amax((1, 3)).clamp(min=1e-12) / 448.0
    return (t / s[:, None, :, None]).reshape(n, k).to(E4M3), s


def per_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = (x.float().abs().amax().clamp(min=1e-12) / 448.0).reshape(())
    return (x.float() / s).clamp(-448, 448).to(E4M3), s


def gemm_rows(ceil, device, quick: bool) -> list[dict]:
    from atom_kernels.ops.fp8 import reference as ref
    from atom_kernels.ops.fp8 import triton as fp8_triton

    rows = []
    for name, (n, k) in GEMMS.items():
        torch.manual_seed(0)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * k**-0.5
        wq, ws = block_quantize(w)
        wt_q, wt_s = per_tensor(w)
        wt_col = wt_q.t()  # [K, N] column-major, as _scaled_mm wants its second operand
        for m in [1, 256] if quick else MS:
            case = f"{name} N={n} K={k} M={m}"
            try:
                x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
                got = fp8_triton.fp8_linear(x, wq, ws)
                err = (got.float() - ref.fp8_linear(x.float(), wq, ws).float()).abs().max().item()
                xq, xs = fp8_triton.fp8_act_quant(x)
                xt_q, xt_s = per_tensor(x)
                flops = 2.0 * m * n * k
                fp8_bytes = n * k + ws.numel() * 4 + m * k * 2 + m * n * 2
                fns = {
                    "triton block-scaled (act quant + gemm)": (lambda: fp8_triton.fp8_linear(x, wq, ws), fp8_bytes),
                    "triton block-scaled gemm only": (
                        lambda: fp8_triton.fp8_gemm(xq, xs, wq, ws, (128, 128), torch.bfloat16), fp8_bytes),
                    "cuBLAS fp8 per-tensor (_scaled_mm)": (
                        lambda: torch._scaled_mm(xt_q, wt_col, scale_a=xt_s, scale_b=wt_s,
                                                 out_dtype=torch.bfloat16), n * k + m * k + m * n * 2),
                    "cuBLAS bf16": (lambda: x @ w.t(), 2 * n * k + 2 * m * k + 2 * m * n),
                }  # fmt: skip
                for impl, (fn, nbytes) in fns.items():
                    try:
                        ms = common.time_ms(fn, graph=True, rep_ms=50)
                        eager = common.time_ms(fn) if impl.startswith("triton block-scaled (") else None
                    except Exception as exc:
                        rows.append(common.row(bench="gemm", case=case, impl=impl, ms=None, ceil=ceil,
                                               error=f"{type(exc).__name__}: {exc}"[:300]))  # fmt: skip
                        print(case, impl, "failed:", str(exc)[:200])
                        continue
                    rows.append(common.row(bench="gemm", case=case, impl=impl, ms=ms, ceil=ceil, nbytes=nbytes,
                                           flops=flops, m=m, n=n, k=k, eager_ms=eager,
                                           max_err_vs_reference=err if impl.startswith("triton") else None))  # fmt: skip
                sweep = SWEEP["small"] if m <= 64 else SWEEP.get(m, [])
                for cfg in [] if quick else sweep:
                    try:
                        f2 = lambda cfg=cfg: fp8_triton.fp8_linear(x, wq, ws, config=cfg)  # noqa: E731
                        e2 = (f2().float() - got.float()).abs().max().item()
                        ms = common.time_ms(f2, graph=True, rep_ms=30)
                        rows.append(common.row(bench="gemm_sweep", case=case, impl=f"triton {cfg}", ms=ms,
                                               ceil=ceil, nbytes=fp8_bytes, flops=flops, m=m, n=n, k=k,
                                               config=cfg, diff_vs_default=e2))  # fmt: skip
                    except Exception as exc:
                        print(case, "sweep", cfg, "failed:", str(exc)[:200])
                line = [f"{r['impl'][:28]} {r['ms'] * 1e3:.1f}us {r['frac_copy']:.0%}BW {r['tflops']:.0f}TF"
                        for r in rows if r["case"] == case and r["bench"] == "gemm" and r["ms"]]  # fmt: skip
                print(case, f"err {err:.2e} |", " | ".join(line))
            except Exception as exc:
                traceback.print_exc()
                rows.append(dict(bench="gemm", case=case, impl="(failed)", ms=None, error=str(exc)[:300]))
    return rows


def routing(tokens, seed, device):
    g = torch.Generator(device=device).manual_seed(seed)
    w, ids = torch.softmax(torch.randn((tokens, E), device=device, generator=g), -1).topk(TOP_K, -1)
    return w / w.sum(-1, keepdim=True), ids


def moe_rows(ceil, device, quick: bool) -> list[dict]:
    from atom_kernels.ops.moe import reference as moe_ref
    from atom_kernels.ops.moe import triton as moe_triton
    from atom_kernels.ops.moe import triton_fp8

    torch.manual_seed(0)
    w13 = torch.randn(E, 2 * INTER, H, device=device, dtype=torch.bfloat16) * H**-0.5
    w2 = torch.randn(E, H, INTER, device=device, dtype=torch.bfloat16) * INTER**-0.5
    q13 = torch.empty(w13.shape, device=device, dtype=E4M3)
    s13 = torch.empty(E, 2 * INTER // 128, H // 128, device=device)
    q2 = torch.empty(w2.shape, device=device, dtype=E4M3)
    s2 = torch.empty(E, H // 128, INTER // 128, device=device)
    for e in range(E):
        q13[e], s13[e] = block_quantize(w13[e])
        q2[e], s2[e] = block_quantize(w2[e])
    rows = []
    for t in [1, 256] if quick else MS:
        case = f"T={t}"
        try:
            x = torch.randn(t, H, device=device, dtype=torch.bfloat16)
            reps = 8 if t <= 64 else (2 if t <= 256 else 1)
            routes = [routing(t, 100 + r, device) for r in range(reps)]
            wts, ids = routes[0]
            got = triton_fp8.moe_experts_fp8(x, wts, ids, q13, s13, q2, s2)
            expect = moe_ref.moe_experts_fp8(x, wts, ids, q13, s13, q2, s2)
            err = (got.float() - expect.float()).abs().max().item()
            touched = torch.unique(ids).numel()
            flops = 2.0 * t * TOP_K * 3 * INTER * H
            act = 2 * t * H * 2
            fns = {
                "triton fp8 fused": (lambda w, i: triton_fp8.moe_experts_fp8(x, w, i, q13, s13, q2, s2),
                                     touched * (3 * INTER * H + 4 * 3 * 16 * 4) + act),
                "triton bf16 fused": (lambda w, i: moe_triton.moe_experts(x, w, i, w13, w2),
                                      touched * 3 * INTER * H * 2 + act),
            }  # fmt: skip
            for impl, (fn, nbytes) in fns.items():
                ms = common.time_ms(lambda: [fn(w, i) for w, i in routes], graph=True, rep_ms=30) / reps
                eager = common.time_ms(lambda: fn(wts, ids)) if impl.startswith("triton fp8") else None
                rows.append(common.row(bench="moe", case=case, impl=impl, ms=ms, ceil=ceil, nbytes=nbytes,
                                       flops=flops, eager_ms=eager, touched_experts=touched,
                                       max_err_vs_reference=err if "fp8" in impl else None))  # fmt: skip
            line = [f"{r['impl']} {r['ms'] * 1e3:.1f}us {r['frac_copy']:.0%}BW {r['tflops']:.0f}TF"
                    for r in rows if r["case"] == case and r["ms"]]  # fmt: skip
            print("moe", case, f"err {err:.2e} |", " | ".join(line))
        except Exception as exc:
            traceback.print_exc()
            rows.append(dict(bench="moe", case=case, impl="(failed)", ms=None, error=str(exc)[:300]))
    return rows


def main() -> None:
    args, out, device, ceil = common.bench_setup(__doc__)
    rows = gemm_rows(ceil, device, args.quick) + moe_rows(ceil, device, args.quick)
    common.write_json(out / "fp8_h200.json", {"env": common.environment(), "ceilings": ceil, "rows": rows})
    common.plot_rows(out / "fp8_h200.png", [r for r in rows if r["bench"] in ("gemm", "moe")], value="frac_copy",
                     title="FP8 GEMM (80B shapes) and FP8 MoE (512x top-10) vs cuBLAS per-tensor FP8 and bf16",
                     xlabel="fraction of measured device copy bandwidth (bytes: weights + activations)")  # fmt: skip
    common.print_table(rows, ["case", "impl", "ms", "eager_ms", "gbps", "frac_copy", "tflops", "frac_matmul"])


if __name__ == "__main__":
    main()
