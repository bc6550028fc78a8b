"""The cpu backend's GDN decode and verify calls, this tree against a base revision, in one process.

Per call of one GDN layer on the bundled model's shapes (2 key heads, 4 value heads, head dims 128, conv
kernel 4), bf16 or float32 tokens, a float32 state pool and pending pool, ``N`` sequences on scattered
slots of a pool of ``2N``, the plugin's layouts (the conv output's q / k / v views, the raw gates as column
slices of one projection, ``A_log`` float32 and ``dt_bias`` in the token dtype):

- ``op``: the gated delta rule op alone, ``gated_delta_rule_recurrent`` (decode, one token per sequence)
  or ``gated_delta_rule_verify`` (``k + 1`` tokens, every acceptance count);
- ``layer``: ``atom_models.gdn_pipeline.gdn_decode`` / ``gdn_verify`` (the conv update, the split, the op
  and the pending bookkeeping) with the ``cpu`` kernels.

``base`` runs the gated delta rule's cpu modules (the op, its C passes) of the git revision ``--base``
(extracted with ``git archive``, imported under module objects of their own), ``new`` this tree's; every
other op (the conv update, ...) is this tree's in both.
The two alternate call by call, each on its own copy of the pools, so the machine's load hits them alike;
each call is timed in CPU seconds of the process (``time.process_time``: other processes' time on the
shared cores does not count), one thread by default; the median of ``--reps`` calls after three warm-up
calls is reported, with the largest difference of the outputs and pools between the two.

    uv run --no-sync python benchmarks/cpu_gdn_core.py --out benchmarks/results/cpu_gdn_core.json
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HK, HV, D, CONV = 2, 4, 128, 4
REPO = Path(__file__).resolve().parents[1]
SRC = "packages/atom-kernels/src"
PACKAGE = "atom_kernels.ops.gated_delta_rule"
SWAPPED = tuple(f"{PACKAGE}.{m}" for m in ("cpu_native", "cpu_native_verify", "cpu"))
"""The modules taken from the base revision, in import order (the C passes, their callers)."""


def load_base_ops(ref: str, into: Path):
    """The gated delta rule's cpu module of git revision ``ref``: :data:`SWAPPED` loaded from that revision
    (each under its own module object, the other atom_kernels modules shared with this tree's; the
    package's torch custom ops cannot be registered twice in one process), this tree's put back after."""
    paths = [f"{SRC}/{name.replace('.', '/')}.py" for name in SWAPPED]
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", ref, *paths], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    package = importlib.import_module(PACKAGE)
    mine = {name: sys.modules[name] for name in SWAPPED}
    try:
        for name, path in zip(SWAPPED, paths):
            spec = importlib.util.spec_from_file_location(name, into / path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            setattr(package, name.rsplit(".", 1)[1], module)
            spec.loader.exec_module(module)
        return sys.modules[SWAPPED[-1]]
    finally:
        for name, module in mine.items():
            sys.modules[name] = module
            setattr(package, name.rsplit(".", 1)[1], module)


def build(n: int, k_spec: int, dtype: torch.dtype, seed: int):
    from atom_models.gdn_meta import GDNDecodeMeta, GDNVerifyMeta, GDNWeights
    from atom_models.gdn_state import GDNGeometry, GDNLayerState

    geo = GDNGeometry(HK, HV, D, D, CONV, num_speculative_tokens=max(k_spec, 1))
    q_len, conv_dim = 1 + k_spec, geo.conv_dim
    gen = torch.Generator().manual_seed(seed)
    proj = torch.randn(n * q_len, conv_dim + geo.value_dim, generator=gen).to(dtype)  # [q | k | v | z]
    ba = (torch.randn(n * q_len, 2 * HV, generator=gen) * 2).to(dtype)
    weights = GDNWeights(
        conv_weight=(torch.randn(conv_dim, CONV, generator=gen) * 0.5).to(dtype),
        conv_bias=None,
        A_log=torch.linspace(-2.0, 1.0, HV),
        dt_bias=(torch.randn(HV, generator=gen) * 0.5).to(dtype),
    )
    slots = torch.randperm(2 * n, generator=gen)[:n].to(torch.int32)
    accepted = torch.randint(1, q_len + 1, (n,), generator=gen, dtype=torch.int32)
    conv = torch.randn(2 * n, geo.conv_width, conv_dim, generator=gen).to(dtype)  # [S, W, C] storage
    ssm = torch.randn(2 * n, HV, D, D, generator=gen) * 0.05
    pending = torch.randn(2 * n, geo.num_verify_tokens, geo.pending_width, generator=gen) * 0.1
    pending[..., -HV:] = -torch.rand(2 * n, geo.num_verify_tokens, HV, generator=gen) * 0.3
    pos = torch.zeros(2 * n, 1, dtype=torch.int32)
    if k_spec == 0:
        meta = GDNDecodeMeta(num_seqs=n, token_start=0, state_indices=slots)
    else:
        meta = GDNVerifyMeta(num_seqs=n, q_len=q_len, state_indices=slots, num_accepted=accepted)
    inputs = (proj[:, :conv_dim], ba[:, HV:], ba[:, :HV])  # mixed_qkv, b, a: row-strided views

    def fresh():  # a decode runs as without speculative decoding: no pending tokens
        c, s, p, pp = (t.clone() for t in (conv, ssm, pending, pos))
        if k_spec == 0:
            p = pp = None
        return GDNLayerState(conv=c.transpose(1, 2), ssm=s, pending=p, pending_pos=pp)

    return geo, weights, inputs, meta, fresh


def k_of(meta) -> int:
    """0 for a decode's metadata, else the verify's draft tokens ``q_len - 1``."""
    return getattr(meta, "q_len", 1) - 1 if hasattr(meta, "num_accepted") else 0


def op_call(gdr_cpu, geo, weights, inputs, meta, st):
    """The op alone on the inputs the layer hands it (the conv output taken as the raw projection)."""
    x, b, a = inputs
    decode = k_of(meta) == 0
    n, q_len = meta.num_seqs, 1 if decode else meta.q_len
    q, k, v = geo.split_qkv(x.view(n, q_len, -1))
    a, b = a.view(n, q_len, -1), b.view(n, q_len, -1)
    gates = {"A_log": weights.A_log, "dt_bias": weights.dt_bias}
    if decode:
        return gdr_cpu.gated_delta_rule_recurrent(
            q, k, v, a, b, st.ssm, meta.state_indices, geo.scale, True, **gates
        )
    return gdr_cpu.gated_delta_rule_verify(
        q, k, v, a, b, st.ssm, st.pending, meta.state_indices, meta.num_accepted, geo.scale, True,
        pending_pos=st.pending_pos, **gates,
    )  # fmt: skip


def layer_call(kernels, geo, weights, inputs, meta, st):
    from atom_models.gdn_pipeline import gdn_decode, gdn_verify

    fn = gdn_decode if k_of(meta) == 0 else gdn_verify
    return fn(kernels, geo, weights, st, *inputs, meta)


def measure(impls, what, reps, dtype_name, k_spec, n) -> dict:
    dtype = getattr(torch, dtype_name)
    geo, weights, inputs, meta, fresh = build(n, k_spec, dtype, seed=n + 7 * k_spec)
    states = {f: fresh() for f in impls}
    times: dict[str, list[float]] = {f: [] for f in impls}
    outs = {}
    for rep in range(reps + 3):
        for f, (kernels, gdr_cpu) in impls.items():
            t0 = time.process_time()
            if what == "op":
                outs[f] = op_call(gdr_cpu, geo, weights, inputs, meta, states[f])
            else:
                outs[f] = layer_call(kernels, geo, weights, inputs, meta, states[f])
            if rep >= 3:
                times[f].append(time.process_time() - t0)
    row = {"what": what, "dtype": dtype_name, "k": k_spec, "n": n}
    row.update({f"{f}_us": statistics.median(times[f]) * 1e6 for f in impls})
    row["speedup"] = row["base_us"] / row["new_us"]
    a, b = states["new"], states["base"]
    row["max_diff"] = {
        "out": (outs["new"].float() - outs["base"].float()).abs().max().item(),
        "ssm": (a.ssm - b.ssm).abs().max().item(),
        "pending": (a.pending - b.pending).abs().max().item() if k_spec else None,
        "pending_pos_equal": bool(torch.equal(a.pending_pos, b.pending_pos)) if k_spec else None,
    }
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="main", help="git revision of the baseline atom-kernels package")
    ap.add_argument("--reps", type=int, default=201)
    ap.add_argument("--ns", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 1, 3], help="0: decode; k >= 1: verify")
    ap.add_argument("--what", nargs="+", default=["op", "layer"], choices=["op", "layer"])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from atom_kernels import select_kernels
    from atom_kernels.ops.gated_delta_rule import cpu as gdr_cpu

    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", args.base], capture_output=True, text=True, check=True
    ).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        base_cpu = load_base_ops(args.base, Path(tmp))
        meta = {
            "base": args.base,
            "base_commit": commit,
            "threads": args.threads,
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "load_avg": os.getloadavg(),
            "torch": torch.__version__,
        }
        rows = []
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            kernels = select_kernels("cpu", dtype, backend="cpu")
            base_kernels = dataclasses.replace(
                kernels,
                gated_delta_rule_recurrent=base_cpu.gated_delta_rule_recurrent,
                gated_delta_rule_verify=base_cpu.gated_delta_rule_verify,
            )
            impls = {"base": (base_kernels, base_cpu), "new": (kernels, gdr_cpu)}
            for what in args.what:
                for k_spec in args.ks:
                    for n in args.ns:
                        row = measure(impls, what, args.reps, dtype_name, k_spec, n)
                        rows.append(row)
                        print(json.dumps(row, default=float), flush=True)
    meta["load_avg_end"] = os.getloadavg()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=float) + "\n")


if __name__ == "__main__":
    main()
