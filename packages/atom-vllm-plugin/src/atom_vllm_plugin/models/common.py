"""Pieces both model wrappers share: kernel selection, GDN state spec from vLLM's config, checkpoint dir."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch
from atom_kernels import select_kernels
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator, is_conv_state_dim_first

from atom_vllm_plugin.config import AtomVllmConfig, from_vllm
from atom_vllm_plugin.layers.gdn_state import GDNStateSpec


def kernels_for(vllm_config: Any, dtype: torch.dtype):
    return select_kernels(device=torch.device(vllm_config.device_config.device), dtype=dtype)


def gdn_state_spec(vllm_config: Any, cfg: AtomVllmConfig | None = None) -> GDNStateSpec:
    """The GDN state every target GDN layer gets. The plugin computes the whole model on each TP rank
    (atom-models has no tensor parallelism), so the state is the full per-layer state, not a 1/TP shard.
    """
    cfg = cfg or from_vllm(vllm_config, "target")
    conv_dtype, ssm_dtype = MambaStateDtypeCalculator.gated_delta_net_state_dtype(
        vllm_config.model_config.dtype,
        vllm_config.cache_config.mamba_cache_dtype,
        vllm_config.cache_config.mamba_ssm_cache_dtype,
    )
    return GDNStateSpec.from_config(
        cfg.model, cfg.num_speculative_tokens, conv_dtype, ssm_dtype, conv_dim_first=is_conv_state_dim_first()
    )


def checkpoint_dir(model_config: Any) -> str:
    """Local directory of the checkpoint vLLM serves (resolving a hub id through vLLM's own download)."""
    path = model_config.model
    if os.path.isdir(path):
        return path
    from vllm.model_executor.model_loader.weight_utils import download_weights_from_hf

    return download_weights_from_hf(
        path, cache_dir=None, allow_patterns=["*.safetensors", "*.json"], revision=model_config.revision
    )


def start_vllm_load_clock(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Advance vLLM's lazy weight iterator by one tensor (one small read) and leave the rest unread.

    atom-models reads the checkpoint itself, but vLLM 0.32's DefaultModelLoader starts its "Loading weights
    took ... seconds" clock only when that iterator is first advanced; left untouched, it logged the
    process uptime instead (e.g. 6006 s for a 20 s load).
    """
    next(iter(weights), None)


def all_parameter_names(module: torch.nn.Module) -> set[str]:
    """What vLLM's loader checks the returned "loaded" set against."""
    return {name for name, _ in module.named_parameters()}
