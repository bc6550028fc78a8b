"""One GDN layer's whole MTP verify step on the cpu backend, as vLLM's worker runs it, form by form.

``atom_models.gdn_pipeline.gdn_verify`` on the plugin's layouts: the pre-conv ``mixed_qkv`` and the raw gate
inputs ``a`` / ``b`` as row-strided views of the layer's projections (bf16 or float32), the conv state
stored ``[S, W, C]`` (passed as the ``[S, C, W]`` view) in the token dtype, a float32 state pool and pending
pool, ``N`` sequences on scattered slots of a pool of ``2N``, every acceptance count. The step is the
causal conv update and ``gated_delta_rule_verify``:

- ``step``: the backend's default where a C compiler works: the conv update in one C call
  (``conv1d.cpu_native``), the verify's inputs prepared (L2 norms, gates' cumsums, the closed form's
  coefficients, the pending tokens' commit and stash) in the same C call as the state pass
  (``cpu_native_verify``);
- ``torch_prep``: the forms they replace (both switched off): the conv update in torch ops, the same C
  state pass with its inputs prepared in torch ops.

The forms alternate call by call on their own copies of the state, so the machine's load hits them alike;
the median of ``--reps`` calls after two warm-up calls is reported, with the largest difference of the
step form's outputs and pools from the torch form's. ``--profile`` adds each form's torch.profiler table
(self CPU time per op) of ``--reps`` steps at each N.

    uv run --no-sync python benchmarks/cpu_gdn_verify_step.py --out benchmarks/results/cpu_gdn_verify_step.json
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

MODELS = {"bundled": (2, 4), "80b": (16, 32)}  # (key heads, value heads); head dims 128, conv kernel 4


def build(n: int, k_spec: int, dtype: torch.dtype, heads: tuple[int, int], seed: int):
    from atom_models.gdn_meta import GDNVerifyMeta, GDNWeights
    from atom_models.gdn_state import GDNGeometry, GDNLayerState

    hk, hv = heads
    geo = GDNGeometry(hk, hv, 128, 128, 4, num_speculative_tokens=k_spec)
    q_len, conv_dim = 1 + k_spec, geo.conv_dim
    gen = torch.Generator().manual_seed(seed)
    proj = torch.randn(n * q_len, conv_dim + geo.value_dim, generator=gen).to(dtype)  # [q | k | v | z]
    ba = (torch.randn(n * q_len, 2 * hv, generator=gen) * 2).to(dtype)
    weights = GDNWeights(
        conv_weight=(torch.randn(conv_dim, 4, generator=gen) * 0.5).to(dtype),
        conv_bias=None,
        A_log=torch.linspace(-2.0, 1.0, hv),
        dt_bias=(torch.randn(hv, generator=gen) * 0.5).to(dtype),
    )
    slots = torch.randperm(2 * n, generator=gen)[:n].to(torch.int32)
    accepted = torch.randint(1, q_len + 1, (n,), generator=gen, dtype=torch.int32)
    conv = torch.randn(2 * n, geo.conv_width, conv_dim, generator=gen).to(dtype)  # [S, W, C] storage
    ssm = torch.randn(2 * n, hv, 128, 128, generator=gen) * 0.05
    pending = torch.randn(2 * n, q_len, geo.pending_width, generator=gen) * 0.1
    pending[..., -hv:] = -torch.rand(2 * n, q_len, hv, generator=gen) * 0.3
    pos = torch.zeros(2 * n, 1, dtype=torch.int32)
    meta = GDNVerifyMeta(num_seqs=n, q_len=q_len, state_indices=slots, num_accepted=accepted)
    state = (conv, ssm, pending, pos)
    inputs = (proj[:, :conv_dim], ba[:, hv:], ba[:, :hv])  # mixed_qkv, b, a: row-strided views

    def fresh():
        c, s, p, pp = (t.clone() for t in state)
        return GDNLayerState(conv=c.transpose(1, 2), ssm=s, pending=p, pending_pos=pp)

    return geo, weights, inputs, meta, fresh


def run_step(form: str, kernels, geo, weights, inputs, meta, layer_state):
    from atom_kernels.ops.conv1d import cpu_native as conv_native
    from atom_kernels.ops.gated_delta_rule import cpu_native_verify
    from atom_models.gdn_pipeline import gdn_verify

    if form == "step":
        return gdn_verify(kernels, geo, weights, layer_state, *inputs, meta)
    with (
        mock.patch.object(cpu_native_verify, "usable", lambda *_: False),
        mock.patch.object(conv_native, "usable", lambda *_: False),
    ):
        return gdn_verify(kernels, geo, weights, layer_state, *inputs, meta)


def measure(kernels, forms, reps, threads, model, dtype_name, k_spec, n, profile) -> dict:
    torch.set_num_threads(threads)
    dtype = getattr(torch, dtype_name)
    geo, weights, inputs, meta, fresh = build(n, k_spec, dtype, MODELS[model], seed=n + k_spec)
    states = {f: fresh() for f in forms}
    times: dict[str, list[float]] = {f: [] for f in forms}
    outs = {}
    for rep in range(reps + 2):
        for f in forms:
            t0 = time.perf_counter()
            outs[f] = run_step(f, kernels, geo, weights, inputs, meta, states[f])
            if rep >= 2:
                times[f].append(time.perf_counter() - t0)
    row = {
        "model": model,
        "dtype": dtype_name,
        "k": k_spec,
        "n": n,
        "threads": threads,
        **{f"{f}_ms": statistics.median(times[f]) * 1e3 for f in forms},
    }
    if "step" in forms and "torch_prep" in forms:
        row["speedup"] = row["torch_prep_ms"] / row["step_ms"]
        a, b = states["step"], states["torch_prep"]
        row["max_diff"] = {
            "out": (outs["step"].float() - outs["torch_prep"].float()).abs().max().item(),
            "ssm": (a.ssm - b.ssm).abs().max().item(),
            "pending": (a.pending - b.pending).abs().max().item(),
            "conv": (a.conv.float() - b.conv.float()).abs().max().item(),
            "pending_pos_equal": bool(torch.equal(a.pending_pos, b.pending_pos)),
        }
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        row["profile"] = {}
        for f in forms:
            with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(reps):
                    run_step(f, kernels, geo, weights, inputs, meta, states[f])
            events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
            row["profile"][f] = [
                {
                    "op": e.key,
                    "self_us_per_step": e.self_cpu_time_total / reps,
                    "calls_per_step": e.count / reps,
                }
                for e in events[:12]
            ]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--ns", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--models", nargs="+", default=["bundled"], choices=list(MODELS))
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from atom_kernels import select_kernels
    from atom_kernels.ops.gated_delta_rule import cpu_native_verify

    t0 = time.perf_counter()
    built = cpu_native_verify._library() is not None
    meta = {
        "build_or_load_s": time.perf_counter() - t0,
        "c_step_built": built,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_avg": os.getloadavg(),
        "torch": torch.__version__,
    }
    forms = ["step", "torch_prep"] if built else ["torch_prep"]
    rows = []
    for model in args.models:
        for dtype_name in args.dtypes:
            kernels = select_kernels("cpu", getattr(torch, dtype_name), backend="cpu")
            for threads in args.threads:
                for k_spec in args.ks:
                    for n in args.ns:
                        row = measure(
                            kernels, forms, args.reps, threads, model, dtype_name, k_spec, n, args.profile
                        )
                        rows.append(row)
                        print(
                            json.dumps({k: v for k, v in row.items() if k != "profile"}, default=float),
                            flush=True,
                        )
                        for f, table in row.get("profile", {}).items():
                            print(f"  {f}: " + ", ".join(
                                f"{e['op']} {e['self_us_per_step']:.0f}us x{e['calls_per_step']:g}" for e in table
                            ), flush=True)  # fmt: skip
    meta["load_avg_end"] = os.getloadavg()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=float) + "\n")


if __name__ == "__main__":
    main()
