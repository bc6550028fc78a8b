"""Cores of the standalone engine: paged attention and GDN with one state slot per sequence."""

from __future__ import annotations

import torch
from atom_core import Qwen3NextConfig
from torch import nn

from atom_models.engine.cache import EngineCaches
from atom_models.engine.context import StepContext
from atom_models.gdn_meta import GDNWeights
from atom_models.gdn_pipeline import gdn_forward
from atom_models.parallel import TPLayout


class PagedAttentionCore(nn.Module):
    def __init__(self, layer_idx: int, config: Qwen3NextConfig, caches: EngineCaches, kernels):
        super().__init__()
        self.layer_idx = layer_idx
        self.caches = caches
        self.kernels = kernels
        self.scale = config.head_dim**-0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        key_cache, value_cache = self.caches.kv[self.layer_idx]
        ks, vs = self.caches.kv_scales or (None, None)
        m = ctx.attn
        self.kernels.kv_cache_write(k, v, key_cache, value_cache, m.slot_mapping, ks, vs)
        return self.kernels.paged_attention(
            q, key_cache, value_cache, m.block_tables, m.seq_lens, m.query_start_loc, self.scale, ks, vs
        )


class SlotGDNCore(nn.Module):
    """The GDN pipeline (``atom_models.gdn_pipeline``) over the layer's slots in the engine's caches."""

    def __init__(self, layer_idx: int, config: Qwen3NextConfig, caches: EngineCaches, kernels):
        super().__init__()
        self.layer_idx = layer_idx
        self.caches = caches
        self.kernels = kernels

    def forward(self, mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, weights: GDNWeights, ctx):
        if ctx.gdn is None:
            raise ValueError(f"GDN layer {self.layer_idx}: the step context has no GDN metadata")
        state = self.caches.gdn[self.layer_idx]
        return gdn_forward(self.kernels, self.caches.gdn_geometry, weights, state, mixed_qkv, b, a, ctx.gdn)


class EngineCoreFactory:
    """``CoreFactory`` binding every layer to the engine's cache tensors."""

    def __init__(self, caches: EngineCaches, kernels):
        self.caches = caches
        self.kernels = kernels

    def attention(self, prefix: str, layer_idx: int, config: Qwen3NextConfig, layout: TPLayout) -> nn.Module:
        if layer_idx not in self.caches.kv:
            raise KeyError(f"{prefix}: no KV cache allocated for attention layer {layer_idx}")
        heads = self.caches.kv[layer_idx][0].shape[-2]
        if heads != layout.num_kv_heads:
            raise ValueError(
                f"{prefix}: the KV cache holds {heads} KV heads per block row, but this tensor-parallel rank "
                f"({layout.rank} of {layout.world_size}) has {layout.num_kv_heads}"
            )
        return PagedAttentionCore(layer_idx, config, self.caches, self.kernels)

    def gdn(self, prefix: str, layer_idx: int, config: Qwen3NextConfig, layout: TPLayout) -> nn.Module:
        if layer_idx not in self.caches.gdn:
            raise KeyError(f"{prefix}: no GDN state allocated for layer {layer_idx}")
        self.caches.gdn_geometry.check_layout(layout, f"{prefix}: the engine's GDN state")
        return SlotGDNCore(layer_idx, config, self.caches, self.kernels)
