"""Qwen3-Next target model (hybrid Gated DeltaNet + gated attention, MoE with a shared expert)."""

from __future__ import annotations

from typing import Protocol

import torch
from atom_core import FULL_ATTENTION, LINEAR_ATTENTION, Qwen3NextConfig
from torch import nn

from atom_models.attention import Qwen3NextAttention
from atom_models.gdn import GatedDeltaNet
from atom_models.modules import Embedding, GatedMLP, Linear, RMSNorm
from atom_models.moe import SparseMoeBlock


class CoreFactory(Protocol):
    """Supplies the cache-touching part of each token mixer (see docs/model-api.md)."""

    def attention(self, prefix: str, layer_idx: int, config: Qwen3NextConfig) -> nn.Module: ...

    def gdn(self, prefix: str, layer_idx: int, config: Qwen3NextConfig) -> nn.Module: ...


class Qwen3NextDecoderLayer(nn.Module):
    """Pre-norm decoder layer; residual adds are fused into the norms (``rms_norm(x, residual=...)``)."""

    def __init__(
        self,
        config: Qwen3NextConfig,
        layer_idx: int,
        layer_type: str,
        prefix: str,
        cores: CoreFactory,
        kernels,
        dtype,
    ):
        super().__init__()
        self.layer_idx = layer_idx
        self.layer_type = layer_type
        if layer_type == LINEAR_ATTENTION:
            core = cores.gdn(f"{prefix}.linear_attn", layer_idx, config)
            self.linear_attn = GatedDeltaNet(config, layer_idx, core, kernels, dtype=dtype)
        elif layer_type == FULL_ATTENTION:
            core = cores.attention(f"{prefix}.self_attn", layer_idx, config)
            self.self_attn = Qwen3NextAttention(config, layer_idx, core, kernels, dtype=dtype)
        else:
            raise ValueError(f"layer {layer_idx}: unknown layer type {layer_type!r}")
        if config.is_moe_layer(layer_idx):
            self.mlp = SparseMoeBlock(config, kernels, dtype=dtype)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, kernels, dtype=dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels, dtype=dtype)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None, ctx
    ):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        if self.layer_type == LINEAR_ATTENTION:
            hidden_states = self.linear_attn(positions, hidden_states, ctx)
        else:
            hidden_states = self.self_attn(positions, hidden_states, ctx)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class Qwen3NextModel(nn.Module):
    def __init__(
        self, config: Qwen3NextConfig, cores: CoreFactory, kernels, dtype=None, prefix: str = "model"
    ):
        super().__init__()
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            Qwen3NextDecoderLayer(
                config, i, config.layer_types[i], f"{prefix}.layers.{i}", cores, kernels, dtype
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, ctx)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


def _check_inputs(input_ids: torch.Tensor, positions: torch.Tensor) -> None:
    if input_ids.dim() != 1:
        raise ValueError(
            f"input_ids: expected a flat [T] tensor of token ids, got shape {tuple(input_ids.shape)}"
        )
    if positions.shape != input_ids.shape:
        raise ValueError(
            f"positions: expected shape {tuple(input_ids.shape)} (like input_ids), got {tuple(positions.shape)}"
        )


class Qwen3NextForCausalLM(nn.Module):
    """``forward(input_ids[T], positions[T], ctx) -> hidden[T, H]`` (after the final norm);
    ``compute_logits(hidden) -> [T, V]``.

    ``cores`` supplies the attention / GDN cores; ``kernels`` (atom_kernels ``Kernels``) the numeric ops;
    ``dtype`` the parameter dtype (default: ``kernels.dtype``); tensors are created on the current
    default device (use ``with torch.device(...)`` to build elsewhere).
    """

    def __init__(
        self, config: Qwen3NextConfig, cores: CoreFactory, kernels, dtype: torch.dtype | None = None
    ):
        super().__init__()
        dtype = kernels.dtype if dtype is None else dtype
        self.config = config
        self.kernels = kernels
        self.model = Qwen3NextModel(config, cores, kernels, dtype=dtype, prefix="model")
        self.lm_head = Linear(config.hidden_size, config.vocab_size, dtype=dtype)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx=None) -> torch.Tensor:
        _check_inputs(input_ids, positions)
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden_states: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        logits = self.lm_head(hidden_states)
        return logits if dtype is None else logits.to(dtype)
