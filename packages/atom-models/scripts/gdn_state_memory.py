"""GDN state bytes per sequence of the standalone engine's cache layout, for k = 0..8 (the largest k
``atom_core.MAX_SPECULATIVE_TOKENS`` allows).

"before": 1 + k recurrent states per sequence, one per verify token (vLLM's per-token layout); "after":
the engine's layout, one committed state plus a float32 pending pool of 1 + k tokens
(``gated_delta_rule_verify``). Sizes come from ``EngineCaches`` built on the meta device (nothing
allocated); the conv state (model dtype, here bf16) is the same in both and listed apart.

    .venv/bin/python packages/atom-models/scripts/gdn_state_memory.py \
        [--config packages/atom-core/tests/data/qwen3-next-80b-a3b-instruct.json] [--ks 0 1 2 3 4 5 6 7 8]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from atom_core import MAX_SPECULATIVE_TOKENS, Qwen3NextConfig
from atom_core.paths import default_model_dir
from atom_models.engine.cache import EngineCaches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, nargs="+", default=None, help="config.json files or model dirs")
    ap.add_argument("--ks", type=int, nargs="+", default=list(range(MAX_SPECULATIVE_TOKENS + 1)))
    args = ap.parse_args()
    for path in args.config or [default_model_dir()]:
        cfg = Qwen3NextConfig.from_hf(path)
        print(
            f"{path}: {len(cfg.linear_attention_layers)} GDN layers of {cfg.num_hidden_layers}, "
            f"Hk={cfg.linear_num_key_heads} Hv={cfg.linear_num_value_heads} "
            f"Dk={cfg.linear_key_head_dim} Dv={cfg.linear_value_head_dim}, float32 recurrent state"
        )
        for k in args.ks:
            caches = EngineCaches(
                cfg,
                num_blocks=1,
                block_size=1,
                max_num_seqs=1,
                num_speculative_tokens=k,
                dtype=torch.bfloat16,
                device=torch.device("meta"),
            )
            b = caches.gdn_bytes_per_seq()
            before = (1 + k) * b["ssm"]
            after = b["ssm"] + b["pending"]
            print(
                f"  k={k}: before {before:>11,d} B ({before / 2**20:7.2f} MiB) -> after {after:>11,d} B "
                f"({after / 2**20:6.2f} MiB = state {b['ssm'] / 2**20:.2f} + pending {b['pending'] / 2**20:.3f}) "
                f"{before / after:.2f}x less; conv {b['conv'] / 2**20:.3f} MiB (unchanged)"
            )


if __name__ == "__main__":
    main()
