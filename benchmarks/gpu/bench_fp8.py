"""FP8 W8A8 block-scaled GEMM and fused MoE at the Qwen3-Next-80B-A3B shapes, H200.

GEMM (``fp8_linear``: per-token-group(128) activation quantisation + block-scaled e4m3 GEMM) at the 80B
checkpoint's dense FP8 projections, M = 1, 2, 8, 16, 64 (decode) and 256, 4096 (prefill), timed in the
same run on the same weights:
- ``triton one-launch``: ``_fp8_linear_decode_kernel`` with its default tiles (``config={"ONE_LAUNCH":
  True}``; the default plan up to ``ONE_LAUNCH_MAX_M``);
- ``triton 3-launch``: act quant + GEMM (+ split-K reduce) (``config={"ONE_LAUNCH": False}``);
- ``triton (act quant + gemm)``: the default plan at M > 64;
- ``triton block-scaled gemm only``: the three-launch GEMM on pre-quantised activations;
- ``cuBLAS fp8 per-tensor``: ``torch._scaled_mm`` with one scale per tensor on pre-quantised operands
  (the fastest FP8 GEMM torch offers; it refuses 1x128 / 128x128 block scales);
- ``cuBLAS bf16``: ``x @ w.T`` with the weight in bf16.
At M <= 64 a sweep of the one-launch plan (``gemm_sweep`` rows: column tile, split-K, warps, stages,
weight-as-left-operand, each row the one-launch plan's default tiles with the keys shown replaced) is timed
too, and ``decode_best`` in the JSON (printed at the end) gives, per shape and M, the fastest one-launch
config beside the one-launch defaults, the three-launch plan and cuBLAS. MoE (``moe_experts_fp8``, 512
experts top-10, H=2048, I=512, with the caller's tickets) against our bf16 fused MoE on the same routing;
at T <= 8 (the pair path) also the pair path with the routed sum in a third launch (``FUSED_SUM=False``)
and the aligned path. Every case is first checked against the float32 reference (max abs error stored);
sweep rows store their max difference from the default plan. Times are CUDA-graph replays (launch gaps out; a split-K plan's per-call ticket memset is in the
graph); the eager time of the default plan is stored too. Bytes: weights (fp8: 1 B/element + block scales;
bf16: 2 B) + activations in + out.

Usage: python benchmarks/gpu/bench_fp8.py [--out DIR] [--quick] [--decode-only | --moe-only]
(``--decode-only``: M <= 64 GEMMs and their sweep only, no MoE; writes fp8_decode_h200.json. ``--moe-only``:
the MoE rows only; writes fp8_moe_h200.json.)
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
GEMMS = {  # name -> (N, K) of the 80B-A3B's block-quantised dense projections
    "gdn in_proj_qkvz": (12288, 2048),
    "attn q_proj": (8192, 2048),
    "gdn out_proj / attn o_proj": (2048, 4096),
    "attn k_proj / v_proj": (512, 2048),
    "shared expert gate_up": (1024, 2048),
    "shared expert down": (2048, 512),
}
DECODE_MS = [1, 2, 8, 16, 64]
PREFILL_MS = [256, 4096]
MOE_TOKENS = [1, 2, 8, 64, 256, 4096]
DECODE_SWEEP = (  # replaced keys of the default one-launch plan
    [dict(BLOCK_N=bn, SPLIT_K=1) for bn in (16, 32, 64, 128)]
    + [dict(BLOCK_N=bn, SPLIT_K=sk) for bn in (16, 32, 64) for sk in (2, 4)]
    + [dict(BLOCK_N=128, SPLIT_K=2)]
    + [dict(SWAP_AB=sw, BLOCK_N=bn, SPLIT_K=1) for sw in (False, True) for bn in (32, 64)]
    + [dict(num_warps=2), dict(num_warps=4), dict(num_warps=8), dict(num_stages=3), dict(num_stages=6)]
)
SWEEP = {  # tile alternatives to fp8 triton.plan at prefill sizes, timed in the same run
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


def _time(rows, fn, *, bench, case, impl, ceil, nbytes, flops, rep_ms=30, **extra) -> float | None:
    try:
        ms = common.time_ms(fn, graph=True, rep_ms=rep_ms)
    except Exception as exc:
        rows.append(common.row(bench=bench, case=case, impl=impl, ms=None, ceil=ceil,
                               error=f"{type(exc).__name__}: {exc}"[:300], **extra))  # fmt: skip
        print(case, impl, "failed:", str(exc)[:200])
        return None
    rows.append(common.row(bench=bench, case=case, impl=impl, ms=ms, ceil=ceil, nbytes=nbytes, flops=flops,
                           **extra))  # fmt: skip
    return ms


def gemm_rows(ceil, device, quick: bool, decode_only: bool) -> tuple[list[dict], list[dict]]:
    from atom_kernels.ops.fp8 import reference as ref
    from atom_kernels.ops.fp8 import triton as fp8_triton

    sms = torch.cuda.get_device_properties(device).multi_processor_count
    ms_list = [1, 256] if quick else DECODE_MS + ([] if decode_only else PREFILL_MS)
    rows, best = [], []
    for name, (n, k) in GEMMS.items():
        torch.manual_seed(0)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * k**-0.5
        wq, ws = block_quantize(w)
        wt_q, wt_s = per_tensor(w)
        wt_col = wt_q.t()  # [K, N] column-major, as _scaled_mm wants its second operand
        for m in ms_list:
            case = f"{name} N={n} K={k} M={m}"
            try:
                x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
                default = fp8_triton.plan(m, n, k, 128, sms)
                got = fp8_triton.fp8_linear(x, wq, ws)
                err = (got.float() - ref.fp8_linear(x.float(), wq, ws).float()).abs().max().item()
                xq, xs = fp8_triton.fp8_act_quant(x)
                xt_q, xt_s = per_tensor(x)
                flops = 2.0 * m * n * k
                fp8_bytes = n * k + ws.numel() * 4 + m * k * 2 + m * n * 2
                common_kw = dict(ceil=ceil, flops=flops, m=m, n=n, k=k)
                ours = (
                    "triton one-launch"
                    if default["ONE_LAUNCH"]
                    else ("triton 3-launch" if m <= 64 else "triton (act quant + gemm)")
                )
                fns = {
                    ours: (lambda: fp8_triton.fp8_linear(x, wq, ws), fp8_bytes),
                    "triton block-scaled gemm only": (
                        lambda: fp8_triton.fp8_gemm(xq, xs, wq, ws, (128, 128), torch.bfloat16), fp8_bytes),
                    "cuBLAS fp8 per-tensor (_scaled_mm)": (
                        lambda: torch._scaled_mm(xt_q, wt_col, scale_a=xt_s, scale_b=wt_s,
                                                 out_dtype=torch.bfloat16), n * k + m * k + m * n * 2),
                    "cuBLAS bf16": (lambda: x @ w.t(), 2 * n * k + 2 * m * k + 2 * m * n),
                }  # fmt: skip
                one = fp8_triton.plan(m, n, k, 128, sms, {"ONE_LAUNCH": True})
                if m <= 64:  # both decode plans, whichever is the default
                    alt, alt_cfg = (
                        ("triton 3-launch", {"ONE_LAUNCH": False})
                        if default["ONE_LAUNCH"]
                        else ("triton one-launch", one)
                    )
                    fns[alt] = (lambda: fp8_triton.fp8_linear(x, wq, ws, config=alt_cfg), fp8_bytes)
                times = {}
                for impl, (fn, nbytes) in fns.items():
                    extra = {}
                    if impl == ours:
                        extra = dict(config=default, eager_ms=common.time_ms(fn), max_err_vs_reference=err)
                    times[impl] = _time(rows, fn, bench="gemm", case=case, impl=impl, nbytes=nbytes,
                                        **common_kw, **extra)  # fmt: skip
                sweep = DECODE_SWEEP if m <= 64 else SWEEP.get(m, [])
                swept, seen = [], [one]
                for cfg in [] if quick else sweep:
                    full = {**(one if m <= 64 else default), **cfg}
                    if m <= 64 and full in seen:
                        continue
                    seen.append(full)
                    try:
                        f2 = lambda full=full: fp8_triton.fp8_linear(x, wq, ws, config=full)  # noqa: E731
                        e2 = (f2().float() - got.float()).abs().max().item()
                    except Exception as exc:
                        print(case, "sweep", cfg, "failed:", str(exc)[:200])
                        continue
                    t = _time(rows, f2, bench="gemm_sweep", case=case, impl=f"triton {cfg}", nbytes=fp8_bytes,
                              rep_ms=10, config=full, diff_vs_default=e2, **common_kw)  # fmt: skip
                    if t:
                        swept.append((t, full))
                if m <= 64 and times.get("triton one-launch"):
                    t_one = times["triton one-launch"]
                    t_best, cfg_best = min(swept + [(t_one, one)], key=lambda r: r[0])
                    cublas = times.get("cuBLAS fp8 per-tensor (_scaled_mm)")
                    best.append(dict(case=case, n=n, k=k, m=m, one_launch_us=t_one * 1e3,
                                     three_launch_us=(times.get("triton 3-launch") or 0) * 1e3,
                                     best_us=t_best * 1e3, best_config=cfg_best, one_launch_config=one,
                                     default_plan="one-launch" if default["ONE_LAUNCH"] else "3-launch",
                                     cublas_fp8_us=(cublas or 0) * 1e3,
                                     best_vs_cublas=t_best / cublas if cublas else None,
                                     best_frac_copy=fp8_bytes / t_best / 1e6 / ceil["copy_gbps"]))  # fmt: skip
                line = [f"{r['impl'][:28]} {r['ms'] * 1e3:.1f}us {r['frac_copy']:.0%}BW"
                        for r in rows if r["case"] == case and r["bench"] == "gemm" and r["ms"]]  # fmt: skip
                print(case, f"err {err:.2e} |", " | ".join(line))
            except Exception as exc:
                traceback.print_exc()
                rows.append(dict(bench="gemm", case=case, impl="(failed)", ms=None, error=str(exc)[:300]))
    return rows, best


def routing(tokens, seed, device):
    g = torch.Generator(device=device).manual_seed(seed)
    w, ids = torch.softmax(torch.randn((tokens, E), device=device, generator=g), -1).topk(TOP_K, -1)
    return w / w.sum(-1, keepdim=True), ids


def moe_rows(ceil, device, quick: bool) -> list[dict]:
    from atom_kernels.ops.moe import experts_fp8_tickets, triton_fp8
    from atom_kernels.ops.moe import reference as moe_ref
    from atom_kernels.ops.moe import triton as moe_triton

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
    for t in [1, 256] if quick else MOE_TOKENS:
        case = f"T={t}"
        try:
            x = torch.randn(t, H, device=device, dtype=torch.bfloat16)
            reps = 8 if t <= 64 else (2 if t <= 256 else 1)
            routes = [routing(t, 100 + r, device) for r in range(reps)]
            wts, ids = routes[0]
            tickets = torch.zeros(experts_fp8_tickets(H), dtype=torch.int32, device=device)  # the module's
            got = triton_fp8.moe_experts_fp8(x, wts, ids, q13, s13, q2, s2, tickets=tickets)
            expect = moe_ref.moe_experts_fp8(x, wts, ids, q13, s13, q2, s2)
            err = (got.float() - expect.float()).abs().max().item()
            touched = torch.unique(ids).numel()
            flops = 2.0 * t * TOP_K * 3 * INTER * H
            act = 2 * t * H * 2
            fp8_bytes = touched * (3 * INTER * H + 4 * 3 * 16 * 4) + act
            fns = {
                "triton fp8 fused": (lambda w, i: triton_fp8.moe_experts_fp8(x, w, i, q13, s13, q2, s2,
                                                                             tickets=tickets), fp8_bytes),
                "triton bf16 fused": (lambda w, i: moe_triton.moe_experts(x, w, i, w13, w2),
                                      touched * 3 * INTER * H * 2 + act),
            }  # fmt: skip
            # the default is the pair path there (its second GEMM sums the routed rows): the pair path with
            # the sum in a launch of its own, and the aligned path, beside it
            if t <= triton_fp8.PAIR_MAX_TOKENS:
                fns["triton fp8 pairs, sum launch"] = (
                    lambda w, i: triton_fp8.moe_experts_fp8(
                        x, w, i, q13, s13, q2, s2, config={"FUSED_SUM": False}
                    ),
                    fp8_bytes,
                )
                fns["triton fp8 aligned"] = (
                    lambda w, i: triton_fp8.moe_experts_fp8(
                        x, w, i, q13, s13, q2, s2, config={"PAIRS": False}
                    ),
                    fp8_bytes,
                )
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
    args, out, device, ceil = common.bench_setup(
        __doc__,
        flags=[("--decode-only", "M <= 64 GEMMs and the one-launch sweep only (no MoE)"),
               ("--moe-only", "the MoE rows only (no GEMMs)")],
    )  # fmt: skip
    rows, best = ([], []) if args.moe_only else gemm_rows(ceil, device, args.quick, args.decode_only)
    if not args.decode_only:
        rows += moe_rows(ceil, device, args.quick)
    name = "fp8_decode_h200" if args.decode_only else ("fp8_moe_h200" if args.moe_only else "fp8_h200")
    common.write_json(out / f"{name}.json", {"env": common.environment(), "ceilings": ceil, "rows": rows,
                                            "decode_best": best})  # fmt: skip
    common.plot_rows(out / f"{name}.png", [r for r in rows if r["bench"] in ("gemm", "moe")], value="frac_copy",
                     title="FP8 GEMM (80B shapes) and FP8 MoE (512x top-10) vs cuBLAS per-tensor FP8 and bf16",
                     xlabel="fraction of measured device copy bandwidth (bytes: weights + activations)")  # fmt: skip
    common.print_table(rows, ["case", "impl", "ms", "eager_ms", "gbps", "frac_copy", "tflops", "frac_matmul"])
    print("\ndecode: one-launch plan (default tiles), fastest swept config, three-launch, cuBLAS fp8")
    common.print_table(best, ["case", "default_plan", "one_launch_us", "best_us", "three_launch_us",
                              "cublas_fp8_us", "best_vs_cublas", "best_frac_copy", "best_config"])  # fmt: skip


if __name__ == "__main__":
    main()
