"""Qwen3-Next target model (hybrid Gated DeltaNet + gated attention, MoE with a shared expert)."""

from __future__ import annotations

from typing import Protocol

import torch
from atom_core import FULL_ATTENTION, LINEAR_ATTENTION, Qwen3NextConfig
from torch import nn

from atom_models.attention import Qwen3NextAttention
from atom_models.gdn import GatedDeltaNet
from atom_models.modules import GatedMLP, RMSNorm
from atom_models.moe import SparseMoeBlock
from atom_models.parallel import (
    SINGLE_PROCESS,
    ParallelContext,
    TPLayout,
    VocabParallelEmbedding,
    parallel_lm_head,
)


class CoreFactory(Protocol):
    """Supplies the cache-touching part of each token mixer (see docs/model-api.md). ``layout`` is this
    tensor-parallel rank's: a core works on ``layout.num_heads`` / ``num_kv_heads`` attention heads and
    the GDN heads of ``GDNGeometry.from_config(config, k, layout)``."""

    def attention(
        self, prefix: str, layer_idx: int, config: Qwen3NextConfig, layout: TPLayout
    ) -> nn.Module: ...

    def gdn(self, prefix: str, layer_idx: int, config: Qwen3NextConfig, layout: TPLayout) -> nn.Module: ...


class Qwen3NextDecoderLayer(nn.Module):
    """Pre-norm decoder layer; residual adds are fused into the norms (``rms_norm(x, residual=...)``). The
    residual stream is float32 whatever the model dtype (the norms' outputs are in the model dtype): a bf16
    model then rounds each layer's output once, not the running sum too (stock vLLM keeps the sum in bf16;
    measured on script-made checkpoints: fewer tokens off the float32 argmax, docs/performance.md)."""

    def __init__(
        self,
        config: Qwen3NextConfig,
        layer_idx: int,
        layer_type: str,
        prefix: str,
        cores: CoreFactory,
        kernels,
        dtype,
        layout: TPLayout,
        parallel: ParallelContext,
    ):
        super().__init__()
        self.layer_idx = layer_idx
        self.layer_type = layer_type
        tp = {"layout": layout, "parallel": parallel}
        if layer_type == LINEAR_ATTENTION:
            core = cores.gdn(f"{prefix}.linear_attn", layer_idx, config, layout)
            self.linear_attn = GatedDeltaNet(config, layer_idx, core, kernels, dtype=dtype, **tp)
        elif layer_type == FULL_ATTENTION:
            core = cores.attention(f"{prefix}.self_attn", layer_idx, config, layout)
            self.self_attn = Qwen3NextAttention(config, layer_idx, core, kernels, dtype=dtype, **tp)
        else:
            raise ValueError(f"layer {layer_idx}: unknown layer type {layer_type!r}")
        if config.is_moe_layer(layer_idx):
            self.mlp = SparseMoeBlock(config, kernels, dtype=dtype, **tp)
        else:
            self.mlp = GatedMLP(
                config.hidden_size, config.intermediate_size, kernels, dtype=dtype, parallel=parallel
            )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels, dtype=dtype)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None, ctx
    ):
        if residual is None:  # the residual stream is float32: its sums are not rounded to bf16
            residual = hidden_states.float()
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
        self,
        config: Qwen3NextConfig,
        cores: CoreFactory,
        kernels,
        dtype=None,
        prefix: str = "model",
        layout: TPLayout | None = None,
        parallel: ParallelContext = SINGLE_PROCESS,
    ):
        super().__init__()
        layout = TPLayout.of(config, parallel, layout)
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, parallel, dtype=dtype
        )
        self.layers = nn.ModuleList(
            Qwen3NextDecoderLayer(
                config,
                i,
                config.layer_types[i],
                f"{prefix}.layers.{i}",
                cores,
                kernels,
                dtype,
                layout,
                parallel,
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

    ``parallel``: the tensor-parallel group (default :class:`SingleProcess`, TP = 1). Every rank builds
    this with its own ``parallel``; ``self.layout`` (:class:`TPLayout`) holds the rank's sizes, checked
    against the config (``ConfigError`` naming the field the world size does not divide). Every rank
    runs ``forward`` on the same inputs and gets the same (replicated) hidden states; ``compute_logits``
    all-gathers the vocabulary shards, so every rank gets the full ``[T, V]``. ``expert_parallel``: the
    routed experts are partitioned over the ranks, whole, instead of split over their intermediate
    dimension (:class:`TPLayout`; each rank loads only its own experts).
    """

    def __init__(
        self,
        config: Qwen3NextConfig,
        cores: CoreFactory,
        kernels,
        dtype: torch.dtype | None = None,
        parallel: ParallelContext = SINGLE_PROCESS,
        expert_parallel: bool = False,
    ):
        super().__init__()
        dtype = kernels.dtype if dtype is None else dtype
        self.config = config
        self.kernels = kernels
        self.parallel = parallel
        self.layout = TPLayout.from_config(config, parallel.rank, parallel.world_size, expert_parallel)
        self.model = Qwen3NextModel(
            config, cores, kernels, dtype=dtype, prefix="model", layout=self.layout, parallel=parallel
        )
        self.lm_head = parallel_lm_head(config.hidden_size, config.vocab_size, parallel, dtype=dtype)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx=None) -> torch.Tensor:
        _check_inputs(input_ids, positions)
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden_states: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        return gather_logits(self.lm_head, self.parallel, hidden_states, dtype)


def gather_logits(lm_head: nn.Module, parallel: ParallelContext, hidden: torch.Tensor, dtype) -> torch.Tensor:
    """Full-vocabulary logits on every rank: this rank's ``lm_head`` rows, all-gathered in rank order."""
    logits = parallel.all_gather(lm_head(hidden), -1)
    return logits if dtype is None else logits.to(dtype)
