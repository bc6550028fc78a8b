"""Split-KV count of the paged-attention plan at small batch: the plan's choice against every power of two.

Decode (1 query token) and verification (2 and 4 query tokens) at batch 1, 8, 64 and context 1k and 8k,
Qwen3-Next-80B-A3B TP 1 shapes (16 query / 2 KV heads, head_dim 256, bf16 cache, block size 16). Each
``num_splits`` in 1..32 is timed by CUDA-graph replay on the same inputs, beside the default plan and its
choice; ``max_err_vs_default`` is the largest difference from the default plan's output (the merge of
partial results changes only the rounding).

Usage: python benchmarks/gpu/bench_attention_splits.py [--out DIR] [--quick]
"""

# ruff: noqa: B023  (closures are timed inside the loop iteration that made them)
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from bench_attention import BLOCK, HKV, HQ, D, make_paged  # noqa: E402

SPLITS = (1, 2, 4, 8, 16, 32)


def main() -> None:
    from atom_kernels.ops.paged_attention import triton as pa

    args, out, device, ceil = common.bench_setup(__doc__, quick_help="batch 1 and context 1k only")
    scale = D**-0.5
    rows = []
    for ctx in (1024,) if args.quick else (1024, 8192):
        for batch in (1,) if args.quick else (1, 8, 64):
            kc, vc, bt = make_paged(batch, ctx, BLOCK, torch.bfloat16, device, 3)
            kv_bytes = batch * ctx * HKV * D * 2 * 2
            for q_len in (1, 2, 4):
                q = torch.randn(batch * q_len, HQ, D, device=device, dtype=torch.bfloat16)
                seq_lens = torch.full((batch,), ctx, device=device, dtype=torch.int32)
                qsl = torch.arange(0, batch + 1, device=device, dtype=torch.int32) * q_len
                chosen = pa.plan(batch * q_len, batch, HKV, HQ // HKV, D, 2, bt.shape[1] * BLOCK, device)
                ref = pa.paged_attention(q, kc, vc, bt, seq_lens, qsl, scale)
                case = f"q={q_len} B={batch} ctx={ctx // 1024}k"
                for s in (None, *SPLITS):
                    cfg = None if s is None else {"num_splits": s}
                    fn = lambda: pa.paged_attention(q, kc, vc, bt, seq_lens, qsl, scale, config=cfg)  # noqa: E731
                    err = (fn().float() - ref.float()).abs().max().item()
                    ms = common.time_ms(fn, graph=True, rep_ms=20)
                    impl = f"plan ({chosen['num_splits']} splits)" if s is None else f"{s} splits"
                    rows.append(common.row(bench="attention_splits", case=case, impl=impl, ms=ms, ceil=ceil,
                                           nbytes=kv_bytes, flops=0.0, max_err_vs_default=err))  # fmt: skip
                    print(case, impl, f"{ms * 1e3:.1f} us", flush=True)
    common.write_json(
        out / "attention_splits_h200.json", {"env": common.environment(), "ceilings": ceil, "rows": rows}
    )
    common.print_table(rows, ["case", "impl", "ms", "frac_copy"])


if __name__ == "__main__":
    main()
