"""Programmatic dependent launch (PDL, Hopper) on a chain of decode-sized GEMVs in one CUDA graph.

A decode step at batch 1 is ~600 small kernels in a row, each waiting for the previous one to finish
before it launches and starts streaming its weights. With PDL a kernel is launched while its
predecessor still runs; ``griddepcontrol.wait`` (``gdc_wait``) holds it until the predecessor's memory is
visible, and everything before the wait (its weight loads) overlaps the predecessor. This script measures
what that is worth on one chain ``x_{i+1} = W_i x_i`` of ``L`` distinct bf16 weights (no L2 reuse), captured
in a CUDA graph, per kernel:

- ``serial``: plain launches (each kernel waits for the previous one to complete);
- ``pdl``: PDL launches, ``gdc_wait`` then ``gdc_launch_dependents`` first (only the launch overlaps);
- ``pdl_prefetch``: as ``pdl``, each program loads its weight rows into registers before ``gdc_wait``;
- ``pdl_l2``: as ``pdl``, each program asks the L2 for its weight rows line by line
  (``prefetch.global.L2``, ``_prefetch_rows``) before ``gdc_wait``;
- ``early`` / ``early_l2``: ``gdc_launch_dependents`` before ``gdc_wait`` (the next kernel may launch
  while this one still waits), without / with the L2 prefetch.

Every variant's result is checked against the serial one. ``--out``: ``pdl_<gpu>.json``. On the chain the
L2 prefetch is the fastest form (H100: 4.24 against 4.95 us per 8 MB kernel); in the 32-layer FP8 engine
step the product kernels with it were slower (``pdl_launch_modes_h100_32layers.json``), so they load
nothing before the wait.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

# variant -> (PDL: 0 off, 1 wait then trigger, 2 trigger then wait; PREFETCH: 0 none, 1 registers, 2 L2)
VARIANTS = {
    "serial": (0, 0),
    "pdl": (1, 0),
    "pdl_prefetch": (1, 1),
    "pdl_l2": (1, 2),
    "early": (2, 0),
    "early_l2": (2, 2),
}


@triton.jit
def _prefetch_rows(ptr, rows, K, LINES: tl.constexpr):
    """Ask the L2 for every 128-byte line of the bf16 rows ``rows`` of the ``[., K]`` matrix at ``ptr``."""
    lines = tl.arange(0, LINES) * 64  # bf16 elements per line
    for c in range(0, K, LINES * 64):
        ptrs = ptr + rows[:, None].to(tl.int64) * K + tl.minimum(c + lines, K - 1)[None, :]
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;",
            "=r,l",
            [ptrs],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@triton.jit
def _gemv_kernel(w_ptr, x_ptr, y_ptr, K, PDL: tl.constexpr, PREFETCH: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :]
    if PREFETCH == 1:
        w = tl.load(w_ptrs).to(tl.float32)  # independent of the previous kernel: before the wait
    if PREFETCH == 2:
        _prefetch_rows(w_ptr, rows, K, 16)
    if PDL == 2:
        gdc_launch_dependents()
        gdc_wait()
    elif PDL == 1:
        gdc_wait()
        gdc_launch_dependents()
    if PREFETCH != 1:
        w = tl.load(w_ptrs).to(tl.float32)
    x = tl.load(x_ptr + cols)
    tl.store(y_ptr + rows, tl.sum(w * x[None, :], 1))


def chain(ws, xs, variant: str, block_n: int) -> None:
    pdl, prefetch = VARIANTS[variant]
    for i, w in enumerate(ws):
        n, k = w.shape
        _gemv_kernel[(n // block_n,)](
            w, xs[i], xs[i + 1], k, PDL=pdl, PREFETCH=prefetch, BLOCK_N=block_n, BLOCK_K=k, num_warps=4,
            launch_pdl=pdl > 0,
        )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--layers", type=int, default=96)
    args = ap.parse_args()
    out = common.out_dir(args.out)
    device = common.require_cuda()
    ceil = common.ceilings(out, device)
    rows = []
    for n, block_n in ((256, 4), (2048, 8)):  # 128 KB (launch-bound) and 8 MB (streaming) per weight
        k = n if n == 256 else 2048
        ws = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * k**-0.5 for _ in range(args.layers)]
        base = {}
        x0 = torch.randn(max(n, k), device=device)
        for variant in VARIANTS:
            xs = [torch.zeros(max(n, k), device=device) for _ in range(args.layers + 1)]
            xs[0].copy_(x0)
            chain(ws, xs, variant, block_n)  # compile
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                chain(ws, xs, variant, block_n)
            graph.replay()
            torch.cuda.synchronize()
            if variant == "serial":
                base = {i: x.clone() for i, x in enumerate(xs)}
            ok = all(torch.equal(xs[i], base[i]) for i in base)
            diff = max(float((xs[i] - base[i]).abs().max()) for i in base)
            finite = all(bool(x.isfinite().all()) for x in xs)
            ms = common.time_ms(graph.replay, warmup_ms=20, rep_ms=100)
            per = ms * 1e3 / args.layers
            nbytes = n * k * 2
            r = {
                "bench": "pdl_chain",
                "weight_bytes": nbytes,
                "variant": variant,
                "us_per_kernel": per,
                "frac_copy_bw": nbytes / (per * 1e-6) / (ceil["copy_gbps"] * 1e9),
                "equal_to_serial": ok,
                "max_abs_diff": diff,
                "finite": finite,
            }
            rows.append(r)
            print(r, flush=True)
    common.write_json(
        out / f"pdl_{common.gpu_tag(device)}.json",
        {"env": common.environment(), "ceilings": ceil, "rows": rows},
    )


if __name__ == "__main__":
    main()
