"""Prefix caching's whole-slot GDN copies at Qwen3-Next-80B shapes on the GPU: per-layer loop vs one launch.

One step's copies of one Mamba group: 36 GDN layers, each copying its conv (bf16, stored ``[W, C]``, read
through the transposed view), ssm (float32 ``[32, 128, 128]``), pending and pending_pos rows (k = 1) from
``n`` source slots to ``n`` destination slots, in vLLM's layout (one pool of pages per layer, 64-byte
padded pages). Forms:

- ``loop``: per layer ``atom_models.testing.copy_slots`` (one ``index_select`` + ``index_copy_`` per
  tensor: 36 x 4 x 2 launches), the plugin's copies before ``SlotCopier``;
- ``slot_copier``: one ``SlotCopier.copy`` on the triton backend (one launch);
- ``slot_copier_padded``: the same with fixed-size ``[256]`` index tensors, the real pairs first and -1 after
  (what a caller with persistent buffers passes);
- ``slot_copier_graph``: the padded call replayed from a CUDA graph (launch cost removed).

Bytes: each copied row read once and written once. Each form's result is checked against the loop's, and
the graph is replayed with other pairs written into its index buffers.

Usage: python benchmarks/gpu/bench_slot_copies.py [--out DIR] [--quick]
"""

# ruff: noqa: B023  (closures are timed inside the loop iteration that made them)
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "packages/atom-core/tests/data/qwen3-next-80b-a3b-instruct.json"
PADDED = 256


def main() -> None:
    args, out, device, ceil = common.bench_setup(__doc__, quick_help="pairs 1 and 8 only")
    from atom_core import Qwen3NextConfig
    from atom_kernels import select_kernels
    from atom_models.gdn_snapshot import SlotCopier
    from atom_models.gdn_state import GDNGeometry
    from atom_models.testing import copy_slots, paged_gdn_states

    config = Qwen3NextConfig.from_hf(json.loads(CONFIG.read_text()))
    geo = GDNGeometry.from_config(config, 1)
    pairs_list = [1, 8] if args.quick else [1, 2, 8, 32]
    slots = 2 * max(pairs_list)
    states, pools = paged_gdn_states(geo, len(config.linear_attention_layers), slots, device=device)
    kern = select_kernels(device, torch.bfloat16)
    assert kern.backend_of("copy_rows") == "triton", kern.backend_of("copy_rows")
    copier = SlotCopier(kern, states)
    slot_bytes = sum(copier.rows.row_bytes)
    rows = []
    for n in pairs_list:
        s = torch.arange(n, device=device)
        d = torch.arange(n, 2 * n, device=device)
        ps = torch.full((PADDED,), -1, dtype=torch.int64, device=device)
        pd = ps.clone()
        ps[:n], pd[:n] = s, d

        def loop():
            for st in states:
                copy_slots(st, s, d)

        forms = {
            "loop": loop,
            "slot_copier": lambda: copier.copy(s, d),
            "slot_copier_padded": lambda: copier.copy(ps, pd),
        }
        before = [p.clone() for p in pools]
        loop()
        expect = [p.clone() for p in pools]
        for name, fn in forms.items():
            for p, b in zip(pools, before):  # destinations back to their own (random) values
                p.copy_(b)
            fn()
            torch.cuda.synchronize()
            if not all(torch.equal(p, e) for p, e in zip(pools, expect)):
                raise RuntimeError(f"{name}: pools differ from the loop's after n = {n}")
        nbytes = 2 * n * slot_bytes
        for name, fn in forms.items():
            rows.append(common.row(bench="slot_copies", case=f"pairs={n}", impl=name, ms=common.time_ms(fn),
                                   ceil=ceil, nbytes=nbytes))  # fmt: skip
        ms = common.time_ms(lambda: copier.copy(ps, pd), graph=True)
        rows.append(common.row(bench="slot_copies", case=f"pairs={n}", impl="slot_copier_graph", ms=ms,
                               ceil=ceil, nbytes=nbytes))  # fmt: skip
    # capturable: one graph, new pairs written into its index buffers before each replay
    ps = torch.full((PADDED,), -1, dtype=torch.int64, device=device)
    pd = ps.clone()
    copier.copy(ps, pd)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        copier.copy(ps, pd)
    for pairs in ([(0, 5)], [(3, 1), (2, 7)]):
        ps.fill_(-1)
        pd.fill_(-1)
        for i, (a, b) in enumerate(pairs):
            ps[i], pd[i] = a, b
        graph.replay()
        torch.cuda.synchronize()
        for st in states:
            for t in st.tensors():
                for a, b in pairs:
                    if not torch.equal(t[b], t[a]):
                        raise RuntimeError(f"graph replay with pairs {pairs}: row {b} differs from row {a}")
    common.print_table(rows, ["case", "impl", "ms", "gbps", "frac_copy"])
    common.write_json(
        out / f"slot_copies_{common.gpu_tag(device)}.json",
        {"environment": common.environment(), "ceilings": ceil, "layers": len(states), "k": 1,
         "slot_bytes_all_layers": slot_bytes, "chunks": int(copier.rows.chunks.shape[0]), "rows": rows},
    )  # fmt: skip


if __name__ == "__main__":
    main()
