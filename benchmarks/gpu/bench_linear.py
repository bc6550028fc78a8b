"""Dense ``linear`` at decode sizes: the Triton GEMV (``atom_kernels`` op ``linear``) against ``F.linear`` (cuBLAS).

Shapes (bf16, K = 2048, the 80B model's hidden size): ``N = 64`` (GDN ``in_proj_ba`` at TP = 1: 2 x 32 value
heads), ``N = 16`` (TP = 4), ``N = 512`` and ``N = 1024`` (the widest output the GEMV takes by default);
``M = 1, 2, 4`` tokens (``--tokens``; 4 and 8 run the GEMV through ``max_m=8``, past the default
``GEMV_MAX_M``). Times are CUDA-graph replays of back-to-back calls (launch gaps removed; the GEMV launches
with PDL on sm_90+, as in a graphed decode step, cuBLAS without). ``cold``: consecutive calls read
different copies of the weight (>= 128 MB of copies, twice the H200's L2), so every call reads its weight
from DRAM as in a decode step, where the layers in between evict it; ``hot``: one weight, L2-resident
(full mode only). Rows: ``cublas`` (``F.linear``), ``gemv default`` (the op's own plan), and the sweep
``gemv bnB wW`` over ``block_n`` x ``num_warps`` (``--quick``: only N = 64 and 1024, ``block_n`` 1, 2, 4
at 4 warps, cold only; < 30 s on an H200). ``max_err``: max |GEMV - cuBLAS| (bf16 outputs; one bf16 ulp at
|y| ~ 4 is 0.031). ``--out``: ``linear_h200.json``.

Usage: python benchmarks/gpu/bench_linear.py [--out DIR] [--quick] [--tokens 1,2,4] [--n 64,1024]
"""

# ruff: noqa: B023  (closures are timed inside the loop iteration that made them)
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

K = 2048
COLD_BYTES = 128 << 20  # weight copies per cold case: twice the H200's 60 MB L2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--quick", action="store_true", help="N = 64 / 1024, block_n 1, 2, 4 at 4 warps, cold only"
    )
    ap.add_argument("--tokens", default=None, help="token counts, comma-separated (default 1,2,4)")
    ap.add_argument("--n", default=None, help="output features, comma-separated (default 16,64,512,1024)")
    args = ap.parse_args()
    out = common.out_dir(args.out)
    device = common.require_cuda()
    ceil = common.ceilings(out, device)
    from atom_kernels import registry
    from atom_kernels.ops._device import device_sms
    from atom_kernels.ops.linear.triton import plan

    gemv = registry.resolve("linear", device, torch.bfloat16, "triton").fn
    tokens = [int(t) for t in (args.tokens or "1,2,4").split(",")]
    widths = [int(n) for n in (args.n or ("64,1024" if args.quick else "16,64,512,1024")).split(",")]
    sweep = (
        [(bn, 4) for bn in (1, 2, 4)]
        if args.quick
        else [(bn, w) for bn in (1, 2, 4, 8, 16) for w in (1, 2, 4, 8)]
    )
    modes = ("cold",) if args.quick else ("cold", "hot")
    rep_ms = 20 if args.quick else 100  # per replay; the median of 10 replays is kept
    sms = device_sms(device)
    rows = []
    for n in widths:
        copies = max(1, -(-COLD_BYTES // (n * K * 2)))
        weights = torch.randn(copies, n, K, device=device, dtype=torch.bfloat16) * K**-0.5
        for m in tokens:
            x = torch.randn(m, K, device=device, dtype=torch.bfloat16)
            want = F.linear(x, weights[0])
            nbytes = (n * K + m * K + m * n) * 2
            default = plan(m, n, K, sms, max_m=8)
            impls = [
                ("cublas", lambda w: F.linear(x, w), None),
                ("gemv default", lambda w: gemv(x, w, max_m=8), default),
            ]
            impls += [(f"gemv bn{bn} w{nw}", lambda w, bn=bn, nw=nw: gemv(x, w, max_m=8, block_n=bn, num_warps=nw),
                       plan(m, n, K, sms, max_m=8, block_n=bn, num_warps=nw)) for bn, nw in sweep if bn <= n]  # fmt: skip
            for impl, fn, cfg in impls:
                err = float((fn(weights[0]).float() - want.float()).abs().max())
                for mode in modes:
                    turn = [0]

                    def call():  # cold: each captured call takes the next weight copy
                        i = turn[0] % copies if mode == "cold" else 0
                        turn[0] += 1
                        return fn(weights[i])

                    try:
                        ms = common.time_ms(call, rep_ms=rep_ms, graph=True)
                    except Exception as exc:  # record and go on
                        print(f"N={n} M={m} {impl} {mode} failed: {exc}", flush=True)
                        rows.append(dict(bench="linear", case=f"N={n} M={m} {mode}", impl=impl, ms=None,
                                         error=str(exc)[:300]))  # fmt: skip
                        continue
                    rows.append(common.row(bench="linear", case=f"N={n} M={m} {mode}", impl=impl, ms=ms, ceil=ceil,
                                           nbytes=nbytes, flops=2 * m * n * K, us=ms * 1e3, max_err=err,
                                           config=cfg))  # fmt: skip
            for mode in modes:
                case = [r for r in rows if r["case"] == f"N={n} M={m} {mode}" and r["ms"]]
                base = next((r for r in case if r["impl"] == "cublas"), None)
                dflt = next((r for r in case if r["impl"] == "gemv default"), None)
                best = min(
                    (r for r in case if r["impl"].startswith("gemv")), key=lambda r: r["ms"], default=None
                )
                if base and dflt and best:
                    print(f"N={n} M={m} {mode}: cublas {base['us']:.2f} us, gemv default {dflt['us']:.2f} us "
                          f"{dflt['config']}, best {best['impl']} {best['us']:.2f} us (max_err {best['max_err']:.3g})",
                          flush=True)  # fmt: skip
    common.write_json(out / "linear_h200.json", {"env": common.environment(), "ceilings": ceil, "rows": rows})
    common.print_table(rows, ["case", "impl", "us", "gbps", "frac_copy", "max_err"])


if __name__ == "__main__":
    main()
