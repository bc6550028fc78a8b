"""Fused MoE experts at the Qwen3-Next-80B-A3B shapes (512 experts, top-10, hidden 2048, inter 512), H200.

Implementations, timed in the same run on the same inputs:
- ``triton fused``: atom_kernels' triton ``moe_experts`` (align + two grouped GEMMs with fused SiLU-and-mul
  + weighted sum; 4 launches);
- ``torch._grouped_mm``: sort by expert with torch ops, two ``torch._grouped_mm`` calls, SiLU-and-mul,
  weighted ``index_add_`` (the baseline of docs/performance.md, MoE section);
- ``torch per-expert loop``: the reference backend's loop over experts that received tokens.
Plus ``routed+shared``: the shared expert (intermediate 512) stacked as expert 513 with its sigmoid gate
as the routing weight, so one fused call does routed and shared experts (top-11 of 513).

Bytes: the weights of every distinct expert the batch touches (gate, up, down; bf16) + x + out.
FLOPs: 2 * T * K * (2I * H + H * INTER). Timing: eager (``do_bench``, L2 flushed, launch cost included) and
CUDA-graph replay of R calls with R different routings (different experts, so weights come from HBM).

Usage: python benchmarks/gpu/bench_moe.py [--out DIR] [--quick]
"""

# ruff: noqa: B023  (closures are timed inside the loop iteration that made them)
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

E, K, H, INTER = 512, 10, 2048, 512


SWEEP = {  # tile alternatives to moe_triton.plan, timed in the same run
    1: [("N1=16 N2=32", dict(N1=16, N2=32)), ("N1=64 N2=128", dict(N1=64, N2=128)),
        ("K=64 S=6", dict(K1=64, S1=6, K2=64, S2=6))],
    8: [("N1=16 N2=32", dict(N1=16, N2=32)), ("N1=64 N2=128", dict(N1=64, N2=128))],
    4096: [("BM=128 N1=64 w8 s3", dict(BLOCK_M=128, N1=64, K1=64, W1=8, S1=3, N2=128, K2=64, W2=8, S2=3)),
           ("BM=64 N1=128 w8 s3", dict(BLOCK_M=64, N1=128, K1=64, W1=8, S1=3, N2=256, K2=64, W2=8, S2=3)),
           ("BM=32 K=128", dict(BLOCK_M=32, N1=64, K1=128, W1=4, S1=4, N2=128, K2=128, W2=4, S2=4))],
}  # fmt: skip


def grouped_mm_moe(x, weights, ids, w13, w2):
    """Baseline: torch sort + torch._grouped_mm (no host sync)."""
    top_k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tok = order // top_k
    xs = x[tok]
    counts = torch.bincount(flat, minlength=w13.shape[0])
    offs = torch.cumsum(counts, 0).to(torch.int32)
    h = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)
    half = h.shape[-1] // 2
    a = F.silu(h[:, :half]) * h[:, half:]
    y = torch._grouped_mm(a, w2.transpose(1, 2), offs=offs)
    y = y.float() * weights.reshape(-1)[order, None].float()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    out.index_add_(0, tok, y)
    return out.to(x.dtype)


def routing(tokens, seed, device, num_experts=E, top_k=K):
    g = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn((tokens, num_experts), device=device, generator=g)
    w, ids = torch.softmax(logits, -1).topk(top_k, -1)
    return (w / w.sum(-1, keepdim=True)), ids


def weight_bytes(ids, inter=INTER, hidden=H):
    n = torch.unique(ids).numel()
    return n * 3 * inter * hidden * 2


def main() -> None:
    args, out, device, ceil = common.bench_setup(__doc__)
    from atom_kernels.ops.moe import triton as moe_triton

    kern = common.backend_ops("triton", device, ["moe_experts"])
    ref = common.backend_ops("reference", device, ["moe_experts"])
    torch.manual_seed(0)
    w13 = torch.randn(E + 1, 2 * INTER, H, device=device, dtype=torch.bfloat16) * H**-0.5
    w2 = torch.randn(E + 1, H, INTER, device=device, dtype=torch.bfloat16) * INTER**-0.5
    r13, r2 = w13[:E], w2[:E]  # routed experts; expert E is the shared expert
    gate_w = torch.randn(1, H, device=device, dtype=torch.bfloat16) * H**-0.5
    has_gmm = hasattr(torch, "_grouped_mm")
    rows = []
    for T in [1, 8, 64, 256, 4096] if not args.quick else [1, 256]:
        try:
            x = torch.randn(T, H, device=device, dtype=torch.bfloat16)
            reps = 8 if T <= 64 else (2 if T <= 256 else 1)
            routes = [routing(T, 100 + r, device) for r in range(reps)]
            wts, ids = routes[0]
            nbytes = weight_bytes(ids) + 2 * T * H * 2
            flops = 2.0 * T * K * (2 * INTER * H + H * INTER)
            case = f"T={T}"
            got = kern.moe_experts(x, wts, ids, r13, r2)
            expect = ref.moe_experts(x, wts, ids, r13, r2)
            err = (got.float() - expect.float()).abs().max().item()
            if not err < 5e-2:
                print(f"moe T={T}: triton vs reference max error {err:.3e} (timed anyway)")
            fns = {"triton fused": lambda w, i: kern.moe_experts(x, w, i, r13, r2)}
            if has_gmm:
                fns["torch._grouped_mm"] = lambda w, i: grouped_mm_moe(x, w, i, r13, r2)
            for impl, fn in fns.items():
                try:  # eager: what one call costs from Python (launches included); L2 flushed
                    eager = common.time_ms(lambda fn=fn: fn(wts, ids))
                except Exception as exc:
                    rows.append(common.row(bench="moe", case=case, impl=impl, ms=None, ceil=ceil,
                                           error=f"{type(exc).__name__}: {exc}"[:400]))  # fmt: skip
                    print(case, impl, "failed:", exc)
                    continue
                try:  # CUDA graph over `reps` routings (different experts, weights from HBM)
                    graph = common.time_ms(lambda fn=fn: [fn(w, i) for w, i in routes], graph=True, rep_ms=20)
                    graph /= reps
                except Exception as exc:  # torch._grouped_mm copies from the host: not capturable
                    print(case, impl, "not graph-capturable:", str(exc)[:120])
                    graph = None
                rows.append(common.row(bench="moe", case=case, impl=impl, ms=graph if graph else eager, ceil=ceil,
                                       nbytes=nbytes, flops=flops, eager_ms=eager, graph_ms=graph,
                                       timing="cuda graph" if graph else "eager",
                                       max_err_vs_reference=err if impl == "triton fused" else None))  # fmt: skip
                if impl == "triton fused" and T in SWEEP:
                    for label, cfg in SWEEP[T]:
                        try:
                            f2 = lambda w, i, cfg=cfg: moe_triton.moe_experts(x, w, i, r13, r2, config=cfg)  # noqa: E731
                            e2 = (f2(wts, ids).float() - expect.float()).abs().max().item()
                            g2 = common.time_ms(
                                lambda f2=f2: [f2(w, i) for w, i in routes], graph=True, rep_ms=20
                            )
                            rows.append(common.row(bench="moe_sweep", case=case, impl=f"triton fused {label}",
                                                   ms=g2 / reps, ceil=ceil, nbytes=nbytes, flops=flops,
                                                   config=cfg, max_err_vs_reference=e2))  # fmt: skip
                            print(case, "sweep", label, f"{g2 / reps * 1e3:.1f} us")
                        except Exception as exc:
                            print(case, "sweep", label, "failed:", str(exc)[:200])
            if T <= 256 or not args.quick:
                loop = common.time_ms(lambda: ref.moe_experts(x, wts, ids, r13, r2), rep_ms=200)
                rows.append(common.row(bench="moe", case=case, impl="torch per-expert loop", ms=loop, ceil=ceil,
                                       nbytes=nbytes, flops=flops, timing="eager"))  # fmt: skip
            # routed + shared expert in one call: shared expert = expert E, routing weight sigmoid(gate(x))
            shared_w = torch.sigmoid((x @ gate_w.t()).float())
            ids_s = torch.cat([ids, torch.full((T, 1), E, device=device, dtype=ids.dtype)], 1)
            wts_s = torch.cat([wts, shared_w], 1)
            ms = common.time_ms(lambda: kern.moe_experts(x, wts_s, ids_s, w13, w2), graph=True, rep_ms=20)
            rows.append(common.row(bench="moe", case=case, impl="triton fused routed+shared (top-11 of 513)", ms=ms,
                                   ceil=ceil, nbytes=weight_bytes(ids_s) + 2 * T * H * 2,
                                   flops=2.0 * T * (K + 1) * 3 * INTER * H, timing="cuda graph, one routing"))  # fmt: skip
            for r in [r for r in rows[-len(fns) - 2 :] if r["ms"]]:
                print(case, r["impl"], f"{r['ms'] * 1e3:.1f} us", f"{r['frac_copy']:.0%} of BW on weights",
                      f"{r['tflops']:.0f} TFLOP/s", f"eager {r.get('eager_ms', 0) * 1e3:.1f} us")  # fmt: skip
        except Exception as exc:  # record and go on with the next size
            import traceback

            traceback.print_exc()
            rows.append(
                dict(
                    bench="moe",
                    case=f"T={T}",
                    impl="(failed)",
                    ms=None,
                    error=f"{type(exc).__name__}: {exc}"[:400],
                )
            )
    common.write_json(out / "moe_h200.json", {"env": common.environment(), "ceilings": ceil, "rows": rows})
    common.plot_rows(out / "moe_h200.png", [r for r in rows if r["bench"] == "moe"], value="frac_copy",
                     title="MoE 512 experts top-10, H=2048, I=512, bf16: fraction of copy BW on weights read",
                     xlabel="fraction of measured device copy bandwidth (bytes: weights of touched experts)")  # fmt: skip
    common.print_table(rows, ["case", "impl", "ms", "eager_ms", "gbps", "frac_copy", "tflops", "frac_matmul"])


if __name__ == "__main__":
    main()
