"""The MoE router and the GDN conv update at 80B shapes: each op's two Triton programs side by side, per M.

- ``router``: ``moe_router`` on the logits the model's router Linear gives (bf16, ``[M, 520]`` rows, the
  first 513 columns read: 512 routed experts + the shared gate), top-10, renormalised: ``variant="block"``
  (four warps per token) against ``variant="warp"`` (one warp per token); the router Linear alone
  (cuBLAS) and ``moe_gate_router`` (what the model runs: the fused launch up to its ``FUSED_MAX_T``, else
  the Linear + ``moe_router`` with the default variant) for context. ``same``: ids and weight bits equal.
- ``conv``: ``causal_conv1d_update`` over ``N = M / Q`` sequences (C = 8192 channels, width 4, bf16 state
  ``[S, C, K - 2 + Q]``), ``variant="columns"`` against ``variant="tile"``, on a channel-major state (the
  standalone engine's, and the plugin's with ``VLLM_SSM_CONV_STATE_LAYOUT=DS``) and on the transposed
  one (``[S, W, C]``: vLLM's default buffer, what the plugin runs). ``same``: outputs and states
  bit-equal after one call from the same state.

Times are CUDA-graph replays (``common.time_ms(graph=True)``, medians), as a graphed step pays them.
``default``: the variant each op picks at that M without the argument (the size thresholds
``ROUTER_WARP_MIN_T`` and ``CONV_TILE_MIN_TOKENS``).

    python benchmarks/gpu/bench_router_conv.py --out $OUT        # M = 1 2 16 128 512 1024, Q = 1 and 2

Output ``router_conv_<gpu>.json``.
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

H, E, ROWS, TOP_K = 2048, 512, 520, 10
CONV_C, CONV_K = 2 * 16 * 128 + 32 * 128, 4


def router_rows(ms_list, device, ceil, rep_ms) -> list[dict]:
    from atom_kernels.ops.moe import triton as moe
    from atom_kernels.ops.moe.triton_gate_router import moe_gate_router

    g = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(ROWS, H, device=device, dtype=torch.bfloat16, generator=g) * H**-0.5
    tickets = torch.zeros(1, dtype=torch.int32, device=device)
    rows = []
    for m in ms_list:
        x = torch.randn(m, H, device=device, dtype=torch.bfloat16, generator=g)
        logits = F.linear(x, w)[:, : E + 1]
        nbytes = m * (E + 1) * 2 + m * (TOP_K + 1) * 12
        block = moe.moe_router(logits, TOP_K, True, 1, variant="block")
        warp = moe.moe_router(logits, TOP_K, True, 1, variant="warp")
        same = torch.equal(block[1], warp[1]) and torch.equal(
            block[0].view(torch.int32), warp[0].view(torch.int32)
        )
        default = "warp" if m >= moe.ROUTER_WARP_MIN_T else "block"
        case = f"router M={m}"
        for variant in ("block", "warp"):
            ms = common.time_ms(lambda v=variant: moe.moe_router(logits, TOP_K, True, 1, variant=v), graph=True,
                                rep_ms=rep_ms)  # fmt: skip
            rows.append(common.row(bench="router_conv", case=case, impl=f"moe_router {variant}", ms=ms, ceil=ceil,
                                   nbytes=nbytes, same=same, default=variant == default))  # fmt: skip
        ms = common.time_ms(lambda: F.linear(x, w), graph=True, rep_ms=rep_ms)
        rows.append(common.row(bench="router_conv", case=case, impl="router linear (cuBLAS, 520 rows)", ms=ms,
                               ceil=ceil, nbytes=ROWS * H * 2 + m * (H + ROWS) * 2))  # fmt: skip
        ms = common.time_ms(lambda: moe_gate_router(x, w, E, TOP_K, True, 1, tickets=tickets), graph=True,
                            rep_ms=rep_ms)  # fmt: skip
        rows.append(common.row(bench="router_conv", case=case, impl="moe_gate_router (model path)", ms=ms,
                               ceil=ceil, nbytes=ROWS * H * 2 + m * H * 2))  # fmt: skip
        print(f"{case}: block {rows[-4]['ms'] * 1e3:.2f} us, warp {rows[-3]['ms'] * 1e3:.2f} us, same {same}",
              flush=True)  # fmt: skip
    return rows


def conv_rows(ms_list, qs, device, ceil, rep_ms) -> list[dict]:
    from atom_kernels.ops.conv1d import triton as conv

    g = torch.Generator(device=device).manual_seed(1)
    weight = (torch.randn(CONV_C, CONV_K, device=device, generator=g) * 0.5).to(torch.bfloat16)
    rows = []
    for q in qs:
        for m in ms_list:
            n = max(1, m // q)
            width = CONV_K - 2 + q
            x = torch.randn(n, q, CONV_C, device=device, generator=g).to(torch.bfloat16)
            idx = torch.arange(1, n + 1, dtype=torch.int32, device=device)
            acc = None if q == 1 else torch.ones(n, dtype=torch.int32, device=device)
            major = torch.randn(n + 1, CONV_C, width, device=device, generator=g).to(torch.bfloat16)
            trans = major.transpose(1, 2).contiguous().transpose(1, 2)  # vLLM's [S, W, C] buffer
            same = {}
            for label, pool in (("", major), (" [S, W, C]", trans)):
                outs, states = [], []
                for variant in ("columns", "tile"):
                    s = pool.clone()
                    outs.append(conv.causal_conv1d_update(x, weight, None, s, idx, acc, variant=variant))
                    states.append(s)
                same[label] = torch.equal(outs[0], outs[1]) and torch.equal(states[0], states[1])
            nbytes = 2 * (2 * x.numel() + n * CONV_C * (CONV_K - 1) + n * CONV_C * width)
            default = "tile" if n * q >= conv.CONV_TILE_MIN_TOKENS else "columns"
            case = f"conv Q={q} M={n * q}"
            times = []
            for label, state in (("", major), (" [S, W, C]", trans)):
                for v in ("columns", "tile"):
                    ms = common.time_ms(lambda v=v, state=state: conv.causal_conv1d_update(x, weight, None, state, idx,
                                                                                          acc, variant=v),
                                        graph=True, rep_ms=rep_ms)  # fmt: skip
                    times.append(ms * 1e3)
                    rows.append(common.row(bench="router_conv", case=case, impl=f"conv {v}{label}", ms=ms, ceil=ceil,
                                           nbytes=nbytes, same=same[label],
                                           default=v == (default if not label else "columns")))  # fmt: skip
            print(f"{case}: [S, C, W] columns {times[0]:.2f} / tile {times[1]:.2f} us, [S, W, C] columns "
                  f"{times[2]:.2f} / tile {times[3]:.2f} us, same {same}", flush=True)  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--ms", default="1,2,16,128,512,1024", help="token counts M, comma-separated")
    ap.add_argument("--qs", default="1,2", help="conv tokens per sequence Q (1 + k), comma-separated")
    ap.add_argument("--ops", default="router,conv", help="router, conv or both")
    ap.add_argument("--rep-ms", type=int, default=50, help="timing window per case (ms)")
    args = ap.parse_args()
    ms_list = [int(v) for v in args.ms.split(",")]
    qs = [int(v) for v in args.qs.split(",")]
    out = common.out_dir(args.out)
    device = common.require_cuda()
    ceil = common.ceilings(out, device)
    rows = []
    if "router" in args.ops:
        rows += router_rows(ms_list, device, ceil, args.rep_ms)
    if "conv" in args.ops:
        rows += conv_rows(ms_list, qs, device, ceil, args.rep_ms)
    name = f"router_conv_{common.gpu_tag(device)}.json"
    common.write_json(out / name, {"env": common.environment(), "ceilings": ceil, "rows": rows})
    common.print_table(rows, ["case", "impl", "ms", "gbps", "frac_copy", "same", "default"])


if __name__ == "__main__":
    main()
