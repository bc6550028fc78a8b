"""The cpu backend's paged attention on decode / MTP verify rows, the C pass beside the torch group path.

- ``native``: the backend's default where a C compiler works (``paged_attention.cpu_native``): per sequence
  and KV head, each cached key / value row read once in place, online float32 softmax.
- ``torch``: the path it replaces (``cpu_native`` switched off): the keys and values of a group of
  sequences gathered into float32 copies, one padded masked softmax per group.

Shapes: the bundled model's full-attention layer (4 query heads, 2 KV heads, head dim 128), 16-token
blocks of vLLM's hybrid page (``[block, token, head, K | V]``, keys and values views of one memory, each
block padded as vLLM pads it to the GDN state's page), blocks shuffled; ``N`` sequences (``--ns``) of
``k + 1`` queries each (``--ks``; k = 1: an MTP verify), every sequence with ``--contexts`` tokens in the
cache, bf16 (``--dtypes``). The forms alternate call by call on the same inputs, so the machine's load hits
them alike; each call is timed in CPU seconds of the process (``time.process_time``: the time other
processes take from the shared cores does not count; with several threads, their sum), the median of
``--reps`` calls after one warm-up call is reported, with the largest difference of the outputs.

    uv run --no-sync python benchmarks/cpu_paged_attention.py --threads 1 \
        --out benchmarks/results/cpu_paged_attention.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

HQ, HKV, D, BLOCK = 4, 2, 128, 16
PAGE_PAD = 1000  # elements of padding after each block's K | V rows (vLLM pads pages to the GDN state's)


def inputs(n: int, q_len: int, context: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-context // BLOCK)
    num_blocks = n * per_seq + 1
    pages = torch.randn(num_blocks, BLOCK * HKV * 2 * D + PAGE_PAD, generator=gen).to(dtype)
    kv = pages[:, : BLOCK * HKV * 2 * D].view(num_blocks, BLOCK, HKV, 2 * D)
    key_cache, value_cache = kv[..., :D], kv[..., D:]
    tables = torch.randperm(num_blocks, generator=gen)[: n * per_seq].view(n, per_seq).to(torch.int32)
    q = torch.randn(n * q_len, HQ, D, generator=gen).to(dtype)
    seq_lens = torch.full((n,), context, dtype=torch.int32)
    qsl = torch.arange(0, n * q_len + 1, q_len, dtype=torch.int32)
    return q, key_cache, value_cache, tables, seq_lens, qsl, D**-0.5


def call(form: str, cpu, args):
    if form == "native":
        return cpu.paged_attention(*args)
    with mock.patch.object(cpu.cpu_native, "usable", lambda *_: False):
        return cpu.paged_attention(*args)


def measure(cpu, forms, reps, threads, dtype_name, k_spec, n, context) -> dict:
    args = inputs(n, k_spec + 1, context, getattr(torch, dtype_name))
    times: dict[str, list[float]] = {f: [] for f in forms}
    outs = {}
    for rep in range(reps + 1):
        for f in forms:
            t0 = time.process_time()
            outs[f] = call(f, cpu, args)
            if rep:  # the first call of each warms up
                times[f].append(time.process_time() - t0)
    med = {f: statistics.median(times[f]) for f in forms}
    row = {"threads": threads, "dtype": dtype_name, "k": k_spec, "n": n, "context": context}
    row.update({f"{f}_ms": round(med[f] * 1e3, 3) for f in forms})
    row["torch_over_native"] = round(med["torch"] / med["native"], 2)
    row["max_abs_diff"] = float((outs["native"].float() - outs["torch"].float()).abs().max())
    print(
        f"t={threads} {dtype_name:8s} k={k_spec} N={n:3d} ctx={context:5d}  torch {row['torch_ms']:8.3f} ms"
        f"  native {row['native_ms']:8.3f} ms ({row['torch_over_native']:.1f}x)  |diff| {row['max_abs_diff']:.1e}",
        flush=True,
    )
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--ns", type=int, nargs="+", default=[16, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--ks", type=int, nargs="+", default=[1])
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=["bfloat16", "float32"])
    ap.add_argument("--out", type=Path, default=None)
    opts = ap.parse_args()

    from atom_kernels.ops.paged_attention import cpu, cpu_native

    t0 = time.perf_counter()
    native_ok = cpu_native.load() is not None
    first_load_s = time.perf_counter() - t0
    if not native_ok:
        sys.exit("no C compiler builds the pass: nothing to compare")
    forms = ["torch", "native"]
    load_before = os.getloadavg()
    rows = []
    for threads in opts.threads:
        torch.set_num_threads(threads)
        for dtype_name in opts.dtypes:
            for k_spec in opts.ks:
                for n in opts.ns:
                    for context in opts.contexts:
                        rows.append(measure(cpu, forms, opts.reps, threads, dtype_name, k_spec, n, context))
    if opts.out:
        meta = {
            "command": "uv run --no-sync python benchmarks/cpu_paged_attention.py " + " ".join(sys.argv[1:]),
            "machine": platform.processor() or platform.machine(),
            "shapes": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D, "block_size": BLOCK},
            "native_first_load_s": round(first_load_s, 3),
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
            "torch": torch.__version__,
            "reps": opts.reps,
            "columns": "median CPU ms per call (process time); torch_over_native > 1: the C pass faster than the torch path",
        }
        opts.out.parent.mkdir(parents=True, exist_ok=True)
        opts.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
