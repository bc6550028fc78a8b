"""MoE router at decode sizes: ``moe_gate_router``'s one launch against the Linear (cuBLAS) + ``moe_router``.

Shapes of Qwen3-Next-80B-A3B with the shared expert folded in: H = 2048, 512 routed experts + the shared
gate row (router weight padded to 520 rows), top-10, T = 1, 2, 4, 8 tokens. Times are CUDA-graph replays
(launch gaps removed), so they are what a graphed decode step pays per MoE layer; the fused launch's
``block_e`` (router rows per program) and ``num_warps`` are swept (``--quick``: only the defaults, the
configuration the model runs; ``--tokens``: the token counts). ``exact_mismatches``: of ``--exact`` draws of
a sparse hidden state (4 entries of +-2^k, so that the Linear's sums are exact and cuBLAS and the fused
launch see the same bf16 logits, with many exact ties), the tokens whose fused weights (bit for bit) or
ids differ from ``moe_router``'s; it must be 0. ``--out``: ``gate_router_h200.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

H, E, ROWS, TOP_K = 2048, 512, 520, 10


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--tokens", default="1,2,4,8", help="token counts, comma-separated (default 1,2,4,8)")
    ap.add_argument("--quick", action="store_true", help="only the default block_e and num_warps")
    ap.add_argument("--exact", type=int, default=300, help="draws of the exactness check per case")
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    out = common.out_dir(args.out)
    device = common.require_cuda()
    ceil = common.ceilings(out, device)
    from atom_kernels.ops.moe import triton as moe
    from atom_kernels.ops.moe.triton_gate_router import BLOCK_E, moe_gate_router

    w = torch.randn(ROWS, H, device=device, dtype=torch.bfloat16) * H**-0.5
    tickets = torch.zeros(1, dtype=torch.int32, device=device)
    rows = []
    gen = torch.Generator(device=device).manual_seed(0)

    def exact_mismatches(fused, t: int) -> int:
        bad = 0
        for _ in range(args.exact):
            x = torch.zeros(t, H, device=device, dtype=torch.bfloat16)
            cols = torch.randint(0, H, (t, 4), device=device, generator=gen)
            mags = 2.0 ** torch.randint(0, 5, (t, 4), device=device, generator=gen)
            signs = torch.randint(0, 2, (t, 4), device=device, generator=gen) * 2 - 1
            x.scatter_(1, cols, (mags * signs).to(torch.bfloat16))
            want_w, want_ids = moe.moe_router(F.linear(x, w)[:, : E + 1], TOP_K, True, 1)
            got_w, got_ids = fused(x)
            same_w = torch.equal(got_w.view(torch.int32), want_w.view(torch.int32))
            bad += int(not (same_w and torch.equal(got_ids, want_ids)))
        return bad

    for t in tokens:
        x = torch.randn(t, H, device=device, dtype=torch.bfloat16)
        nbytes = (E + 1) * H * 2

        def two_launches(x=x):
            return moe.moe_router(F.linear(x, w)[:, : E + 1], TOP_K, True, 1)

        ref_w, ref_ids = two_launches()
        ms = common.time_ms(two_launches, graph=True)
        rows.append(common.row(bench="gate_router", case=f"T={t}", impl="cublas linear + moe_router", ms=ms,
                               ceil=ceil, nbytes=nbytes))  # fmt: skip
        for block_e in (BLOCK_E,) if args.quick else (1, 2, 4, 8):
            for warps in (4,) if args.quick else (2, 4, 8):

                def fused(x=x, block_e=block_e, warps=warps):
                    return moe_gate_router(x, w, E, TOP_K, True, 1, tickets=tickets, block_e=block_e,
                                           num_warps=warps, max_fused_tokens=8)  # fmt: skip

                got_w, got_ids = fused()
                same = bool(torch.equal(got_ids, ref_ids))
                ms = common.time_ms(fused, graph=True)
                rows.append(common.row(bench="gate_router", case=f"T={t}", impl=f"fused e{block_e} w{warps}",
                                       ms=ms, ceil=ceil, nbytes=nbytes, same_ids=same,
                                       max_weight_diff=float((got_w - ref_w).abs().max()),
                                       exact_mismatches=exact_mismatches(fused, t)))  # fmt: skip
        best = min((r for r in rows if r["case"] == f"T={t}" and "fused" in r["impl"]), key=lambda r: r["ms"])
        base = next(r for r in rows if r["case"] == f"T={t}" and "cublas" in r["impl"])
        print(f"T={t}: cublas+router {base['ms'] * 1e3:.2f} us, best fused {best['impl']} "
              f"{best['ms'] * 1e3:.2f} us (ids equal: {best['same_ids']}, exact mismatches "
              f"{best['exact_mismatches']} of {args.exact})", flush=True)  # fmt: skip
    common.write_json(
        out / "gate_router_h200.json", {"env": common.environment(), "ceilings": ceil, "rows": rows}
    )
    common.print_table(
        rows, ["case", "impl", "ms", "frac_copy", "same_ids", "max_weight_diff", "exact_mismatches"]
    )


if __name__ == "__main__":
    main()
