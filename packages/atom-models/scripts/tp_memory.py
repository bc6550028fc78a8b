"""Bytes one tensor-parallel rank holds: parameters (target + MTP, as built: FP8 where the config's
``quantization_config`` says so), GDN state per sequence and KV cache per token, for each TP size.

Models are built on the meta device (nothing allocated) with rank 0's layout (every rank holds the same
sizes). The KV cache counts the target's full-attention layers and the MTP layer, in the given cache dtype.

    .venv/bin/python packages/atom-models/scripts/tp_memory.py \
        --config packages/atom-core/tests/data/qwen3-next-80b-a3b-instruct-fp8.json --tp 1 2 4 --kv-cache-dtype fp8
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from atom_core import Qwen3NextConfig
from atom_core.paths import default_model_dir
from atom_kernels import select_kernels
from atom_models import DenseCoreFactory, Qwen3NextForCausalLM, Qwen3NextMTP
from atom_models.gdn_state import GDNGeometry
from atom_models.loader import convert_mtp_fp8, convert_target_fp8
from atom_models.parallel import RankWithoutGroup


def rank_bytes(cfg: Qwen3NextConfig, tp: int, k: int, kv_bytes: int) -> dict:
    kernels = select_kernels(torch.device("cpu"), torch.bfloat16)
    par = RankWithoutGroup(0, tp)
    with torch.device("meta"):
        target = Qwen3NextForCausalLM(
            cfg, DenseCoreFactory(kernels), kernels, dtype=torch.bfloat16, parallel=par
        )
        shared = (target.model.embed_tokens, target.lm_head)
        mtp = Qwen3NextMTP(
            cfg, DenseCoreFactory(kernels), kernels, *shared, dtype=torch.bfloat16, parallel=par
        )
        convert_target_fp8(target)
        convert_mtp_fp8(mtp)
    params = {id(p): p for m in (target, mtp) for p in m.parameters()}
    geo = GDNGeometry.from_config(cfg, k, target.layout)
    per_layer = (
        geo.conv_dim * geo.conv_width * 2  # bf16 conv history
        + geo.num_v_heads * geo.head_v_dim * geo.head_k_dim * 4  # float32 recurrent state
        + (geo.num_verify_tokens * geo.pending_width * 4 if geo.has_pending else 0)
    )
    attn_layers = len(cfg.full_attention_layers) + cfg.num_mtp_layers
    return {
        "tp": tp,
        "params_gb": sum(p.numel() * p.element_size() for p in params.values()) / 1e9,
        "gdn_mib_per_seq": len(cfg.linear_attention_layers) * per_layer / 2**20,
        "kv_kib_per_token": attn_layers * 2 * target.layout.num_kv_heads * cfg.head_dim * kv_bytes / 1024,
        "kv_heads": target.layout.num_kv_heads,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--config", type=Path, default=None, help="config.json or model dir (default: the tiny model)"
    )
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--k", type=int, default=1, help="speculative tokens (GDN pending tokens)")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto", help="auto: bf16")
    args = ap.parse_args()
    cfg = Qwen3NextConfig.from_hf(args.config or default_model_dir())
    kv_bytes = 1 if args.kv_cache_dtype == "fp8" else 2
    weights = "FP8 block-scaled" if cfg.quantization is not None else "bf16"
    print(
        f"{cfg.source}: {cfg.num_hidden_layers} layers + {cfg.num_mtp_layers} MTP, {weights} weights, k={args.k}"
    )
    for tp in args.tp:
        r = rank_bytes(cfg, tp, args.k, kv_bytes)
        print(
            f"  TP={tp}: parameters {r['params_gb']:.2f} GB per rank; GDN state {r['gdn_mib_per_seq']:.1f} MiB "
            f"per sequence; KV cache {r['kv_kib_per_token']:.1f} KiB per token ({r['kv_heads']} KV head(s) per rank)"
        )


if __name__ == "__main__":
    main()
